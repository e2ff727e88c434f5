"""The main job's last bad inputs of issue 34 (probe cases 1-29): DeepSpeed configs read as DeepSpeed reads them or
refused in one line naming the key, ``--json-out`` paths that name no file, conflicting flags, the launcher's
variables, and a diverged run's report (strict JSON, one warning line)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout import job as job_lib
from rollout.opsd import ds_config_checks
from rollout.opsd.console import ProgressBar, loss_warning
from rollout.opsd.engines import deepspeed_config, model_dtype, teacher_engine_config
from rollout.opsd.report import write_json
from scripts import train_opsd
from tests.test_job_checks import _ds_file, _refusal

REPO = Path(__file__).resolve().parents[1]


def _checked(tmp_path, content, *argv):
    """``check_job`` of a job with this DeepSpeed config (None: it passed)."""
    args = job_lib.parse_args(["--deepspeed-config", _ds_file(tmp_path, content), *argv])
    return job_lib.check_job(args.job, args.opsd)


# ---- DeepSpeed configs DeepSpeed takes (cases 1, 2) ---------------------------------------------------------------

@pytest.mark.parametrize("content", [{"gradient_accumulation_steps": 4}, {"gradient_clipping": 1.0},
                                     {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                                     {"zero_optimization": {"stage": 0}, "bf16": None}])
def test_a_config_without_zero_optimization_or_with_a_null_bf16_passes(tmp_path, content):
    assert _checked(tmp_path, content) is None
    config = deepspeed_config(_ds_file(tmp_path, content), None, 8, False)
    assert ds_config_checks.zero_stage(config) == 0 and model_dtype(config) == torch.float32


def test_the_older_bfloat16_section_sets_the_models_dtype_as_deepspeed_reads_it(tmp_path):
    config = deepspeed_config(_ds_file(tmp_path, {"bfloat16": {"enabled": True}}), None, 8, False)
    assert model_dtype(config) == torch.bfloat16
    assert teacher_engine_config(config, 8)["bf16"] == {"enabled": True}
    assert model_dtype({"bf16": None, "fp16": {"enabled": True}}) == torch.float16


# ---- DeepSpeed configs refused naming the key (cases 2, 3, 7, 15) -------------------------------------------------

@pytest.mark.parametrize("content, argv, message", [
    ({"zero_optimization": {"stage": 0}, "bf16": True}, [], r'bf16 must be an object \(\{"enabled": true\}\); got true'),
    ({"fp16": None}, [], r"fp16 must be an object .*; got null$"),
    ({"zero_optimization": 3}, ["--zero-stage", "2"], r"zero_optimization must be an object .*; got 3$"),
    ({"zero_optimization": True}, [], r"zero_optimization must be an object .*; got true$"),
    ({"bf16": {"enabled": "false"}}, [], r'bf16.enabled must be true or false; got "false"$'),
    ({"bf16": {"enabled": "auto"}}, [], r'bf16.enabled must be true or false; got "auto"$'),
    ({"fp16": {"enabled": 1}}, [], r"fp16.enabled must be true or false; got 1$"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, [], r"optimizer.params.lr must be a finite number >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": -1}}}, [], r"optimizer.params.eps must be a finite number >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e31}}}, [], r"optimizer.params.lr must be at most 1e\+30 "),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": None}}}, [], r"optimizer.params.weight_decay must be"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, [], r"optimizer.params.betas must be two"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, [], r"max_grad_norm: DeepSpeed refuses it"),
    ({"optimizer": {"type": "AdamW", "params": [1]}}, [], r"optimizer.params must be an object; got \[1\]$"),
    ({"optimizer": None}, [], r"optimizer must be an object with a 'type'; got null$"),
    ({"optimizer": {"type": "NoSuchOpt"}}, [], r"optimizer.type 'NoSuchOpt' is neither DeepSpeed's \(adagrad, "),
    ({"scheduler": {"type": "NoSuchSched"}}, [], r"scheduler.type 'NoSuchSched' is neither DeepSpeed's \(LRRangeTest"),
    ({"gradient_clipping": "x"}, [], r"gradient_clipping must be a finite number; got 'x'$"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, [],
     r"zero_optimization.offload_param.nvme_path must be a path with device 'nvme'; got null$"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, [],
     r"zero_optimization.offload_optimizer.device must be 'none', 'cpu' or 'nvme'; got \"gpu\"$"),
    ('{"steps_per_print": 1, "steps_per_print": 2}', [], r"duplicate key 'steps_per_print'"),
])
def test_bad_deepspeed_values_are_refused_naming_the_key(monkeypatch, tmp_path, content, argv, message):
    refusal = _refusal(["--deepspeed-config", _ds_file(tmp_path, content), *argv], monkeypatch)
    assert refusal.startswith("error: --deepspeed-config ") and re.search(message, refusal), refusal


@pytest.mark.parametrize("content", [{"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                                     {"optimizer": {"type": "adamw", "params": {"lr": 0, "betas": [0.9, 0.99]}}},
                                     {"optimizer": {"type": "AdamW", "params": {"lr": 1e30, "weight_decay": 1}}},
                                     {"scheduler": {"type": "WarmupLR", "params": {}}},
                                     {"scheduler": {"type": "StepLR", "params": {"step_size": 10}}},
                                     {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"}}}])
def test_optimizers_and_schedulers_deepspeed_builds_pass(tmp_path, content):
    assert _checked(tmp_path, content) is None


@pytest.mark.parametrize("foreach", [True, False])
def test_the_largest_rate_taken_is_one_adamw_steps_with_and_above_it_adamw_raises(foreach):
    """``MAX_LR`` is where torch's AdamW still takes its first step (lr / (1 - beta1) passed as a float32 scalar) for
    beta1 up to 1 - 1e-8; the fuzzed ``--lr 1e300`` raised there after the models were built. (A weight decay that
    overflows gives infinite weights, no error: the job's divergence warning covers it.)"""
    def first_step(lr, beta1, weight_decay):
        param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        param.grad = torch.ones(4, dtype=torch.bfloat16)
        torch.optim.AdamW([param], lr=lr, betas=(beta1, 0.999), weight_decay=weight_decay, foreach=foreach).step()

    for beta1 in (0.0, 0.9, 1 - 1e-8):
        first_step(ds_config_checks.MAX_LR, beta1, 1.0)
    for lr, beta1 in ((1e300, 0.9), (1e38, 0.9), (1e31, 1 - 1e-8)):
        with pytest.raises(RuntimeError, match="overflow"):
            first_step(lr, beta1, 0.01)


def test_fp16_is_refused_where_the_device_has_none(monkeypatch, tmp_path):
    monkeypatch.setattr(ds_config_checks, "fp16_supported", lambda device_type: False)
    refusal = _refusal(["--deepspeed-config", _ds_file(tmp_path, {"fp16": {"enabled": True}})], monkeypatch)
    assert re.search(r"^error: --deepspeed-config .*: fp16.enabled: this device has no fp16", refusal)
    assert ds_config_checks.check_deepspeed_config({"fp16": {"enabled": True}}, None, 1, fp16_ok=True) is None


def test_the_copied_names_and_the_fp16_test_match_deepspeeds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    assert ds_config_checks.DS_OPTIMIZERS == tuple(DEEPSPEED_OPTIMIZERS)
    assert ds_config_checks.DS_SCHEDULERS == tuple(lr_schedules.VALID_LR_SCHEDULES)
    assert ds_config_checks.fp16_supported("cpu") == bool(CPU_Accelerator().is_fp16_supported())


# ---- paths, flags and variables (cases 4, 5, 13, 19, 20, 29) -----------------------------------------------------

@pytest.mark.parametrize("path, why", [("", "is empty"), ("{tmp}/nodir/", "ends in a separator (a directory)"),
                                       ("{tmp}/nodir/.", "names a directory"), ("{tmp}", "is a directory")])
def test_a_json_out_naming_no_file_is_refused_before_building(monkeypatch, tmp_path, path, why):
    message = _refusal(["--json-out", path.format(tmp=tmp_path)], monkeypatch)
    assert message.startswith("error: --json-out ") and f": {why}; name a file" in message
    assert not os.path.exists(tmp_path / "nodir")


@pytest.mark.parametrize("argv, message", [
    (["--teacher-top-k", "3", "--train-path", "packed"],
     r"^error: --train-path packed: cannot run with a top-k teacher cache \(--teacher-top-k 3\)"),
    (["--route", "auto", "--rollout", "routing.cost_model='/nonexist.json'"],
     r"^error: --rollout routing.cost_model: cannot read '/nonexist.json' as a calibration file"),
])
def test_conflicting_flags_are_refused_before_building(monkeypatch, argv, message):
    assert re.search(message, _refusal(argv, monkeypatch))


@pytest.mark.parametrize("name", ["WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK"])
def test_a_bad_launcher_variable_is_named(monkeypatch, name):
    monkeypatch.setenv(name, "abc")
    assert _refusal([], monkeypatch) == f"error: {name}='abc': the environment variable must be an int >= " \
                                        f"{0 if 'RANK' in name else 1}"


@pytest.mark.parametrize("argv, message", [
    (["--deepspeed-config", "{tmp}"], r"deepspeed_config: '.*' is a directory; name a JSON file"),
    (["--max-student-rows", "lots"], r"argument --max-student-rows: expected auto, all or an int >= 1 \(rows\); "
                                     r"got 'lots'"),
    (["--max-teacher-rows", "0"], r"argument --max-teacher-rows: expected auto, all or an int >= 1"),
])
def test_bad_paths_and_row_flags_name_the_flag_at_parse_time(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit):
        job_lib.parse_args([a.format(tmp=tmp_path) for a in argv])
    assert re.search(message, capsys.readouterr().err)


def test_row_flags_still_take_auto_all_and_counts():
    opsd = job_lib.parse_args(["--max-student-rows", "all", "--max-teacher-rows", "3"]).opsd
    assert opsd.max_student_rows is None and opsd.max_teacher_rows == 3


# ---- ignored flags and diverged runs (cases 17, 18) ---------------------------------------------------------------

def test_lr_ignored_under_a_config_optimizer_warns_in_one_line(tmp_path):
    path = _ds_file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    lines = job_lib.job_warnings(job_lib.parse_args(["--deepspeed-config", path, "--lr", "0.01"]).job)
    assert lines == [f"warning: --lr 0.01 is ignored: --deepspeed-config {path} defines an optimizer (AdamW, lr "
                     "0.0001)"]
    assert job_lib.job_warnings(job_lib.parse_args(["--deepspeed-config", path]).job) == []
    assert job_lib.job_warnings(job_lib.parse_args(["--lr", "0.01"]).job) == []


def _strict(text):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path):
    path = tmp_path / "run.json"
    write_json(str(path), {"last_loss": float("nan"), "ranks": [{"losses": [0.5, float("inf"), -float("inf")]}]})
    assert _strict(path.read_text()) == {"last_loss": None, "ranks": [{"losses": [0.5, None, None]}]}
    assert loss_warning(1, float("nan")).startswith("warning: step 1's loss is nan, not finite")
    assert loss_warning(0, 0.25) is None


