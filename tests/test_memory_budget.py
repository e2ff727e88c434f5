"""The KV memory budget: slots and capacity follow ``max_cache_gib``; calls that cannot fit are refused
with the figures before anything is allocated."""

import time

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.plan.layout import PromptLayout
from rollout.plan.memory import GIB, Budget, CallMemory, MemoryNeed, slots_within_budget
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
COLUMN = 2 * 2 * 2 * 16 * 4  # tiny Qwen2, fp32: bytes of one cache column of one row


def _call(prompts=8, samples=4, span=8, new=8, static=False):
    layout = PromptLayout((span,) * prompts, (span,) * prompts, span)
    return CallMemory(layout, samples, new, 512, COLUMN, static, static)


# 8 prompts x 4 samples of 8 tokens, 8 new: the ordinary route needs 32 rows x 16 columns; the continuous
# route 64 columns a slot with refills (2 x (8 + 8 - 1) = 30 -> 64), 64 without (15 -> 64).
@pytest.mark.parametrize("route, cap_column_rows, expected", [
    ("ordinary", None, None),              # no cap: as planned
    ("auto", 32 * 16, None),               # every row fits: Auto keeps its plan
    ("auto", 32 * 16 - 1, 4),              # 511 column-rows / 64 columns = 7 slots -> whole prompts: 4
    ("continuous", 31 * 64, 28),           # 31 slots of 64 columns -> 28 (whole prompts)
    ("continuous", 1000 * 64, 32),         # never more slots than rows
])
def test_slots_follow_the_cap(route, cap_column_rows, expected):
    cap = None if cap_column_rows is None else cap_column_rows * COLUMN
    plan = slots_within_budget(_call(), route, None, Budget(cap, None))
    assert (plan.slots if plan else None) == expected


def test_the_ordinary_route_counts_the_prompts_padded_to_a_tile_edge():
    """Prompts read from each run's first row are padded in front to a tile edge (``prompt_multiple``), and the
    ordinary route's need counts those columns."""
    layout = PromptLayout((5, 9), (5, 9), 9)
    plain, padded = (CallMemory(layout, 4, 8, 512, COLUMN, True, True, multiple).ordinary() for multiple in (1, 64))
    assert (plain.rows, plain.columns) == (padded.rows, 9 + 8) and padded.columns == 64 + 8


def test_static_buffers_give_up_their_rounded_capacity_when_it_costs_slots():
    call = _call(static=True)  # static buffers: capacity rounded up to 256 columns, batch buckets
    cap = 8 * 64 * COLUMN  # 8 slots at 64 columns, but only 2 at 256
    plan = slots_within_budget(call, "continuous", None, Budget(cap, None))
    assert plan.slots == 8 and plan.capacity == 64


def test_requested_slots_are_an_upper_bound():
    call = _call()
    assert slots_within_budget(call, "continuous", 12, Budget(None, None)).slots == 12
    assert slots_within_budget(call, "auto", 12, Budget(None, None)).slots == 12  # fewer slots than rows


@pytest.mark.parametrize("route, match", [
    ("ordinary", "max_cache_gib: the ordinary route \\(32 rows\\) needs a KV cache of 32 rows x 16 columns"),
    ("continuous", "max_cache_gib: one prompt's 4 samples needs a KV cache of 4 rows"),
    ("auto", "max_cache_gib: one prompt's 4 samples"),
])
def test_a_call_that_cannot_fit_is_refused_with_the_figures(route, match):
    with pytest.raises(ValueError, match=match):
        slots_within_budget(_call(), route, None, Budget(3 * 16 * COLUMN, None))


def test_free_memory_counts_the_per_row_buffers():
    need = MemoryNeed(rows=10, columns=100, column_bytes=COLUMN, row_overhead_bytes=1000)
    assert need.total_bytes == need.cache_bytes + 10_000
    assert Budget(None, need.total_bytes).fits(need) and not Budget(None, need.total_bytes - 1).fits(need)
    assert Budget(None, need.total_bytes).max_rows(need) == 10


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


def test_auto_under_a_cap_runs_continuous_batching_with_the_slots_that_fit(model):
    ids, mask = random_prompts(8, 8, seed=2)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=2)
    cap_gib = 15 * 16 * COLUMN / GIB  # below the ordinary route's 16 rows x 16 columns: 3 slots of 64 columns
    ro = Rollout(model, NO_EOS, RolloutConfig(route="auto", max_cache_gib=cap_gib))
    got = ro.generate(RolloutRequest(ids, mask), sampling)
    stats = ro.last_stats
    assert stats.route == "continuous" and stats.cache.nbytes <= cap_gib * GIB and stats.cache.capacity == 64
    for row in range(0, 16, 3):
        assert response_of(got, row) == hf_greedy(model, ids[row // 2], mask[row // 2], 8), f"row {row}"


def test_an_impossible_call_is_refused_before_any_work(model):
    """n_samples_per_prompt = 10**7 was OOM-killed after 25 s; now refused at once, nothing allocated."""
    ids, mask = random_prompts(2, 8, seed=1)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="max_cache_gib: the ordinary route \\(20000000 rows\\)"):
        Rollout(model, TinyTokenizer()).generate(RolloutRequest(ids, mask),
                                                 SamplingConfig(max_new_tokens=8, n_samples_per_prompt=10**7))
    assert time.perf_counter() - start < 30  # generous: the point is that nothing ran (no OOM, no swap)


def test_ordinary_route_over_the_cap_is_refused(model):
    ids, mask = random_prompts(4, 8, seed=1)
    with pytest.raises(ValueError, match="max_cache_gib: the ordinary route"):
        Rollout(model, NO_EOS, RolloutConfig(max_cache_gib=1e-9)).generate(
            RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4))


def test_continuous_without_graphs_is_budgeted_as_it_allocates(model):
    """cuda_graphs=False: the continuous route's per-call cache has no batch buckets and no rounded
    capacity, and the budget counts the same shape: 3 slots of 64 columns fit a 3-slot cap exactly."""
    ids, mask = random_prompts(6, 8, seed=2)
    cap_gib = 3 * 64 * COLUMN / GIB
    ro = Rollout(model, NO_EOS, RolloutConfig(route="continuous", max_cache_gib=cap_gib, kernels=KernelConfig(
        cuda_graphs=False)))
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert (ro.last_stats.cache.num_slots, ro.last_stats.cache.capacity) == (3, 64)
