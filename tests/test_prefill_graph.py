"""The captured prefill (``rollout/executors/prefill_graph.py``, ``RolloutConfig.kernels.prefill_graph_tokens``).

On the CPU its padded pass runs eagerly (``PrefillGraphs(use_graphs=False)``) with variable-length attention
emulated by SDPA per segment (the CPU has no flash kernel): the buckets and padded offsets are what the kernel
needs, the padded pass writes the same cache and gives the same logits as the eager prefill, both routes give
HF generate's greedy tokens through it (fp32), and a failure or a pass over the limit leaves the eager prefill.
On CUDA (bf16, the flash kernel): captured once per bucket, replayed, close to the eager pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.executors import prefill_graph as pg
from rollout.model import prefill
from rollout.model.prefill import prefill_logits
from rollout.plan.layout import RowSpans
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of

#: The step's kernels with CUDA graphs off (the eager parts the CPU tests read).
EAGER_GRAPHS = KernelConfig(cuda_graphs=False)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def segment_attention(q, k, v, cu_seq, max_len: int, scale: float):
    """Variable-length causal attention as SDPA per segment: what the flash kernel computes, checking that
    every segment fits ``max_len`` and that ``cu_seq`` covers the packed tokens."""
    bounds = cu_seq.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.shape[0] and bounds == sorted(bounds)
    out = torch.zeros_like(q)
    for start, stop in zip(bounds, bounds[1:]):
        assert stop - start <= max_len
        if stop > start:
            rows = [t[start:stop].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, L, D]
            out[start:stop] = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scale,
                                                             enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)
    return out


@pytest.fixture
def emulated_varlen(monkeypatch):
    """``prefill.varlen_attention`` available on the CPU (fp32), through :func:`segment_attention`."""
    monkeypatch.setattr(prefill, "varlen_attention", lambda device, dtype: segment_attention)


# ---- buckets and offsets (pure) -------------------------------------------------------------------
@pytest.mark.parametrize("counts", [[1], [5, 7, 300], [1, 1, 1], [64, 64, 64, 64, 1], [256], [257], [3] * 9,
                                    [1000, 1, 24], [4096]])
def test_padded_offsets_cover_the_bucket(counts):
    shape = pg.prefill_shape(counts, 4096)
    total = sum(counts)
    assert shape.tokens >= max(total, pg.MIN_TOKENS) and shape.tokens & (shape.tokens - 1) == 0
    assert shape.rows >= len(counts) and shape.longest >= max(counts) and shape.longest <= shape.tokens
    offsets = pg.padded_segments(counts, shape)
    assert len(offsets) == shape.segments + 1 and offsets[0] == 0 and offsets[-1] == shape.tokens
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    assert lengths[:len(counts)] == counts  # the real rows first, in order
    assert all(0 <= n <= shape.longest for n in lengths)
    assert lengths[len(counts):shape.rows] == [0] * (shape.rows - len(counts))
    last = pg.padded_last(counts, shape)
    assert last[:len(counts)] == [offsets[i + 1] - 1 for i in range(len(counts))]
    assert last[len(counts):] == [0] * (shape.rows - len(counts))


def test_shapes_outside_the_limit_and_bad_fits():
    assert pg.prefill_shape([2048, 2049], 4096) is None
    assert pg.prefill_shape([], 4096) is None
    assert pg.prefill_shape([4096], 4096) == pg.PrefillShape(4096, 1, 4096)
    with pytest.raises(ValueError, match="do not fit"):
        pg.padded_segments([300, 300], pg.PrefillShape(512, 2, 256))


# ---- the padded pass against the eager prefill (CPU, fp32) ------------------------------------------
def _cache(model, rows: int, capacity: int, seed: int):
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, capacity, dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_padded_pass_writes_the_cache_and_logits_of_the_eager_prefill(family, monkeypatch):
    model = tiny_model(family, seed=3)
    ids, mask = random_prompts(5, 13, min_len=1, seed=4)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(kernels=KernelConfig(cuda_graphs=False)))
    parts = ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False)
    keys, values = _cache(model, 5, 20, seed=1)
    want_keys, want_values = keys.clone(), values.clone()
    want = prefill_logits(parts, want_keys, want_values, ids, mask)  # the CPU's eager prefill (SDPA per group)
    monkeypatch.setattr(prefill, "varlen_attention", lambda device, dtype: segment_attention)
    graphs = pg.PrefillGraphs(1024, use_graphs=False)
    got = prefill_logits(parts, keys, values, ids, mask, graphs=graphs)
    assert graphs.replays == 1 and graphs.failure is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, want_keys, rtol=1e-5, atol=1e-5)  # padding columns untouched in both
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
    # a second pass of another length in the same bucket reuses the buffers
    ids2, mask2 = random_prompts(5, 13, min_len=1, seed=8)
    want2 = prefill_logits(parts, *_cache(model, 5, 20, seed=2), ids2, mask2)
    got2 = prefill_logits(parts, *_cache(model, 5, 20, seed=2), ids2, mask2, graphs=graphs)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
    assert graphs.replays == 2 and len(graphs._inputs) == 1
    assert graphs.nbytes > 0


def test_shared_buffers_grow_and_drop_the_graphs_that_read_them(emulated_varlen, monkeypatch):
    """One staging and one logits buffer serve every shape: a pass with more rows or tokens than they hold
    replaces them and drops the graphs captured over the old ones (their inputs with them); smaller passes
    reuse them. Each pass still equals the eager prefill."""
    model = tiny_model("qwen2", seed=3)
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    graphs = pg.PrefillGraphs(2048, use_graphs=False)
    dropped = []
    original = graphs._drop_graphs
    monkeypatch.setattr(graphs, "_drop_graphs", lambda: (dropped.append(len(graphs._inputs)), original()))
    for rows, length, staged_tokens, logits_rows, inputs in ((2, 9, 256, 2, 1), (5, 9, 256, 8, 1),
                                                             (2, 9, 256, 8, 2), (3, 200, 1024, 8, 1)):
        ids, mask = random_prompts(rows, length, min_len=length, seed=rows + length)
        want = prefill_logits(parts, *_cache(model, rows, length + 2, seed=0), ids, mask)
        got = prefill_logits(parts, *_cache(model, rows, length + 2, seed=0), ids, mask, graphs=graphs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (graphs._staging[0].shape[1], graphs._logits.shape[0], len(graphs._inputs)) == \
            (staged_tokens, logits_rows, inputs)
    assert dropped == [1, 2]  # rows 2 -> 8 dropped the first shape; tokens 256 -> 1024 dropped the two of 256


def test_passes_over_the_limit_run_eagerly(emulated_varlen):
    model = tiny_model("qwen2", seed=3)
    ids, mask = random_prompts(3, 9, min_len=9, seed=4)  # 27 real tokens
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    graphs = pg.PrefillGraphs(26, use_graphs=False)
    prefill_logits(parts, *_cache(model, 3, 12, seed=1), ids, mask, graphs=graphs)
    assert graphs.replays == 0 and graphs.nbytes == 0


def test_a_failing_pass_warns_once_and_the_eager_prefill_runs(emulated_varlen, monkeypatch):
    model = tiny_model("qwen2", seed=3)
    ids, mask = random_prompts(3, 9, min_len=2, seed=4)
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    want = prefill_logits(parts, *_cache(model, 3, 12, seed=1), ids, mask)
    graphs = pg.PrefillGraphs(1024, use_graphs=False)

    def broken(*args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(graphs, "_run", broken)
    with pytest.warns(RuntimeWarning, match="capture refused"):
        got = prefill_logits(parts, *_cache(model, 3, 12, seed=1), ids, mask, graphs=graphs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "eager prefill runs instead" in graphs.failure
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: later passes go straight to the eager prefill
        prefill_logits(parts, *_cache(model, 3, 12, seed=1), ids, mask, graphs=graphs)


def test_a_failed_capture_keeps_this_pass_and_leaves_later_ones_to_the_eager_prefill(emulated_varlen, monkeypatch):
    """Where ``GraphSet`` could not capture (it then ran the padded pass eagerly), the pass's result stands,
    a warning says why, and the next passes run the eager prefill."""
    model = tiny_model("qwen2", seed=3)
    ids, mask = random_prompts(3, 9, min_len=2, seed=4)
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    want = prefill_logits(parts, *_cache(model, 3, 12, seed=1), ids, mask)
    graphs = pg.PrefillGraphs(1024)

    def replay(key, work, mutable):  # what GraphSet does where a capture fails: run the work eagerly, say so
        work()
        graphs.graphs.fallback_reason = "prefill route: CUDA graph capture failed (no)"
        return "eager"

    monkeypatch.setattr(graphs.graphs, "replay", replay)
    keys, values = _cache(model, 3, 12, seed=1)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = graphs._run(parts, prefill._pack(ids, mask, None), keys, values, segment_attention,
                          pg.prefill_shape([int(n) for n in mask.sum(1)], 1024))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphs.failure is not None and graphs.nbytes == 0
    assert graphs.run(parts, prefill._pack(ids, mask, None), keys, values) is None


# ---- through the routes (CPU, fp32) -----------------------------------------------------------------
@pytest.mark.parametrize("route,slots", [("ordinary", None), ("continuous", 2)])
def test_routes_through_the_padded_pass_equal_hf_generate(emulated_varlen, route, slots):
    """Greedy fp32 tokens of both routes (the continuous one with refills: 2 slots for 5 prompts) equal HF
    generate per request when every prefill pass runs padded; the call's stats count those passes."""
    model = tiny_model("qwen2", seed=11)
    ids, mask = random_prompts(5, 10, min_len=2, seed=12)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None),
                 RolloutConfig(route=route, kernels=KernelConfig(cuda_graphs=False, prefill_graph_tokens=512)))
    ro.runner.prefill_graphs.use_graphs = False  # the CPU runs the padded pass eagerly
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0,
                              **({} if slots is None else {"continuous_batch_size": slots}))
    out = ro.generate(RolloutRequest(ids, mask), sampling)
    stats = ro.last_stats
    assert stats.prefill.path == "varlen" and stats.route == route
    assert stats.prefill.graph_passes == stats.prefill.forwards >= (1 if slots is None else 2)
    for row in range(5):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 5)


