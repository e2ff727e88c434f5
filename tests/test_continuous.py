"""The continuous-batching route: aligned cache operations, greedy equality with HF ``generate`` per
request (refills, EOS mid-stream, compaction, trims, shifts), shared prefill, repetition penalty,
seeded sampling, Auto routing, bad configs, stages and host syncs.

Oracles: HF ``generate`` on each prompt alone (fp32, greedy) and the ordinary route, never the
continuous route itself.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from instrumentation import stages
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import CachePool, ScratchArena
from rollout.cache.static import CacheShape, cache_shape
from rollout.executors.context import CallContext, EosIds, no_stage
from rollout.executors.continuous.loop import SlotSpec, generate_continuous
from rollout.ops.masks import layout_tensors
from rollout.plan.buckets import batch_bucket
from rollout.plan.layout import check_gather, layout_from_lists
from rollout.plan.planner import DEFAULT_MAX_TOKENS, CostModel
from rollout.testing import TinyTokenizer, tiny_model
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def qwen_eager():
    return tiny_model("qwen2", seed=2, attn_implementation="eager")


def make_prompts(lengths, seed=0, extra_pad=0, holes=()):
    """Left-padded ``(ids, mask)`` with exactly ``lengths`` real tokens per row (ids avoid 0, 1, 2);
    ``extra_pad`` all-padding columns in front; ``holes``: ``(row, col)`` masked inside a prompt."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + extra_pad
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 512, (length,), generator=gen)
        mask[row, width - length:] = 1
    for row, col in holes:
        mask[row, col] = 0
    return ids, mask


def cut(tokens, eos):
    """Tokens through the first EOS (HF pads after it; our rows hold zeros after it)."""
    hits = [k for k, t in enumerate(tokens) if t in eos]
    return tokens[:hits[0] + 1] if hits else tokens


def staggered_eos(model, ids, mask, max_new):
    """EOS ids that end several rows at different steps: row r's free-run token at step 2 + 2r."""
    eos = set()
    for row in range(0, ids.shape[0], 2):
        free = hf_greedy(model, ids[row], mask[row], max_new)
        eos.add(free[min(2 + row, max_new - 2)])
    return sorted(eos)


def run_cb(model, ids, mask, sampling, eos=None, **kwargs):
    """``generate_continuous`` with the old keyword interface of these tests: the call context from
    ``cost_model``, ``max_prefill_tokens``, ``stage``, ``fast``, ``fast_prefill``; the slot spec from
    ``num_slots``, ``capacity``, ``cache``, ``arena``; ``layout`` as is. ``eos``: ids, or an ``EosIds``
    made beforehand (no host->device copy inside a checked region)."""
    eos_ids = eos if isinstance(eos, EosIds) else EosIds.on(tuple(eos or ()), ids.device)
    ctx = CallContext(model, sampling, eos_ids, kwargs.pop("cost_model", CostModel.from_model(model)),
                      max_prefill_tokens=kwargs.pop("max_prefill_tokens", DEFAULT_MAX_TOKENS),
                      stage=kwargs.pop("stage", no_stage),
                      fast=kwargs.pop("fast", None), fast_prefill=kwargs.pop("fast_prefill", None))
    layout = kwargs.pop("layout", None)
    return generate_continuous(ctx, ids, mask, layout, SlotSpec(**kwargs))


def prompt_layout(mask):
    return layout_from_lists(*layout_tensors(mask).tolist(), mask.shape[1])


def ordinary_tokens(model, ids, mask, sampling, tokenizer=NO_EOS):
    batch = Rollout(model, tokenizer, RolloutConfig()).generate(RolloutRequest(ids, mask), sampling)
    return batch.input_ids[:, ids.shape[1]:], batch.attention_mask[:, ids.shape[1]:]


# ----------------------------------------------------------------------------- the aligned cache

def _tagged_cache(num_slots=4, capacity=10):
    shape = CacheShape(num_slots, capacity, 2, 1, 2, torch.float32, torch.device("cpu"))
    cache = AlignedKVCache(shape)
    tags = torch.arange(num_slots * capacity, dtype=torch.float32).view(num_slots, 1, capacity, 1)
    cache.key_storage.copy_(tags.expand_as(cache.key_storage[0]).unsqueeze(0).expand_as(cache.key_storage))
    cache.value_storage.copy_(-cache.key_storage)
    return cache


