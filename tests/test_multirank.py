"""CI multi-process run: ``torchrun --nproc_per_node 2 scripts/train_opsd.py --zero-stage 3`` on CPU.

Two gloo processes train under ZeRO-3 with ``OPSD_PROFILE=1`` and ``OPSD_PROFILE_RANKS=all``; then
``scripts/summarize_trace.py --by-rank --format json`` on the run directory must list both ranks
and name a straggler per stage. ZeRO-3 gathers parameters collectively in every forward, so the
ranks must run the same number of prefill/decode forwards (lockstep) even though each rank samples
its own responses; the run would hang or fail otherwise.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from instrumentation import stages as S

REPO = Path(__file__).resolve().parent.parent
NUM_RANKS = 2
NUM_STEPS = 3
#: Recorded steps with the default ``OPSD_PROFILE_STEPS`` (1-3) in a 3-step run: steps 1 and 2.
NUM_RECORDED_STEPS = 2
TRAIN_TIMEOUT_S = 150
SUMMARY_TIMEOUT_S = 60


def run_bounded(argv, env, cwd, timeout_s):
    """Run ``argv`` in its own process group; on timeout kill that group and fail the test."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[:4]} timed out after {timeout_s} s\n{err[-4000:]}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPSD_", "NVTX_INJECTION"))}
    env.update({"OPSD_PROFILE": "1", "OPSD_PROFILE_RANKS": "all", "OPSD_PROFILE_DIR": str(tmp / "traces"),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NUM_RANKS),
            str(REPO / "scripts" / "train_opsd.py"), "--steps", str(NUM_STEPS), "--zero-stage", "3"]
    code, out, err = run_bounded(argv, env, tmp, TRAIN_TIMEOUT_S)
    assert code == 0, f"torchrun failed ({code}):\n{err[-6000:]}"
    run_dirs = sorted((tmp / "traces").glob("run-*"))
    assert len(run_dirs) == 1, "both ranks must share one run directory"
    code, summary, err = run_bounded([sys.executable, str(REPO / "scripts" / "summarize_trace.py"),
                                      str(run_dirs[0]), "--by-rank", "--format", "json"], env, tmp,
                                     SUMMARY_TIMEOUT_S)
    assert code == 0, err
    return run_dirs[0], json.loads(summary)


def test_each_rank_writes_its_own_traces_and_scalars(two_rank_run):
    run_dir, _ = two_rank_run
    for rank in range(NUM_RANKS):
        assert list(run_dir.glob(f"rank{rank}.*.pt.trace.json.gz")), f"no trace of rank {rank}"
        assert list((run_dir / f"rank{rank}").glob("events.out.tfevents.*")), f"no scalars of rank {rank}"


def test_summary_lists_both_ranks_and_a_straggler_per_stage(two_rank_run):
    _, doc = two_rank_run
    assert doc["ranks"] == list(range(NUM_RANKS))
    assert sorted(doc["per_rank"]) == [str(r) for r in range(NUM_RANKS)]
    names = [row["name"] for row in doc["stages"]]
    assert set(doc["straggler"]) == set(names)
    for name in names:
        totals = {int(rank): row["cpu_ms"]["total"] for rank, entry in doc["per_rank"].items()
                  for row in entry["stages"] if row["name"] == name}
        assert set(totals) == set(range(NUM_RANKS)), f"{name} missing on a rank"
        assert doc["straggler"][name] == max(totals, key=totals.get)  # the slowest rank by CPU total


def test_ranks_run_in_lockstep(two_rank_run):
    _, doc = two_rank_run
    counts = {rank: {row["name"]: row["count"] for row in entry["stages"]} for rank, entry in doc["per_rank"].items()}
    step, prefill, decode = (S.range_name(s) for s in (S.STEP, S.PREFILL, S.DECODE))
    assert {c[step] for c in counts.values()} == {NUM_RECORDED_STEPS}
    assert len({c[prefill] for c in counts.values()}) == 1
    assert len({c[decode] for c in counts.values()}) == 1 and counts["0"][decode] > 0
