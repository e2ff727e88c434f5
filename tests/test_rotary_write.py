"""The one-kernel rotary and cache write of a decode step (``rollout/ops/rotary_write.py``): on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest without CUDA), on CUDA compiled. It equals the
compiled step's arithmetic (fp32 rotary, rounded once) for q, the written k and v, and leaves every other
cache column alone; the step built on it gives HF generate's greedy tokens (fp32); inputs it does not handle
take the PyTorch path; ``RolloutConfig.kernels.rotary_kernel`` decides whether the step uses it."""

from __future__ import annotations


import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.model.pieces import _rotate, rotary
from rollout.ops import rotary_write as rw
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.test_decode_attention import device  # noqa: F401 - the fixture


def _inputs(rows, heads, kv_heads, dim, dtype, dev, seed=0, capacity=12, col=5):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(dev)
    positions = torch.randint(0, 500, (rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rotary(positions.to(dev), inv_freq.to(dev), 1.0, dtype)
    cache = torch.randn(2, rows, kv_heads, capacity + 3, dim, generator=gen).to(dtype).to(dev)
    key_layer, value_layer = cache[0, :, :, 2:], cache[1, :, :, 2:]  # strided views, as the static cache's
    return qkv, cos, sin, key_layer, value_layer, torch.tensor([col], device=dev)


def _eager(qkv, cos, sin, heads, kv_heads, dim):
    """What ``attention_inputs_qkv`` computes after its projection (in fp32 here: no rounding between ops)."""
    rows = qkv.shape[0]
    q, k, v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    c, s = cos.float(), sin.float()
    return (_rotate(q.reshape(rows, heads, 1, dim), c, s), _rotate(k.reshape(rows, kv_heads, 1, dim), c, s),
            v.reshape(rows, kv_heads, 1, dim))


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (16, 2, 128), (6, 6, 32), (8, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_step_arithmetic(device, heads, kv_heads, dim, dtype):
    qkv, cos, sin, key_layer, value_layer, cols = _inputs(3, heads, kv_heads, dim, dtype, device, seed=heads + dim)
    keys_before, values_before = key_layer.clone(), value_layer.clone()
    q = rw.rotary_write(qkv, cos, sin, key_layer, value_layer, cols, heads=heads, kv_heads=kv_heads, head_dim=dim,
                        interpret=True)
    eq, ek, ev = _eager(qkv, cos, sin, heads, kv_heads, dim)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    if dtype == torch.float32:
        tol = dict(rtol=1e-6, atol=1e-6)  # FMA contraction may differ from PyTorch's two roundings
    assert q.shape == (3, heads, 1, dim) and q.dtype == dtype
    torch.testing.assert_close(q.float(), eq, **tol)
    col = int(cols)
    torch.testing.assert_close(key_layer[:, :, col:col + 1].float(), ek, **tol)
    assert torch.equal(value_layer[:, :, col:col + 1].float(), ev)  # v is copied as it is
    others = [c for c in range(key_layer.shape[2]) if c != col]
    assert torch.equal(key_layer[:, :, others], keys_before[:, :, others])
    assert torch.equal(value_layer[:, :, others], values_before[:, :, others])
    # the PyTorch path (the fallback) computes the same
    key2, value2 = keys_before.clone(), values_before.clone()
    q2 = rw.rotary_write_reference(qkv, cos, sin, key2, value2, cols, heads=heads, kv_heads=kv_heads, head_dim=dim)
    torch.testing.assert_close(q2.float(), q.float(), **tol)
    torch.testing.assert_close(key2.float(), key_layer.float(), **tol)
    assert torch.equal(value2, value_layer)


def test_unsupported_inputs_take_the_pytorch_path(device):
    qkv, cos, sin, key_layer, value_layer, cols = _inputs(2, 4, 2, 24, torch.float32, device)
    assert "power of two" in rw.unsupported_reason(qkv, key_layer, value_layer, 24, interpret=True)
    q = rw.rotary_write(qkv, cos, sin, key_layer, value_layer, cols, heads=4, kv_heads=2, head_dim=24, interpret=True)
    eq, ek, _ = _eager(qkv, cos, sin, 4, 2, 24)
    torch.testing.assert_close(q, eq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(key_layer[:, :, 5:6], ek, rtol=1e-6, atol=1e-6)
    if not torch.cuda.is_available():
        assert rw.unsupported_reason(qkv, key_layer, value_layer, 16) == "not a CUDA tensor"


def test_a_failing_kernel_warns_once_and_falls_back(device, monkeypatch):
    qkv, cos, sin, key_layer, value_layer, cols = _inputs(2, 4, 2, 16, torch.float32, device)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(rw, "_launch", broken)
    monkeypatch.setattr(rw, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="no kernel for you"):
        q = rw.rotary_write(qkv, cos, sin, key_layer, value_layer, cols, heads=4, kv_heads=2, head_dim=16,
                            interpret=True)
    torch.testing.assert_close(q, _eager(qkv, cos, sin, 4, 2, 16)[0], rtol=1e-6, atol=1e-6)
    assert rw.failure(qkv.device) is not None
    assert "no kernel for you" in rw.unsupported_reason(qkv, key_layer, value_layer, 16, interpret=True)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
def test_step_with_the_kernel_equals_hf_generate(device, family):
    """Our step with the kernel between the q|k|v projection and the attention gives HF generate's greedy
    tokens (fp32), rows with left padding; every layer of every decode step calls it."""
    from tests.conftest import hf_greedy, response_of, with_step_pieces
    model = tiny_model(family, seed=5).to(device)
    ids, mask = random_prompts(3, 7, min_len=2, seed=9)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False, fold_norms=False)))  # folded (CUDA, fp32), rotary_write_rms would take the kernel's place
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return rw.rotary_write(*args, **kwargs, interpret=True)

    with_step_pieces(ro, rotary_write=counted)
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert ro.last_stats.decode.path == "fast_eager"
    assert len(calls) == 5 * model.config.num_hidden_layers  # 5 decode steps after the prefill's token
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


@pytest.mark.parametrize("setting", [True, False])
def test_config_decides_the_piece(monkeypatch, setting):
    """``RolloutConfig.kernels.rotary_kernel`` puts the kernel in a CUDA call's step (built without a GPU here); never on
    the CPU, nor without fused q|k|v."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    from rollout.model import step
    step.compiled_step_fns.cache_clear()
    try:
        model = tiny_model("qwen2", seed=0)
        ro = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(rotary_kernel=setting)))
        cuda = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False)
        assert cuda.fns.rotary_write is (rw.rotary_write if setting else None)
        assert ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False).fns.rotary_write is None
        unfused = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(
            rotary_kernel=setting, fuse_qkv=False)))
        assert unfused.runner.fast_step.parts(torch.device("cuda"), mirrored=False).fns.rotary_write is None
    finally:
        step.compiled_step_fns.cache_clear()
