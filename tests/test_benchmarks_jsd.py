"""``benchmarks.jsd``: the loss kernel's candidates checked against the reference, and launched with the arguments
their signatures name (older kernels take log beta and log(1 - beta) too)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import jsd as bench

REPO = Path(__file__).resolve().parents[1]


class _FakeKernel:
    """Stands in for a Triton ``JITFunction``: its argument names, and the launch it was given."""

    def __init__(self, names):
        self.arg_names, self.launches = names, []

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((grid, kwargs))


def test_a_kernel_is_launched_with_the_arguments_its_signature_names():
    old = _FakeKernel(["s_ptr", "t_ptr", "loss_ptr", "stride_s", "stride_t", "vocab", "inv_tau", "scale", "beta",
                       "log_beta", "log_1m_beta", "MODE", "WRITE_GRAD", "BLOCK"])
    student, teacher = torch.zeros(3, 7), torch.zeros(3, 7)
    losses = bench._launcher(old, 1024, 4)(student, teacher, 0.25, 0.5, 0.1, True)
    (grid, kwargs), = old.launches
    assert grid == (3,) and losses.shape == (3,) and kwargs["num_warps"] == 4 and kwargs["BLOCK"] == 1024
    assert kwargs["log_beta"] == pytest.approx(math.log(0.25)) and kwargs["log_1m_beta"] == pytest.approx(
        math.log(0.75)) and kwargs["inv_tau"] == 2.0 and kwargs["MODE"] == 2 and kwargs["s_ptr"] is student
    new = _FakeKernel(["s_ptr", "t_ptr", "loss_ptr", "stride_s", "stride_t", "vocab", "inv_tau", "scale", "beta",
                       "MODE", "WRITE_GRAD", "BLOCK"])
    bench._launcher(new, 4096, 8)(student, teacher, 1.0, 1.0, 1.0, False)
    assert "log_beta" not in new.launches[0][1] and new.launches[0][1]["MODE"] == 1
    unknown = _FakeKernel(["s_ptr", "gamma"])
    with pytest.raises(ValueError, match="gamma"):
        bench._launcher(unknown, 4096, 8)(student, teacher, 0.5, 1.0, 1.0, True)


def test_every_candidate_matches_the_reference_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    other = tmp_path / "jsd_kernel_copy.py"  # another tree's kernel file (here: a copy of this tree's)
    shutil.copy(REPO / "rollout" / "ops" / "jsd_kernel.py", other)
    out = tmp_path / "jsd.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.jsd", "--device", "cpu", "--interpret", "--rows", "2",
                           "--vocab", "1200", "--repeats", "1", "--betas", "0.5", "0", "--configs", "1024x4",
                           "--kernel", f"copy={other}", "--reference", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["candidate"] for r in rows}) == ["PyTorch reference", "kernel (copy)", "kernel (copy, 1024x4)",
                                                        "kernel (this tree)", "kernel (this tree, 1024x4)"]
    assert sorted({r["beta"] for r in rows}) == [0.0, 0.5] and len(rows) == 10
    for row in rows:
        assert row["loss_rel_diff"] < 1e-5 and row["grad_max_diff"] < 1e-3 and row["ms"] > 0
        assert row["step_ms"] == pytest.approx(row["ms"] * 261026 / 2)
    assert "| 0.500 | kernel (this tree) |" in proc.stdout


@pytest.mark.parametrize("argv, flag", [(["--configs", "3000x4"], "--configs"), (["--kernel", "nolabel"], "--kernel"),
                                        (["--betas", "1.5"], "--betas"), (["--rows", "0"], "--rows"),
                                        (["--step-positions", "-3"], "--step-positions")])
def test_bad_flags_name_themselves(argv, flag, capsys, monkeypatch):
    """In process (a subprocess each took 3.5 s of the suite): exit 2 naming the flag, before the rates are measured."""
    from benchmarks import jsd as bench

    monkeypatch.setattr(bench, "measure_rates", lambda *a, **k: pytest.fail("the benchmark started"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err