def test_on_by_default_off_at_zero_and_released_without_keep_cache(emulated_varlen):
    model = tiny_model("qwen2", seed=11)
    ids, mask = random_prompts(2, 6, min_len=2, seed=12)
    assert Rollout(model, TinyTokenizer(), RolloutConfig()).runner.prefill_graphs.max_tokens == 2048
    off = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(prefill_graph_tokens=0)))
    assert off.runner.prefill_graphs is None
    ro = Rollout(model, TinyTokenizer(eos_token_id=None),
                 RolloutConfig(keep_cache=False, kernels=KernelConfig(cuda_graphs=False, prefill_graph_tokens=512)))
    ro.runner.prefill_graphs.use_graphs = False
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert ro.last_stats.prefill.graph_passes == 1 and ro.runner.prefill_graphs.nbytes == 0
    kept = Rollout(model, TinyTokenizer(eos_token_id=None),
                   RolloutConfig(kernels=KernelConfig(cuda_graphs=False, prefill_graph_tokens=512)))
    kept.runner.prefill_graphs.use_graphs = False
    kept.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert kept.runner.prefill_graphs.nbytes > 0 and kept.held_bytes >= kept.runner.prefill_graphs.nbytes


def test_staging_bytes_the_budget_counts(emulated_varlen):
    """What the memory budget subtracts before a first pass: both staging buffers at the largest bucket
    (layers x tokens x KV heads x head dim x itemsize, twice), then nothing once they are held at that size."""
    model = tiny_model("qwen2", seed=3)
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    graphs = pg.PrefillGraphs(300, use_graphs=False)  # rounds up to 512
    assert graphs.new_bytes(model) == 2 * cfg.num_hidden_layers * 512 * cfg.num_key_value_heads * dim * 4
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    ids, mask = random_prompts(2, 150, min_len=150, seed=4)  # 300 real tokens: the 512 bucket
    prefill_logits(parts, *_cache(model, 2, 160, seed=1), ids, mask, graphs=graphs)
    assert graphs.new_bytes(model) == 0 and graphs.replays == 1


