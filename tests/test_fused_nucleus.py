"""The one-kernel nucleus sampler (``rollout/ops/fused_nucleus.py``), in both forms (one program per row, and rows
cut into chunks with a launch per pass): on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``; skipped
where triton is not installed), on CUDA compiled. Its tokens equal the eager sorting sampler's with ties in stable
order (HF's order on CUDA), for bf16 logits at T=1 (16 key bits dropped) and fp32 logits at other temperatures,
per-row and shared token indices; tie groups that straddle chunks lose the same members; a row's token does not
depend on its batch; its draws equal the eager sampler's, whose draws follow the filtered softmax (chi-square); the
Sampler routes to it only where it applies and falls back when it raises."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TopPLogitsWarper

import rollout.ops as ops_pkg
from rollout.config import SamplerConfig, SamplingConfig
from rollout.ops import fused_nucleus
from rollout.ops.sampling import Sampler, SamplerKey, _select, sampler_key
from tests.oracles import saturated_case

CHI2_MIN_P = 1e-6


@pytest.fixture
def interpreted(monkeypatch):
    """``fused_nucleus`` with its kernel module imported under ``TRITON_INTERPRET=1`` (runs on CPU tensors),
    removed again afterwards so that a later CUDA import compiles."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not knobs.runtime.interpret:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    _forget_kernel()
    monkeypatch.setattr(fused_nucleus, "CHUNK_TOKENS", 0)  # one program per row unless a test cuts rows
    try:
        importlib.import_module("rollout.ops.nucleus_kernel")
        importlib.import_module("rollout.ops.nucleus_split_kernel")
    except Exception as exc:  # noqa: BLE001 - an old triton whose interpreter cannot run this kernel
        pytest.skip(f"triton interpreter unavailable: {exc!r:.200}")
    yield fused_nucleus
    _forget_kernel()


def _forget_kernel():
    for name in ("nucleus_kernel", "nucleus_split_kernel"):
        sys.modules.pop(f"rollout.ops.{name}", None)
        if hasattr(ops_pkg, name):
            delattr(ops_pkg, name)


@pytest.fixture
def chunked(interpreted, monkeypatch):
    """The interpreted sampler with rows cut into chunks of 300 tokens (a vocabulary of 1000: 4 chunks, the last
    of 100), read 128 tokens an iteration."""
    monkeypatch.setattr(fused_nucleus, "CHUNK_TOKENS", 300)
    monkeypatch.setattr(fused_nucleus, "SPLIT_BLOCK", 128)
    return interpreted


@pytest.fixture
def stable_sort(monkeypatch):
    """``torch.sort`` made stable: the eager oracle orders ties by index, as HF's sort does on CUDA."""
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sort(*a, **{**k, "stable": True}))


def _logits(rows, vocab, scale, seed, dtype, ties):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * scale
    return (x.round() if ties else x).to(dtype)


CASES = [  # dtype, temperature, top_p, scale, ties, per-row token indices
    (torch.bfloat16, 1.0, 0.9, 3.0, False, False),
    (torch.bfloat16, 1.0, 0.5, 3.0, False, True),
    (torch.bfloat16, 1.0, 0.9, 2.0, True, False),
    (torch.bfloat16, 1.0, 0.3, 2.0, True, True),
    (torch.bfloat16, 1.0, 0.999, 0.5, False, False),
    (torch.float32, 0.7, 0.8, 2.0, True, False),
    (torch.float32, 1.3, 0.95, 4.0, False, True),
    (torch.float32, 1.0, 0.05, 6.0, False, False),
    (torch.bfloat16, 0.6, 0.9, 3.0, True, True),
    (torch.float16, 0.8, 0.9, 3.0, True, False),
    (torch.float16, 1.0, 0.7, 2.0, False, True),
]


@pytest.mark.parametrize("dtype, temperature, top_p, scale, ties, per_row", CASES)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 3001])
def test_tokens_and_logprobs_equal_the_sorting_sampler(interpreted, stable_sort, dtype, temperature, top_p, scale,
                                                       ties, per_row, vocab):
    logits = _logits(6, vocab, scale, vocab + int(top_p * 100), dtype, ties)
    key = SamplerKey(temperature, 0, top_p, 1.0)
    seed, rows = torch.tensor(2**32 - 5), torch.arange(6) * 7 + 3
    step = torch.arange(6) + 11 if per_row else torch.tensor(4)
    assert fused_nucleus.key_shift(dtype) == {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}[dtype]
    tokens, logprobs = interpreted.sample_top_p(logits, temperature, top_p, seed, rows, step, True)
    expected, expected_lp = _select(logits, key, None, seed, rows, step, True, search=False)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, expected)
    assert torch.allclose(logprobs, expected_lp, atol=2e-6)
    again, none = interpreted.sample_top_p(logits, temperature, top_p, seed, rows, step, False)
    assert torch.equal(again, tokens) and none is None


