"""Our outputs through clients we did not write: an NVTX tool, TensorBoard, Holistic Trace Analysis.

- NVTX: ``tests/nvtx_inject/opsd_nvtx_inject.c``, compiled here with the machine's C compiler, is
  loaded by the NVTX runtime of the ``nvtx`` package through ``NVTX_INJECTION64_PATH`` (the way
  Nsight Systems attaches) and logs every push/pop of a profiled demo run.
- TensorBoard: the real server, started on 127.0.0.1, serves the run's per-stage scalars over its
  HTTP API; they match the per-stage table the demo printed from its live timers.
- HTA (``holistictraceanalysis``, optional): its user-annotation breakdown of our trace directory
  has our stages with the CPU totals of our own report.

Each client test runs the demo (``scripts/train_opsd.py``, tiny CPU models, 2 steps) in a
subprocess; every wait is bounded.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from instrumentation import stages as S
from tests.ds_util import free_port

REPO = Path(__file__).resolve().parent.parent
INJECT_SOURCE = REPO / "tests" / "nvtx_inject" / "opsd_nvtx_inject.c"
DEMO_STEPS = 2
DEMO_TIMEOUT_S = 180
SERVER_WAIT_S = 60
#: Stages every CPU demo step passes through (the demo's OPSD step on the tiny models).
CORE_STAGES = (S.STEP, S.ROLLOUT, S.PREFILL, S.DECODE, S.TEACHER_FORWARD, S.STUDENT_FORWARD, S.LOSS,
               S.BACKWARD, S.OPTIMIZER_STEP)


def run_demo(tmp: Path, env_extra: dict, steps: int = DEMO_STEPS) -> subprocess.CompletedProcess:
    """``scripts/train_opsd.py --steps N`` in a fresh process; fails the test on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPSD_", "NVTX_INJECTION"))}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
                "OPSD_PROFILE_DIR": str(tmp / "traces")})
    env.update(env_extra)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_opsd.py"), "--steps", str(steps)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


# ---- NVTX ------------------------------------------------------------------------------------------

def c_compiler():
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def nvtx_include_dirs() -> list[str]:
    """Directories holding ``nvtx3/nvToolsExt.h``: $NVTX_INCLUDE_DIR, the nvidia-nvtx wheel, CUDA."""
    candidates = [os.environ.get("NVTX_INCLUDE_DIR", "")]
    try:
        import nvidia  # namespace package of NVIDIA's wheels (nvidia-nvtx ships the headers)

        for root in getattr(nvidia, "__path__", []):
            candidates += glob.glob(os.path.join(root, "*", "include")) + glob.glob(
                os.path.join(root, "*", "*", "include"))
    except ImportError:
        pass
    for cuda in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))):
        candidates.append(os.path.join(cuda, "include") if cuda else "")
    return [d for d in dict.fromkeys(candidates) if d and os.path.isfile(os.path.join(d, "nvtx3", "nvToolsExt.h"))]


@pytest.fixture(scope="module")
def nvtx_tool(tmp_path_factory):
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang) to build the NVTX injection library")
    out = tmp_path_factory.mktemp("nvtx_tool") / "libopsd_nvtx_inject.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(out), str(INJECT_SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def read_nvtx_logs(log_dir: Path) -> list[list[str]]:
    return [line.split("\t") for path in sorted(log_dir.glob("nvtx.*.log"))
            for line in path.read_text().splitlines() if line]


def replay(events):
    """Push/pop replay per (thread, domain): pushes with their parents, and every inconsistency."""
    stacks, pushes, problems = defaultdict(list), [], []
    for ev in events:
        if ev[0] == "P":
            _, tid, domain, message, color = ev
            stack = stacks[(tid, domain)]
            pushes.append({"domain": domain, "message": message, "color": int(color, 16),
                           "parents": [m for m in stack]})
            stack.append(message)
        elif ev[0] == "O":
            _, tid, domain, depth = ev
            stack = stacks[(tid, domain)]
            if not stack:
                problems.append(f"pop without push on thread {tid} domain {domain!r}")
                continue
            stack.pop()
            if int(depth) != len(stack):
                problems.append(f"depth {depth} reported, {len(stack)} replayed")
    problems += [f"{len(s)} range(s) left open on {key}: {s}" for key, s in stacks.items() if s]
    return pushes, problems


