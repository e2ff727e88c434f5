"""Our own prefill (packed linear layers, attention per bucket) against the HF forward."""

import pytest
import torch

from rollout.model import compat
from rollout.model import prefill as fast_prefill
from rollout.model import step as fast_decode
from rollout.ops import masks
from rollout.plan.layout import RowSpans
from rollout.cache.static import CacheShape, StaticKVCache
from rollout.model.hf import prefill_forward
from rollout.testing import random_prompts, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _caches(model, rows, capacity, dtype=torch.float32, device="cpu"):
    layers, heads, dim = compat.kv_geometry(model)
    shape = CacheShape(rows, capacity, layers, heads, dim, dtype, torch.device(device))
    return StaticKVCache(shape), StaticKVCache(shape)


def _hf_prefill(model, cache, ids, mask):
    with torch.no_grad():
        return prefill_forward(model, cache, ids, mask, ids.shape[1], compat.mask_dtype(model))


def _fast_prefill(model, cache, ids, mask, groups=None, fns=None):
    with torch.no_grad():
        return fast_prefill.prefill_logits(_parts(model, fns), cache.key_storage, cache.value_storage, ids, mask,
                                           groups)


def _parts(model, fns=None):
    spec, weights = fast_decode.spec_and_weights(model)
    return fast_decode.StepParts(spec, weights, fns or fast_decode.StepFns())


def _real_columns_equal(got: StaticKVCache, expected: StaticKVCache, mask, **tol):
    real = mask.bool()  # [N, T_p]
    for storage in ("key_storage", "value_storage"):
        a = getattr(got, storage)[:, :, :, :mask.shape[1]].permute(1, 3, 0, 2, 4)[real]
        b = getattr(expected, storage)[:, :, :, :mask.shape[1]].permute(1, 3, 0, 2, 4)[real]
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("groups", [None, [(0, 2, 11), (2, 5, 7)], [(0, 1, 11), (1, 2, 5), (2, 5, 7)]])
def test_logits_and_cache_match_hf_prefill(arch, groups):
    model = tiny_model(arch, seed=11)
    lengths = [11, 5, 7, 3, 1]  # rows sorted so every group's length covers its rows
    ids, mask = torch.zeros((5, 11), dtype=torch.long), torch.zeros((5, 11), dtype=torch.long)
    gen = torch.Generator().manual_seed(5)
    for row, n in enumerate(lengths):
        ids[row, 11 - n:] = torch.randint(3, 512, (n,), generator=gen)
        mask[row, 11 - n:] = 1
    hf_cache, fast_cache = _caches(model, 5, 16)
    expected = _hf_prefill(model, hf_cache, ids, mask)
    got = _fast_prefill(model, fast_cache, ids, mask, groups)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _real_columns_equal(fast_cache, hf_cache, mask, rtol=1e-5, atol=1e-5)


def test_interior_padding_gets_hf_positions_and_masking():
    """A row with a hole in its mask: positions skip the hole and nobody attends to it, as in HF."""
    model = tiny_model("qwen2", seed=12)
    ids, mask = random_prompts(3, 8, min_len=6, seed=3)
    mask[1, 4] = 0
    ids[1, 4] = 0
    hf_cache, fast_cache = _caches(model, 3, 10)
    torch.testing.assert_close(_fast_prefill(model, fast_cache, ids, mask), _hf_prefill(model, hf_cache, ids, mask),
                               rtol=1e-5, atol=1e-5)
    _real_columns_equal(fast_cache, hf_cache, mask, rtol=1e-5, atol=1e-5)


def test_padding_columns_are_not_written():
    model = tiny_model("qwen2", seed=13)
    ids, mask = random_prompts(2, 6, min_len=2, seed=4)
    mask[1, :3], ids[1, :3] = 0, 0
    _, cache = _caches(model, 2, 8)
    cache.key_storage.fill_(3.0)
    _fast_prefill(model, cache, ids, mask)
    assert torch.all(cache.key_storage[:, 1, :, :3] == 3.0)  # the padding columns keep their (finite) values
    assert not torch.any(cache.key_storage[:, 1, :, 3:6] == 3.0)