@pytest.mark.parametrize("arity", [2, 4, 8])
def test_every_arity_gives_the_same_tokens(interpreted, stable_sort, monkeypatch, arity):
    """The search ends on the same boundary key whatever the thresholds per pass (``WIDE_ARITY`` at wide batches)."""
    logits = _logits(5, 3001, 3.0, 17, torch.bfloat16, True)
    args = (torch.tensor(9), torch.arange(5), torch.arange(5) + 2)
    tokens, logprobs = interpreted.sample_top_p(logits, 0.9, 0.9, *args, True)
    monkeypatch.setattr(interpreted, "ARITY", arity)
    again, again_lp = interpreted.sample_top_p(logits, 0.9, 0.9, *args, True)
    assert torch.equal(again, tokens) and torch.equal(again_lp, logprobs)


@pytest.mark.parametrize("dtype, temperature, top_p, scale, ties, per_row", [CASES[i] for i in (0, 3, 5, 8, 9)])
def test_chunked_rows_give_the_sorting_samplers_tokens(chunked, stable_sort, dtype, temperature, top_p, scale, ties,
                                                      per_row):
    """Rows cut into 4 chunks: tokens equal the eager sorting sampler's, log-probabilities close (fp32, fp16 and
    bf16 keys; ties; temperatures; per-row and shared token indices)."""
    logits = _logits(4, 1000, scale, 1000 + int(top_p * 100), dtype, ties)
    key = SamplerKey(temperature, 0, top_p, 1.0)
    seed, rows = torch.tensor(2**32 - 5), torch.arange(4) * 7 + 3
    step = torch.arange(4) + 11 if per_row else torch.tensor(4)
    assert fused_nucleus.chunk_count(1000) == 4
    tokens, logprobs = chunked.sample_top_p(logits, temperature, top_p, seed, rows, step, True)
    expected, expected_lp = _select(logits, key, None, seed, rows, step, True, search=False)
    assert torch.equal(tokens, expected)
    assert torch.allclose(logprobs, expected_lp, atol=2e-6)
    again, none = chunked.sample_top_p(logits, temperature, top_p, seed, rows, step, False)
    assert torch.equal(again, tokens) and none is None


@pytest.mark.parametrize("vocab, cut", [(1000, 0.7037), (1000, 0.0437), (1000, 0.9987), (260, 0.513)])
def test_a_tie_group_across_chunks_loses_its_lowest_indices(chunked, stable_sort, vocab, cut):
    """Every score equal: one tie group over all chunks, of which the lowest ``floor((1 - top_p) * V)`` indices
    are dropped (the first kept member lies in the first, a middle or the last chunk; ``(1 - top_p) * V`` is not
    within rounding of an integer, where both forms may differ from the sort by one member)."""
    logits = torch.full((2, vocab), 1.5)
    key = SamplerKey(1.0, 0, cut, 1.0)
    for seed in range(2):
        args = (torch.tensor(seed), torch.arange(2), torch.tensor(seed + 1))
        tokens, logprobs = chunked.sample_top_p(logits, 1.0, cut, *args, True)
        expected, expected_lp = _select(logits, key, None, *args, True, search=False)
        assert torch.equal(tokens, expected) and torch.allclose(logprobs, expected_lp, atol=2e-6), seed


def test_chunked_dyadic_tie_groups(chunked, stable_sort, monkeypatch):
    """The exact masses of ``test_dyadic_tie_groups_lose_their_lowest_indices`` in chunks of 4 tokens, so the
    straddling group's members sit in several chunks: the draws equal the stable-sort sampler's."""
    monkeypatch.setattr(fused_nucleus, "CHUNK_TOKENS", 4)
    _check_dyadic_draws(chunked, shuffle_seed=5, num_rows=2, seeds=2)


def test_a_rows_token_does_not_depend_on_its_batch(chunked):
    """The chunked form's sums run in one order whatever the rows: a row sampled alone, or in another batch,
    draws the same token with the same log-probability."""
    logits = _logits(4, 1000, 3.0, 21, torch.bfloat16, False)
    seed, rows, step = torch.tensor(8), torch.arange(4) + 40, torch.arange(4) + 3
    tokens, logprobs = chunked.sample_top_p(logits, 0.8, 0.9, seed, rows, step, True)
    for picked in ([2], [3, 0]):
        alone, alone_lp = chunked.sample_top_p(logits[picked], 0.8, 0.9, seed, rows[picked], step[picked], True)
        assert torch.equal(alone, tokens[picked]) and torch.equal(alone_lp, logprobs[picked])


