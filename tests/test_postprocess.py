"""Case 7 of the seed request: the batched post-processing equals the per-row reference loop."""

import pytest
import torch

from rollout.ops.expand import expand_prompts
from rollout.ops.postprocess import postprocess, postprocess_reference


def _random_case(seed, batch, n, prompt_len, width, vocab, eos_ids, pad):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, pad)
    generated = torch.randint(0, vocab, (batch * n, width), generator=gen)
    return ids, mask, generated


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_reference_on_random_inputs(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    batch, n = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
    prompt_len, width = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(0, 12, (1,), generator=gen))
    vocab = 6  # tiny vocab: EOS and pad collisions are frequent
    eos_ids = [(), (2,), (2, 4), (0,)][seed % 4]
    pad = [0, 0, 2, 5][seed % 4]
    ids, mask, generated = _random_case(seed, batch, n, prompt_len, width, vocab, eos_ids, pad)
    exp_ids, exp_mask = expand_prompts(ids, mask, n)
    fast = postprocess(exp_ids, exp_mask, generated, eos_ids, pad)
    ref = postprocess_reference(ids, mask, generated, n, eos_ids, pad)
    assert torch.equal(fast.input_ids, ref.input_ids)
    assert torch.equal(fast.attention_mask, ref.attention_mask)
    assert torch.equal(fast.response_start_idx, ref.response_start_idx)


def test_hand_built_case():
    ids = torch.tensor([[0, 7, 8], [9, 9, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    generated = torch.tensor([
        [5, 2, 6, 2],  # EOS (2) at step 1: kept, rest padded
        [0, 3, 3, 3],  # a generated pad-valued token keeps mask 1, no EOS
    ])
    out = postprocess(ids, mask, generated, eos_token_ids=(2,), pad_token_id=0)
    assert out.input_ids.tolist() == [[0, 7, 8, 5, 2, 0, 0], [9, 9, 9, 0, 3, 3, 3]]
    assert out.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
    assert out.response_start_idx.tolist() == [3, 3]


def test_pad_equal_to_eos_keeps_the_first_eos():
    ids, mask = torch.tensor([[4, 4]]), torch.tensor([[1, 1]])
    generated = torch.tensor([[6, 2, 2, 2]])
    out = postprocess(ids, mask, generated, eos_token_ids=(2,), pad_token_id=2)
    assert out.input_ids.tolist() == [[4, 4, 6, 2]]  # trimmed to the longest response
    assert out.attention_mask.tolist() == [[1, 1, 1, 1]]


def test_empty_generation_gives_prompt_only():
    ids, mask = torch.tensor([[4, 5]]), torch.tensor([[1, 1]])
    out = postprocess(ids, mask, torch.zeros((1, 0), dtype=torch.long), (2,), 0)
    assert out.input_ids.tolist() == [[4, 5]] and out.seq_len == 2