def _row_cols(cache, row, start, end):
    return cache.key_storage[:, row, 0, start:end, 0].tolist()


def test_aligned_cache_subclasses_the_library_base_and_writes_the_front_column():
    from transformers.cache_utils import Cache

    cache = _tagged_cache()
    assert isinstance(cache, Cache) and cache.is_compileable
    cache.reset(front=6)
    keep = cache.begin_decode(num_rows=3, max_extent=4)
    assert keep.shape == (3, 1, 1, 5) and keep[:, 0, 0, -1].all()
    new = torch.full((3, 1, 1, 2), 100.0)
    keys, values = cache.update(new, -new, 1)
    assert keys.shape == (3, 1, 5, 2) and torch.equal(keys[:, :, -1], new[:, :, 0])
    assert torch.equal(cache.key_storage[1, :3, :, 6], new[:, :, 0]) and cache.key_storage[1, 3, 0, 6, 0] != 100
    cache.end_decode()
    assert cache.front == 7


def test_move_rows_and_realign_keep_each_rows_window_and_validity():
    cache = _tagged_cache()
    cache.reset(front=8)
    for row, start in enumerate([5, 3, 6, 2]):  # rows use columns [start, 8)
        cache.valid[row, start:8] = True
    before = {row: _row_cols(cache, row, 2, 8) for row in range(4)}
    cache.move_rows(torch.tensor([3]), torch.tensor([0]), max_extent=6)  # row 3 -> row 0 over [2, 8)
    assert _row_cols(cache, 0, 2, 8) == before[3]
    assert cache.valid[0].tolist() == cache.valid[3].tolist()
    cache.realign(num_rows=3, max_extent=6, new_front=6)  # trim: [2, 8) -> [0, 6)
    assert cache.front == 6 and cache.stats.trims == 1
    assert [_row_cols(cache, r, 0, 6) for r in range(3)] == [before[3], before[1], before[2]]
    assert cache.valid[:3].sum(dim=1).tolist() == [6, 5, 2] and not cache.valid[:3, 6:].any()
    cache.realign(num_rows=3, max_extent=6, new_front=9)  # shift right by 3
    assert cache.stats.shifts == 1 and [_row_cols(cache, r, 3, 9) for r in range(3)] == \
        [before[3], before[1], before[2]]
    assert cache.valid[1].tolist() == [False] * 4 + [True] * 5 + [False]
    assert cache.stats.bytes_moved == (1 * 6 + 3 * 6 + 3 * 6) * cache.column_bytes


def test_write_prompts_right_aligns_each_scratch_row_into_its_slots():
    cache = _tagged_cache(num_slots=4, capacity=10)
    cache.reset(front=7)
    scratch = ScratchArena.like(cache.shape).get(2, 3)
    scratch.key_storage.copy_(torch.arange(6.0).view(1, 2, 1, 3, 1).expand_as(scratch.key_storage))
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    cache.write_prompts(scratch, torch.tensor([1, 1, 0]), torch.tensor([0, 2, 3]), mask)
    for slot, src in [(0, 1), (2, 1), (3, 0)]:
        assert _row_cols(cache, slot, 4, 7)[0] == [3.0 * src, 3.0 * src + 1, 3.0 * src + 2]
        assert cache.valid[slot].tolist() == [False] * 4 + mask[src].bool().tolist() + [False] * 3
    assert cache.stats.prefill_copy_bytes == 3 * 3 * cache.column_bytes


# ----------------------------------------------------------------------------- greedy equality with HF