def test_chunks_per_program_and_arity_change_no_result(chunked, monkeypatch):
    """A program taking 1, 3 or all 4 chunks of a row, at 4 or 16 thresholds a pass: the same tokens and
    log-probabilities, bit for bit (each chunk is summed on its own; a threshold's sum does not depend on the
    others), which is what lets both follow the rows."""
    logits = _logits(3, 1000, 3.0, 33, torch.bfloat16, True)
    args = (torch.tensor(12), torch.arange(3) + 5, torch.arange(3))
    results = []
    for per_program, arity in ((1, 16), (3, 4), (4, 16)):
        monkeypatch.setattr(fused_nucleus, "CHUNKS_PER_PROGRAM", per_program)
        monkeypatch.setattr(fused_nucleus, "SPLIT_ARITY", arity)
        results.append(chunked.sample_top_p(logits, 0.9, 0.9, *args, True))
    for tokens, logprobs in results[1:]:
        assert torch.equal(tokens, results[0][0]) and torch.equal(logprobs, results[0][1])


def test_the_chunked_arity_follows_the_programs_against_the_multiprocessors(monkeypatch):
    monkeypatch.setattr(fused_nucleus, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert fused_nucleus.split_arity(8, 19, cuda) == fused_nucleus.SPLIT_ARITY  # 152 programs
    assert fused_nucleus.split_arity(16, 19, cuda) == fused_nucleus.SPLIT_WIDE_ARITY != fused_nucleus.SPLIT_ARITY
    assert fused_nucleus.split_arity(111, 19, cuda) == fused_nucleus.SPLIT_WIDE_ARITY  # 2109 programs
    assert fused_nucleus.split_arity(112, 19, cuda) == fused_nucleus.SPLIT_WIDEST_ARITY != fused_nucleus.SPLIT_WIDE_ARITY
    assert fused_nucleus.split_arity(256, 19, torch.device("cpu")) == fused_nucleus.SPLIT_ARITY


def test_chunk_tokens_of_a_call_override_the_default(interpreted, monkeypatch):
    """``sample_top_p(..., chunk_tokens=N)`` cuts rows in chunks of N whatever ``CHUNK_TOKENS`` (None: it; 0: one
    program per row)."""
    spans = []
    chunked = interpreted._sample_chunked
    monkeypatch.setattr(interpreted, "_sample_chunked",
                        lambda logits, span, chunks, *rest, **kw: spans.append((span, chunks))
                        or chunked(logits, span, chunks, *rest, **kw))
    monkeypatch.setattr(interpreted, "SPLIT_BLOCK", 128)
    logits = _logits(2, 1000, 3.0, 8, torch.bfloat16, False)
    args = (torch.tensor(1), torch.arange(2), torch.tensor(2))
    one, _ = interpreted.sample_top_p(logits, 1.0, 0.9, *args, False)  # the fixture's CHUNK_TOKENS = 0
    cut, _ = interpreted.sample_top_p(logits, 1.0, 0.9, *args, False, chunk_tokens=250)
    again, _ = interpreted.sample_top_p(logits, 1.0, 0.9, *args, False, chunk_tokens=0)
    assert spans == [(250, 4)] and torch.equal(cut, one) and torch.equal(again, one)


def test_the_rollout_config_reaches_the_kernel(monkeypatch):
    """``RolloutConfig.sampler.chunk_tokens`` -> ``sampler_fn`` -> ``Sampler`` -> ``sample_top_p``."""
    from rollout import Rollout, RolloutConfig, RolloutRequest
    from rollout.executors import runner as engine
    from rollout.testing import TinyTokenizer, tiny_model

    made = []
    real = engine.sampler_fn
    monkeypatch.setattr(engine, "sampler_fn", lambda *a, **k: made.append(k.get("chunk_tokens")) or real(*a, **k))
    ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(pad_token_id=0, eos_token_id=None),
                 RolloutConfig(sampler=SamplerConfig(chunk_tokens=4096)))
    ids = torch.tensor([[5, 6, 7]])
    ro.generate(RolloutRequest(ids, torch.ones_like(ids)), SamplingConfig(max_new_tokens=2, temperature=1.0,
                                                                           top_p=0.9, seed=3))
    assert made == [4096]
    seen = []
    _route_to_kernel(monkeypatch,
                     lambda *a, **k: seen.append(k.get("chunk_tokens")) or (torch.zeros(2, dtype=torch.long), None))
    sampler = Sampler(SamplerKey(1.0, 0, 0.9, 1.0), compiled=True, chunk_tokens=4096)
    sampler(torch.zeros(2, 50), None, torch.tensor(1), torch.arange(2), torch.tensor(0))
    assert seen == [4096] and sampler.last_path == "fused"


