"""``RolloutConfig.kernels.fold_norms``: the RMSNorm gains before q|k|v and gate|up folded into the fused weight
copies, and decode steps that scale the raw residual's products by each row's 1/RMS in two kernels
(``rollout/ops/rms_scaled.py``: on the CPU through Triton's interpreter, on CUDA compiled).

The kernels equal their PyTorch references and the unfolded arithmetic (norm, projection, rotary / SiLU-mul); the
folded copies hold ``weight * gain`` with ones in the record, refreshed again when the setting changes; a step on
the folded record gives HF generate's greedy tokens (fp32, norm gains made non-trivial) on both routes with the
kernels in every decode layer and no norm piece there, and the same seeded samples as the unfolded step; the
setting only folds where the kernels run."""

from __future__ import annotations

import functools

import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.model import step
from rollout.model.pieces import gate_up_silu, qkv_projection, rotary
from rollout.model.weights import FusedGateUp, FusedQKV, spec_and_weights
from rollout.ops import rms_scaled as rs
from rollout.ops import rotary_write as rw
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import counter, hf_greedy, response_of, with_step_pieces
from tests.test_decode_attention import device  # noqa: F401 - the fixture

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
EPS = 1e-6


def _gained(model, seed: int):
    """``model`` with every RMSNorm gain drawn from [0.5, 1.5] (HF initializes them to ones: folding would be
    invisible)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model


def _cache(rows, kv_heads, dim, dtype, dev, gen):
    cache = torch.randn(2, rows, kv_heads, 12, dim, generator=gen).to(dtype).to(dev)
    return cache[0, :, :, 2:], cache[1, :, :, 2:]  # strided views, as the static cache's


@pytest.mark.parametrize("heads,kv_heads,dim,hidden,bias", [(4, 2, 16, 64, True), (16, 2, 128, 2048, True),
                                                           (6, 6, 32, 200, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_equals_its_reference_and_the_unfolded_arithmetic(device, heads, kv_heads, dim, hidden, bias,
                                                                        dtype):
    gen = torch.Generator().manual_seed(heads + hidden)
    rows, width = 3, (heads + 2 * kv_heads) * dim
    h = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.randn(width, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(device)
    gain = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    b = torch.randn(width, generator=gen).to(dtype).to(device) if bias else None
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rotary(torch.randint(0, 500, (rows,), generator=gen).to(device), inv_freq.to(device), 1.0, dtype)
    cols = torch.tensor([5], device=device)
    shape = dict(eps=EPS, heads=heads, kv_heads=kv_heads, head_dim=dim)
    product = h @ (weight * gain).t()
    caches = [_cache(rows, kv_heads, dim, dtype, device, torch.Generator().manual_seed(1)) for _ in range(3)]
    before = caches[0][0].clone()
    got = rs.rotary_write_rms(product, h, b, cos, sin, *caches[0], cols, **shape, interpret=True)
    ref = rs.rotary_write_rms_reference(product, h, b, cos, sin, *caches[1], cols, **shape)
    unfolded = rw.rotary_write_reference(qkv_projection(h, gain, weight, b, EPS), cos, sin, *caches[2], cols,
                                         heads=heads, kv_heads=kv_heads, head_dim=dim)
    same = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.shape == (rows, heads, 1, dim) and got.dtype == dtype
    for mine, theirs in ((got, ref), (caches[0][0], caches[1][0]), (caches[0][1], caches[1][1])):
        torch.testing.assert_close(mine.float(), theirs.float(), **same)
    loose = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=6e-2, atol=6e-2)
    for mine, theirs in ((got, unfolded), (caches[0][0], caches[2][0]), (caches[0][1], caches[2][1])):
        torch.testing.assert_close(mine.float(), theirs.float(), **loose)
    others = [c for c in range(before.shape[2]) if c != 5]
    assert torch.equal(caches[0][0][:, :, others], before[:, :, others])


@pytest.mark.parametrize("rows,inter,hidden", [(3, 100, 64), (5, 1500, 300), (1, 2048, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_kernel_equals_its_reference_and_the_unfolded_piece(device, rows, inter, hidden, dtype):
    gen = torch.Generator().manual_seed(rows + inter)
    h = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(device)
    gain = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    product = h @ (weight * gain).t()
    got = rs.silu_mul_rms(product, h, eps=EPS, interpret=True)
    assert got.shape == (rows, inter) and got.dtype == dtype
    same = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), rs.silu_mul_rms_reference(product, h, eps=EPS).float(), **same)
    loose = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=6e-2, atol=6e-2)
    torch.testing.assert_close(got.float(), gate_up_silu(h, gain, weight, EPS).float(), **loose)


@pytest.mark.parametrize("block,warps", [(16, 1), (64, 2), (256, 4), (1024, 8)])
def test_every_silu_launch_gives_the_reference(device, block, warps):
    """A launch other than the default (``--parts silu`` times them): blocks that cut the row into 1 to 7 programs,
    the last one partly masked, give what the default launch gives."""
    gen = torch.Generator().manual_seed(block)
    h = (torch.randn(3, 48, generator=gen) * 3).to(device)
    product = (torch.randn(3, 200, generator=gen) * 20).to(device)
    got = rs.silu_mul_rms(product, h, eps=EPS, interpret=True, block=block, warps=warps)
    torch.testing.assert_close(got, rs.silu_mul_rms_reference(product, h, eps=EPS), rtol=1e-5, atol=1e-5)
    default = rs.silu_mul_rms(product, h, eps=EPS, interpret=True)
    if device == "cpu":  # the interpreter: bitwise; compiled launches may round fp32 apart (H100: 1.2e-6 relative)
        torch.testing.assert_close(got, default, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launch,field", [(dict(block=48), "block"), (dict(block=8), "block"), (dict(block=True), "block"),
                                          (dict(block=64.0), "block"), (dict(warps=3), "warps"), (dict(warps=64), "warps"),
                                          (dict(warps=0), "warps")])
def test_a_silu_launch_the_kernel_cannot_take_is_refused_by_name(launch, field):
    product, h = torch.randn(2, 8), torch.randn(2, 4)
    with pytest.raises(ValueError, match=f"^{field}: must be None or a power of two"):
        rs.silu_mul_rms(product, h, eps=EPS, **launch)


def test_silu_blocks_fill_the_device():
    assert rs.silu_block(256, 11008, 132) == 4096  # 3 programs a row, 768 in all
    assert rs.silu_block(8, 11008, 132) == 512  # the smallest block: 22 a row
    assert rs.silu_block(64, 11008, 132) == 2048
    assert rs.silu_block(1, 100, 132) == 512  # never below 512 columns (masked)


def test_failing_kernels_warn_once_and_fall_back(device, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    product, h = torch.randn(2, 64, generator=gen).to(device), torch.randn(2, 16, generator=gen).to(device)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(rs, "_launch_silu", broken)
    monkeypatch.setattr(rs, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="no kernel for you"):
        got = rs.silu_mul_rms(product, h, eps=EPS, interpret=True)
    torch.testing.assert_close(got, rs.silu_mul_rms_reference(product, h, eps=EPS))
    assert "no kernel for you" in rs.failure(product.device)
    assert "no kernel for you" in rs.unsupported_reason(product, h, interpret=True)


def test_unsupported_inputs_take_the_pytorch_path():
    product, h = torch.randn(2, 64), torch.randn(2, 16)
    cache = torch.zeros(2, 1, 4, 24)
    assert rs.rotary_problem(torch.randn(2, 72), h, cache, cache, 24, interpret=True).startswith("head dimension 24")
    assert rs.unsupported_reason(product, h.t(), interpret=True).startswith("the product and residual")
    assert rs.unsupported_reason(product, h) in ("not a CUDA tensor", rs.available())


def test_folded_copies_hold_weight_times_gain_and_refresh_when_the_setting_changes():
    model = _gained(tiny_model("qwen2", seed=31), seed=1)
    _, weights = spec_and_weights(model)
    w = weights.layers[0]
    qkv, gate_up = FusedQKV(), FusedGateUp()
    folded = gate_up.refresh(qkv.refresh(weights, fold=True), fold=True).layers[0]
    torch.testing.assert_close(folded.qkv, torch.cat([w.q, w.k, w.v]) * w.input_norm, rtol=0, atol=0)
    torch.testing.assert_close(folded.gate_up, torch.cat([w.gate, w.up]) * w.post_norm, rtol=0, atol=0)
    torch.testing.assert_close(folded.qkv_bias, torch.cat([w.q_bias, w.k_bias, w.v_bias]), rtol=0, atol=0)
    assert torch.equal(folded.input_norm, torch.ones_like(w.input_norm))
    assert torch.equal(folded.post_norm, torch.ones_like(w.post_norm))
    assert not torch.equal(w.input_norm, torch.ones_like(w.input_norm))  # the model's own gains untouched
    plain = qkv.refresh(weights, copy=False).layers[0]  # a second refresh (copy=False), unfolded: not the folded values
    torch.testing.assert_close(plain.qkv, torch.cat([w.q, w.k, w.v]), rtol=0, atol=0)
    assert plain.input_norm is w.input_norm


def _forced(ro, kernels: bool):
    """``ro``'s step folds the norms on the CPU (the setting folds only where the kernels run: CUDA); ``kernels``:
    with the interpreted kernels (else their PyTorch paths) and counting calls."""
    fast = ro.runner.fast_step
    fast._folds = lambda device, rotary_kernel: (True, True)
    calls = {"rotary": 0, "silu": 0, "norm": 0}
    counted = counter(calls)
    pieces = dict(qkv_projection=counted("norm", step.qkv_projection), gate_up_silu=counted("norm", step.gate_up_silu),
                  rotary_attention=None)  # the rotary kernel itself (on CUDA the attention would take it in)
    if kernels:
        pieces.update(rotary_write_rms=counted("rotary", functools.partial(rs.rotary_write_rms, interpret=True)),
                      silu_mul_rms=counted("silu", functools.partial(rs.silu_mul_rms, interpret=True)))
    with_step_pieces(ro, **pieces)
    return calls


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_folded_step_gives_hf_greedy_tokens(device, family, route):
    model = _gained(tiny_model(family, seed=32), seed=2).to(device)
    ids, mask = random_prompts(3, 8, seed=6, vocab_size=model.config.vocab_size, min_len=2)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, NO_EOS, RolloutConfig(route=route, kernels=KernelConfig(cuda_graphs=False, fold_norms=True)))
    calls = _forced(ro, kernels=True)
    new = 6
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=new, temperature=0.0,
                                                                continuous_batch_size=2))
    layers = model.config.num_hidden_layers
    decode_layer_calls = calls["rotary"]
    assert decode_layer_calls >= (new - 1) * layers and decode_layer_calls % layers == 0
    assert calls["silu"] == decode_layer_calls  # every decode layer: both kernels, no norm piece
    assert calls["norm"] == 0
    for row in range(ids.shape[0]):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], new)


def test_folded_step_samples_as_the_unfolded_one():
    model = _gained(tiny_model("qwen2", seed=33), seed=3)
    ids, mask = random_prompts(3, 8, seed=9, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, n_samples_per_prompt=2, seed=5)
    runs = []
    for fold in (True, False):
        ro = Rollout(model, NO_EOS, RolloutConfig(kernels=KernelConfig(fold_norms=fold)))
        if fold:
            _forced(ro, kernels=False)  # the kernels' PyTorch paths (what runs where triton cannot)
        runs.append(ro.generate(RolloutRequest(ids, mask), sampling).input_ids)
    assert torch.equal(runs[0], runs[1])


def test_setting_folds_only_where_the_kernels_run(monkeypatch):
    """A CUDA call's parts (built without a GPU here) carry the kernels and ones in the record; a CPU call's do not;
    without ``residual_in_place`` gate|up is not folded; the setting is a bool."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    step.compiled_step_fns.cache_clear()
    try:
        model = _gained(tiny_model("qwen2", seed=34), seed=4)
        ro = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(fold_norms=True)))
        cuda = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False)
        assert cuda.fns.rotary_write_rms is rs.rotary_write_rms and cuda.fns.silu_mul_rms is rs.silu_mul_rms
        assert torch.equal(cuda.weights.layers[0].input_norm, torch.ones(model.config.hidden_size))
        half = Rollout(tiny_model("qwen2", seed=34, dtype=torch.float16), TinyTokenizer(),
                       RolloutConfig(kernels=KernelConfig(fold_norms=True)))
        assert half.runner.fast_step.parts(torch.device("cuda"), mirrored=False).fns.rotary_write_rms is None
        cpu = ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False)
        assert cpu.fns.rotary_write_rms is None and cpu.fns.silu_mul_rms is None
        assert torch.equal(cpu.weights.layers[0].input_norm, model.model.layers[0].input_layernorm.weight)
        copied = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(fold_norms=True,
                                                                                     residual_in_place=False)))
        parts = copied.runner.fast_step.parts(torch.device("cuda"), mirrored=False)
        assert parts.fns.rotary_write_rms is rs.rotary_write_rms and parts.fns.silu_mul_rms is None
        assert torch.equal(parts.weights.layers[0].post_norm, model.model.layers[0].post_attention_layernorm.weight)
    finally:
        step.compiled_step_fns.cache_clear()
    with pytest.raises(ValueError, match="kernels.fold_norms"):
        KernelConfig(fold_norms=1)


