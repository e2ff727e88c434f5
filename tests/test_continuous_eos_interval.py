"""``eos_check_interval`` on the continuous route: EOS checks every k steps (sticky EOS flags on the device in
between, so the host does not wait each step). Responses, finish reasons and log-probabilities equal those
of k = 1 (and HF ``generate``, greedy fp32) with refills and compaction; a row that ended between checks
decodes at most k - 1 masked tokens more; host syncs are the checks."""

from __future__ import annotations

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, RoutingConfig
from rollout.request import FINISH_BUDGET, FINISH_EOS
from rollout.testing import TinyTokenizer
from tests.conftest import hf_greedy, response_of
from tests.test_continuous import make_prompts, staggered_eos

LENGTHS = [5, 3, 8, 2, 6, 4, 7]
MAX_NEW = 12


def _run(model, ids, mask, eos, interval, sampling):
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=eos),
                 RolloutConfig(route="continuous", routing=RoutingConfig(eos_check_interval=interval)))
    return ro.generate(RolloutRequest(ids, mask), sampling), ro.last_stats


@pytest.mark.parametrize("interval", [2, 3, 5])
def test_greedy_responses_equal_every_step_checks_and_hf(qwen, interval):
    ids, mask = make_prompts(LENGTHS, seed=21)
    eos = staggered_eos(qwen, ids, mask, MAX_NEW)
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0, continuous_batch_size=3,
                              return_finish_reasons=True)
    every, every_stats = _run(qwen, ids, mask, eos, 1, sampling)
    got, stats = _run(qwen, ids, mask, eos, interval, sampling)
    assert stats.plans > 1  # refills: more than one admission wave
    for row in range(ids.shape[0]):
        expected = hf_greedy(qwen, ids[row], mask[row], MAX_NEW, eos=eos)
        assert response_of(every, row) == expected
        assert response_of(got, row) == expected
    assert torch.equal(got.finish_reasons, every.finish_reasons)
    assert (got.finish_reasons == FINISH_EOS).any() and (got.finish_reasons == FINISH_BUDGET).any()
    # host syncs: one per check, every `interval` steps, against one per step
    assert every_stats.decode.host_syncs == every_stats.decode.steps
    assert stats.decode.host_syncs == stats.decode.steps // interval < every_stats.decode.host_syncs


@pytest.mark.parametrize("interval", [2, 4])
def test_sampled_rows_and_logprobs_equal_every_step_checks(qwen, interval):
    """Seeded sampling with top-p and a repetition penalty, 2 samples per prompt, log-probabilities: each
    row's tokens are keyed by its own sample id and token index, so the check interval changes nothing
    a response holds."""
    ids, mask = make_prompts(LENGTHS, seed=22)
    eos = staggered_eos(qwen, ids, mask, MAX_NEW)
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.85, repetition_penalty=1.2,
                              seed=5, n_samples_per_prompt=2, continuous_batch_size=4, return_logprobs=True)
    every, _ = _run(qwen, ids, mask, eos, 1, sampling)
    got, _ = _run(qwen, ids, mask, eos, interval, sampling)
    for row in range(every.input_ids.shape[0]):
        assert response_of(got, row) == response_of(every, row)
        width = int(every.attention_mask[row, ids.shape[1]:].sum())
        assert torch.allclose(got.logprobs[row, :width], every.logprobs[row, :width])
        assert torch.all(got.logprobs[row, width:] == 0)


def test_rows_decode_at_most_interval_minus_one_extra_tokens(qwen):
    """The scheduler's per-row token counts: a row that ended at an EOS id is retired at the next check,
    so the call's width grows by less than the interval."""
    ids, mask = make_prompts(LENGTHS, seed=23)
    eos = staggered_eos(qwen, ids, mask, MAX_NEW)
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0, continuous_batch_size=3)
    every, every_stats = _run(qwen, ids, mask, eos, 1, sampling)
    interval = 4
    got, stats = _run(qwen, ids, mask, eos, interval, sampling)
    assert every_stats.decode.num_steps <= stats.decode.num_steps <= min(
        MAX_NEW, every_stats.decode.num_steps + interval - 1)
    assert stats.decode.rows >= every_stats.decode.rows  # the extra tokens are decoded, then masked
