"""The two opt-in outputs RL users expect: finish reasons per row and the sampled tokens' log-probabilities
under the distribution actually used (after repetition penalty, temperature, top-k, top-p)."""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.ops.masks import prompt_positions
from rollout.ops.sampling import prompt_history, sampled_logprobs
from rollout.request import FINISH_BUDGET, FINISH_EOS
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

ROUTES = [("ordinary", {}), ("continuous", {}), ("continuous", {'kernels.cuda_graphs': False}),
          ("ordinary", {'kernels.fast_decode': False})]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 8, min_len=2, seed=1)


def _direct_logprobs(model, batch, sampling, row: int) -> torch.Tensor:
    """One forward over the row's prompt + response; the log-probability of each response token under
    the sampling distribution at its position, computed from those logits."""
    ids, mask = batch.input_ids[row:row + 1], batch.attention_mask[row:row + 1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=prompt_positions(mask)).logits[0]
    start = int(batch.response_start_idx[row])
    width = int(mask[0, start:].sum())
    out = []
    for k in range(width):
        # the prompt from its first real token on and the response so far (HF semantics)
        history = torch.cat([prompt_history(ids[:, :start], mask[:, :start]), ids[:, start:start + k]], dim=1)
        seen = torch.zeros((1, model.config.vocab_size), dtype=torch.bool).scatter_(1, history, True)
        out.append(sampled_logprobs(logits[start + k - 1:start + k], sampling, seen, ids[0, start + k:start + k + 1]))
    return torch.cat(out)


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=10, temperature=0.8, top_k=60, top_p=0.9, seed=3, repetition_penalty=1.2,
                   n_samples_per_prompt=2, return_logprobs=True),
    SamplingConfig(max_new_tokens=10, temperature=0.0, return_logprobs=True),
], ids=["sampled", "greedy"])
def test_logprobs_equal_a_direct_computation_on_every_route(model, prompts, sampling):
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    first = None
    for route, config in ROUTES:
        batch = Rollout(model, tok, RolloutConfig(route=route).with_settings(config)).generate(
            RolloutRequest(*prompts), sampling)
        assert batch.logprobs.shape == (batch.batch_size, batch.seq_len - 8) and batch.logprobs.dtype == torch.float32
        first = first or batch
        assert torch.equal(batch.input_ids, first.input_ids)
        torch.testing.assert_close(batch.logprobs, first.logprobs, rtol=0, atol=1e-5)
    for row in range(first.batch_size):
        direct = _direct_logprobs(model, first, sampling, row)
        torch.testing.assert_close(first.logprobs[row, :direct.shape[0]], direct, rtol=1e-4, atol=1e-4)
        assert torch.isfinite(direct).all() and (direct <= 0).all()


def test_finish_reasons_say_eos_or_budget(model, prompts):
    free = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None)).generate(
        RolloutRequest(*prompts), SamplingConfig(max_new_tokens=12, temperature=0.0))
    eos = free.input_ids[0, 8 + 4].item()  # row 0's 5th token: it ends there, others may not
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0, return_finish_reasons=True)
    for route, config in ROUTES:
        batch = Rollout(model, tok, RolloutConfig(route=route).with_settings(config)).generate(
            RolloutRequest(*prompts), sampling)
        lengths = batch.attention_mask[:, 8:].sum(1)
        ended = (batch.input_ids[:, 8:] == eos).any(1)
        expected = torch.where(ended, FINISH_EOS, FINISH_BUDGET).to(torch.int8)
        assert torch.equal(batch.finish_reasons, expected)
        assert batch.finish_reason_names()[0] == "eos" and lengths[0] == 5
        assert all(lengths[r] == 12 for r in range(5) if not ended[r])


def test_outputs_are_opt_in(model, prompts):
    batch = Rollout(model, TinyTokenizer()).generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=4))
    assert batch.finish_reasons is None and batch.logprobs is None
    with pytest.raises(ValueError, match="finish_reasons: not requested"):
        batch.finish_reason_names()
