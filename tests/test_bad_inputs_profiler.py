"""Bad inputs and faults of the profiler in training, one row each, with the exact outcome.

* Variables: every bad ``OPSD_*`` value is refused by ``check_environment()`` (what the main job calls
  before building models) and by ``opsd_profiler()`` on entry, with a one-line ``ValueError`` naming
  the variable and the accepted values; no step runs, nothing is written; importing never raises.
* Run directories: a second run under the same ``OPSD_PROFILE_RUN_NAME`` is refused (the first
  run's files untouched); the ranks of one run share it; run names never leave ``OPSD_PROFILE_DIR``.
* Export faults (full disk, Ctrl-C, kill, a profiler that writes nothing or half a trace): nothing
  under a trace's final name, nothing outside the run directory (torch's temporary JSON included:
  ``TMPDIR`` stays empty), and training finishes where the fault is not an interruption.
"""

import errno
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from instrumentation import ProfilingWarning, check_environment, stages
from instrumentation.profiler import opsd_profiler
from instrumentation.ranges import stage
from tests.ds_util import free_port
from tests.profiling_env import clean_profiling_env  # noqa: F401  (autouse fixture)
from traces.cli import main as summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINAL = ".pt.trace.json"  # in every name torch or we give a trace


def train(prof, num_steps=4, repeat=1):
    """A small loop of OPSD-shaped steps (``repeat`` forward/backward pairs each); returns the losses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    losses = []
    for _ in range(num_steps):
        with stage(stages.STEP):
            for _ in range(repeat):
                with stage(stages.STUDENT_FORWARD):
                    loss = model(torch.randn(4, 64)).square().mean()
                with stage(stages.BACKWARD):
                    loss.backward()
        losses.append(loss.item())
        prof.step()
    return losses


def files_below(root):
    """Every file below ``root`` (relative paths), sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def traces_below(root):
    return [f for f in files_below(root) if FINAL in os.path.basename(f)]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """OPSD_PROFILE=1 into tmp_path/out/run, torch's temporary files into tmp_path/tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    values = {"OPSD_PROFILE": "1", "OPSD_PROFILE_DIR": str(tmp_path / "out"), "OPSD_PROFILE_STEPS": "1-2",
              "OPSD_PROFILE_RUN_NAME": "run", "TMPDIR": str(tmp)}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


# ---------------------------------------------------------------------------------------------
# Variables: name -> (environment on top of `env`, the message (regex, whole line))
ACCEPTED_MODE = (r"'0' \(or unset\) for off, '1' for ranges \+ timers \+ traces, 'nvtx' for NVTX ranges only, "
                 r"'timers' for device timers and scalars every step")
ACCEPTED_STEPS = r"'A-B' \(inclusive, A <= B\) or a comma list such as '1,3,5-7' of integers >= 0"
ACCEPTED_BOOL = "one of 1, true, yes, on, 0, false, no, off"
ACCEPTED_NAME = (r"a name of 1-200 letters, digits, '\.', '_', '-' that stays inside OPSD_PROFILE_DIR "
                 r"\(not '\.' or '\.\.', not ending in '\.partial'\)")
VARIABLES = {
    "mode 2": ({"OPSD_PROFILE": "2"}, rf"OPSD_PROFILE='2' is not valid; accepted: {ACCEPTED_MODE}"),
    "mode timer (typo)": ({"OPSD_PROFILE": "timer"}, rf"OPSD_PROFILE='timer' is not valid; accepted: {ACCEPTED_MODE}"),
    "steps ²": ({"OPSD_PROFILE_STEPS": "²"}, rf"OPSD_PROFILE_STEPS='²' is not valid; accepted: {ACCEPTED_STEPS}"),
    "steps 3-1": ({"OPSD_PROFILE_STEPS": "3-1"}, rf"OPSD_PROFILE_STEPS='3-1' is not valid; accepted: {ACCEPTED_STEPS}"),
    "steps of 5000 digits": ({"OPSD_PROFILE_STEPS": "9" * 5000},
                             rf"OPSD_PROFILE_STEPS='9{{39}}\.\.\.\(5002 characters\) is not valid; accepted: "
                             rf"{ACCEPTED_STEPS}"),
    "steps 0-10**9": ({"OPSD_PROFILE_STEPS": "0-1000000000"},
                      rf"OPSD_PROFILE_STEPS='0-1000000000' is not valid; accepted: {ACCEPTED_STEPS}; at most 100000 "
                      r"items"),
    "steps in off mode": ({"OPSD_PROFILE": "0", "OPSD_PROFILE_STEPS": "x"},
                          rf"OPSD_PROFILE_STEPS='x' is not valid; accepted: {ACCEPTED_STEPS}"),
    "ranks -1": ({"OPSD_PROFILE_RANKS": "-1"}, r"OPSD_PROFILE_RANKS='-1' is not valid; accepted: 'all' or a comma "
                                               r"list such as '0', '0,2' or '0-3' of integers >= 0"),
    "ranks ٣ (not ASCII)": ({"OPSD_PROFILE_RANKS": "٣"}, r"OPSD_PROFILE_RANKS='٣' is not valid; accepted: 'all'.*"),
    "every 0": ({"OPSD_PROFILE_EVERY": "0"}, r"OPSD_PROFILE_EVERY='0' is not valid; accepted: an integer >= 1"),
    "every ²": ({"OPSD_PROFILE_EVERY": "²"}, r"OPSD_PROFILE_EVERY='²' is not valid; accepted: an integer >= 1"),
    "every 1.5": ({"OPSD_PROFILE_EVERY": "1.5"}, r"OPSD_PROFILE_EVERY='1\.5' is not valid; accepted: an integer >= 1"),
    "teardown maybe": ({"OPSD_PROFILE_TEARDOWN_CUPTI": "maybe"},
                       rf"OPSD_PROFILE_TEARDOWN_CUPTI='maybe' is not valid; accepted: {ACCEPTED_BOOL}"),
    "memory 2": ({"OPSD_PROFILE_MEMORY": "2"}, rf"OPSD_PROFILE_MEMORY='2' is not valid; accepted: {ACCEPTED_BOOL}"),
    "oom snapshot y": ({"OPSD_PROFILE_OOM_SNAPSHOT": "y"},
                       rf"OPSD_PROFILE_OOM_SNAPSHOT='y' is not valid; accepted: {ACCEPTED_BOOL}"),
    "run name ..": ({"OPSD_PROFILE_RUN_NAME": ".."}, rf"OPSD_PROFILE_RUN_NAME='\.\.' is not valid; accepted: {ACCEPTED_NAME}"),
    "run name .": ({"OPSD_PROFILE_RUN_NAME": "."}, rf"OPSD_PROFILE_RUN_NAME='\.' is not valid; accepted: {ACCEPTED_NAME}"),
    "run name absolute": ({"OPSD_PROFILE_RUN_NAME": "/tmp/x"}, r"OPSD_PROFILE_RUN_NAME='/tmp/x' is not valid; .*"),
    "run name a/../b": ({"OPSD_PROFILE_RUN_NAME": "a/../b"}, r"OPSD_PROFILE_RUN_NAME='a/\.\./b' is not valid; .*"),
    "run name x.partial": ({"OPSD_PROFILE_RUN_NAME": "x.partial"}, r"OPSD_PROFILE_RUN_NAME='x\.partial' is not valid; .*"),
    "run name of 201 characters": ({"OPSD_PROFILE_RUN_NAME": "r" * 201}, r"OPSD_PROFILE_RUN_NAME='r{39}.*is not valid; .*"),
    "unknown OPSD_PROFILE_STEP": ({"OPSD_PROFILE_STEP": "2"},
                                  r"OPSD_PROFILE_STEP is not a known variable \(did you mean OPSD_PROFILE_STEPS\?\); "
                                  r"accepted: OPSD_PROFILE, OPSD_PROFILE_DIR, OPSD_PROFILE_EVERY, .*"),
    "OPSD_TRACEBACK maybe": ({"OPSD_TRACEBACK": "maybe"}, rf"OPSD_TRACEBACK='maybe' is not valid; accepted: {ACCEPTED_BOOL}"),
}


@pytest.mark.parametrize("name", list(VARIABLES))
def test_bad_variable_is_refused_before_any_work(name, env, monkeypatch, tmp_path):
    variables, message = VARIABLES[name]
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as before_models:
        check_environment()
    steps = []
    with pytest.raises(ValueError) as on_entry:
        with opsd_profiler() as prof:
            steps += train(prof)
    for raised in (before_models.value, on_entry.value):
        assert "\n" not in str(raised)
        assert re.fullmatch(message, str(raised)), str(raised)
    assert steps == [] and files_below(tmp_path / "out") == []


def test_importing_never_raises_whatever_the_variables():
    bad = {key: value for variables, _ in VARIABLES.values() for key, value in variables.items()}
    code = "import instrumentation, instrumentation.profiler, traces.cli, rollout; print('imported')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **bad, "PYTHONPATH": REPO})
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr


# ---------------------------------------------------------------------------------------------
# Run directories
LOOP = """
from instrumentation import opsd_profiler, stage, stages
with opsd_profiler() as prof:
    for _ in range(3):
        with stage(stages.STEP):
            torch.randn(4, 4).sum()
        prof.step()
