"""The fused q|k|v projection of our step (``RolloutConfig.kernels.fuse_qkv``, ``rollout.model.step.FusedQKV``): the
same tokens as three projections and as HF ``generate`` (fp32), weights changed between calls are followed,
its copy is counted in ``held_bytes`` and dropped with ``keep_cache=False``."""

from __future__ import annotations

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.model.step import FusedQKV, spec_and_weights
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


def _qkv_bytes(model) -> int:
    total = 0
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            total += proj.weight.nbytes + (proj.bias.nbytes if proj.bias is not None else 0)
    return total


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_same_tokens_as_three_projections_and_hf(family, route):
    model = tiny_model(family, seed=5)
    ids, mask = random_prompts(4, 9, seed=3, vocab_size=model.config.vocab_size, min_len=2)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.0, continuous_batch_size=2)
    fused = Rollout(model, NO_EOS, RolloutConfig(route=route)).generate(RolloutRequest(ids, mask), sampling)
    plain = Rollout(model, NO_EOS, RolloutConfig(route=route, kernels=KernelConfig(fuse_qkv=False))).generate(
        RolloutRequest(ids, mask), sampling)
    assert torch.equal(fused.input_ids, plain.input_ids)
    for row in range(ids.shape[0]):
        assert response_of(fused, row) == hf_greedy(model, ids[row], mask[row], 7)


def test_weights_changed_between_calls_are_followed():
    """The fused copy is refreshed at every call: after an in-place update of k_proj (what an optimizer
    step does), the next call decodes with the new weights."""
    model = tiny_model("qwen2", seed=6)
    ids, mask = random_prompts(3, 8, seed=4, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    ro = Rollout(model, NO_EOS, RolloutConfig())
    before = ro.generate(RolloutRequest(ids, mask), sampling)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-3.0)
            layer.self_attn.v_proj.bias.add_(0.5)
    after = ro.generate(RolloutRequest(ids, mask), sampling)
    fresh = Rollout(model, NO_EOS, RolloutConfig(kernels=KernelConfig(fuse_qkv=False))).generate(
        RolloutRequest(ids, mask), sampling)
    assert torch.equal(after.input_ids, fresh.input_ids)
    assert not torch.equal(after.input_ids, before.input_ids)
    for row in range(ids.shape[0]):
        assert response_of(after, row) == hf_greedy(model, ids[row], mask[row], 6)


def test_held_bytes_count_the_copy_and_keep_cache_false_drops_it():
    model = tiny_model("qwen2", seed=7)
    ids, mask = random_prompts(2, 6, seed=5, vocab_size=model.config.vocab_size, min_len=2)
    sampling = SamplingConfig(max_new_tokens=3, temperature=0.0)
    kept = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(fuse_gate_up=False)))
    kept.generate(RolloutRequest(ids, mask), sampling)
    assert kept.runner.fast_step.nbytes == _qkv_bytes(model)
    unfused = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(
        fuse_qkv=False, fuse_gate_up=False)))
    unfused.generate(RolloutRequest(ids, mask), sampling)
    assert kept.held_bytes - unfused.held_bytes == _qkv_bytes(model)
    loose = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", keep_cache=False))
    loose.generate(RolloutRequest(ids, mask), sampling)
    assert loose.held_bytes == 0


def test_fused_copy_layout_and_reuse():
    """``[q; k; v]`` rows in that order; a missing bias is zeros; the buffers keep their addresses across
    refreshes (captured graphs read them) and follow the source values."""
    model = tiny_model("qwen2", seed=8)
    _, weights = spec_and_weights(model)
    with torch.no_grad():
        weights.layers[0].k_bias = None  # as if k had no bias
    fused = FusedQKV()
    first = fused.refresh(weights).layers[0]
    w = weights.layers[0]
    assert torch.equal(first.qkv, torch.cat([w.q, w.k, w.v]))
    assert torch.equal(first.qkv_bias, torch.cat([w.q_bias, torch.zeros(w.k.shape[0]), w.v_bias]))
    with torch.no_grad():
        w.q.add_(1.0)
    second = fused.refresh(weights).layers[0]
    assert second.qkv.data_ptr() == first.qkv.data_ptr() and torch.equal(second.qkv[: w.q.shape[0]], w.q)


