"""``Rollout`` on a peft LoRA model: fused generation equals the merged model; training state untouched."""

import copy

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

peft = pytest.importorskip("peft")
TOK = TinyTokenizer(pad_token_id=0, eos_token_id=None)


def _lora_model(seed=0):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(tiny_model(seed=seed), config)


@pytest.mark.parametrize("fuse_lora", [True, False])
def test_lora_tokens_equal_the_merged_model(fuse_lora):
    model = _lora_model()
    merged = copy.deepcopy(model).merge_and_unload()
    ids, mask = random_prompts(3, 8, min_len=2, seed=31)
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.0)
    got = Rollout(model, TOK, RolloutConfig(fuse_lora=fuse_lora)).generate(RolloutRequest(ids, mask), cfg)
    want = Rollout(merged, TOK).generate(RolloutRequest(ids, mask), cfg)
    assert torch.equal(got.input_ids, want.input_ids)
    hf = merged.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         eos_token_id=None, temperature=None, top_p=None, top_k=None)
    assert torch.equal(got.input_ids, hf)


def test_rollout_leaves_base_weights_and_adapter_path_intact():
    model = _lora_model(seed=1)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = random_prompts(2, 6, seed=32)
    with torch.no_grad():
        logits_before = model(input_ids=ids, attention_mask=mask).logits
    ro = Rollout(model, TOK)
    for _ in range(3):
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=0.0))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        logits_after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits_before, logits_after)  # adapters not double-applied, not lost
    assert model.training