GREEDY_CASES = {
    # name: (model fixture, lengths, prompt seed, slots, capacity ("min" = the fewest columns), extra_pad,
    #        holes, expected minimum (trims, shifts, row moves) - the mechanisms the case must exercise)
    "all_slots": ("qwen", [5, 12, 3, 8, 1, 10, 7], 9, None, None, 1, [(1, 6)], (0, 0, 1)),
    "three_slots_min_capacity": ("qwen", [5, 12, 3, 8, 1, 10, 7], 24, 3, "min", 0, [(1, 6)], (1, 0, 1)),
    "two_slots_long_prompt_last": ("llama", [2, 3, 2, 3, 2, 3, 12], 0, 2, "min", 0, [], (1, 1, 1)),
    "eager_attention": ("qwen_eager", [6, 2, 9, 4, 9, 1, 3], 15, 3, "min", 0, [], (1, 0, 1)),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_tokens_equal_hf_generate_per_request(request, case):
    fixture, lengths, seed, slots, capacity, extra_pad, holes, (trims, shifts, moves) = GREEDY_CASES[case]
    model = request.getfixturevalue(fixture)
    max_new = 10
    ids, mask = make_prompts(lengths, seed=seed, extra_pad=extra_pad, holes=holes)
    eos = staggered_eos(model, ids, mask, max_new)
    if capacity == "min":
        capacity = max(lengths) + max_new - 1
    result = run_cb(model, ids, mask, SamplingConfig(max_new_tokens=max_new, temperature=0.0), eos,
                    num_slots=slots, capacity=capacity)
    for row in range(len(lengths)):
        expected = cut(hf_greedy(model, ids[row], mask[row], max_new, eos=eos), eos)
        assert cut(result.generated[row].tolist(), eos) == expected, f"row {row}"
    ended = [r for r in range(len(lengths)) if any(t in eos for t in result.generated[r].tolist())]
    assert 0 < len(ended) < len(lengths), "the case needs EOS mid-stream and rows that run to the budget"
    counters = result.stats
    assert (counters.cache.trims >= trims, counters.cache.shifts >= shifts, counters.cache.row_moves >= moves) == \
        (True, True, True), counters
    assert result.num_steps == max_new == result.generated.shape[1]


def test_shared_prefill_gives_every_sample_the_hf_tokens(qwen):
    ids, mask = make_prompts([4, 9, 2], seed=3)
    n = 3
    result = run_cb(qwen, ids, mask, SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=n),
                    num_slots=4)  # 4 slots: one prompt's 3 samples at a time, admitted together
    assert result.generated.shape == (3 * n, 6)
    for row in range(3 * n):
        assert result.generated[row].tolist() == hf_greedy(qwen, ids[row // n], mask[row // n], 6), f"row {row}"
    assert result.stats.prefill.rows == 3  # each distinct prompt prefilled once
    assert result.stats.decode.rows == 3 * n * 5


def test_repetition_penalty_equals_hf_and_the_ordinary_route(qwen):
    ids, mask = make_prompts([3, 8, 5, 1], seed=4, extra_pad=1)  # pad token 0 is in every padded history
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, repetition_penalty=1.8)
    result = run_cb(qwen, ids, mask, sampling, num_slots=2)
    ordinary, _ = ordinary_tokens(qwen, ids, mask, sampling)
    assert torch.equal(result.generated, ordinary)
    for row in range(4):
        assert result.generated[row].tolist() == hf_greedy(qwen, ids[row], mask[row], 8, repetition_penalty=1.8)


# ----------------------------------------------------------------------------- seeded sampling

SAMPLED = SamplingConfig(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=100, n_samples_per_prompt=3,
                         seed=1234, repetition_penalty=1.1)


def test_seeded_samples_reproduce_and_do_not_depend_on_slots_or_route(qwen):
    ids, mask = make_prompts([6, 2, 9, 4], seed=5)
    first = run_cb(qwen, ids, mask, SAMPLED).generated
    assert torch.equal(run_cb(qwen, ids, mask, SAMPLED).generated, first)
    for slots in (3, 7):  # other neighbours, refills and compaction: the same samples
        assert torch.equal(run_cb(qwen, ids, mask, SAMPLED, num_slots=slots).generated, first)
    ordinary, _ = ordinary_tokens(qwen, ids, mask, SAMPLED)
    assert torch.equal(ordinary, first)  # same keys (sample id, token index) as the ordinary route
    other_seed = SamplingConfig(**{**SAMPLED.__dict__, "seed": 99})
    assert not torch.equal(run_cb(qwen, ids, mask, other_seed).generated, first)
    samples = first.view(4, 3, 8)
    assert any(len({tuple(s.tolist()) for s in samples[p]}) > 1 for p in range(4))


# ----------------------------------------------------------------------------- bad configs

@pytest.mark.parametrize("change, match", [
    (dict(sampling=SamplingConfig(max_new_tokens=4, n_samples_per_prompt=3, continuous_batch_size=2)),
     "continuous_batch_size"),
    (dict(capacity=5), "capacity"),
    (dict(cost_model=None), "cost_model"),
    (dict(max_prefill_tokens=4), "max_prefill_tokens"),
    (dict(sampling={"max_new_tokens": 4}), "sampling"),
    (dict(cache=AlignedKVCache(CacheShape(1, 20, 2, 2, 16, torch.float32, torch.device("cpu")))), "cache"),
    (dict(prompt_mask=torch.tensor([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])), "prompt_(attention_)?mask"),
])
def test_bad_configs_raise_naming_the_field(qwen, change, match):
    ids, mask = make_prompts([6, 3])
    kwargs = dict(sampling=SamplingConfig(max_new_tokens=4, temperature=0.0), cost_model=CostModel.from_model(qwen),
                  prompt_mask=mask)
    kwargs.update(change)
    sampling, mask = kwargs.pop("sampling"), kwargs.pop("prompt_mask")
    with pytest.raises(ValueError, match=match):
        run_cb(qwen, ids, mask, sampling, None, **kwargs)


@pytest.mark.parametrize("route, gather, is_zero3, raises", [
    ("continuous", "per_forward", True, True),
    ("auto", "per_forward", True, True),
    ("continuous", "once", True, False),
    ("continuous", "per_forward", False, False),
    ("ordinary", "per_forward", True, False),
])
def test_zero3_per_forward_gathering_is_refused_for_continuous_routes(route, gather, is_zero3, raises):
    if raises:
        with pytest.raises(ValueError, match="gather"):
            check_gather(route, gather, is_zero3)
    else:
        check_gather(route, gather, is_zero3)


# ----------------------------------------------------------------------------- stages and host syncs

def test_stages_wrap_every_plan_prefill_decode_and_cache_operation(qwen):
    names = []

    class Record:
        def __init__(self, name):
            names.append(name)

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    ids, mask = make_prompts([5, 12, 3, 8, 1], seed=6)
    eos = staggered_eos(qwen, ids, mask, 8)
    result = run_cb(qwen, ids, mask, SamplingConfig(max_new_tokens=8, temperature=0.0), eos, num_slots=2,
                    capacity=19, stage=Record)
    counts, counters = Counter(names), result.stats
    assert counts[stages.PREFILL] == counters.prefill.forwards == counts[stages.CACHE_ACQUIRE] - 1
    assert counts[stages.DECODE] == counters.decode.forwards and counts[stages.PLAN] == counters.plans
    assert counts[stages.CACHE_TRIM] >= counters.cache.trims + counters.cache.shifts > 0
    assert counts[stages.CACHE_RELEASE] == 1 and names[0] == stages.CACHE_ACQUIRE


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("with_eos", [True, False])
def test_at_most_one_host_sync_per_step(qwen, monkeypatch, with_eos):
    ids, mask = make_prompts([5, 12, 3, 8, 1, 10, 7], seed=7)
    eos = staggered_eos(qwen, ids, mask, 8) if with_eos else None
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    calls = Counter()
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    result = run_cb(qwen, ids, mask, sampling, eos, num_slots=3, capacity=19)
    monkeypatch.undo()
    counters = result.stats
    assert sum(calls.values()) == counters.decode.host_syncs, calls
    # one for the prompt layout, then one per step (the EOS flags) - none at all without EOS ids
    assert counters.decode.host_syncs == 1 + (counters.decode.steps if with_eos else 0)
    assert counters.decode.steps > counters.decode.forwards / 3  # refills: several steps per admitted wave


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_debug_mode_sees_one_sync_per_step():
    model = tiny_model("qwen2", seed=0, device="cuda")
    ids, mask = make_prompts([5, 12, 3, 8, 1, 10, 7], seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    eos = EosIds.on(tuple(staggered_eos(model, ids, mask, 8)), "cuda")
    layout = prompt_layout(mask)
    run_cb(model, ids, mask, sampling, eos, num_slots=3, layout=layout)  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run_cb(model, ids, mask, sampling, eos, num_slots=3, layout=layout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the sync warnings alone: the first set_sync_debug_mode of a process also warns (once) that the
    # mode is a prototype, which made this count one too many when this test ran first
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == result.stats.decode.host_syncs == result.stats.decode.steps


@pytest.mark.parametrize("max_new", [1, 5])
def test_engine_owned_cache_and_arena_are_reused_across_calls(qwen, max_new):
    ids, mask = make_prompts([4, 7, 2, 5], seed=8)
    sampling = SamplingConfig(max_new_tokens=max_new, temperature=0.0)
    base = CachePool(keep=True).acquire(cache_shape(qwen, 6, 48))  # larger than needed: the leading part is used
    arena = ScratchArena.like(base.shape)
    results = []
    for _ in range(2):
        cache = AlignedKVCache(cache_shape(qwen, 2, 32), storage=(base.key_storage, base.value_storage))
        assert cache.key_storage.data_ptr() == base.key_storage.data_ptr()
        results.append(run_cb(qwen, ids, mask, sampling, num_slots=2, cache=cache, arena=arena))
    for row in range(4):
        assert results[1].generated[row].tolist() == hf_greedy(qwen, ids[row], mask[row], max_new), f"row {row}"
    assert torch.equal(results[0].generated, results[1].generated)
    assert results[1].stats.cache.scratch_allocations == results[0].stats.cache.scratch_allocations  # reused
    assert results[1].stats.decode.forwards == (0 if max_new == 1 else 2 * (max_new - 1))


def test_cache_shape_matches_the_model(qwen):
    shape = cache_shape(qwen, 3, 40)
    assert (shape.batch_size, shape.capacity, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (3, 40, 2, 2, 16)


# ----------------------------------------------------------------------------- static-buffer decode

@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=9, temperature=0.0, continuous_batch_size=3),
    SamplingConfig(max_new_tokens=9, temperature=0.0, repetition_penalty=1.6, continuous_batch_size=5),
    SamplingConfig(max_new_tokens=7, temperature=0.9, top_p=0.9, top_k=50, n_samples_per_prompt=2, seed=7,
                   continuous_batch_size=4),
], ids=["greedy-3slots", "penalty-5slots", "sampled-4slots"])
def test_static_buffer_decode_equals_the_per_call_path(qwen, sampling):
    """The graph-ready path (static buffers, batch-bucket padding slots, reads from column 0) gives the
    per-call eager path's tokens, with refills, EOS and compaction; on the CPU it runs eagerly."""
    ids, mask = make_prompts([7, 2, 11, 4, 9, 1, 6], seed=12)
    eos = staggered_eos(qwen, ids, mask, sampling.max_new_tokens)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    static = Rollout(qwen, tok, RolloutConfig(route="continuous"))
    per_call = Rollout(qwen, tok, RolloutConfig(route="continuous", kernels=KernelConfig(cuda_graphs=False)))
    got = static.generate(RolloutRequest(ids, mask), sampling)
    expected = per_call.generate(RolloutRequest(ids, mask), sampling)
    assert torch.equal(got.input_ids, expected.input_ids)
    assert torch.equal(got.attention_mask, expected.attention_mask)
    stats = static.last_stats
    assert stats.decode.eager_steps == stats.decode.forwards > 0  # the static path ran (no graphs on CPU)
    assert stats.cache.num_slots == batch_bucket(sampling.continuous_batch_size)  # padding slots of the buckets
    assert per_call.last_stats.decode.eager_steps == 0  # per-call tensors, not the static buffers
    if sampling.is_greedy:
        for row in range(7):
            assert response_of(got, row) == cut(
                hf_greedy(qwen, ids[row], mask[row], sampling.max_new_tokens,
                          repetition_penalty=sampling.repetition_penalty), eos)


def test_static_buffers_are_reused_across_calls_and_released_without_keep_cache(qwen):
    ids, mask = make_prompts([5, 3, 8], seed=13)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, continuous_batch_size=2)
    ro = Rollout(qwen, NO_EOS, RolloutConfig(route="continuous"))
    first = ro.generate(RolloutRequest(ids, mask), sampling)
    bufs = ro.runner.executors["continuous"].buffers
    ids2, mask2 = make_prompts([4, 6, 2], seed=14)
    ro.generate(RolloutRequest(ids2, mask2), sampling)
    assert ro.runner.executors["continuous"].buffers is bufs  # same shapes: the same static tensors (and graphs on GPU)
    again = ro.generate(RolloutRequest(ids, mask), sampling)
    assert torch.equal(again.input_ids, first.input_ids)  # nothing of the previous call leaks in
    loose = Rollout(qwen, NO_EOS, RolloutConfig(route="continuous", keep_cache=False))
    assert torch.equal(loose.generate(RolloutRequest(ids, mask), sampling).input_ids, first.input_ids)
    assert loose.runner.executors["continuous"].buffers is None and loose.held_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_continuous_decode_equals_the_eager_paths_fp32():
    model = tiny_model("qwen2", seed=3, device="cuda")
    ids, mask = make_prompts([7, 2, 11, 4, 9, 1, 6], seed=12)
    ids, mask = ids.cuda(), mask.cuda()
    eos = staggered_eos(model, ids, mask, 12)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    for sampling in (SamplingConfig(max_new_tokens=12, temperature=0.0, continuous_batch_size=3),
                     SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.8, seed=2, repetition_penalty=1.3,
                                    n_samples_per_prompt=2, continuous_batch_size=6)):
        graphs = Rollout(model, tok, RolloutConfig(route="continuous", kernels=KernelConfig(compile=False)))
        got = graphs.generate(RolloutRequest(ids, mask), sampling)
        assert graphs.last_stats.decode.path == "graph", graphs.last_stats.decode.fallback_reason
        assert graphs.last_stats.decode.graph_steps == graphs.last_stats.decode.forwards
        eager = Rollout(model, tok, RolloutConfig(route="continuous", kernels=KernelConfig(
            cuda_graphs=False, compile=False)))
        assert torch.equal(got.input_ids, eager.generate(RolloutRequest(ids, mask), sampling).input_ids)
        hf = Rollout(model, tok, RolloutConfig(route="continuous", kernels=KernelConfig(fast_decode=False)))
        assert torch.equal(got.input_ids, hf.generate(RolloutRequest(ids, mask), sampling).input_ids)
        captures = graphs.runner.executors["continuous"].graphs.num_captures
        assert torch.equal(graphs.generate(RolloutRequest(ids, mask), sampling).input_ids, got.input_ids)
        assert graphs.runner.executors["continuous"].graphs.num_captures == captures  # graphs are reused across calls


