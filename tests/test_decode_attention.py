"""The Triton decode attention (``rollout/ops/decode_attention.py``): on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by conftest without CUDA; skipped where triton is missing), on
CUDA compiled. It equals SDPA with ``enable_gqa`` for every split of the key window, on strided cache views
and masks with left padding and holes; the step built on it gives HF generate's greedy tokens (fp32);
inputs it does not handle go to SDPA."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.ops import decode_attention as da
from rollout.testing import TinyTokenizer, random_prompts, tiny_model


@pytest.fixture
def device():
    """CUDA where there is one; else the CPU under the interpreter (skipped when triton cannot run)."""
    triton = pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not knobs.runtime.interpret:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    return "cpu"


def _inputs(rows, heads, kv_heads, length, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, rows, kv_heads, length + 11, dim, generator=gen).to(dtype)
    k, v = cache.to(device)[0, :, :, 5:5 + length], cache.to(device)[1, :, :, 5:5 + length]  # strided views
    q = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype).to(device)
    keep = torch.rand(rows, 1, 1, length, generator=gen) > 0.25
    keep[0, ..., : length // 2] = False  # left padding
    keep[..., -1] = True
    return q, k, v, keep.to(device)


def _sdpa(q, k, v, keep, heads, kv_heads):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep,
                                          scale=q.shape[-1] ** -0.5, enable_gqa=heads != kv_heads)


@pytest.mark.parametrize("heads,kv_heads,length,dim", [(4, 2, 70, 16), (16, 2, 150, 128), (6, 6, 5, 8),
                                                       (8, 1, 200, 32), (3, 3, 64, 24)])
@pytest.mark.parametrize("splits", [None, 1, 2, 5])
def test_equals_sdpa_fp32(device, heads, kv_heads, length, dim, splits):
    q, k, v, keep = _inputs(3, heads, kv_heads, length, dim, torch.float32, device, seed=heads + length)
    assert da.unsupported_reason(q, k, v, keep, interpret=True) is None
    got = da.attention(q, k, v, keep, dim ** -0.5, heads != kv_heads, splits=splits, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, _sdpa(q, k, v, keep, heads, kv_heads), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_sdpa_half(device, dtype):
    q, k, v, keep = _inputs(4, 16, 2, 300, 64, dtype, device, seed=3)
    expected = _sdpa(q, k, v, keep, 16, 2)
    for splits in (1, 3):
        got = da.attention(q, k, v, keep, 64 ** -0.5, True, splits=splits, interpret=True)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_row_with_nothing_kept_gives_zeros(device):
    q, k, v, keep = _inputs(3, 4, 2, 130, 16, torch.float32, device)
    keep[1] = False
    for splits in (1, 3):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        torch.testing.assert_close(got[[0, 2]], _sdpa(q, k, v, keep, 4, 2)[[0, 2]], rtol=1e-5, atol=1e-5)


def test_split_count():
    assert da.split_count(256, 2, 512, 132) == 1  # 512 programs already cover 132 SMs twice
    assert da.split_count(32, 2, 512, 132) == 4  # 8 tiles, at least 2 each
    assert da.split_count(8, 2, 128, 132) == 1  # 2 tiles: one split
    assert da.split_count(1, 1, 4096, 132) == 32  # one long window: 64 tiles over 32 programs
    assert da.split_count(4, 2, 1100, 132) == 9  # the long tail: a few rows over ~1k columns
    assert da.split_count(1024, 2, 40, 132) == 1


def test_falls_back_to_sdpa_where_it_does_not_apply():
    q, k, v, keep = _inputs(2, 4, 2, 9, 16, torch.float32, "cpu")
    assert da.unsupported_reason(q, k, v, keep) == "not a CUDA tensor" or da.available() is not None
    additive = torch.zeros(keep.shape).masked_fill_(~keep, -65504.0)
    assert "boolean" in da.unsupported_reason(q, k, v, additive, interpret=True) or da.available() is not None
    two_queries = torch.randn(2, 4, 2, 16)
    assert "[B, Hq, 1, D]" in (da.unsupported_reason(two_queries, k, v, keep, interpret=True) or "[B, Hq, 1, D]")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.25, enable_gqa=True)
    assert torch.equal(da.attention(q, k, v, additive, 0.25, True), expected)


def test_step_with_the_kernel_equals_hf_generate(device):
    """Our step with the kernel as its attention piece gives HF generate's greedy tokens (fp32); prompts of
    different lengths, so rows carry left padding."""
    from rollout.model.step import StepFns
    from tests.conftest import hf_greedy, response_of
    model = tiny_model("qwen2", seed=5).to(device)
    ids, mask = random_prompts(3, 7, min_len=2, seed=9)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", cuda_graphs=False))
    fns = dataclasses.replace(StepFns(), attention=functools.partial(da.attention, interpret=True))
    original = ro._fast_step.parts
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fns.attention(*args, **kwargs)

    ro._fast_step.parts = lambda dev, mirrored: dataclasses.replace(
        original(dev, mirrored), fns=dataclasses.replace(fns, attention=counted))
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert ro.last_stats.decode_path == "fast_eager"
    assert calls, "the step did not call the attention piece"
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


def test_left_padding_tiles_are_not_read(device):
    """Whole tiles before a row's first kept column are skipped: NaN there (never attended) cannot reach
    the output, where a kernel that read them would give NaN (0 x NaN)."""
    q, k, v, keep = _inputs(3, 4, 2, 150, 16, torch.float32, device, seed=7)
    expected = _sdpa(q, k, v, keep, 4, 2)  # row 0 keeps nothing before column 75
    k, v = k.clone(), v.clone()
    k[0, :, :da.BLOCK_L] = float("nan")
    v[0, :, :da.BLOCK_L] = float("nan")
    for splits in (1, 2):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", [0, 5, 1030, 1499])
def test_long_padding_beyond_one_scan_block(device, padding):
    """Rows whose first kept column lies past the first mask block the kernel scans (``SCAN`` columns) or
    within its first tile: the same result as SDPA."""
    q, k, v, keep = _inputs(2, 4, 2, 1500, 16, torch.float32, device, seed=padding)
    keep[1, ..., :padding] = False
    keep[1, ..., padding:] = True
    for splits in (1, 4):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        torch.testing.assert_close(got, _sdpa(q, k, v, keep, 4, 2), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_fails_falls_back_to_sdpa_once(device, monkeypatch):
    """A kernel that cannot compile or launch (e.g. an unsupported GPU) warns once, returns SDPA's result,
    and leaves those inputs (and the device's later calls: ``attention_path``) to SDPA from then on."""
    from rollout.executors.decode import attention_path
    from rollout.ops import decode_attention_kernel as kernels

    monkeypatch.setattr(da, "_FAILED", {})
    calls = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError("no kernel image for this device")
            return launch

    monkeypatch.setattr(kernels, "decode_attention_split", Broken())
    q, k, v, keep = _inputs(3, 4, 2, 70, 16, torch.float32, device)
    with pytest.warns(RuntimeWarning, match="no kernel image"):
        got = da.attention(q, k, v, keep, 0.25, True, interpret=True)
    torch.testing.assert_close(got, _sdpa(q, k, v, keep, 4, 2), rtol=1e-5, atol=1e-5)
    assert "no kernel image" in da.unsupported_reason(q, k, v, keep, interpret=True)
    assert "no kernel image" in da.failure(q.device)
    da.attention(q, k, v, keep, 0.25, True, interpret=True)
    assert len(calls) == 1  # the second call went straight to SDPA
    if q.is_cuda:
        assert attention_path("triton", q.device) == "sdpa"


def test_gpus_before_sm80_use_sdpa(monkeypatch):
    """bf16 products need compute capability 8.0: older GPUs are refused before any launch."""
    q, k, v, keep = _inputs(2, 4, 2, 9, 16, torch.float32, "cpu")
    if da.available() is not None:
        pytest.skip(da.available())
    monkeypatch.setattr(da, "_capability", lambda index: (7, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert "compute capability (7, 0)" in da.unsupported_reason(q, k, v, keep)
