"""The KV storage's width: one row and KV head's columns span an odd multiple of 16 KiB where that adds at most an
eighth (``rollout.plan.buckets.storage_columns``; on CUDA), because the decode attention read a cache of 1,280
columns 6-19% slower on an H100. The padded columns change no token, and the budget and the stats count them."""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.cache import static
from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import CachePool
from rollout.cache.static import CacheShape, StaticKVCache
from rollout.plan import buckets
from rollout.plan.buckets import storage_columns
from rollout.plan.layout import PromptLayout
from rollout.plan.memory import Budget, CallMemory, slots_within_budget
from rollout.testing import TinyTokenizer, random_prompts
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
COLUMN = 2 * 2 * 2 * 16 * 4  # tiny Qwen2, fp32: bytes of one cache column of one row
HEAD_COLUMN = 16 * 4  # one KV head's key column


def test_storage_columns_make_the_stride_an_odd_multiple_of_16_kib():
    assert [storage_columns(c, 256) for c in (1280, 1344, 2304, 2560, 512)] == [1344, 1344, 2368, 2624, 576]
    assert storage_columns(1280, 128) == 1408  # 128 B a column: units of 128 columns
    assert storage_columns(449, 256) == 449  # 576 would add more than an eighth
    assert storage_columns(1280, 0) == storage_columns(1280, 160) == 1280  # not padded; 160 B does not divide 16 KiB
    for column in (64, 128, 256, 512):
        for capacity in range(1, 5000, 37):
            got = storage_columns(capacity, column)
            assert capacity <= got <= capacity * 9 / 8
            assert got == capacity or got * column % 32768 == 16384, (capacity, column, got)


def test_only_cuda_storage_is_padded(monkeypatch):
    shape = CacheShape(2, 1280, 3, 2, 128, torch.bfloat16, torch.device("cpu"))
    assert (shape.padded_head_bytes, shape.storage_columns) == (0, 1280)
    cuda = CacheShape(2, 1280, 3, 2, 128, torch.bfloat16, torch.device("cuda", 0))
    assert (cuda.padded_head_bytes, cuda.storage_columns) == (256, 1344)  # nothing allocated: no GPU needed
    monkeypatch.setattr(static, "PADDED_DEVICE_TYPES", ("cuda", "cpu"))
    cache = StaticKVCache(shape)
    assert cache.key_storage.shape[3] == 1344 and cache.layers[0].keys.stride(1) == 1344 * 128
    aligned = AlignedKVCache(shape)
    assert aligned.key_storage.shape[3] == 1280 and aligned.key_storage.stride(2) == 1344 * 128
    assert aligned.nbytes == 2 * 1344 * shape.column_bytes


def test_the_pool_reuses_padded_storage_up_to_its_width(monkeypatch):
    monkeypatch.setattr(static, "PADDED_DEVICE_TYPES", ("cuda", "cpu"))
    pool = CachePool(keep=True)

    def shape(capacity):
        return CacheShape(2, capacity, 1, 2, 128, torch.bfloat16, torch.device("cpu"))

    first = pool.acquire(shape(1280))
    assert first.shape.capacity == 1280 and first.key_storage.shape[3] == 1344
    assert pool.acquire(shape(1344)).key_storage.data_ptr() == first.key_storage.data_ptr()
    assert pool.num_allocations == 1
    assert pool.acquire(shape(1345)).key_storage.shape[3] == 1472 and pool.num_allocations == 2


@pytest.fixture
def padded(monkeypatch):
    """Padding on the CPU, in units of 8 of the tiny model's 64-byte columns."""
    monkeypatch.setattr(static, "PADDED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(buckets, "STRIDE_UNIT_BYTES", 8 * HEAD_COLUMN)


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_padded_storage_changes_no_token(qwen, padded, route):
    ids, mask = random_prompts(4, 24, seed=3)
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.0, n_samples_per_prompt=2)
    ro = Rollout(qwen, NO_EOS, RolloutConfig(route=route, keep_cache=True))
    got = ro.generate(RolloutRequest(ids, mask), sampling)
    stats, storage = ro.last_stats, ro.runner.pool._cache.key_storage
    assert stats.route == route
    assert storage.shape[3] == storage_columns(stats.cache.capacity, HEAD_COLUMN) > stats.cache.capacity
    assert stats.cache.nbytes == stats.cache.num_slots * storage.shape[3] * COLUMN
    for row in range(8):
        assert response_of(got, row) == hf_greedy(qwen, ids[row // 2], mask[row // 2], 40), f"row {row}"


def test_the_budget_counts_the_padded_columns():
    layout = PromptLayout((256,) * 64, (256,) * 64, 256)
    call = CallMemory(layout, 4, 1024, 512, COLUMN, True, True, 1, 256)
    need = call.ordinary()
    assert (need.rows, need.columns, need.allocated_columns) == (256, 1280, 1344)
    assert need.cache_bytes == 256 * 1344 * COLUMN
    assert CallMemory(layout, 4, 1024, 512, COLUMN, True, True).ordinary().cache_bytes == 256 * 1280 * COLUMN
    cap = 256 * 1300 * COLUMN  # the capacity's columns fit; the stored ones do not
    with pytest.raises(ValueError, match="256 rows x 1280 columns \\(stored as 1344\\)"):
        slots_within_budget(call, "ordinary", None, Budget(cap, None))
    assert slots_within_budget(call, "auto", None, Budget(cap, None)).slots < 256
