"""The main job's own traces: every stage it passes through is a ``user_annotation`` named
``opsd/<stage>``, nested as the step is; the summary CLI reads them (issues 4 and 5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from instrumentation import stages
from instrumentation.work import WORK_STAGES
from traces.chrome import read_chrome_trace
from traces.events import RANGE

ROOT = Path(__file__).resolve().parent.parent
ROLLOUT_CHILDREN = {stages.EXPAND, stages.PLAN, stages.MODE_SWITCH, stages.GATHER, stages.CACHE_ACQUIRE,
                    stages.PREFILL, stages.DECODE, stages.CACHE_RELEASE, stages.MASK_BUILD, stages.POSTPROCESS}
STEP_CHILDREN = ROLLOUT_CHILDREN | {stages.ROLLOUT, stages.TEACHER_FORWARD, stages.LOGIT_CACHE,
                                    stages.STUDENT_FORWARD, stages.LOSS, stages.BACKWARD, stages.OPTIMIZER_STEP}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, OPSD_PROFILE="1", OPSD_PROFILE_DIR=str(out), OPSD_PROFILE_STEPS="1-2",
               OPSD_PROFILE_RUN_NAME="demo", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_opsd.py"), "--steps", "3",
                           "--route", "auto"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "demo", proc.stdout


def _ranges(run_dir: Path):
    (trace,) = run_dir.glob("rank0.*.pt.trace.json.gz")
    return [(e[1], e[2], e[3], e[4], e[4] + e[5]) for e in read_chrome_trace(str(trace)) if e[0] == RANGE]


def test_every_stage_of_the_demo_is_in_its_trace_and_nested(demo_run):
    run_dir, stdout = demo_run
    ranges = [r for r in _ranges(run_dir) if r[0].startswith("opsd/")]
    names = {r[0][len("opsd/"):] for r in ranges}
    assert names >= STEP_CHILDREN | {stages.STEP}, sorted(STEP_CHILDREN - names)
    steps = [r for r in ranges if r[0] == "opsd/step"]
    rollouts = [r for r in ranges if r[0] == "opsd/rollout"]
    assert len(steps) == 2 and len(rollouts) == 2  # the two recorded steps

    def inside(r, outer):
        return any(o[1] == r[1] and o[3] <= r[3] and r[4] <= o[4] for o in outer)

    for r in ranges:
        stage = r[0][len("opsd/"):]
        if stage in STEP_CHILDREN:
            assert inside(r, steps), f"{r[0]} outside opsd/step"
        if stage in ROLLOUT_CHILDREN:
            assert inside(r, rollouts), f"{r[0]} outside opsd/rollout"
    assert "per-stage timers" in stdout and "decode" in stdout


def test_summary_cli_reads_the_demo_run(demo_run):
    run_dir, _ = demo_run
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize_trace.py"), str(run_dir),
                           "--format", "json", "--by-step"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {row["name"]: row for row in report["stages"]}
    assert rows["opsd/step"]["count"] == 2 and rows["opsd/step"]["share"] == pytest.approx(1.0)
    assert rows["opsd/decode"]["count"] >= 2 * 1 and rows["opsd/prefill"]["count"] >= 2
    assert rows["opsd/rollout"]["cpu_ms"]["total"] <= rows["opsd/step"]["cpu_ms"]["total"]
    assert rows["opsd/student_forward"]["peak_allocated_mib"] is not None  # CPU [memory] events
    assert report["ranks"] == [0]


def test_the_demo_run_records_the_work_of_its_stages(demo_run):
    run_dir, _ = demo_run
    lines = [json.loads(x) for x in (run_dir / "rank0.work.jsonl").read_text().splitlines()]
    assert [(x["step"], x["stage"]) for x in lines] == [(s, t) for s in (1, 2) for t in WORK_STAGES]  # recorded steps
    for x in lines:
        assert x["flops"] > 0 or x["stage"] in (stages.OPTIMIZER_STEP, stages.LOGIT_CACHE, stages.LOSS)
        assert x["bytes"] > 0 and (x["rows"] > 0) == (x["stage"] != stages.OPTIMIZER_STEP)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize_trace.py"), str(run_dir),
                           "--format", "json"], capture_output=True, text=True, timeout=120)
    rows = {row["name"]: row for row in json.loads(proc.stdout)["stages"]}
    backward = [x for x in lines if x["stage"] == stages.BACKWARD]
    assert rows["opsd/backward"]["work"]["flops"] == pytest.approx(sum(x["flops"] for x in backward) / 2)
    decode = [x for x in lines if x["stage"] == stages.DECODE]
    assert rows["opsd/decode"]["work"]["flops"] == pytest.approx(sum(x["flops"] for x in decode) / 2)
