"""The main job (``scripts/train_opsd.py``) checks its whole configuration, flags and DeepSpeed config before
building anything (issue 34): each bad input is one clear line naming its flag, and no model is built."""

import json
import os
import re

import pytest
import torch

from rollout import job as job_lib
from rollout.config import MAX_SEED
from rollout.opsd import preflight
from rollout.opsd.report import write_json
from scripts import train_opsd

GIB = 2**30


def _refusal(argv, monkeypatch, available_bytes=None):
    """The message ``train_opsd.main(argv)`` stops with; building a model fails the test."""
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the configuration was checked")

    monkeypatch.setattr(train_opsd, "build_step", no_build)
    monkeypatch.setattr(train_opsd, "init_distributed", no_build)
    if available_bytes is not None:
        monkeypatch.setattr(preflight, "available_bytes", lambda device_type: available_bytes)
    with pytest.raises(SystemExit) as info:
        train_opsd.main(argv)
    message = str(info.value.code)
    assert "\n" not in message.strip()
    return message


def _ds_file(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(path)


# ---- parse time (no model needed) --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--sampling-temperature", "nan"], "sampling_temperature: must be a finite number"),
    (["--sampling-temperature", "inf"], "sampling_temperature: must be a finite number"),
    (["--seed", "-1"], r"seed: must be an int in \[0, 2\*\*32\)"),
    (["--seed", str(2**32)], r"seed: must be an int in \[0, 2\*\*32\)"),
    (["--steps", str(10**9)], r"steps: --steps x --batch-size = 2000000000 prompts exceed"),
])
def test_bad_flags_fail_at_parse_time(capsys, argv, message):
    with pytest.raises(SystemExit):
        job_lib.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("seed", [0, 42949, 42950, 10**9, MAX_SEED - 1])
def test_every_seed_in_range_gives_in_range_step_seeds(seed):
    seeds = {job_lib.step_seed(seed, rank, index) for rank in (0, 3) for index in (0, 1, 10**6)}
    assert all(0 <= s < MAX_SEED for s in seeds) and len(seeds) == 6
    if seed < 42949:  # below the old overflow: the same seeds as before
        assert job_lib.step_seed(seed, 1, 2) == seed * 100_003 + 1009 + 2


def test_lazy_prompts_equal_the_prompts_drawn_at_once():
    from rollout.testing import random_prompts

    job = job_lib.parse_args(["--steps", "5", "--batch-size", "3", "--prompt-len", "9", "--seed", "7"]).job
    stream = job_lib.PromptStream(job, vocab_size=512, special=(0, 2), rank=1, device="cpu")
    ids, mask = random_prompts(15, 9, min_len=4, vocab_size=512, pad_token_id=0, seed=7 * 7919 + 1, avoid=(0, 2))
    for index in range(5):
        step_ids, step_mask = stream(index)
        assert torch.equal(step_ids, ids[3 * index:3 * index + 3]) and torch.equal(step_mask, mask[3 * index:3 * index + 3])
    with pytest.raises(ValueError, match="in order"):
        stream(0)


# ---- before any model is built (model configs, DeepSpeed config, memory) -------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "600"], r"^error: --prompt-len 16 \+ --max-new-tokens 600 = 616 exceeds the student's "
                                  r"context of 512 tokens"),
    (["--prompt-len", "500"], r"^error: --prompt-len 500 \+ --max-new-tokens 24 = 524 exceeds"),
    (["--teacher-top-k", "513"], r"^error: --teacher-top-k: 513 exceeds the shared vocabulary size 512"),
    (["--zero-stage", "3", "--gather", "per_forward", "--route", "continuous"],
     r"^error: --gather: route='continuous' under ZeRO-3 needs gather='once'"),
    # a rank past every LoRA weight's smaller side: 10**20 raised an overflow traceback after the model was built
    (["--lora", "65"], r"^error: --lora: rank 65 exceeds the student's hidden size 64 \(tiny-qwen2; "),
    (["--lora", str(10**20)], r"^error: --lora: rank 100000000000000000000 exceeds the student's hidden size 64"),
])
def test_model_dependent_flags_are_checked_before_building(monkeypatch, argv, message):
    assert re.search(message, _refusal(argv, monkeypatch))


