"""The fused gate|up projection of our step (``RolloutConfig.kernels.fuse_gate_up``, ``rollout.model.step.FusedGateUp``):
the same tokens as two projections and as HF ``generate`` (fp32) on both routes and in prefill, weights changed
between calls are followed, the copy is counted in ``held_bytes``, announced to the memory budget before it is
allocated, and dropped with ``keep_cache=False``."""

from __future__ import annotations

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.model import step
from rollout.model.step import FusedGateUp, spec_and_weights
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import assert_setting_keeps_hf_greedy, hf_greedy, response_of, with_step_pieces

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


def _gate_up_bytes(model) -> int:
    return sum(layer.mlp.gate_proj.weight.nbytes + layer.mlp.up_proj.weight.nbytes for layer in model.model.layers)


def _qkv_bytes(model) -> int:
    return sum(p.weight.nbytes + (p.bias.nbytes if p.bias is not None else 0)
               for layer in model.model.layers
               for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_same_tokens_as_two_projections_and_hf(family, route):
    assert_setting_keeps_hf_greedy(family, route, "fuse_gate_up", seed=11, prompt_seed=6)


def test_the_fused_piece_runs_in_decode_and_prefill(monkeypatch):
    """With the option on, every layer of every decode step and of the fast prefill goes through a gate|up piece
    (decode steps: ``gate_up_silu``, with ``kernels.residual_in_place``), and the two-projection piece never runs
    (without it, the reverse)."""
    calls = {"fused": 0, "plain": 0}
    fused_piece, plain_piece = step.attention_output_and_gate_up_mlp, step.attention_output_and_mlp

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    model = tiny_model("qwen2", seed=12)
    ids, mask = random_prompts(2, 7, seed=7, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    for fuse in (True, False):
        calls.update(fused=0, plain=0)
        ro = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(fuse_gate_up=fuse)))
        with_step_pieces(ro, attention_output_and_gate_up_mlp=count("fused", fused_piece),
                         gate_up_silu=count("fused", step.gate_up_silu),
                         attention_output_and_mlp=count("plain", plain_piece))
        ro.generate(RolloutRequest(ids, mask), sampling)
        assert ro.last_stats.prefill.path != "hf"
        layers = model.config.num_hidden_layers
        used, unused = ("fused", "plain") if fuse else ("plain", "fused")
        assert calls[unused] == 0
        assert calls[used] >= layers * 4  # prefill and three decode steps at least, every layer
        assert calls[used] % layers == 0


def test_weights_changed_between_calls_are_followed():
    model = tiny_model("llama", seed=13)
    ids, mask = random_prompts(3, 8, seed=4, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    ro = Rollout(model, NO_EOS, RolloutConfig(kernels=KernelConfig(fuse_gate_up=True)))
    before = ro.generate(RolloutRequest(ids, mask), sampling)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(-4.0)
    after = ro.generate(RolloutRequest(ids, mask), sampling)
    assert not torch.equal(after.input_ids, before.input_ids)
    for row in range(ids.shape[0]):
        assert response_of(after, row) == hf_greedy(model, ids[row], mask[row], 6)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
def test_copies_are_announced_before_allocation_held_and_dropped(family):
    model = tiny_model(family, seed=14)
    ids, mask = random_prompts(2, 6, seed=5, vocab_size=model.config.vocab_size, min_len=2)
    sampling = SamplingConfig(max_new_tokens=3, temperature=0.0)
    ro = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(fuse_gate_up=True)))
    assert ro.runner.fast_step.new_copy_bytes() == _gate_up_bytes(model) + _qkv_bytes(model)
    ro.generate(RolloutRequest(ids, mask), sampling)
    assert ro.runner.fast_step.nbytes == _gate_up_bytes(model) + _qkv_bytes(model)
    assert ro.runner.fast_step.new_copy_bytes() == 0  # held: the next call allocates nothing new
    plain = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(fuse_gate_up=False)))
    plain.generate(RolloutRequest(ids, mask), sampling)
    assert ro.held_bytes - plain.held_bytes == _gate_up_bytes(model)
    loose = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", keep_cache=False, kernels=KernelConfig(
        fuse_gate_up=True)))
    loose.generate(RolloutRequest(ids, mask), sampling)
    assert loose.held_bytes == 0
    assert loose.runner.fast_step.new_copy_bytes() == _gate_up_bytes(model) + _qkv_bytes(model)


def test_the_budget_counts_copies_not_yet_held(monkeypatch):
    """A device with room for the call's cache and buffers but not also for the weight copies a first call
    allocates: refused with the figures before anything runs; with the copies already held, the same free
    memory is enough."""
    import rollout.executors.runner as engine

    model = tiny_model("qwen2", seed=15)
    ids, mask = random_prompts(2, 6, seed=5, vocab_size=model.config.vocab_size, min_len=2)
    sampling = SamplingConfig(max_new_tokens=3, temperature=0.0)
    probe = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(
        fuse_qkv=False, fuse_gate_up=False)))
    monkeypatch.setattr(engine, "free_device_bytes", lambda device: 10**12)
    probe.generate(RolloutRequest(ids, mask), sampling)
    need = probe.runner.pool.nbytes + 64 * 1024  # the cache plus a margin for the per-row buffers
    free = need + _gate_up_bytes(model) // 2
    monkeypatch.setattr(engine, "free_device_bytes", lambda device: free)
    unfused = KernelConfig(fuse_qkv=False, fuse_gate_up=False)
    Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=unfused)).generate(
        RolloutRequest(ids, mask), sampling)
    fused = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(
        fuse_qkv=False, fuse_gate_up=True)))
    with pytest.raises(ValueError, match="max_cache_gib"):
        fused.generate(RolloutRequest(ids, mask), sampling)
    assert fused.runner.fast_step.nbytes == 0 and fused.runner.pool.nbytes == 0  # nothing was allocated
    monkeypatch.setattr(engine, "free_device_bytes", lambda device: 10**12)
    fused.generate(RolloutRequest(ids, mask), sampling)
    monkeypatch.setattr(engine, "free_device_bytes", lambda device: free)
    fused.generate(RolloutRequest(ids, mask), sampling)  # the copies are held now: the same memory suffices


def test_fused_copy_layout_and_reuse():
    model = tiny_model("qwen2", seed=16)
    _, weights = spec_and_weights(model)
    fused = FusedGateUp()
    first = fused.refresh(weights).layers[1]
    w = weights.layers[1]
    assert torch.equal(first.gate_up, torch.cat([w.gate, w.up]))
    with torch.no_grad():
        w.up.add_(1.0)
    second = fused.refresh(weights).layers[1]
    assert second.gate_up.data_ptr() == first.gate_up.data_ptr()
    assert torch.equal(second.gate_up[w.gate.shape[0]:], w.up)
    fused.clear()
    assert fused.nbytes == 0
