"""Edge values the configs refuse: the loss temperature and top-k (issue 34: a NaN, a saturated or a zero loss, with
no warning), the repetition penalty (degenerate tokens), each naming its field and, through the main job's parser,
before anything is built."""

import math

import pytest
import torch

from rollout.config import REPETITION_PENALTY_RANGE, SamplingConfig
from rollout.opsd import OPSDConfig
from rollout.opsd.config import LOSS_TEMPERATURE_RANGE
from rollout.opsd.losses import generalized_jsd_loss


@pytest.mark.parametrize("value", [1e-300, 1e-30, 1e-7, 1e7, 1e300])
def test_loss_temperatures_outside_the_range_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number in \[1e-06, 1e\+06\]"):
        OPSDConfig(temperature=value)


def test_the_loss_temperature_range_is_where_the_loss_stays_finite_and_informative():
    """At the bounds the loss is finite and positive on ordinary logits; beyond them it was NaN or 0 (what the
    bounds refuse)."""
    gen = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(2, 5, 64, generator=gen) * 4 for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.bool)

    def loss(temperature):
        return float(generalized_jsd_loss(student, teacher, mask, 0.5, temperature))

    low, high = LOSS_TEMPERATURE_RANGE
    for temperature in (low, 1.0, high):
        OPSDConfig(temperature=temperature)  # accepted
        assert math.isfinite(loss(temperature)) and loss(temperature) > 0
    assert not math.isfinite(loss(1e-300))
    assert loss(1e300) == 0.0


def test_a_top_k_cache_of_one_id_is_refused():
    with pytest.raises(ValueError, match=r"^teacher_top_k: must be None or an int >= 2"):
        OPSDConfig(teacher_top_k=1)
    assert OPSDConfig(teacher_top_k=2).teacher_top_k == 2


@pytest.mark.parametrize("value", [1e-300, 1e-39, 1e-7, 1e7, 1e300])
def test_repetition_penalties_outside_the_range_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^repetition_penalty: must be a finite number in \[1e-06, 1e\+06\]"):
        SamplingConfig(max_new_tokens=4, repetition_penalty=value)
    low, high = REPETITION_PENALTY_RANGE
    assert SamplingConfig(max_new_tokens=4, repetition_penalty=low).repetition_penalty == low
    assert SamplingConfig(max_new_tokens=4, repetition_penalty=high).repetition_penalty == high


def test_the_repetition_penalty_floor_keeps_greedy_tokens_varied():
    """At the floor the penalised logits stay finite and greedy decoding picks as HF's penalty would; below it (1e-300
    rounds to 0 in float32) the tokens repeated one id."""
    from rollout import Rollout, RolloutRequest
    from rollout.testing import TinyTokenizer, random_prompts, tiny_model

    model = tiny_model("qwen2", seed=0).float()
    ids, mask = random_prompts(2, 6, min_len=3, seed=1)
    rollout = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2))
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                                      repetition_penalty=REPETITION_PENALTY_RANGE[0]))
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              repetition_penalty=REPETITION_PENALTY_RANGE[0], pad_token_id=0, eos_token_id=2)
    assert torch.equal(batch.input_ids[:, :expected.shape[1]], expected)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "1e-300"], "temperature: must be a finite number in"),
    (["--teacher-top-k", "1"], "teacher_top_k: must be None or an int >= 2"),
])
def test_the_main_job_refuses_them_at_parse_time(flags, message, capsys):
    from rollout.job import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--student", "tiny-qwen2", "--teacher", "tiny-qwen2", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