def test_host_layout_gives_the_same_result_without_reading_the_mask():
    model = tiny_model("qwen2", seed=16)
    ids, mask = random_prompts(4, 9, min_len=2, seed=6)
    first, second = _caches(model, 4, 12)
    counts = mask.sum(1).tolist()
    firsts = [9 - c for c in counts]
    with torch.no_grad():
        got = fast_prefill.prefill_logits(_parts(model), first.key_storage, first.value_storage, ids, mask, None,
                                          RowSpans(tuple(counts), tuple(firsts)))
    assert torch.equal(got, _fast_prefill(model, second, ids, mask))
    assert torch.equal(first.key_storage, second.key_storage)


def test_a_group_too_short_for_its_rows_is_an_error():
    model = tiny_model("qwen2", seed=14)
    ids, mask = random_prompts(3, 8, min_len=8, seed=5)
    _, cache = _caches(model, 3, 10)
    with pytest.raises(ValueError, match=r"rows \[1, 3\) of length 4 misses real prompt tokens"):
        _fast_prefill(model, cache, ids, mask, [(0, 1, 8), (1, 3, 4)])


@cuda
def test_compiled_fast_prefill_matches_hf_in_bf16_on_gpu():
    """Compiled pieces on the GPU, bf16: logits within bf16 tolerance of the HF layers', same argmax
    on (almost) every row, across two distinct token counts (the compiled graphs go dynamic)."""
    from rollout.model.step import compiled_step_fns
    model = tiny_model("qwen2", seed=15, device="cuda", dtype=torch.bfloat16)
    for rows, width in ((4, 12), (6, 20)):
        ids, mask = random_prompts(rows, width, min_len=3, seed=rows, device="cuda")
        hf_cache, fast_cache = _caches(model, rows, width + 4, torch.bfloat16, "cuda")
        expected = _hf_prefill(model, hf_cache, ids, mask).float()
        got = _fast_prefill(model, fast_cache, ids, mask, fns=compiled_step_fns()).float()
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
        _real_columns_equal(fast_cache, hf_cache, mask, rtol=0.05, atol=0.05)


@cuda
def test_prefill_with_host_layout_makes_no_host_sync():
    model = tiny_model("qwen2", seed=17, device="cuda")
    ids, mask = random_prompts(3, 10, min_len=2, seed=7, device="cuda")
    counts = mask.sum(1).tolist()
    host_rows = RowSpans(tuple(counts), tuple(10 - c for c in counts))
    _, cache = _caches(model, 3, 12, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            fast_prefill.prefill_logits(_parts(model), cache.key_storage, cache.value_storage, ids, mask,
                                        [(0, 1, 10), (1, 3, 10)], host_rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@cuda
def test_varlen_attention_matches_the_per_group_path_in_bf16():
    """On CUDA in bf16 the packed prefill attends per row with flash varlen; it must agree with the
    SDPA per-group path (and so with HF) to bf16 tolerance, GQA included, holes included."""
    from unittest import mock
    if fast_prefill.varlen_attention(torch.device("cuda"), torch.bfloat16) is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model = tiny_model("qwen2", seed=18, device="cuda", dtype=torch.bfloat16)
    ids, mask = random_prompts(5, 24, min_len=2, seed=8, device="cuda")
    mask[2, 20], ids[2, 20] = 0, 0
    varlen_cache, group_cache = _caches(model, 5, 28, torch.bfloat16, "cuda")
    got = _fast_prefill(model, varlen_cache, ids, mask).float()
    with mock.patch.object(fast_prefill, "varlen_attention", return_value=None):
        expected = _fast_prefill(model, group_cache, ids, mask).float()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
    _real_columns_equal(varlen_cache, group_cache, mask, rtol=0.05, atol=0.05)
