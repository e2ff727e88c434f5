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
    rollout = Rollout(model, TOK, RolloutConfig(fuse_lora=fuse_lora))
    got = rollout.generate(RolloutRequest(ids, mask), cfg)
    want = Rollout(merged, TOK).generate(RolloutRequest(ids, mask), cfg)
    assert torch.equal(got.input_ids, want.input_ids)
    # fused adapters decode through our step (chosen before the call fuses them); unfused ones through HF's layers
    decode = rollout.last_stats.decode
    assert (decode.path != "hf") == fuse_lora, (decode.path, decode.fallback_reason)
    assert rollout.last_stats.prefill.path != "hf" if fuse_lora else "not fused" in decode.fallback_reason
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


def test_a_lora_variant_the_fuser_leaves_unmerged_keeps_hf_layers():
    """DoRA is not fused (peft's forward stays exact for it): the call must not take our step, which would drop it."""
    torch.manual_seed(2)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    model = peft.get_peft_model(tiny_model(seed=2), config)
    merged = copy.deepcopy(model).merge_and_unload()
    ids, mask = random_prompts(2, 6, seed=33)
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
    rollout = Rollout(model, TOK)
    got = rollout.generate(RolloutRequest(ids, mask), cfg)
    assert rollout.last_stats.decode.path == "hf" and "not fused" in rollout.last_stats.decode.fallback_reason
    assert torch.equal(got.input_ids, Rollout(merged, TOK).generate(RolloutRequest(ids, mask), cfg).input_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_lora_decodes_in_cuda_graphs_equal_to_hf_generate_on_the_merged_model():
    """The fused weights through the captured step (fp32), twice: the second call reuses the graphs with the fused
    buffers refreshed in place, after the adapters changed."""
    model = _lora_model(seed=3).to("cuda")
    ids, mask = random_prompts(3, 8, min_len=2, seed=34, device="cuda")
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.0)
    rollout = Rollout(model, TOK)
    for _ in range(2):
        got = rollout.generate(RolloutRequest(ids, mask), cfg)
        assert rollout.last_stats.decode.path == "graph", rollout.last_stats.decode.fallback_reason
        merged = copy.deepcopy(model).merge_and_unload()
        hf = merged.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None, temperature=None, top_p=None, top_k=None)
        assert torch.equal(got.input_ids, hf)
        with torch.no_grad():  # a training step's worth of change to every adapter
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(torch.randn_like(param) * 0.5)
