"""The main job's last bad inputs of issue 34, each refused before any model is built naming its flag or key: a local
teacher with a smaller vocabulary than the student's, ``--train-path packed`` with a model the packed path cannot
run, bad DeepSpeed ``scheduler.params``, a plain file as ``--student``/``--teacher``, negative numbers in scientific
notation; and the DeepSpeed config read once (``job_warnings`` takes the parsed one)."""

import inspect
import os
import re

import pytest

from rollout import job as job_lib
from rollout.opsd import ds_config_checks, engines
from rollout.testing import TINY_SHAPES
from scripts import train_opsd
from tests.test_job_checks import _ds_file, _refusal


def _model_dir(tmp_path, name, arch="llama", **overrides):
    """A local model directory holding only ``config.json`` (the checks read no weights)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    path = tmp_path / name
    if arch == "gpt2":
        GPT2Config(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4, **overrides).save_pretrained(path)
    else:
        (LlamaConfig if arch == "llama" else Qwen2Config)(**{**TINY_SHAPES[arch], **overrides}).save_pretrained(path)
    return str(path)


# ---- 1. a teacher vocabulary smaller than what the student can sample ---------------------------------------------

def test_a_local_teacher_with_a_smaller_vocabulary_is_refused_naming_both_sizes(monkeypatch, tmp_path):
    teacher = _model_dir(tmp_path, "small-teacher", vocab_size=256)
    assert _refusal(["--teacher", teacher], monkeypatch) == (
        f"error: --teacher {teacher}: its vocabulary (vocab_size 256) is smaller than the student's (512, tiny-qwen2); "
        "the student can sample ids the teacher cannot score")
    student = _model_dir(tmp_path, "large-student", "qwen2", vocab_size=1024)  # a named teacher below a local student
    assert re.search(r"^error: --teacher tiny-llama: its vocabulary \(vocab_size 512\) is smaller than the student's "
                     r"\(1024, .*large-student\)", _refusal(["--student", student], monkeypatch))


def test_a_teacher_with_a_larger_or_equal_vocabulary_still_passes(tmp_path):
    for name, vocab in (("larger", 1024), ("equal", 512)):  # the loss compares the shared ids (align_vocab)
        args = job_lib.parse_args(["--teacher", _model_dir(tmp_path, name, vocab_size=vocab)])
        assert job_lib.check_job(args.job, args.opsd) is None


# ---- 2. --train-path packed where the models' configs rule it out -------------------------------------------------

def test_packed_with_a_model_it_cannot_run_is_refused_before_building(monkeypatch, tmp_path):
    teacher = _model_dir(tmp_path, "gpt2-teacher", "gpt2")
    assert _refusal(["--teacher", teacher, "--train-path", "packed"], monkeypatch) == (
        f"error: --train-path packed: cannot run --teacher {teacher}: model type 'gpt2' is not one of ('llama', "
        "'qwen2', 'qwen3', 'mistral'); use --train-path auto (padded for this model) or padded")
    student = _model_dir(tmp_path, "windowed", "qwen2", use_sliding_window=True, sliding_window=64)
    assert re.search(r"^error: --train-path packed: cannot run --student .*windowed: sliding-window attention; ",
                     _refusal(["--student", student, "--train-path", "packed"], monkeypatch))
    for path in ("auto", "padded"):  # auto falls back to padded, as documented
        args = job_lib.parse_args(["--teacher", teacher, "--train-path", path])
        assert job_lib.check_job(args.job, args.opsd) is None


# ---- 3. DeepSpeed scheduler.params ---------------------------------------------------------------------------------

@pytest.mark.parametrize("scheduler, message", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}},
     r'scheduler.params.warmup_num_steps must be an int >= 1; got "ten"$'),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}, r"scheduler.params.warmup_num_steps must be an int"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": -1}},
     r"scheduler.params.warmup_max_lr must be a finite number in \[0, 1e\+30\] or a list of them or null; got -1$"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e31}}, r"scheduler.params.warmup_max_lr .*; got 1e\+31$"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": float("nan")}}, r"scheduler.params.warmup_max_lr .*; got NaN$"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.1, "x"]}}, r"scheduler.params.warmup_min_lr must be"),
    ({"type": "WarmupLR", "params": {"warmup_type": "linaer"}},
     r"scheduler.params.warmup_type must be 'log' or 'linear'; got \"linaer\"$"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}},
     r"scheduler.params.warmup_steps: not a parameter of WarmupLR \(DeepSpeed's WarmupLR takes warmup_min_lr, "),
    ({"type": "WarmupLR"}, r"scheduler.params: WarmupLR needs an object \(\{\} for its defaults\)"),
    ({"type": "WarmupLR", "params": None}, r"scheduler.params: WarmupLR needs an object"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
     r"scheduler.params.total_num_steps: WarmupDecayLR needs it \(it has no default\)$"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": -5}},
     r"scheduler.params.total_num_steps must be an int >= 0"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ratio": float("inf")}},
     r"scheduler.params.cos_min_ratio must be a finite number >= 0; got Infinity$"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}, r"scheduler.params.cycle_max_lr: OneCycle needs it"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}},
     r"scheduler.params.cycle_first_step_size must be a finite number > 0; got 0$"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_momentum": "yes"}},
     r"scheduler.params.cycle_momentum must be true or false"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_rate": "fast"}},
     r"scheduler.params.lr_range_test_step_rate must be a finite number; got \"fast\"$"),
    ({"type": "LRRangeTest", "params": {"last_batch_iteration": -2}},
     r"scheduler.params.last_batch_iteration must be an int >= -1"),
    ({"type": "StepLR", "params": {"gamma": 0.5}}, r"scheduler.params: missing a required argument: 'step_size' "
                                                   r"\(torch.optim.lr_scheduler.StepLR\)$"),
    ({"type": "StepLR", "params": {"step_size": 10, "gamma": float("nan")}},
     r"scheduler.params.gamma must be a finite number; got NaN$"),
])
def test_bad_scheduler_params_are_refused_naming_the_key(monkeypatch, tmp_path, scheduler, message):
    refusal = _refusal(["--deepspeed-config", _ds_file(tmp_path, {"scheduler": scheduler})], monkeypatch)
    assert refusal.startswith("error: --deepspeed-config ") and re.search(message, refusal), refusal


def test_scheduler_params_deepspeed_takes_pass_and_the_table_matches_deepspeeds(tmp_path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    for name, table in ds_config_checks.SCHEDULER_PARAMS.items():
        parameters = dict(inspect.signature(getattr(lr_schedules, name)).parameters)
        parameters.pop("optimizer")
        assert list(table) == list(parameters), name
        required = tuple(key for key, p in parameters.items() if p.default is inspect.Parameter.empty)
        assert ds_config_checks.SCHEDULER_REQUIRED.get(name, ()) == required, name
    for scheduler in ({"type": "WarmupLR", "params": {"warmup_min_lr": [0], "warmup_max_lr": None,
                                                      "warmup_num_steps": 10, "warmup_type": "linear"}},
                      {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": 1e-3}},
                      {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0.1}},
                      {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                      "cycle_second_step_size": None, "cycle_momentum": False}},
                      {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 5,
                                                         "lr_range_test_staircase": True}},
                      {"type": "CosineAnnealingLR", "params": {"T_max": 10, "eta_min": 0.0}}):
        args = job_lib.parse_args(["--deepspeed-config", _ds_file(tmp_path, {"scheduler": scheduler})])
        assert job_lib.check_job(args.job, args.opsd) is None, scheduler


# ---- 4. a plain file as a model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--student", "--teacher"])
def test_a_plain_file_as_a_model_is_refused_naming_the_flag_and_path(capsys, tmp_path, flag):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(SystemExit):
        job_lib.parse_args([flag, str(path)])
    assert f"error: {flag[2:]}: {flag} '{path}' is a file, not a model directory" in capsys.readouterr().err


def test_a_directory_without_a_model_config_is_refused_naming_the_flag(capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(SystemExit):
        job_lib.parse_args(["--teacher", str(tmp_path)])
    assert f"error: teacher: --teacher '{tmp_path}' is a directory without config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert job_lib.parse_args(["--teacher", str(tmp_path)]).job.teacher == str(tmp_path)


# ---- 5. negative numbers in scientific notation -------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1e300"], r"error: lr: must be a finite number in \(0, 1e\+30\] .*; got -1e\+300$"),
    (["--lr", "-inf"], r"error: lr: must be a finite number in \(0, 1e\+30\] .*; got -inf$"),
    (["--lr", "1e300"], r"error: lr: must be a finite number in \(0, 1e\+30\] \(AdamW's float32 step overflows above "
                        r"it\); got 1e\+300$"),  # AdamW raised after the models were built
    (["--temperature", "-1E-3"], r"error: temperature: must be a finite number in \[1e-06, 1e\+06\]"),
    (["--max-cache-gib", "-.5e2"], r"error: max_cache_gib: "),
    (["--peak-tflops", "-2.5e+3"], r"error: peak_tflops: must be a finite number > 0; got -2500.0$"),
])
def test_negative_numbers_in_scientific_notation_reach_the_range_checks(capsys, argv, message):
    with pytest.raises(SystemExit):
        job_lib.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert "expected one argument" not in err and re.search(message, err), err


def test_negative_scientific_values_parse_and_flags_still_work(capsys):
    assert job_lib.parse_args(["--sampling-temperature", "-1e-3"]).job.sampling_temperature == -1e-3  # greedy
    assert job_lib.parse_args(["--sampling-temperature", "-2"]).job.sampling_temperature == -2.0
    with pytest.raises(SystemExit) as info:
        job_lib.parse_args(["-h"])
    assert info.value.code == 0 and "--sampling-temperature" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a flag still needs its value
        job_lib.parse_args(["--lr", "--steps", "2"])
    assert "argument --lr: expected one argument" in capsys.readouterr().err


# ---- 6. the DeepSpeed config read once -----------------------------------------------------------------------------

def test_the_job_reads_its_deepspeed_config_once_and_warns_from_the_parsed_one(monkeypatch, tmp_path, capsys):
    path = _ds_file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    reads, read = [], ds_config_checks.read_deepspeed_config

    def counted(name):
        reads.append(name)
        return read(name)

    monkeypatch.setattr(engines, "read_deepspeed_config", counted)
    monkeypatch.setattr(ds_config_checks, "read_deepspeed_config", counted)
    monkeypatch.setattr(train_opsd, "init_distributed", lambda: (_ for _ in ()).throw(RuntimeError("built")))
    with pytest.raises(RuntimeError, match="built"):
        train_opsd.main(["--deepspeed-config", path, "--lr", "0.01"])
    assert reads == [path]
    assert f"warning: --lr 0.01 is ignored: --deepspeed-config {path} defines an optimizer (AdamW, lr 0.0001)" \
        in capsys.readouterr().err
    job = job_lib.parse_args(["--deepspeed-config", path, "--lr", "0.01"]).job
    os.remove(path)  # the parsed config alone
    assert job_lib.job_warnings(job, deepspeed={"optimizer": {"type": "SGD"}}) == [
        f"warning: --lr 0.01 is ignored: --deepspeed-config {path} defines an optimizer (SGD, lr its default)"]


def _tokenizer(path, size: int) -> None:
    """A word-level tokenizer of ``size`` ids saved into ``path`` (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(path)


def test_a_padded_student_head_above_the_teacher_vocabulary_is_warned_not_refused(monkeypatch, tmp_path):
    """Qwen2.5-style heads are padded past the tokenizer (151,936 rows for 151,665 ids; 72B: 152,064): a teacher whose
    vocabulary holds every tokenizer id of the student is warned about, not refused; below the tokenizer it is."""
    student = _model_dir(tmp_path, "padded-student", "qwen2", vocab_size=1024)
    _tokenizer(student, 300)
    args = job_lib.parse_args(["--student", student])  # teacher tiny-llama: 512 ids >= 300 tokenizer ids
    with pytest.warns(UserWarning, match=r"its vocabulary \(512\) is smaller than the student's head \(1024\) but "
                                         r"holds all 30\d ids of the student's tokenizer"):
        assert job_lib.check_job(args.job, args.opsd) is None
    teacher = _model_dir(tmp_path, "small-teacher", vocab_size=256)  # below the tokenizer: refused
    assert re.search(r"^error: --teacher .*small-teacher: its vocabulary \(vocab_size 256\) is smaller",
                     _refusal(["--student", student, "--teacher", teacher], monkeypatch))
