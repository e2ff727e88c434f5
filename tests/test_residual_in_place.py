"""``RolloutConfig.kernels.residual_in_place``: decode steps add each layer's o and down projections into the
residual stream in place (``addmm_``) instead of through a GEMM that copies the residual first. The same greedy
tokens as HF ``generate`` (fp32) and as the step without it on both routes; the in-place products run in every
layer of every decode step and not in the prefill; an o projection with a bias keeps the compiled piece."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.model import step
from rollout.model.step import StepFns, decode_logits
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import assert_setting_keeps_hf_greedy, counter, with_step_pieces

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_same_tokens_as_hf_and_the_copying_step(family, route):
    assert_setting_keeps_hf_greedy(family, route, "residual_in_place", seed=21, prompt_seed=8)


def test_seeded_samples_match_the_copying_step():
    model = tiny_model("qwen2", seed=22)
    ids, mask = random_prompts(3, 8, seed=9, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, n_samples_per_prompt=2, seed=5)
    out = [Rollout(model, NO_EOS, RolloutConfig(kernels=KernelConfig(residual_in_place=flag)))
           .generate(RolloutRequest(ids, mask), sampling).input_ids for flag in (True, False)]
    assert torch.equal(out[0], out[1])


def test_every_decode_layer_adds_in_place_and_the_prefill_does_not():
    """Counted through the pieces: with the setting, each decode step's layers call ``gate_up_silu`` (and never the
    whole-layer piece); the prefill keeps its own pieces. Without it, ``gate_up_silu`` never runs."""
    model = tiny_model("qwen2", seed=23)
    layers = model.config.num_hidden_layers
    ids, mask = random_prompts(2, 7, seed=7, vocab_size=model.config.vocab_size, min_len=3)
    new = 5
    for flag in (True, False):
        calls = {"silu": 0, "layer": 0}
        counted = counter(calls)
        ro = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(residual_in_place=flag)))
        with_step_pieces(ro, gate_up_silu=counted("silu", step.gate_up_silu),
                         attention_output_and_gate_up_mlp=counted("layer", step.attention_output_and_gate_up_mlp))
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=new, temperature=0.0))
        decode_calls = (new - 1) * layers  # the first token comes from the prefill's logits
        if flag:
            assert calls["silu"] == decode_calls
            assert calls["layer"] == layers  # the prefill's one pass
        else:
            assert calls["silu"] == 0
            assert calls["layer"] == layers * new


def _step_inputs(model, rows: int, live: int):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(3)
    shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, live + 2, head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tokens = torch.randint(3, cfg.vocab_size, (rows,), generator=gen)
    keep = torch.ones(rows, 1, 1, live + 1, dtype=torch.bool)
    return keys, values, tokens, torch.full((rows,), live), torch.tensor(live), keep


def test_o_with_a_bias_keeps_the_compiled_piece():
    """An o projection with a bias is not added in place (``addmm_`` would need the bias apart): the layer takes
    the whole-layer piece, and the logits equal the step without the setting."""
    from rollout.executors.decode import FastStep

    model = tiny_model("qwen2", seed=24)
    base = FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cpu"), mirrored=False)
    gen = torch.Generator().manual_seed(4)
    layers = [dataclasses.replace(w, o_bias=torch.randn(w.o.shape[0], generator=gen)) for w in base.weights.layers]
    weights = dataclasses.replace(base.weights, layers=layers)
    used = []
    fns = dataclasses.replace(StepFns(), residual_in_place=True,
                              gate_up_silu=lambda *a, **k: used.append(1) or step.gate_up_silu(*a, **k))
    keys, values, tokens, positions, col, keep = _step_inputs(model, 3, 6)
    with torch.no_grad():
        got = decode_logits(dataclasses.replace(base, weights=weights, fns=fns), keys.clone(), values.clone(), tokens,
                            positions, col, keep)
        want = decode_logits(dataclasses.replace(base, weights=weights, fns=StepFns()), keys.clone(), values.clone(),
                             tokens, positions, col, keep)
    assert not used
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_in_place_logits_equal_the_copying_step_fp32():
    from rollout.executors.decode import FastStep

    model = tiny_model("llama", seed=25)
    base = FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cpu"), mirrored=False)
    keys, values, tokens, positions, col, keep = _step_inputs(model, 4, 9)
    with torch.no_grad():
        got = decode_logits(dataclasses.replace(base, fns=dataclasses.replace(base.fns, residual_in_place=True)),
                            keys.clone(), values.clone(), tokens, positions, col, keep)
        want = decode_logits(base, keys.clone(), values.clone(), tokens, positions, col, keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


def test_setting_is_a_bool():
    with pytest.raises(ValueError, match="kernels.residual_in_place"):
        KernelConfig(residual_in_place=1)