"""
CHILD_RUN = "import torch" + LOOP + 'print("traces:", len(prof.trace_paths()))\n'


def _child(code, env, *args, **kwargs):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env, "PYTHONPATH": REPO}, **kwargs)


def _snapshot(root):
    return {f: (root / f).read_bytes() for f in files_below(root)}


def test_a_second_run_with_the_same_name_is_refused(env, tmp_path):
    first = _child(CHILD_RUN, env)
    assert first.returncode == 0 and "traces: 1" in first.stdout, first.stderr
    out = tmp_path / "out"
    before = _snapshot(out)
    assert len(traces_below(out)) == 1
    steps = []
    with pytest.raises(ValueError) as refused:
        check_environment()  # before building models
    with pytest.raises(ValueError) as on_entry:
        with opsd_profiler() as prof:
            steps += train(prof)
    for raised in (refused.value, on_entry.value):
        assert re.fullmatch(
            rf"OPSD_PROFILE_RUN_NAME='run': {out / 'run'} belongs to another run \(run id [0-9a-f]{{16}}, started "
            r"[-0-9]+ [:0-9]+ on host \S+, pid \d+\); choose another name, or leave OPSD_PROFILE_RUN_NAME unset "
            r"\(each run then gets a fresh name\)", str(raised)), str(raised)
    assert steps == [] and _snapshot(out) == before  # the first run's files untouched, nothing added


def test_ranks_of_one_launch_share_the_name_without_torch_distributed(env, tmp_path, monkeypatch):
    for key, value in {"OPSD_PROFILE_RANKS": "all", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(key, value)  # the launcher's variables are the run's id
    for rank in (1, 0):
        with opsd_profiler(rank=rank, world_size=2) as prof:
            train(prof)
    assert [f.split(".")[0] for f in traces_below(tmp_path / "out" / "run")] == ["rank0", "rank1"]
    before = _snapshot(tmp_path / "out")
    monkeypatch.setenv("MASTER_PORT", "29401")  # the next launch
    with pytest.raises(ValueError, match=r"^OPSD_PROFILE_RUN_NAME='run': .* belongs to another run \(run id launch-"):
        with opsd_profiler(rank=1, world_size=2) as prof:
            train(prof)
    assert _snapshot(tmp_path / "out") == before


CHILD_DIST = """
import sys, torch, torch.distributed as dist
from tests.ds_workers.common import end_process
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:""" + textwrap.indent(LOOP, "    ") + """    print("wrote", len(prof.trace_paths()))
except ValueError as exc:
    print("refused", exc)
