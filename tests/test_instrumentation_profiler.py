"""opsd_profiler on CPU: trace files, nesting of opsd/<stage> events, scalars, modes, failures, ranks."""

import gzip
import json
import os
import re
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

from instrumentation import ProfileConfig, ProfilingWarning, configure, get_config, stages
from instrumentation.collect import collect_stages
from instrumentation.config import ENV_VARS
from instrumentation.profiler import opsd_profiler
from instrumentation.ranges import stage
from instrumentation.timers import HUB
from tests.ds_util import free_port
from tests.profiling_env import clean_profiling_env  # noqa: F401  (autouse fixture)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE_NAME = re.compile(r"^rank(\d+)\.\d+\.pt\.trace\.json\.gz$")
ROLLOUT_CHILDREN = (stages.EXPAND, stages.PREFILL, stages.DECODE, stages.POSTPROCESS)
STEP_CHILDREN = (stages.ROLLOUT, *ROLLOUT_CHILDREN, stages.TEACHER_FORWARD, stages.STUDENT_FORWARD,
                 stages.LOSS, stages.BACKWARD, stages.OPTIMIZER_STEP)
NUM_DECODE_STEPS = 2




def train(prof, num_steps, fail_at_step=None, error=RuntimeError):
    """A tiny OPSD-shaped loop: rollout (expand/prefill/decode/postprocess), teacher, student, update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(num_steps):
        with stage(stages.STEP):
            with stage(stages.ROLLOUT), collect_stages():
                with stage(stages.EXPAND):
                    prompts = torch.randn(2, 16).repeat_interleave(2, dim=0)  # prompts: [B * n, H]
                with stage(stages.PREFILL):
                    hidden = model(prompts)
                for _ in range(NUM_DECODE_STEPS):
                    with stage(stages.DECODE):
                        hidden = model(hidden)
                with stage(stages.POSTPROCESS):
                    responses = hidden.detach()
            with stage(stages.TEACHER_FORWARD), torch.no_grad():
                target = model(responses)
            with stage(stages.STUDENT_FORWARD):
                output = model(responses)
            with stage(stages.LOSS):
                loss = torch.nn.functional.mse_loss(output, target)
            if step == fail_at_step:
                raise error("injected")
            with stage(stages.BACKWARD):
                loss.backward()
            with stage(stages.OPTIMIZER_STEP):
                optimizer.step()
                optimizer.zero_grad()
        prof.step()


def _events(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _annotations(path):
    return [e for e in _events(path) if e.get("cat") == "user_annotation" and e.get("ph") == "X"
            and e["name"].startswith("opsd/")]


def _inside(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def _scalars(scalars_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(scalars_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _config(tmp_path, **kwargs):
    return ProfileConfig.from_env({}, **{"mode": "1", "output_dir": str(tmp_path / "traces"), **kwargs})


def test_mode_1_writes_nested_trace_and_scalars(tmp_path):
    configure(_config(tmp_path, steps="1-2"))
    with opsd_profiler() as prof:
        train(prof, num_steps=4)
    (trace,) = prof.trace_paths()
    assert os.path.dirname(trace) == prof.run_dir and TRACE_NAME.match(os.path.basename(trace))
    assert os.path.dirname(prof.run_dir) == str(tmp_path / "traces")
    events = _annotations(trace)
    by_name = {}
    for event in events:
        by_name.setdefault(event["name"][len("opsd/"):], []).append(event)
    assert set(by_name) == {stages.STEP, *STEP_CHILDREN}
    assert len(by_name[stages.STEP]) == 2 and len(by_name[stages.DECODE]) == 2 * NUM_DECODE_STEPS
    for name in STEP_CHILDREN:
        for event in by_name[name]:
            assert any(_inside(event, step) for step in by_name[stages.STEP]), name
    for name in ROLLOUT_CHILDREN:
        for event in by_name[name]:
            assert any(_inside(event, rollout) for rollout in by_name[stages.ROLLOUT]), name
    assert any(e["name"] == "[memory]" for e in _events(trace))  # profile_memory defaults on

    scalars = _scalars(prof.scalars_dir)
    for name in (stages.STEP, *STEP_CHILDREN):
        for kind in ("cpu_ms",) + (("gpu_ms",) if torch.cuda.is_available() else ()):
            assert [s for s, _ in scalars[f"opsd/{name}/{kind}"]] == [1, 2]
    assert prof.recorded_steps == [1, 2]
    rows = {row["stage"]: row for row in prof.stage_rows()}
    assert rows["step"]["count"] == 2 and rows["decode"]["count"] == 2 * NUM_DECODE_STEPS
    assert rows["step"]["share_of_step"] == 1.0
    if not torch.cuda.is_available():  # no allocator peak on CPU
        assert not any(tag.endswith(("peak_allocated_mib", "gpu_ms")) for tag in scalars)
        assert all(row["peak_mib"] is None for row in rows.values())
    assert "optimizer_step" in prof.stage_table()


def test_memory_events_can_be_switched_off(tmp_path):
    configure(_config(tmp_path, steps="1", profile_memory=False))
    with opsd_profiler() as prof:
        train(prof, num_steps=2)
    (trace,) = prof.trace_paths()
    assert not any(e["name"] == "[memory]" for e in _events(trace))


def test_each_window_gets_its_own_trace_file(tmp_path):
    configure(_config(tmp_path, steps="1,3"))
    with opsd_profiler() as prof:
        train(prof, num_steps=5)
    paths = prof.trace_paths()
    assert len(paths) == 2 and len(set(paths)) == 2
    assert [len([e for e in _annotations(p) if e["name"] == "opsd/step"]) for p in paths] == [1, 1]


def test_window_cut_short_by_the_end_of_the_loop_is_saved(tmp_path):
    configure(_config(tmp_path, steps="1-3"))
    with opsd_profiler() as prof:
        train(prof, num_steps=2)
    (trace,) = prof.trace_paths()
    assert len([e for e in _annotations(trace) if e["name"] == "opsd/step"]) == 1


@pytest.mark.parametrize("mode", ["0", "nvtx"])
def test_off_and_nvtx_write_nothing(tmp_path, mode):
    configure(_config(tmp_path, mode=mode))
    with opsd_profiler() as prof:
        train(prof, num_steps=3)
    assert not (tmp_path / "traces").exists()
    assert (prof.run_dir, prof.trace_paths(), prof.stage_rows(), prof.current_step) == (None, [], [], 3)
    assert HUB.sinks == [] and HUB.num_sessions == 0


def test_unselected_rank_writes_nothing(tmp_path):
    configure(_config(tmp_path, ranks="0"))
    with opsd_profiler(rank=1, world_size=2) as prof:
        train(prof, num_steps=3)
    assert not (tmp_path / "traces").exists() and prof.trace_paths() == []


def test_unwritable_directory_warns_and_training_finishes(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    configure(_config(tmp_path, output_dir=str(blocker / "traces"), steps="1-2"))
    with pytest.warns(ProfilingWarning, match="OPSD_PROFILE_DIR") as record:
        with opsd_profiler() as prof:
            train(prof, num_steps=4)
    assert len([w for w in record if issubclass(w.category, ProfilingWarning)]) == 1
    assert prof.current_step == 4 and prof.trace_paths() == []
    assert {row["stage"]: row["count"] for row in prof.stage_rows()}["step"] == 2  # timers still work


def test_failing_trace_export_warns_and_training_finishes(tmp_path, monkeypatch):
    from instrumentation import export

    def broken_compress(src, dst, level=6):
        raise OSError("disk full")

    monkeypatch.setattr(export, "compress", broken_compress)
    configure(_config(tmp_path, steps="1,3"))
    with pytest.warns(ProfilingWarning, match="trace export failed") as record:
        with opsd_profiler() as prof:
            train(prof, num_steps=5)
    assert len([w for w in record if issubclass(w.category, ProfilingWarning)]) == 1
    assert prof.current_step == 5 and prof.trace_paths() == []
    assert not [f for f in os.listdir(prof.run_dir) if ".pt.trace." in f or f.endswith(".partial")]
    assert [s for s, _ in _scalars(prof.scalars_dir)["opsd/step/cpu_ms"]] == [1, 3]


def test_exception_in_the_loop_leaves_no_open_state(tmp_path):
    configure(_config(tmp_path, steps="1-2"))
    with pytest.raises(RuntimeError, match="injected"):
        with opsd_profiler() as prof:
            train(prof, num_steps=4, fail_at_step=1)
    assert HUB.sinks == [] and HUB.frames == [] and HUB.num_sessions == 0
    (trace,) = prof.trace_paths()  # the partial window is still saved
    assert [e["name"] for e in _annotations(trace)].count("opsd/step") == 1


def _fake_dump(paths):
    def dump(path):
        paths.append(path)
        open(path, "wb").close()
    return dump


@pytest.mark.parametrize("fail_at_step,dumped", [(1, True), (0, False)])
def test_oom_in_a_recorded_step_dumps_a_snapshot_and_reraises(tmp_path, monkeypatch, fail_at_step, dumped):
    paths = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", _fake_dump(paths))
    configure(_config(tmp_path, steps="1", oom_snapshot=True))
    notice = pytest.warns(ProfilingWarning, match="memory snapshot written") if dumped else nullcontext()
    with notice, pytest.raises(torch.cuda.OutOfMemoryError):
        with opsd_profiler() as prof:
            train(prof, num_steps=3, fail_at_step=fail_at_step, error=torch.cuda.OutOfMemoryError)
    assert len(paths) == int(dumped)
    if dumped:
        assert os.path.dirname(paths[0]) == prof.run_dir  # dumped to a .partial name, then renamed
        assert re.match(r"rank0\.oom\.\d+\.pickle\.partial$", os.path.basename(paths[0]))
        assert os.path.isfile(paths[0][:-len(".partial")]) and not os.path.exists(paths[0])


def test_oom_snapshot_is_off_by_default(tmp_path, monkeypatch):
    paths = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", _fake_dump(paths))
    configure(_config(tmp_path, steps="1"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with opsd_profiler() as prof:
            train(prof, num_steps=3, fail_at_step=1, error=torch.cuda.OutOfMemoryError)
    assert paths == []


def test_explicit_config_is_active_only_inside_the_session(tmp_path):
    outer = configure(ProfileConfig(mode="0")) or get_config()
    session_config = _config(tmp_path, steps="0")
    with opsd_profiler(session_config) as prof:
        assert get_config() is session_config
        train(prof, num_steps=1)
    assert get_config() is outer and len(prof.trace_paths()) == 1


def test_rank_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    configure(_config(tmp_path, steps="0", ranks="all"))
    with opsd_profiler() as prof:
        train(prof, num_steps=1)
    assert (prof.rank, prof.world_size) == (3, 4)
    assert [TRACE_NAME.match(os.path.basename(p)).group(1) for p in prof.trace_paths()] == ["3"]
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        opsd_profiler()


RANK_SCRIPT = r"""
import torch, torch.distributed as dist
from instrumentation import opsd_profiler, stage, stages
from tests.ds_workers.common import end_process
dist.init_process_group("gloo")
with opsd_profiler() as prof:
    for _ in range(3):
        with stage(stages.STEP):
            t = torch.ones(8) * (dist.get_rank() + 1)
            dist.all_reduce(t)
        prof.step()
