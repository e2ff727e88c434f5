"""``benchmarks.step``: the long-tail cell's lengths and one run of its small twin on the embedded tiny models (CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import step as bench
from tests.ds_util import free_port


def test_longtail_lengths_are_long_tailed_within_the_budget_and_fixed_by_the_seed():
    lengths = bench.longtail_lengths(4096, 1024, 200, seed=3)
    assert torch.equal(lengths, bench.longtail_lengths(4096, 1024, 200, seed=3))
    assert not torch.equal(lengths, bench.longtail_lengths(4096, 1024, 200, seed=4))
    assert lengths.dtype == torch.long and int(lengths.min()) >= 1 and int(lengths.max()) == 1024  # clipped
    mean, median = lengths.float().mean().item(), lengths.float().median().item()
    assert 150 < mean < 220 and median < 0.75 * mean  # the 100-300, and a long right tail


def run_benchmark(*launch: str) -> subprocess.CompletedProcess:
    """``python *launch`` in its own process (the benchmark sets the rendezvous variables and a process group, on a
    free port of its own here: two such tests in parallel would both take the benchmark's default), from the
    repository, on the CPU's embedded tiny models; asserts it exited 0."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *launch, "--student", "", "--teacher", ""], capture_output=True, text=True,
                          cwd=repo, timeout=600, env={**env, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1",
                                                      "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_the_small_longtail_cell_runs_every_path_on_the_same_prompts_and_lengths(tmp_path):
    out = tmp_path / "step.json"
    run_benchmark("-m", "benchmarks.step", "--cells", "longtail-small", "--paths", "packed,padded", "--steps", "1",
                  "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["path"], r["round"]) for r in rows) == [("packed", -1), ("packed", 0), ("padded", -1),
                                                              ("padded", 0)]
    cell = bench.CELLS["longtail-small"]
    for index in (-1, 0):
        pair = [r for r in rows if r["round"] == index]
        drawn = int(bench.longtail_lengths(cell.batch_size * cell.samples, cell.max_new_tokens, cell.mean_length,
                                           index + 1).sum())
        # seeded samples are the same on both paths; each row stops at its drawn length (or at an EOS before it)
        assert pair[0]["response_tokens"] == pair[1]["response_tokens"]
        assert pair[0]["prompt_tokens"] == pair[1]["prompt_tokens"]
        assert 0.8 * drawn <= pair[0]["response_tokens"] <= drawn
        assert drawn < 0.5 * cell.batch_size * cell.samples * cell.max_new_tokens  # far below the budget


RELEASE_PROBE = """
import gc, sys
gc.disable()  # only the benchmark's own collection may free what a cell left
from benchmarks import step
alive = []
run_cell = step.run_cell
def counted(*args):
    alive.append(sum(type(o).__name__.endswith("ForCausalLM") for o in gc.get_objects()))
    run_cell(*args)
step.run_cell = counted
step.main(sys.argv[1:])
print("alive at each cell:", alive)
"""


def test_a_cell_starts_with_nothing_of_the_previous_cell_alive():
    """Each cell builds its own models, engines and rollout; the previous cell's models must be gone by then. A
    ``del`` left them to the cyclic collector (DeepSpeed engines hold cycles): on the H200 the long-tail cell then ran
    beside the uniform cell's 3B models (peak 130.7 GiB, 2.19x its roofline against 1.71x). Here the collector is
    off, so only the benchmark's own release can free them."""
    proc = run_benchmark("-c", RELEASE_PROBE, "--cells", "small,longtail-small", "--paths", "packed", "--steps", "1")
    assert "alive at each cell: [0, 0]" in proc.stdout, proc.stdout[-2000:]