end_process()  # barrier, destroy, exit without finalization
"""


def _launch(env):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", CHILD_DIST, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, **env, "PYTHONPATH": REPO, "OPSD_PROFILE_RANKS": "all"})
             for rank in (0, 1)]
    return [p.communicate(timeout=300)[0].strip() for p in procs]


def test_two_launches_of_two_ranks_same_name(env, tmp_path):
    assert _launch(env) == ["wrote 1", "wrote 1"]  # the ranks of one run share the name and the id
    before = _snapshot(tmp_path / "out")
    second = _launch(env)
    assert all(line.startswith(f"refused OPSD_PROFILE_RUN_NAME='run': {tmp_path / 'out' / 'run'} belongs to "
                               "another run") for line in second), second
    assert _snapshot(tmp_path / "out") == before


def _old_run_dir(out):
    (out / "run").mkdir(parents=True)
    (out / "run" / "rank0.1.pt.trace.json.gz").write_bytes(b"an older run's trace")


def _symlink_out(out):
    out.mkdir()
    (out.parent / "elsewhere").mkdir()
    os.symlink(out.parent / "elsewhere", out / "run")


def _file_in_the_way(out):
    out.mkdir()
    (out / "run").write_text("not a directory")


RUN_DIRS = {  # name -> (prepare(out), message (regex, whole line), refused by check_environment too)
    "a directory of an older run (no marker)": (
        _old_run_dir, r"OPSD_PROFILE_RUN_NAME='run': {run} already holds files of another run \(1 entry, no "
                      r"\.opsd-run\); choose another name, .*", True),
    "a symbolic link out of OPSD_PROFILE_DIR": (
        _symlink_out, r"OPSD_PROFILE_RUN_NAME='run': {run} leads outside OPSD_PROFILE_DIR \(to .*elsewhere\); .*",
        False),
    "a file in the way": (_file_in_the_way, r"OPSD_PROFILE_RUN_NAME='run': {run} is a file, not a run directory; .*",
                          True),
}


@pytest.mark.parametrize("name", list(RUN_DIRS))
def test_run_directory_that_is_not_this_runs(name, env, tmp_path):
    prepare, message, early = RUN_DIRS[name]
    out = tmp_path / "out"
    prepare(out)
    before = _snapshot(tmp_path)
    pattern = message.format(run=re.escape(str(out / "run")))
    if early:
        with pytest.raises(ValueError) as raised:
            check_environment()
        assert re.fullmatch(pattern, str(raised.value)), str(raised.value)
    steps = []
    with pytest.raises(ValueError) as raised:
        with opsd_profiler() as prof:
            steps += train(prof)
    assert re.fullmatch(pattern, str(raised.value)), str(raised.value)
    assert steps == [] and _snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# Export faults. In-process rows: name -> fault(monkeypatch, out); the loop finishes every step.
def _enospc(monkeypatch, out):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gzip.GzipFile, "write", full)


def _writes_nothing(monkeypatch, out):
    monkeypatch.setattr(torch.autograd.profiler.profile, "export_chrome_trace", lambda self, path, *a, **k: None)


def _writes_half(monkeypatch, out):
    def half(self, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write('{"schemaVersion": 1, "traceEvents": [{"ph": "X", "cat": "user_annotation", ')

    monkeypatch.setattr(torch.autograd.profiler.profile, "export_chrome_trace", half)


def _tiny_disk(monkeypatch, out):
    out.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 64 KiB tmpfs here (needs root)")


EXPORT_FAULTS = {  # name -> (fault, the warning (regex))
    "disk full while compressing (ENOSPC)": (_enospc, r"opsd trace export failed.*No space left on device"),
    "a 64 KiB disk": (_tiny_disk, r"opsd trace export failed.*"),
    "the profiler writes no file": (_writes_nothing, r"opsd trace export failed.*the profiler wrote no trace"),
    "the profiler writes half a trace": (_writes_half, r"opsd trace export failed.*not a complete Chrome trace"),
}


@pytest.mark.parametrize("name", list(EXPORT_FAULTS))
def test_failed_export_leaves_no_trace_name_and_training_finishes(name, env, tmp_path, monkeypatch):
    fault, warning = EXPORT_FAULTS[name]
    out = tmp_path / "out"
    fault(monkeypatch, out)
    try:
        with pytest.warns(ProfilingWarning, match=warning):
            with opsd_profiler() as prof:
                losses = train(prof, repeat=50 if name == "a 64 KiB disk" else 1)  # there: ~110 KiB of gzip
        assert len(losses) == 4 and prof.current_step == 4 and prof.trace_paths() == []
        assert traces_below(out) == [] and not [f for f in files_below(out) if ".partial" in f]
        assert files_below(tmp_path / "tmp") == []  # nothing outside the run directory
        assert {f.split(os.sep)[0] for f in files_below(out)} <= {"run"}
    finally:
        if name == "a 64 KiB disk":
            subprocess.run(["umount", "-l", str(out)], check=True)  # lazily: TensorBoard may hold a file


def test_a_good_export_is_complete_listed_and_alone(env, tmp_path):
    with opsd_profiler() as prof:
        train(prof)
    out = tmp_path / "out"
    (trace,) = prof.trace_paths()
    with gzip.open(trace, "rt") as f:
        assert any(e.get("name") == "opsd/step" for e in json.load(f)["traceEvents"])
    assert traces_below(out) == [os.path.relpath(trace, out)]
    assert not [f for f in files_below(out) if ".partial" in f] and files_below(tmp_path / "tmp") == []


# Interrupted exports: a training process stalls inside the export (in the gzip writer torch and we
# both use), then gets SIGINT (Ctrl-C) or SIGKILL.
CHILD_STALL = r"""
import gzip, signal, sys, time, torch
from instrumentation import opsd_profiler, stage, stages