def test_chunk_count_and_passes():
    assert fused_nucleus.search_passes(16, 16) == 4  # bf16 keys
    assert fused_nucleus.search_passes(16, 8) == 6
    assert fused_nucleus.search_passes(13, 16) == 5  # fp16
    assert fused_nucleus.search_passes(0, 16) == 8  # fp32
    assert fused_nucleus.CHUNK_TOKENS > 0 and fused_nucleus.chunk_count(151936) == -(-151936 // fused_nucleus.CHUNK_TOKENS)
    assert fused_nucleus.chunk_count(fused_nucleus.CHUNK_TOKENS) == 1  # one chunk: the one-program kernel


def test_the_arity_follows_the_rows_against_the_multiprocessors(monkeypatch):
    monkeypatch.setattr(fused_nucleus, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert fused_nucleus.arity(131, cuda) == fused_nucleus.ARITY
    assert fused_nucleus.arity(132, cuda) == fused_nucleus.arity(256, cuda) == fused_nucleus.WIDE_ARITY
    assert fused_nucleus.arity(256, torch.device("cpu")) == fused_nucleus.ARITY  # the interpreter: as before


@pytest.mark.parametrize("vocab", [1, 5, 2500])
def test_rows_of_one_value(interpreted, stable_sort, vocab):
    """Every score equal (no search pass runs): the row is one tie group, of which the lowest
    ``floor((1 - top_p) * V)`` indices are dropped, as HF's stable sort drops them."""
    logits = torch.full((3, vocab), 1.5)
    key = SamplerKey(1.0, 0, 0.7, 1.0)
    args = (torch.tensor(4), torch.arange(3), torch.tensor(1))
    tokens, logprobs = interpreted.sample_top_p(logits, 1.0, 0.7, *args, True)
    expected, expected_lp = _select(logits, key, None, *args, True, search=False)
    assert torch.equal(tokens, expected) and torch.allclose(logprobs, expected_lp, atol=2e-6)


def test_dyadic_tie_groups_lose_their_lowest_indices(interpreted, stable_sort):
    """Exact masses (1/4, 2 x 1/8, 4 x 1/16, 8 x 1/32; shuffled per row), so which members of the straddling
    tie group survive is decided by index order alone: the draws equal the stable-sort sampler's for
    every seed and cut."""
    _check_dyadic_draws(interpreted, shuffle_seed=3, num_rows=4, seeds=12)


def _check_dyadic_draws(sampler, shuffle_seed: int, num_rows: int, seeds: int):
    """Rows of the exact masses 1/4, 2 x 1/8, 4 x 1/16, 8 x 1/32 (shuffled per row) at three cuts and ``seeds``
    seeds: ``sampler``'s draws equal the stable-sort sampler's."""
    level = torch.tensor([0] + [1] * 2 + [2] * 4 + [3] * 8)
    gen = torch.Generator().manual_seed(shuffle_seed)
    order = torch.stack([torch.randperm(15, generator=gen) for _ in range(num_rows)])
    logits = (-level[order] * torch.log(torch.tensor(2.0))).float()
    rows = torch.arange(num_rows)
    for top_p in (0.3, 0.6, 0.85):
        key = SamplerKey(1.0, 0, top_p, 1.0)
        for seed in range(seeds):
            args = (torch.tensor(seed), rows, torch.tensor(seed % 3))
            tokens, _ = sampler.sample_top_p(logits, 1.0, top_p, *args, False)
            assert torch.equal(tokens, _select(logits, key, None, *args, False, search=False)[0]), (top_p, seed)


def _eager_counts(logits, key: SamplerKey, ids: int, steps: int, seed: int = 9) -> torch.Tensor:
    """Token counts of the eager sorting sampler's draws from one row of ``logits`` under ``ids`` x ``steps`` noise
    keys (sample id, step)."""
    draws = [_select(logits.expand(ids, -1), key, None, torch.tensor(seed), torch.arange(ids), torch.tensor(step),
                     False, search=False)[0] for step in range(steps)]
    return torch.bincount(torch.cat(draws), minlength=logits.shape[-1]).double()


def test_draws_follow_the_filtered_softmax(interpreted):
    """The kernel's 60 draws on V=8 (30 sample ids x 2 steps) equal the eager sorting sampler's under the same keys,
    and that sampler's 3,000 draws under keys of the same form follow softmax(HF top-p(logits / T)) (chi-square);
    filtered tokens are never drawn. (The kernel's own 300 draws took 41 s of the suite in the interpreter.)"""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.5, -0.25, -1.0, -2.0, 0.0]])
    temperature, top_p = 0.8, 0.85
    key = SamplerKey(temperature, 0, top_p, 1.0)
    for step in range(2):
        args = (torch.tensor(9), torch.arange(30), torch.tensor(step))
        kernel = interpreted.sample_top_p(logits.expand(30, -1), temperature, top_p, *args, False)[0]
        assert torch.equal(kernel, _select(logits.expand(30, -1), key, None, *args, False, search=False)[0]), step
    expected = torch.softmax(TopPLogitsWarper(top_p)(None, logits / temperature).double(), dim=-1)[0]
    counts = _eager_counts(logits, key, 150, 20)
    kept = expected > 0
    assert counts[~kept].sum() == 0 and kept.sum() < 8
    frequencies = expected[kept] / expected[kept].sum() * counts.sum()
    assert frequencies.min() > 5
    assert chisquare(counts[kept].numpy(), frequencies.numpy()).pvalue > CHI2_MIN_P


