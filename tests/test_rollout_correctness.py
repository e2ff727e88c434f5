"""The seven correctness cases of the seed feature request, plus greedy equivalence with HF ``generate``.

Oracle: HF ``generate`` run on each prompt alone (fp32, greedy), never our own code.
"""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


def _rollout(model, tokenizer=NO_EOS, **cfg):
    return Rollout(model, tokenizer, RolloutConfig().with_settings(cfg))


def _check_rows_match_hf(model, batch, ids, mask, n, max_new, eos=None, pad=0):
    prompt_len = ids.shape[1]
    for row in range(batch.batch_size):
        src = row // n
        expected = hf_greedy(model, ids[src], mask[src], max_new, eos=eos, pad=pad)
        if eos is not None:  # HF pads after EOS; keep through the first EOS
            eos_set = set(eos) if isinstance(eos, list) else {eos}
            cut = next((k + 1 for k, t in enumerate(expected) if t in eos_set), len(expected))
            expected = expected[:cut]
        assert response_of(batch, row) == expected, f"row {row}"
        assert torch.equal(batch.input_ids[row, :prompt_len], ids[src])
        assert batch.response_start_idx[row] == prompt_len


def test_case1_single_sample(qwen):
    ids, mask = random_prompts(1, 9, seed=3)
    batch = _rollout(qwen).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=7, temperature=0.0))
    assert batch.input_ids.shape == (1, 9 + 7)
    assert batch.attention_mask.tolist() == [[1] * 16]
    _check_rows_match_hf(qwen, batch, ids, mask, 1, 7)


@pytest.mark.parametrize("n", [2, 4])
def test_case2_several_samples_per_prompt(qwen, n):
    ids, mask = random_prompts(3, 8, min_len=2, seed=4)
    batch = _rollout(qwen).generate(RolloutRequest(ids, mask),
                                    SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=n))
    assert batch.batch_size == 3 * n
    for row in range(3 * n):  # row i belongs to prompt i // n
        assert torch.equal(batch.input_ids[row, :8], ids[row // n])
        assert torch.equal(batch.attention_mask[row, :8], mask[row // n])
    _check_rows_match_hf(qwen, batch, ids, mask, n, 6)


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_case3_left_padded_prompts_match_hf_per_request(request, arch):
    model = request.getfixturevalue(arch)
    ids, mask = random_prompts(5, 12, min_len=1, seed=5)
    assert (mask == 0).any(), "the case needs left padding"
    batch = _rollout(model).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10, temperature=0.0))
    _check_rows_match_hf(model, batch, ids, mask, 1, 10)
    # and equal to the unpadded prompt alone (padding must not leak into real tokens)
    for row in range(5):
        length = int(mask[row].sum())
        alone = ids[row, 12 - length:]
        assert response_of(batch, row) == hf_greedy(model, alone, torch.ones_like(alone), 10)


def test_case4_partially_masked_prompts(qwen):
    ids, mask = random_prompts(4, 10, min_len=4, seed=6)
    mask = mask.clone()
    mask[1, 7] = 0  # a hole inside a prompt
    mask[2, -3] = 0
    batch = _rollout(qwen).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=5, temperature=0.0))
    assert torch.equal(batch.attention_mask[:, :10], mask)
    _check_rows_match_hf(qwen, batch, ids, mask, 1, 5)


def test_case5_prompt_and_mask_alignment(qwen):
    ids, mask = random_prompts(3, 7, min_len=1, seed=7)
    n = 3
    batch = _rollout(qwen).generate(RolloutRequest(ids, mask),
                                    SamplingConfig(max_new_tokens=4, temperature=0.0, n_samples_per_prompt=n))
    expected_ids = ids.repeat_interleave(n, 0)
    expected_mask = mask.repeat_interleave(n, 0)
    assert torch.equal(batch.input_ids[:, :7], expected_ids)
    assert torch.equal(batch.attention_mask[:, :7], expected_mask.long())
    assert batch.response_start_idx.tolist() == [7] * 9
    # left padding keeps mask 0 on exactly the pad columns of each row
    assert ((batch.attention_mask[:, :7] == 0) == (expected_mask == 0)).all()


def _greedy_tokens(model, ids, mask, max_new):
    batch = _rollout(model).generate(RolloutRequest(ids, mask),
                                     SamplingConfig(max_new_tokens=max_new, temperature=0.0))
    return batch.input_ids[:, ids.shape[1]:]


@pytest.mark.parametrize("pad_equals_eos", [False, True])
def test_case6_eos_and_padding(qwen, pad_equals_eos):
    ids, mask = random_prompts(4, 8, min_len=3, seed=8)
    free_run = _greedy_tokens(qwen, ids, mask, 10)
    eos = int(free_run[0, 3])  # row 0 emits it at step 3 (maybe earlier too)
    pad = eos if pad_equals_eos else 0
    tok = TinyTokenizer(pad_token_id=pad, eos_token_id=eos)
    batch = _rollout(qwen, tok).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10,
                                                                                  temperature=0.0))
    _check_rows_match_hf(qwen, batch, ids, mask, 1, 10, eos=eos, pad=pad)
    resp_ids, resp_mask = batch.input_ids[:, 8:], batch.attention_mask[:, 8:]
    for row in range(4):
        tokens = free_run[row].tolist()
        first = tokens.index(eos) if eos in tokens else None
        if first is None:
            assert resp_mask[row].sum() == resp_ids.shape[1]
            continue
        assert resp_mask[row, :first + 1].tolist() == [1] * (first + 1)  # EOS kept and attended
        assert resp_ids[row, first] == eos
        assert resp_mask[row, first + 1:].sum() == 0  # everything after is pad, mask 0
        assert (resp_ids[row, first + 1:] == pad).all()


def test_case6_several_eos_ids(qwen):
    ids, mask = random_prompts(4, 8, min_len=3, seed=9)
    free_run = _greedy_tokens(qwen, ids, mask, 10)
    eos_ids = [int(free_run[1, 2]), int(free_run[3, 5])]
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos_ids)
    batch = _rollout(qwen, tok).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10,
                                                                                  temperature=0.0))
    _check_rows_match_hf(qwen, batch, ids, mask, 1, 10, eos=eos_ids)
    assert batch.attention_mask[1, 8:].sum() <= 3 and batch.attention_mask[3, 8:].sum() <= 6


def test_case6_generated_token_equal_to_pad_keeps_mask(qwen):
    ids, mask = random_prompts(3, 8, min_len=3, seed=10)
    free_run = _greedy_tokens(qwen, ids, mask, 6)
    pad = int(free_run[0, 2])  # row 0 generates the pad id at step 2: mask comes from positions
    tok = TinyTokenizer(pad_token_id=pad, eos_token_id=None)
    batch = _rollout(qwen, tok).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6,
                                                                                  temperature=0.0))
    assert batch.input_ids[0, 8 + 2] == pad
    assert batch.attention_mask[:, 8:].tolist() == [[1] * 6] * 3


def test_stops_early_when_every_row_has_finished(qwen):
    ids, mask = random_prompts(2, 6, min_len=6, seed=11)
    free_run = _greedy_tokens(qwen, ids, mask, 12)
    eos = int(free_run[0, 1])
    rows_with_eos = [r for r in range(2) if eos in free_run[r].tolist()]
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    ro = _rollout(qwen, tok)
    batch = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=12, temperature=0.0))
    if len(rows_with_eos) == 2:  # both rows end: output is as wide as the longest response only
        longest = max(free_run[r].tolist().index(eos) + 1 for r in range(2))
        assert batch.seq_len == 6 + longest
    else:
        assert batch.seq_len == 6 + 12