@pytest.mark.parametrize("argv, message", [
    (["--teacher", "self", "--max-new-tokens", "490"],  # the student's 16 + 490 = 506 fits; the teacher's 514 does not
     r"^error: --prompt-len 16 \+ --teacher self's context 8 \+ --max-new-tokens 490 = 514 exceeds the teacher's "
     r"context of 512 tokens \(--teacher self: max_position_embeddings of tiny-qwen2\)$"),
    (["--teacher", "self", "--prompt-len", "500", "--max-new-tokens", "5"],
     r"^error: --prompt-len 500 \+ --teacher self's context 8 \+ --max-new-tokens 5 = 513 exceeds the teacher's"),
    (["--teacher", "self", "--rollout", "max_context=100", "--max-new-tokens", "80"],
     r"^error: --prompt-len 16 \+ --teacher self's context 8 \+ --max-new-tokens 80 = 104 exceeds the teacher's "
     r"context of 100 tokens \(--teacher self: max_context of tiny-qwen2\)$"),
])
def test_the_self_teachers_longer_prompts_must_fit_the_context(monkeypatch, argv, message):
    assert re.search(message, _refusal(argv, monkeypatch))


def _short_teacher(tmp_path, context):
    from transformers import LlamaConfig

    from rollout.testing import TINY_SHAPES

    LlamaConfig(**{**TINY_SHAPES["llama"], "max_position_embeddings": context}).save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_teacher_with_a_shorter_context_than_the_students_is_refused(monkeypatch, tmp_path):
    teacher = _short_teacher(tmp_path, 64)
    message = _refusal(["--teacher", teacher, "--max-new-tokens", "60"], monkeypatch)
    assert message == (f"error: --prompt-len 16 + --max-new-tokens 60 = 76 exceeds the teacher's context of 64 tokens "
                       f"(max_position_embeddings of {teacher})")


@pytest.mark.parametrize("argv", [["--teacher", "self", "--max-new-tokens", "488"],  # 16 + 8 + 488 = 512
                                  ["--teacher", "self", "--prompt-len", "488", "--max-new-tokens", "16"]])
def test_teacher_contexts_that_fit_pass(argv):
    args = job_lib.parse_args(argv)
    assert job_lib.check_job(args.job, args.opsd) is None


def test_a_short_teacher_within_its_context_passes(tmp_path):
    args = job_lib.parse_args(["--teacher", _short_teacher(tmp_path, 64), "--max-new-tokens", "48"])
    assert job_lib.check_job(args.job, args.opsd) is None


@pytest.mark.parametrize("content, message", [
    ("{nope", r"^error: --deepspeed-config .*ds.json: not valid JSON \(.*line 1 column 2"),
    ("[1, 2]", r"^error: --deepspeed-config .*ds.json: must hold a JSON object; got list"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"^error: --deepspeed-config .*: bf16 and fp16 are both"),
    ({"zero_optimization": {"stage": 4}}, r"^error: --deepspeed-config .*: zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}, r"^error: --deepspeed-config .*: train_batch_size 3"),
    ({"gradient_accumulation_steps": 0}, r"^error: --deepspeed-config .*: gradient_accumulation_steps must be an int"),
])
def test_bad_deepspeed_configs_are_refused_before_building(monkeypatch, tmp_path, content, message):
    refusal = _refusal(["--deepspeed-config", _ds_file(tmp_path, content)], monkeypatch)
    assert re.search(message, refusal)


def test_models_larger_than_the_host_are_refused_with_the_estimate(monkeypatch):
    message = _refusal(["--student", "qwen25-7b", "--teacher", "qwen25-7b"], monkeypatch, available_bytes=22 * GIB)
    assert message.startswith("error: --student/--teacher: the models need at least ")
    assert "qwen25-7b" in message and "22 GiB available" in message


def test_samples_beyond_the_memory_budget_are_refused(monkeypatch):
    message = _refusal(["--samples-per-prompt", "100000", "--max-new-tokens", "400"], monkeypatch,
                       available_bytes=8 * GIB)
    assert message.startswith("error: --samples-per-prompt 100000: ")
    capped = _refusal(["--samples-per-prompt", "64", "--max-cache-gib", "0.0001"], monkeypatch)
    assert capped.startswith("error: --samples-per-prompt 64: ") and "--max-cache-gib" in capped


def test_an_unwritable_json_out_is_refused_before_building(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = _refusal(["--json-out", str(blocker / "run.json")], monkeypatch)
    assert message.startswith("error: --json-out ") and "not a directory" in message
    assert _refusal(["--json-out", str(tmp_path)], monkeypatch).startswith("error: --json-out ")


def test_the_default_job_passes_the_checks():
    args = job_lib.parse_args([])
    assert job_lib.check_job(args.job, args.opsd) is None


def test_a_failed_report_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "run.json"
    target.mkdir()  # os.replace onto a directory fails after the temporary file is written
    with pytest.raises(OSError):
        write_json(str(target), {"a": 1})
    assert os.listdir(tmp_path) == ["run.json"]