@pytest.mark.parametrize("kwargs, applies", [
    (dict(temperature=1.0, top_p=0.9), True), (dict(temperature=0.7, top_p=0.5), True),
    (dict(temperature=1.0, top_p=0.9, top_k=50), False), (dict(temperature=1.0, top_p=0.9, top_k=1000), True),
    (dict(temperature=1.0), False), (dict(temperature=0.0, top_p=0.9), False),
])
def test_applies_to_temperature_and_top_p_only(kwargs, applies):
    key = sampler_key(SamplingConfig(max_new_tokens=1, **kwargs))
    assert fused_nucleus.applies(key.temperature, key.top_k, key.top_p, False, 1000) is applies  # top_k >= V: off
    assert fused_nucleus.applies(key.temperature, key.top_k, key.top_p, True, 1000) is False  # a penalty


def test_supports_refuses_cpu_logits_and_missing_triton(monkeypatch):
    assert not fused_nucleus.supports(torch.zeros(2, 10), 1.0, 0, 0.9, False)  # CPU tensors: other paths
    fused_nucleus.available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    try:
        assert "triton unavailable" in fused_nucleus.available()
    finally:
        fused_nucleus.available.cache_clear()


def _route_to_kernel(monkeypatch, kernel, plain=False):
    """CPU logits count as supported (the device check aside, ``applies`` decides); ``kernel`` runs: the nucleus
    (``sample_top_p``), or with ``plain`` the plain draw of top-p 1 (``sample_plain``)."""
    applies = fused_nucleus.applies_plain if plain else fused_nucleus.applies
    monkeypatch.setattr(fused_nucleus, "supports_plain" if plain else "supports",
                        lambda logits, t, k, p, penalised: applies(t, k, p, penalised, logits.shape[-1]))
    monkeypatch.setattr(fused_nucleus, "sample_plain" if plain else "sample_top_p", kernel)


def _fused_and_unfused(monkeypatch, kernel, key, plain: bool, seed: int, args: tuple):
    """A compiled Sampler of ``key`` routed to ``kernel`` (interpreted here) returns the eager sampler's tokens and
    log-probabilities through the fused path, and ``fused=False`` takes the compiled one. Returns the logits."""
    _route_to_kernel(monkeypatch, kernel, plain=plain)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the "compiled" functions run eagerly here
    logits = _logits(5, 800, 3.0, seed, torch.bfloat16, True)
    sampler = Sampler(key, compiled=True)
    tokens, logprobs = sampler(logits, None, *args, with_logprobs=True)
    expected, expected_lp = _select(logits, key, None, *args, True, search=False)
    assert sampler.is_fused and sampler.last_path == "fused" and torch.equal(tokens, expected)
    assert torch.allclose(logprobs, expected_lp, atol=2e-6)
    unfused = Sampler(key, compiled=True, fused=False)
    unfused(logits, None, *args)
    assert unfused.last_path == "compiled"
    return logits


def test_sampler_runs_the_kernel_where_it_applies(interpreted, stable_sort, monkeypatch):
    """A compiled Sampler of a temperature/top-p key calls the kernel (here interpreted on the CPU) and
    returns what the eager sampler returns; ``fused=False`` or a repetition penalty keep the other paths."""
    args = (torch.tensor(77), torch.arange(5), torch.tensor(3))
    logits = _fused_and_unfused(monkeypatch, interpreted.sample_top_p, SamplerKey(1.0, 0, 0.9, 1.0), False, 1, args)
    penalised = Sampler(SamplerKey(1.0, 0, 0.9, 1.3), compiled=True)
    penalised(logits, torch.zeros(5, 800, dtype=torch.bool), *args)
    assert penalised.last_path == "compiled"
    with_top_k = Sampler(SamplerKey(1.0, 5, 0.9, 1.0), compiled=True)
    with_top_k(logits, None, *args)
    assert with_top_k.last_path == "compiled"


