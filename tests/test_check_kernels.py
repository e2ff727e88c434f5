"""``scripts/check_kernels.py``: every Triton kernel of ``rollout/ops`` compiles for a Hopper GPU (sm_90) without one.

The tests run the kernels through Triton's interpreter on the CPU, which accepts code the GPU compiler rejects;
without this check such a kernel would first fail on a GPU (and fall back to PyTorch there with a warning).
The script runs in a subprocess: here ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``, and kernels defined
under it cannot be compiled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from scripts import check_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _compiler_env(cache_dir) -> dict:
    """The script's environment: no interpreter, and Triton's cache in the test's own directory (nothing read from
    or written to the home directory's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=REPO, TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(cache_dir))
    return env


@needs_triton
@pytest.mark.slow
def test_every_kernel_the_ops_launch_compiles_for_sm90(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "scripts/check_kernels.py", "--json", str(out)], cwd=REPO,
                          env=_compiler_env(tmp_path / "cache"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["missing"] == []
    variants = report["variants"]
    assert all(v["ok"] for v in variants)
    compiled = {v["kernel"] for v in variants}
    assert compiled == {f"{module}.{name}" for module, names in check_kernels.ENTRY_KERNELS.items()
                        for name in names}
    assert {v["arch"] for v in variants} == {90}
    # what each launch asks of the GPU, read from its cubin
    assert all(0 < v["registers"] <= 255 and v["local_bytes"] >= 0 and v["shared_bytes"] >= 0 for v in variants)
    # each kernel's variants that the routes launch, with the constexprs a CUDA launch passes
    shared = [v["constexprs"] for v in variants if v["kernel"].endswith(".decode_attention_shared")]
    assert any("LAST=True" in c for c in shared) and any("LAST=False" in c for c in shared)
    assert all("DOT_FP32=False" in v["constexprs"] for v in variants if "DOT_FP32" in v["constexprs"])
    assert {c.split("ARITY=")[1].split(",")[0] for c in (v["constexprs"] for v in variants
                                                          if v["kernel"].endswith(".search_pass"))} == {"16", "8", "4"}


BROKEN = """
import sys
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from scripts import check_kernels

@triton.jit
def loop_sum(x_ptr, n, BLOCK: tl.constexpr):
    acc = 0  # int32 here, fp32 after the first iteration: the interpreter runs it, the compiler refuses
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc = acc + tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0))
    tl.store(x_ptr, acc)

compiler = check_kernels.Compiler([90])
JITFunction.run = lambda fn, *a, grid, warmup, **kw: compiler.run(fn, *a, grid=grid, warmup=warmup, **kw)
loop_sum[(1,)](torch.ones(100), 100, BLOCK=32)
(result,) = compiler.results
print(result.ok, result.kernel.rsplit(".", 1)[1], result.constexprs)
print(result.error)
"""


@needs_triton
def test_a_kernel_only_the_interpreter_accepts_is_reported(tmp_path):
    # Triton's interpreter runs it and gets the sum ...
    script = tmp_path / "broken.py"
    script.write_text(textwrap.dedent(BROKEN))
    definition = BROKEN.split("compiler = ")[0]
    run_it = definition + "x = torch.ones(100)\nloop_sum[(1,)](x, 100, BLOCK=32)\nprint(x[0].item())\n"
    interpreted = subprocess.run([sys.executable, "-c", run_it], cwd=REPO, capture_output=True, text=True, timeout=300,
                                 env={**_compiler_env(tmp_path / "cache"), "TRITON_INTERPRET": "1"})
    assert interpreted.returncode == 0, interpreted.stderr[-3000:]
    assert interpreted.stdout.split() == ["100.0"]
    # ... and the check compiles it for sm_90, which fails, and says where
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_compiler_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, *error = proc.stdout.splitlines()
    assert first == "False loop_sum BLOCK=32"
    assert "Loop-carried variable acc" in "\n".join(error)


def test_script_refuses_an_interpreted_triton(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as exc:
        check_kernels.main([])
    assert exc.value.code == 2
    assert "TRITON_INTERPRET is set" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [(0, "i32"), (2 ** 31 - 1, "i32"), (-2 ** 31, "i32"), (2 ** 31, "i64"),
                                             (-2 ** 31 - 1, "i64"), (True, "i1"), (0.5, "fp32")])
def test_runtime_arguments_take_the_launchers_types(value, expected):
    assert check_kernels.value_type(value) == expected


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "*bf16"), (torch.float16, "*fp16"),
                                             (torch.float32, "*fp32"), (torch.int64, "*i64"), (torch.int32, "*i32"),
                                             (torch.bool, "*i1")])
def test_tensors_become_typed_pointers(dtype, expected):
    assert check_kernels.value_type(torch.zeros(2, dtype=dtype)) == expected


def test_an_argument_without_a_triton_type_is_named():
    with pytest.raises(TypeError, match="no Triton type for str 'x'"):
        check_kernels.value_type("x")
    with pytest.raises(TypeError, match="no Triton pointer type for torch.complex64"):
        check_kernels.value_type(torch.zeros(2, dtype=torch.complex64))


USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function decode_attention_split:
  REG:182 STACK:0 SHARED:0 LOCAL:16 CONSTANT[0]:656 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_cuobjdump_resource_usage_is_read():
    assert check_kernels.parse_usage(USAGE) == {"registers": 182, "static_shared": 0, "local_bytes": 16}
    with pytest.raises(ValueError, match="no resource usage in cuobjdump's output"):
        check_kernels.parse_usage("Resource usage:\n")


@pytest.mark.parametrize("arch, registers, shared, warps, problem", [
    (90, 255, 232_448, 8, None),  # at both limits
    (90, 255, 232_449, 4, "needs 232,449 bytes of shared memory, sm_90 allows 232,448 per block"),
    (80, 128, 200_000, 4, "needs 200,000 bytes of shared memory, sm_80 allows 166,912 per block"),
    (90, 255, 0, 16, "needs 255 registers x 512 threads = 130,560 per block, more than 65,536"),
    (75, 64, 10 ** 6, 4, None),  # an architecture without a known shared limit: registers only
])
def test_a_launch_that_could_not_start_is_named(arch, registers, shared, warps, problem):
    assert check_kernels.launch_problem(arch, registers, shared, warps) == problem