def test_injection_abi_matches_the_official_nvtx_headers(tmp_path):
    cc, dirs = c_compiler(), nvtx_include_dirs()
    if cc is None or not dirs:
        pytest.skip("no C compiler or no NVTX v3 headers (nvidia-nvtx wheel / CUDA) to check against")
    proc = subprocess.run([cc, "-fsyntax-only", "-DOPSD_NVTX_ABI_CHECK", f"-I{dirs[0]}", str(INJECT_SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_nvtx_tool_records_the_stage_ranges_of_a_profiled_run(nvtx_tool, tmp_path):
    logs = tmp_path / "nvtx"
    logs.mkdir()
    run_demo(tmp_path, {"OPSD_PROFILE": "nvtx", "NVTX_INJECTION64_PATH": str(nvtx_tool),
                        "OPSD_NVTX_LOG_DIR": str(logs)})
    events = read_nvtx_logs(logs)
    assert "I" in [ev[0] for ev in events]  # the NVTX runtime loaded the tool
    assert [ev[2] for ev in events if ev[0] == "D"].count(S.NVTX_DOMAIN) == 1
    pushes, problems = replay(events)
    assert problems == []  # balanced push/pop on every thread and domain
    ours = [p for p in pushes if p["domain"] == S.NVTX_DOMAIN]
    assert ours and all(p["domain"] == S.NVTX_DOMAIN for p in pushes if p["message"].startswith(S.PREFIX))
    by_stage = defaultdict(list)
    for push in ours:
        stage = S.stage_of(push["message"])
        assert stage is not None, push["message"]
        assert push["color"] == S.STAGE_COLORS[stage]
        by_stage[stage].append(push)
    assert set(CORE_STAGES) <= set(by_stage)
    assert len(by_stage[S.STEP]) == DEMO_STEPS and all(p["parents"] == [] for p in by_stage[S.STEP])
    step_name, rollout_name = S.range_name(S.STEP), S.range_name(S.ROLLOUT)
    for stage in (S.PREFILL, S.DECODE):
        assert all(p["parents"][:2] == [step_name, rollout_name] for p in by_stage[stage])
    assert all(p["parents"] == [step_name] for p in by_stage[S.OPTIMIZER_STEP])
    assert not list((tmp_path / "traces").rglob("*.pt.trace.json*"))  # nvtx mode writes no traces


def test_nvtx_tool_records_nothing_when_profiling_is_off(nvtx_tool, tmp_path):
    logs = tmp_path / "nvtx"
    logs.mkdir()
    run_demo(tmp_path, {"OPSD_PROFILE": "0", "NVTX_INJECTION64_PATH": str(nvtx_tool),
                        "OPSD_NVTX_LOG_DIR": str(logs)})
    events = read_nvtx_logs(logs)
    assert [ev for ev in events if ev[0] in ("P", "S", "D")] == []


# ---- a profiled run (traces + scalars) shared by TensorBoard and HTA ---------------------------

@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    proc = run_demo(tmp, {"OPSD_PROFILE": "1"})
    run_dirs = sorted((tmp / "traces").glob("run-*"))
    assert len(run_dirs) == 1, list((tmp / "traces").iterdir())
    return run_dirs[0], proc.stdout


def live_timer_totals(stdout: str) -> dict[str, float]:
    """``{stage: total ms}`` from the per-stage table the demo prints (rows: stage count total ...)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per-stage timers"))
    totals = {}
    for line in lines[start + 1:]:
        tokens = line.split()
        if tokens and tokens[0] in S.ALL_STAGES and len(tokens) >= 3:
            totals[tokens[0]] = float(tokens[2])
        elif totals and not line.strip():
            break
    return totals


def tensorboard_command(logdir: Path, port: int) -> list[str]:
    script = Path(sys.executable).with_name("tensorboard")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "tensorboard.main"]
    return base + ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
                   "--load_fast", "false", "--reload_interval", "1"]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def wait_for_tags(proc, base: str, run: str, tag: str) -> dict:
    """Poll the scalars plugin until ``run`` lists ``tag`` (bounded by SERVER_WAIT_S)."""
    deadline, last = time.monotonic() + SERVER_WAIT_S, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            last = get_json(base + "/data/plugin/scalars/tags")
            if tag in last.get(run, {}):
                return last
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.25)
    pytest.fail(f"tensorboard did not serve {run}/{tag} within {SERVER_WAIT_S} s; last tags: {last}")


def test_tensorboard_serves_the_per_stage_scalars(profiled_run, tmp_path):
    run_dir, stdout = profiled_run
    port = free_port()
    proc = subprocess.Popen(tensorboard_command(run_dir, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        tags = wait_for_tags(proc, base, "rank0", "opsd/step/cpu_ms")
        expected = live_timer_totals(stdout)
        assert set(CORE_STAGES) <= set(expected)
        for stage, total_ms in expected.items():
            assert f"opsd/{stage}/cpu_ms" in tags["rank0"]  # the demo runs on the CPU: no gpu_ms tag
            assert f"opsd/{stage}/gpu_ms" not in tags["rank0"]
            query = urllib.parse.urlencode({"run": "rank0", "tag": f"opsd/{stage}/cpu_ms"})
            points = get_json(f"{base}/data/plugin/scalars/scalars?{query}")
            assert [p[1] for p in points] == [1]  # the recorded step (OPSD_PROFILE_STEPS default 1-3)
            assert points[0][2] == pytest.approx(total_ms, abs=1e-3)  # the table prints 3 decimals
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        proc.stderr.close()


# ---- Holistic Trace Analysis ----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore:.*inplace")
def test_hta_user_annotation_breakdown_has_our_stages_and_cpu_totals(profiled_run):
    pytest.importorskip("hta", reason="holistictraceanalysis is not installed (test-only, optional)")
    from hta.trace_analysis import TraceAnalysis

    run_dir, _ = profiled_run
    summary = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_trace.py"), str(run_dir),
                              "--by-rank", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    ours = json.loads(summary.stdout)["per_rank"]
    frame = TraceAnalysis(trace_dir=str(run_dir)).get_gpu_user_annotation_breakdown(
        use_gpu_annotation=False, visualize=False, duration_ratio=1.0, num_kernels=1 << 20)
    assert frame is not None
    sum_column = next(c for c in frame.columns if c.startswith("sum"))  # "sum (us)" in HTA 0.5
    for rank, entry in ours.items():
        rows = entry["stages"]
        hta_rows = frame[(frame["rank"] == int(rank)) & frame["name"].str.startswith(S.PREFIX)]
        hta_total_ms = {name: total_us / 1000.0 for name, total_us in zip(hta_rows["name"], hta_rows[sum_column])}
        assert set(hta_total_ms) == {row["name"] for row in rows}
        for row in rows:  # HTA rounds each start up and end down to whole us: < 2 us per range
            tolerance_ms = 2e-3 * row["count"] + 1e-3
            assert hta_total_ms[row["name"]] == pytest.approx(row["cpu_ms"]["total"], abs=tolerance_ms)


# ---- HTA's idle-time breakdown against our headline ----------------------------------------------

def hta_figures(trace_dir: Path, rank: int = 0) -> dict:
    """HTA's busy time (temporal breakdown) and idle split (idle-time breakdown, all streams), in us."""
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=str(trace_dir))
    temporal = analysis.get_temporal_breakdown(visualize=False)
    row = temporal[temporal["rank"] == rank].iloc[0]
    idle, _ = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)
    by_category = idle.groupby("idle_category")["idle_time"].sum().to_dict()
    return {"busy_us": float(row["kernel_time(us)"] - row["idle_time(us)"]),
            "kernel_span_us": float(row["kernel_time(us)"]), "streams": idle["stream"].nunique(),
            **{k: float(v) for k, v in by_category.items()}}


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore:.*inplace")
def test_headline_matches_hta_idle_time_breakdown(tmp_path):
    pytest.importorskip("hta", reason="holistictraceanalysis is not installed (test-only, optional)")
    from tests.test_traces_gpu import graph_step_events
    from traces.synth import write_events

    events = graph_step_events(corr_base=1_000_000)  # HTA's parser needs ids that do not fit int8
    write_events(str(tmp_path / "rank0.pt.trace.json"), events, rank=0)
    summary = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_trace.py"), str(tmp_path),
                              "--format", "json"], capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    head = json.loads(summary.stdout)["headline"]
    hta = hta_figures(tmp_path)
    assert hta["streams"] == 1  # HTA splits idle time per stream; on one stream it is the device's
    step = next(e for e in events if e["name"] == S.range_name(S.STEP))
    kernels = [e for e in events if e["cat"] == "kernel"]
    before_first = min(k["ts"] for k in kernels) - step["ts"]
    after_last = step["ts"] + step["dur"] - max(k["ts"] + k["dur"] for k in kernels)
    assert head["gpu_busy_ms"] * 1e3 == pytest.approx(hta["busy_us"])
    # HTA counts the gaps between kernels; ours also the step's edges before the first / after the last
    idle = head["idle"]
    assert (idle["host_launch_ms"] + idle["host_sync_ms"]) * 1e3 == pytest.approx(
        hta["host_wait"] + before_first + after_last)
    assert idle["other_ms"] * 1e3 == pytest.approx(hta.get("kernel_wait", 0.0) + hta.get("other", 0.0))