@pytest.mark.parametrize("top_p, what", [(0.8, "nucleus"), (1.0, "plain sampling")])
def test_sampler_falls_back_when_the_kernel_raises(monkeypatch, top_p, what):
    """The nucleus kernel, or top-p 1's plain draw, raising: the compiled sampler takes over for good, the reason
    names the kernel and its error, and the tokens are the eager sampler's."""
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    _route_to_kernel(monkeypatch, broken, plain=top_p >= 1.0)
    key = SamplerKey(0.9, 0, top_p, 1.0)
    sampler = Sampler(key, compiled=True)
    logits = _logits(3, 300, 2.0, 4, torch.float32, False)
    args = (torch.tensor(5), torch.arange(3), torch.tensor(0))
    tokens, _ = sampler(logits, None, *args)
    assert f"fused {what} kernel raised" in sampler.fallback_reason
    assert "no kernel today" in sampler.fallback_reason and sampler.last_path in ("compiled", "eager")
    expected, _ = _select(logits, key, None, *args, False, search=False)
    assert torch.equal(tokens, expected)
    sampler(logits, None, *args)  # dropped for good: the kernel is not called again
    assert sampler.last_path != "fused" and not sampler.is_fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernel_in_a_cuda_graph_on_the_gpu(temperature):
    """Compiled on CUDA, captured in a graph at the 3B vocabulary: tokens equal the eager stable-sort
    sampler's except where rounding decides (fast exp on the GPU), log-probabilities close."""
    from rollout.executors.graphs import capture_graph

    if fused_nucleus.available() is not None:
        pytest.skip(fused_nucleus.available())
    key = SamplerKey(temperature, 0, 0.9, 1.0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 3).bfloat16()
    seed, step, rows = torch.tensor(11, device="cuda"), torch.tensor(2, device="cuda"), torch.arange(256, device="cuda")
    sampler = Sampler(key, compiled=True)
    sampler(logits, None, seed, rows, step)  # compile outside the capture
    out = torch.zeros(256, dtype=torch.long, device="cuda")
    graph = capture_graph(lambda: out.copy_(sampler(logits, None, seed, rows, step)[0]), [],
                          torch.cuda.graph_pool_handle())
    graph.replay()
    assert sampler.last_path == "fused" and sampler.fallback_reason is None
    expected, expected_lp = _select(logits, key, None, seed, rows, step, True, search=False)  # CUDA sort: stable
    assert (out == expected).float().mean() >= 0.99
    tokens, logprobs = sampler(logits, None, seed, rows, step, True)
    same = tokens == expected
    assert torch.allclose(logprobs[same], expected_lp[same], atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wide_arity_gives_the_narrow_arity_tokens_on_the_gpu(monkeypatch):
    """At 256 rows (a program for every multiprocessor) the kernel searches with ``WIDE_ARITY``; the tokens and
    log-probabilities are those of ``ARITY`` at the 3B vocabulary."""
    if fused_nucleus.available() is not None:
        pytest.skip(fused_nucleus.available())
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 3).bfloat16()
    args = (torch.tensor(5, device="cuda"), torch.arange(256, device="cuda"), torch.tensor(3, device="cuda"))
    monkeypatch.setattr(fused_nucleus, "CHUNK_TOKENS", 0)  # the one-program kernel, whose arity follows the rows
    assert fused_nucleus.arity(256, logits.device) == fused_nucleus.WIDE_ARITY != fused_nucleus.ARITY
    tokens, logprobs = fused_nucleus.sample_top_p(logits, 1.0, 0.9, *args, True)
    monkeypatch.setattr(fused_nucleus, "WIDE_ARITY", fused_nucleus.ARITY)
    narrow, narrow_lp = fused_nucleus.sample_top_p(logits, 1.0, 0.9, *args, True)
    assert torch.equal(tokens, narrow) and torch.equal(logprobs, narrow_lp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_rows_on_the_gpu(monkeypatch, temperature):
    """At the 3B vocabulary, compiled: the chunked form's tokens equal the one-program kernel's except where
    rounding decides, its log-probabilities are close, and a row's token is the same in batches of 256 and 8."""
    if fused_nucleus.available() is not None:
        pytest.skip(fused_nucleus.available())
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 3).bfloat16()
    args = (torch.tensor(6, device="cuda"), torch.arange(256, device="cuda"), torch.arange(256, device="cuda") + 1)
    assert fused_nucleus.chunk_count(151936) > 1
    tokens, logprobs = fused_nucleus.sample_top_p(logits, temperature, 0.9, *args, True)
    few, few_lp = fused_nucleus.sample_top_p(logits[:8], temperature, 0.9, *(a[:8] if a.dim() else a for a in args),
                                             True)
    assert torch.equal(few, tokens[:8]) and torch.equal(few_lp, logprobs[:8])
    monkeypatch.setattr(fused_nucleus, "CHUNK_TOKENS", 0)
    one, one_lp = fused_nucleus.sample_top_p(logits, temperature, 0.9, *args, True)
    same = tokens == one
    assert same.float().mean() >= 0.99
    assert torch.allclose(logprobs[same], one_lp[same], atol=1e-4)