def test_the_budget_counts_the_ones_where_norms_fold():
    model = tiny_model("qwen2", seed=35)
    fast = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(fold_norms=True))).runner.fast_step
    plain = fast.new_copy_bytes()
    fast._folds = lambda device, rotary_kernel: (True, True)
    assert fast.new_copy_bytes(torch.device("cpu")) == plain + 2 * model.config.hidden_size * 4
    fast.parts(torch.device("cpu"), mirrored=False)
    assert fast.nbytes == plain + 2 * model.config.hidden_size * 4  # what the call then holds
    assert fast.new_copy_bytes(torch.device("cpu")) == 0


def test_decode_logits_fold_equals_unfolded_fp32():
    """One step over random cache contents: the folded record with the kernels' PyTorch paths equals the unfolded
    step (fp32, 1e-5)."""
    from rollout.executors.decode import FastStep

    model = _gained(tiny_model("llama", seed=36), seed=5)
    folding = FastStep(model, KernelConfig(fold_norms=True), mirror_weights=False)
    folding._folds = lambda device, rotary_kernel: (True, True)
    folded = folding.parts(torch.device("cpu"), mirrored=False)
    assert folded.fns.rotary_write_rms is rs.rotary_write_rms and folded.fns.silu_mul_rms is rs.silu_mul_rms
    _assert_logits_equal_the_unfolded_step(model, folded, rows=4, live=9)