# a foreground run's Ctrl-C, also where the suite itself runs as a background job (which ignores SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)

def stall(self, data):
    open(sys.argv[1], "w").close()
    time.sleep(600)

gzip.GzipFile.write = stall
with opsd_profiler() as prof:
    for _ in range(4):
        with stage(stages.STEP):
            torch.randn(4, 4).sum()
        prof.step()
"""


@pytest.mark.parametrize("sig,partial_left", [(signal.SIGINT, False), (signal.SIGKILL, True)], ids=["Ctrl-C", "SIGKILL"])
def test_interrupted_export_leaves_nothing_under_a_trace_name(sig, partial_left, env, tmp_path, capsys):
    ready = tmp_path / "exporting"
    proc = subprocess.Popen([sys.executable, "-c", CHILD_STALL, str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **env, "PYTHONPATH": REPO})
    deadline = time.monotonic() + 240
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), proc.communicate(timeout=60)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -sig and ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)
    out = tmp_path / "out"
    assert traces_below(out) == []
    partial = [f for f in files_below(out) if ".partial" in f]
    assert bool(partial) == partial_left and all(f.startswith(os.path.join("run", "rank0.")) for f in partial)
    assert files_below(tmp_path / "tmp") == []  # torch's temporary JSON never goes to TMPDIR
    assert {f.split(os.sep)[0] for f in files_below(out)} == {"run"}
    if partial_left:  # the summarizer names what the kill left, and has no trace to report
        assert summarize([str(out)]) == 2
        err = capsys.readouterr().err
        assert "incomplete export(s) (*.partial" in err and "holds no *.pt.trace.json[.gz] file" in err
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("mode", ["1", "timers"])
@pytest.mark.parametrize("ranks,rank,world_size,warns", [
    ("1", None, None, True),        # one process: rank 0 only exists
    ("2-3", 1, 2, True),            # no rank of a 2-rank run is selected
    ("0", 1, 4, False),             # rank 1 of 4 is not selected, rank 0 writes: normal, silent
    ("0", None, None, False),
], ids=["1 in one process", "2-3 of 2 ranks", "0 seen from rank 1", "0 in one process"])
def test_ranks_that_select_no_rank_of_the_run_warn_once(ranks, rank, world_size, warns, mode, env, tmp_path,
                                                        monkeypatch):
    import warnings

    monkeypatch.setenv("OPSD_PROFILE", mode)
    monkeypatch.setenv("OPSD_PROFILE_RANKS", ranks)
    monkeypatch.delenv("OPSD_PROFILE_RUN_NAME")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opsd_profiler(rank=rank, world_size=world_size) as prof:
            train(prof, num_steps=3)
    mine = [str(w.message) for w in caught if "OPSD_PROFILE_RANKS" in str(w.message)]
    selected = ",".join(str(r) for r in range(int(ranks[0]), int(ranks[-1]) + 1))
    expected = (f"OPSD_PROFILE_RANKS selects rank {selected}, none of this run's (world size {world_size or 1}; "
                f"this process is rank {rank or 0}): no traces or scalars are written") if warns else None
    assert mine == ([expected] if warns else [])
    if warns:
        assert files_below(tmp_path / "out") == []