# Plain sampling (top-p 1): fused_nucleus.sample_plain, the Gumbel-max draw with every token kept.

PLAIN_CASES = [  # dtype, temperature, scale, ties, per-row token indices
    (torch.bfloat16, 1.0, 3.0, False, False),
    (torch.bfloat16, 1.0, 2.0, True, True),
    (torch.float32, 0.7, 2.0, True, False),
    (torch.float32, 1.3, 4.0, False, True),
    (torch.float16, 0.8, 3.0, True, False),
]


def _check_plain(sampler_module, dtype, temperature, scale, ties, per_row, vocab, rows=6):
    logits = _logits(rows, vocab, scale, vocab + int(temperature * 10), dtype, ties)
    key = SamplerKey(temperature, 0, 1.0, 1.0)
    seed, ids = torch.tensor(2**32 - 7), torch.arange(rows) * 5 + 1
    step = torch.arange(rows) + 9 if per_row else torch.tensor(6)
    tokens, logprobs = sampler_module.sample_plain(logits, temperature, seed, ids, step, True)
    expected, expected_lp = _select(logits, key, None, seed, ids, step, True, search=False)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, expected)
    assert torch.allclose(logprobs, expected_lp, atol=2e-6)
    again, none = sampler_module.sample_plain(logits, temperature, seed, ids, step, False)
    assert torch.equal(again, tokens) and none is None
    return logits, (seed, ids, step), tokens, logprobs


@pytest.mark.parametrize("dtype, temperature, scale, ties, per_row", PLAIN_CASES)
@pytest.mark.parametrize("vocab", [1, 7, 1000])
def test_plain_draw_equals_the_eager_sampler(interpreted, dtype, temperature, scale, ties, per_row, vocab):
    """One chunk a row: the same tokens as the eager Gumbel-max of the whole softmax (the compiled path's
    noise and first-index ties), log-probabilities close, with and without them."""
    _check_plain(interpreted, dtype, temperature, scale, ties, per_row, vocab)


@pytest.mark.parametrize("dtype, temperature, scale, ties, per_row", [PLAIN_CASES[i] for i in (0, 1, 3)])
def test_plain_draw_in_chunks_equals_the_eager_sampler_and_ignores_the_batch(chunked, dtype, temperature, scale, ties,
                                                                              per_row):
    """Rows cut into 4 chunks (the last of 100 tokens): the eager sampler's tokens; a row sampled alone draws the
    same token with the same log-probability."""
    assert fused_nucleus.chunk_count(1000) == 4
    logits, (seed, ids, step), tokens, logprobs = _check_plain(chunked, dtype, temperature, scale, ties, per_row,
                                                               1000, rows=4)
    for picked in ([1], [3, 0]):
        pick = [torch.tensor(picked)]
        alone, alone_lp = chunked.sample_plain(logits[pick], temperature, seed, ids[pick],
                                               step[pick] if step.dim() else step, True)
        assert torch.equal(alone, tokens[pick]) and torch.equal(alone_lp, logprobs[pick])


def test_plain_draws_follow_the_softmax(chunked):
    """100 draws of one row of 1000 tokens in 4 chunks at T = 1 (100 sample ids, so 100 independent noises): each is
    the eager Gumbel-max sampler's token, and that sampler's 4,000 draws under keys of the same form follow the softmax
    (chi-square over the tokens expected at least 5 times, the rest pooled). (The kernel's own 500 draws took 40 s of
    the suite in the interpreter.)"""
    draws_n = 100
    row = _logits(1, 1000, 3.0, 3, torch.float32, False)
    key = SamplerKey(1.0, 0, 1.0, 1.0)
    seed, ids, step = torch.tensor(1), torch.arange(draws_n), torch.tensor(0)
    draws, _ = chunked.sample_plain(row.expand(draws_n, -1), 1.0, seed, ids, step, False)
    eager, _ = _select(row.expand(draws_n, -1), key, None, seed, ids, step, False, search=False)
    assert torch.equal(draws, eager)
    counts = _eager_counts(row, key, 1000, 4, seed=1)
    probs = torch.softmax(row[0].double(), -1)
    big = probs * counts.sum() >= 5
    assert big.sum() >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected = torch.cat([probs[big], probs[~big].sum().reshape(1)]) * counts.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > CHI2_MIN_P


@pytest.mark.parametrize("kwargs, applies", [
    (dict(temperature=1.0), True), (dict(temperature=0.7), True), (dict(temperature=1.0, top_k=1000), True),
    (dict(temperature=1.0, top_k=50), False), (dict(temperature=1.0, top_p=0.9), False),
    (dict(temperature=0.0), False),
])
def test_the_plain_draw_applies_to_temperature_alone(kwargs, applies):
    key = sampler_key(SamplingConfig(max_new_tokens=1, **kwargs))
    assert fused_nucleus.applies_plain(key.temperature, key.top_k, key.top_p, False, 1000) is applies
    assert fused_nucleus.applies_plain(key.temperature, key.top_k, key.top_p, True, 1000) is False  # a penalty
    assert not fused_nucleus.supports_plain(torch.zeros(2, 10), 1.0, 0, 1.0, False)  # CPU tensors: other paths