def test_a_diverged_run_writes_strict_json_and_warns_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_opsd.py"), "--steps", "3", "--lr", "1e30",
                           "--print-every", "0", "--json-out", str(report)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = _strict(report.read_text())
    losses = doc["ranks"][0]["losses"]
    assert losses[0] is not None and None in losses and doc["last_loss"] is None
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "not finite" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step ")
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


# ---- the profiling window and the closing lines (cases 23, 24) -----------------------------------------------------

def test_a_profile_window_past_the_run_is_warned_before_building():
    from instrumentation.config import ProfileConfig
    job = job_lib.parse_args(["--steps", "2"]).job
    assert job_lib.job_warnings(job, ProfileConfig(mode="1", steps="5-7")) == [
        "warning: OPSD_PROFILE_STEPS names steps 5,6,7, but the run has steps 0-1 (--steps 2): no step will be "
        "recorded"]
    assert job_lib.job_warnings(job, ProfileConfig(mode="1", steps="1-3")) == []  # step 1 is in the run
    assert job_lib.job_warnings(job, ProfileConfig(mode="timers", steps="5-7")) == []  # timers: every N-th step


def test_the_closing_profile_lines_name_the_cause(capsys):
    from types import SimpleNamespace

    from instrumentation.config import ProfileConfig
    unwritable = SimpleNamespace(selected=True, run_dir=None, recorded_steps=[])
    train_opsd.print_profile(unwritable)
    assert capsys.readouterr().out == ("profiling on, but nothing was written: OPSD_PROFILE_DIR could not be used "
                                       "(see the warning above)\n")
    past = SimpleNamespace(selected=True, run_dir="/runs/a", recorded_steps=[], current_step=2,
                           config=ProfileConfig(mode="1", steps="5-7"), trace_paths=lambda: ["/runs/a/rank0.t.json"])
    train_opsd.print_profile(past)
    assert capsys.readouterr().out.splitlines() == [
        "profiling on, but no step was recorded: OPSD_PROFILE_STEPS names steps 5,6,7, and the run stopped at step 1",
        "run directory: /runs/a", "trace (no recorded step in it): /runs/a/rank0.t.json"]


def test_the_progress_bar_in_a_log_is_one_line_per_step(capsys):
    """stderr not a terminal (pytest's capture, a log file): the bar is written once per step done, not again after
    every stdout line (it was written after each of a step's 3-4 lines)."""
    bar = ProgressBar(2, enabled=True)
    for step in range(2):
        bar.update()
        for line in ("[k/2] step", "  phases", "  rollout"):
            bar.write(line)
    bar.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[k/2] step", "  phases", "  rollout"] * 2
    assert err.splitlines() == ["[############............] 1/2", "[########################] 2/2"]
    ProgressBar(2, enabled=False).write("quiet")
    assert capsys.readouterr() == ("", "")