print("TRACES", *prof.trace_paths(), flush=True)
end_process()  # barrier, destroy, exit without finalization
"""


@pytest.mark.slow
def test_two_gloo_ranks_write_distinct_trace_names(tmp_path):
    out_dir = tmp_path / "traces"
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS.values()}
    base.update(OPSD_PROFILE="1", OPSD_PROFILE_DIR=str(out_dir), OPSD_PROFILE_STEPS="1",
                OPSD_PROFILE_RANKS="all", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env={**base, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for rank in range(2)]
    outputs = [proc.communicate(timeout=180) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    printed = [line.split()[1:] for stdout, _ in outputs for line in stdout.splitlines()
               if line.startswith("TRACES")]
    (run_dir,) = os.listdir(out_dir)  # both ranks share rank 0's run directory
    names = sorted(n for n in os.listdir(out_dir / run_dir) if n.endswith(".gz"))
    assert [TRACE_NAME.match(n).group(1) for n in names] == ["0", "1"]
    assert sorted(os.path.basename(p) for paths in printed for p in paths) == names
    assert {"rank0", "rank1"} <= set(os.listdir(out_dir / run_dir))  # per-rank scalars


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_session_writes_kernels_and_peak_scalars(tmp_path):
    configure(_config(tmp_path, steps="1"))
    x = torch.randn(512, 512, device="cuda")  # x: [512, 512]
    with opsd_profiler() as prof:
        for _ in range(3):
            with stage(stages.STEP):
                with stage(stages.DECODE):
                    y = x @ x
                with stage(stages.LOSS):
                    y.sum().item()
            prof.step()
    (trace,) = prof.trace_paths()
    assert any(e.get("cat") == "kernel" for e in _events(trace))
    scalars = _scalars(prof.scalars_dir)
    for name in ("step", "decode", "loss"):
        assert [s for s, _ in scalars[f"opsd/{name}/peak_allocated_mib"]] == [1]
        assert [s for s, _ in scalars[f"opsd/{name}/gpu_ms"]] == [1]
    assert all(row["peak_mib"] is not None for row in prof.stage_rows())