def test_sampler_runs_the_plain_draw_at_top_p_1(interpreted, monkeypatch):
    """A compiled Sampler of a temperature-only key calls the plain draw (interpreted here) and returns the eager
    sampler's tokens; ``fused=False`` keeps the compiled path."""
    args = (torch.tensor(78), torch.arange(5), torch.tensor(4))
    _fused_and_unfused(monkeypatch, interpreted.sample_plain, SamplerKey(1.0, 0, 1.0, 1.0), True, 2, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_draw_in_a_cuda_graph_on_the_gpu(temperature):
    """At the 3B vocabulary, captured in a graph: the plain draw's tokens equal the compiled sampler's
    (``fused=False``) and the eager one's, log-probabilities close; a row's token is the same in a batch of 8."""
    from rollout.executors.graphs import capture_graph

    if fused_nucleus.available() is not None:
        pytest.skip(fused_nucleus.available())
    key = SamplerKey(temperature, 0, 1.0, 1.0)
    gen = torch.Generator(device="cuda").manual_seed(4)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 3).bfloat16()
    seed, step, rows = torch.tensor(13, device="cuda"), torch.tensor(5, device="cuda"), torch.arange(256, device="cuda")
    sampler = Sampler(key, compiled=True)
    sampler(logits, None, seed, rows, step)
    out = torch.zeros(256, dtype=torch.long, device="cuda")
    graph = capture_graph(lambda: out.copy_(sampler(logits, None, seed, rows, step)[0]), [],
                          torch.cuda.graph_pool_handle())
    graph.replay()
    assert sampler.last_path == "fused" and sampler.fallback_reason is None
    compiled = Sampler(key, compiled=True, fused=False)
    via_compiled, compiled_lp = compiled(logits, None, seed, rows, step, True)
    eager, _ = _select(logits, key, None, seed, rows, step, True, search=False)
    assert compiled.last_path == "compiled"
    assert (out == via_compiled).float().mean() >= 0.99 and (out == eager).float().mean() >= 0.99
    tokens, logprobs = sampler(logits, None, seed, rows, step, True)
    same = tokens == via_compiled
    assert torch.allclose(logprobs[same], compiled_lp[same], atol=1e-4)
    few, few_lp = fused_nucleus.sample_plain(logits[:8], temperature, seed, rows[:8], step, True)
    assert torch.equal(few, tokens[:8]) and torch.equal(few_lp, logprobs[:8])


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_a_saturated_variate_draws_no_token_of_its_own_in_the_kernels(interpreted, chunk_tokens):
    """The key whose variate for one token was exactly 1.0 (infinite noise: that token drawn, 30 below the favourite):
    the plain draw and the nucleus kernels over every token (top-p 1) draw the favourite, as the eager sampler does,
    in one program a row and in chunks."""
    logits, (seed, rows, step), token = saturated_case()
    expected, _ = _select(logits, SamplerKey(1.0, 0, 1.0, 1.0), None, seed, rows, step, False, search=False)
    assert expected.item() == 0
    plain, _ = interpreted.sample_plain(logits, 1.0, seed, rows, step, False, chunk_tokens=chunk_tokens)
    nucleus, _ = interpreted.sample_top_p(logits, 1.0, 1.0, seed, rows, step, False, chunk_tokens=chunk_tokens)
    assert plain.item() == 0 and nucleus.item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_a_saturated_variate_draws_no_token_of_its_own_on_the_gpu(chunk_tokens):
    """The interpreter test above, compiled on CUDA, and the compiled sampler of a T=1 key (the plain draw)."""
    if fused_nucleus.available() is not None:
        pytest.skip(fused_nucleus.available())
    logits, args, _ = saturated_case()
    logits, (seed, rows, step) = logits.cuda(), [a.cuda() for a in args]
    plain, _ = fused_nucleus.sample_plain(logits, 1.0, seed, rows, step, False, chunk_tokens=chunk_tokens)
    nucleus, _ = fused_nucleus.sample_top_p(logits, 1.0, 1.0, seed, rows, step, False, chunk_tokens=chunk_tokens)
    eager, _ = _select(logits, SamplerKey(1.0, 0, 1.0, 1.0), None, seed, rows, step, False, search=False)
    sampled, _ = Sampler(SamplerKey(1.0, 0, 1.0, 1.0), compiled=True)(logits, None, seed, rows, step)
    assert plain.item() == nucleus.item() == eager.item() == sampled.item() == 0
