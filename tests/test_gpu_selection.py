"""``pytest -m gpu tests`` selects the tests that need CUDA and nothing else (tests/conftest.py marks them)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import needs_cuda

ROOT = Path(__file__).resolve().parents[1]


def test_reasons_that_need_cuda_are_told_from_ones_that_mention_it():
    for reason in ("needs CUDA", "needs a CUDA device", "needs CUDA: events and the allocator's peak",
                   "pinned host memory needs CUDA", "needs CUDA (inductor's Triton backend)"):
        assert needs_cuda(reason), reason
    for reason in ("Triton's interpreter is off (tests/conftest.py sets it without CUDA)",
                   "torch.compile on the CPU needs a C++ compiler", "CUDA graphs are captured elsewhere", ""):
        assert not needs_cuda(reason), reason


def test_the_gpu_selection_leaves_out_the_interpreter_only_tests():
    # test_opsd_packed.py holds both kinds: CUDA tests and tests that run the JSD kernel in Triton's interpreter,
    # which skip where there is a GPU. Only the first kind is the GPU selection.
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          "tests/test_opsd_packed.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    selected = [line for line in out.stdout.splitlines() if line.startswith("tests/")]
    source = (ROOT / "tests" / "test_opsd_packed.py").read_text()
    assert selected, out.stdout + out.stderr
    for node in selected:
        name = node.split("::")[1].split("[")[0]
        before = source[:source.index(f"def {name}(")].rsplit("\n\n", 1)[-1]
        assert "not torch.cuda.is_available()" in before and "@interpreted" not in before, node