def test_cpu_graphs_are_never_used_as_is():
    """A ``PrefillGraphs`` meant for graphs returns None on the CPU (the eager prefill runs)."""
    model = tiny_model("qwen2", seed=3)
    ids, mask = random_prompts(2, 5, min_len=2, seed=4)
    parts = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=EAGER_GRAPHS)).runner.fast_step.parts(
        torch.device("cpu"), mirrored=False)
    graphs = pg.PrefillGraphs(512)
    packed = prefill._pack(ids, mask, RowSpans((5, 3), (0, 2)))
    assert graphs.run(parts, packed, *_cache(model, 2, 8, seed=0)) is None


# ---- CUDA: captured, replayed -----------------------------------------------------------------------
@cuda
def test_captured_pass_replays_and_stays_close_to_the_eager_one_bf16():
    model = tiny_model("qwen2", seed=3, dtype=torch.bfloat16, device="cuda")
    if prefill.varlen_attention(torch.device("cuda"), torch.bfloat16) is None:
        pytest.skip("no variable-length attention in this torch")
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig())
    parts = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=True)
    graphs = pg.PrefillGraphs(4096)
    for seed in (4, 5, 6):  # three passes of one bucket: one capture
        ids, mask = random_prompts(6, 40, min_len=3, seed=seed, device="cuda")
        keys, values = (t.to("cuda", torch.bfloat16) for t in _cache(model, 6, 48, seed=seed))
        want_keys, want_values = keys.clone(), values.clone()
        want = prefill_logits(parts, want_keys, want_values, ids, mask)
        got = prefill_logits(parts, keys, values, ids, mask, graphs=graphs)
        assert graphs.failure is None
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(keys.float(), want_keys.float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(values.float(), want_values.float(), rtol=0.02, atol=0.02)
    assert graphs.replays == 3 and graphs.graphs.num_captures == 1 and graphs.graphs.fallback_reason is None


@cuda
@pytest.mark.parametrize("route,slots", [("ordinary", None), ("continuous", 2)])
def test_routes_replay_captured_prefills_bf16(route, slots):
    model = tiny_model("qwen2", seed=11, dtype=torch.bfloat16, device="cuda")
    if prefill.varlen_attention(torch.device("cuda"), torch.bfloat16) is None:
        pytest.skip("no variable-length attention in this torch")
    ids, mask = random_prompts(5, 10, min_len=2, seed=12, device="cuda")
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0,
                              **({} if slots is None else {"continuous_batch_size": slots}))
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route=route, kernels=KernelConfig(
        prefill_graph_tokens=512)))
    for _ in range(2):
        ro.generate(RolloutRequest(ids, mask), sampling)
        stats = ro.last_stats
        assert stats.prefill.graph_passes == stats.prefill.forwards >= 1 and stats.decode.path == "graph"
    assert ro.runner.prefill_graphs.failure is None and ro.runner.prefill_graphs.graphs.fallback_reason is None