def test_compile_mode_reaches_torch_compile(monkeypatch):
    """``RolloutConfig.kernels.compile_mode`` is the mode every compiled piece of the step is built with (on CUDA;
    checked here through the pieces a CUDA call would read, with torch.compile recorded)."""
    from rollout.executors.decode import FastStep
    from rollout.model import step

    seen = []

    def recording_compile(fn, **kwargs):
        seen.append((fn.__name__, kwargs.get("mode")))
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    step.compiled_step_fns.cache_clear()
    try:
        model = tiny_model("qwen2", seed=0)
        ro = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(
            compile_mode="max-autotune-no-cudagraphs")))
        parts = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False)  # no CUDA needed to build them
        assert {mode for _, mode in seen} == {"max-autotune-no-cudagraphs"}
        assert parts.fns.attention_output_and_mlp is step.attention_output_and_mlp  # the recorder's output
        seen.clear()
        FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cuda"), mirrored=False)
        assert seen and {mode for _, mode in seen} == {None}  # the default: torch's default mode
        seen.clear()
        FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cpu"), mirrored=False)
        assert seen == []  # never compiled on the CPU
    finally:
        step.compiled_step_fns.cache_clear()


@pytest.mark.parametrize("attention,kv_write", [("triton", True), ("sdpa", False), ("triton", False)])
def test_step_pieces_follow_the_config(monkeypatch, attention, kv_write):
    """``RolloutConfig.kernels.decode_attention`` and ``fused_kv_write`` decide the pieces a CUDA call's step runs:
    the Triton attention (where triton imports) or SDPA, and the compiled q|k|v piece that writes k and v
    or none; on the CPU the step keeps SDPA and the separate writes."""
    pytest.importorskip("triton")
    from rollout.model import step
    from rollout.ops import decode_attention

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    step.compiled_step_fns.cache_clear()
    try:
        ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(),
                     RolloutConfig(kernels=KernelConfig(decode_attention=attention, fused_kv_write=kv_write)))
        cuda = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False)  # no CUDA needed to build them
        assert cuda.fns.attention is (decode_attention.attention if attention == "triton" else step.decode_attention)
        assert cuda.fns.attention_inputs_qkv_write is (step.attention_inputs_qkv_write if kv_write else None)
        cpu = ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False)
        assert cpu.fns.attention is step.decode_attention and cpu.fns.attention_inputs_qkv_write is None
    finally:
        step.compiled_step_fns.cache_clear()


def test_one_refresh_per_call():
    """Within ``FastStep.one_call`` (one ``generate``) the kept copies are refreshed by the first ``parts`` only:
    a weight changed after it is not copied again until the next call, while outside it every ``parts``
    refreshes; and one ``generate`` concatenates each layer's copies once (mirror-free model: ``torch.cat``
    is the refresh)."""
    model = tiny_model("qwen2", seed=9)
    ro = Rollout(model, NO_EOS, RolloutConfig())
    step, cpu = ro.runner.fast_step, torch.device("cpu")
    with step.one_call():
        first = step.parts(cpu, mirrored=False).weights.layers[0].qkv.clone()
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.add_(1.0)
        again = step.parts(cpu, mirrored=True).weights.layers[0].qkv
        assert torch.equal(again, first)  # not copied within the call
    outside = step.parts(cpu, mirrored=False).weights.layers[0].qkv
    assert not torch.equal(outside, first)  # refreshed outside a call
    k_rows = slice(model.config.hidden_size, outside.shape[0] - (outside.shape[0] - model.config.hidden_size) // 2)
    assert torch.equal(outside[k_rows], model.model.layers[0].self_attn.k_proj.weight)

    cats = []
    original = torch.cat

    def counting_cat(*args, **kwargs):
        if kwargs.get("out") is not None:
            cats.append(1)
        return original(*args, **kwargs)

    ids, mask = random_prompts(2, 6, seed=5, vocab_size=model.config.vocab_size, min_len=2)
    import unittest.mock
    with unittest.mock.patch.object(torch, "cat", counting_cat):
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3, temperature=0.0))
    layers = model.config.num_hidden_layers
    assert len(cats) == layers * 3  # per layer: q|k|v weight, q|k|v bias, gate|up; once in the call