def _assert_logits_equal_the_unfolded_step(model, folded, rows: int, live: int):
    """One decode step of ``folded`` parts over random cache contents equals the default CPU step's (fp32, 1e-5)."""
    from rollout.executors.decode import FastStep
    from tests.test_residual_in_place import _step_inputs

    plain = FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cpu"), mirrored=False)
    keys, values, tokens, positions, col, keep = _step_inputs(model, rows, live)
    with torch.no_grad():
        got = step.decode_logits(folded, keys.clone(), values.clone(), tokens, positions, col, keep)
        want = step.decode_logits(plain, keys.clone(), values.clone(), tokens, positions, col, keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_folded_copies_pass_through_the_weight_mirror_within_one_call():
    """Under ZeRO-3 with graphs the record goes through the weight mirror: the folded copies and their ones pass as
    they are (fixed addresses, not mirrored twice), a second ``parts`` of the same call reuses them, and the step's
    logits equal the unfolded step's (fp32)."""
    from rollout.executors.decode import FastStep

    model = _gained(tiny_model("qwen2", seed=37), seed=6)
    fast = FastStep(model, KernelConfig(fold_norms=True), mirror_weights=True)
    fast._folds = lambda device, rotary_kernel: (True, True)
    with fast.one_call():
        first = fast.parts(torch.device("cpu"), mirrored=True)
        again = fast.parts(torch.device("cpu"), mirrored=True)
    held = {t.data_ptr() for copies in (fast.fused_qkv, fast.fused_gate_up) for t in copies.buffers}
    layer = first.weights.layers[0]
    assert {layer.qkv.data_ptr(), layer.gate_up.data_ptr(), layer.input_norm.data_ptr(),
            layer.post_norm.data_ptr()} <= held
    assert torch.equal(layer.input_norm, torch.ones_like(layer.input_norm))
    assert first.weights.signature() == again.weights.signature()
    _assert_logits_equal_the_unfolded_step(model, again, rows=3, live=7)


def test_the_call_says_whether_norms_were_folded():
    """``CallStats.decode.norms_folded``: from the call's decode choice (a CUDA choice is built without a GPU here:
    it folds by default, not with the setting off, nor without the rotary kernel and fused gate|up, nor on the HF
    path); a CPU call does not fold and says so."""
    pytest.importorskip("triton")
    from rollout.executors.decode import choose_decode

    model = tiny_model("qwen2", seed=38)
    cuda = torch.device("cuda")

    def folded(**kernels):
        return choose_decode(RolloutConfig(kernels=KernelConfig(**kernels)), model, False, cuda).norms_folded

    assert folded() and not folded(fold_norms=False) and not folded(fast_decode=False)
    assert not folded(rotary_kernel=False, fuse_gate_up=False) and folded(rotary_kernel=False)
    half = tiny_model("qwen2", seed=38, dtype=torch.float16)  # fp16 keeps its norms (the raw products' range)
    assert not choose_decode(RolloutConfig(), half, False, cuda).norms_folded
    assert choose_decode(RolloutConfig(), half.to(torch.bfloat16), False, cuda).norms_folded
    assert not choose_decode(RolloutConfig(), model, False, torch.device("cpu")).norms_folded
    ids, mask = random_prompts(2, 5, seed=1, vocab_size=model.config.vocab_size)
    ro = Rollout(model, NO_EOS, RolloutConfig())
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3, temperature=0.0))
    assert ro.last_stats.decode.norms_folded is False and ro.last_stats.decode.path == "fast_eager"