def test_packed_prefill_admits_every_bucket_in_one_pass(qwen):
    """With the packed prefill an admission is one pass whatever its buckets: the buckets (here one per
    length: free groups, costly attention) only group attention and the copies into the slots."""
    from rollout.model import step as fast_decode
    ids, mask = make_prompts([9, 2, 12, 3, 1, 7], seed=15)
    spec, weights = fast_decode.spec_and_weights(qwen)
    parts = fast_decode.StepParts(spec, weights, fast_decode.StepFns())
    costs = CostModel.from_model(qwen, prefill_group_cost_ms=0.0, prefill_attention_cost_ms=1e4)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, repetition_penalty=1.3)
    result = run_cb(qwen, ids, mask, sampling, num_slots=4, fast=parts, fast_prefill=parts, cost_model=costs)
    counters = result.stats
    assert counters.prefill.forwards == counters.plans >= 2  # one pass per admission wave
    assert counters.prefill.tokens == sum([9, 2, 12, 3, 1, 7])  # every bucket exactly one length
    for row in range(6):
        assert result.generated[row].tolist() == hf_greedy(qwen, ids[row], mask[row], 6, repetition_penalty=1.3)


def test_read_window_covers_the_live_columns_in_few_shapes():
    from rollout.plan.buckets import read_window
    assert read_window(0, 10, 1024, 256) == (0, 256)
    assert read_window(300, 700, 1024, 256) == (256, 768)  # live [300, 701) inside, < 2 buckets extra
    assert read_window(900, 1023, 1024, 256) == (768, 1024)  # never past the capacity
    for read_start in range(0, 900, 37):
        for front in range(read_start, 1024, 53):
            start, stop = read_window(read_start, front, 1024, 256)
            assert start <= read_start and front < stop <= 1024 and start % 256 == 0
