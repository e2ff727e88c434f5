"""The sampler: top-k / top-p masks equal HF's warpers (ties included), the sort-free nucleus equals the
sorting one, the sampled distribution (chi-square), seeds below 2**32 keep the samples of the previous
implementation, log-probabilities, and the compiled sampler's eager fallback."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rollout.config import SamplingConfig
from rollout.ops import sampling as smp
from rollout.ops.nucleus import _nth_member, ordered_keys, top_p_keep
from rollout.ops.sampling import (Sampler, _select, filter_top_k, sampled_logprobs, sampler_fn, sampler_key,
                                  select_next_token)
from benchmarks.sampler import old_select  # the previous implementation (commit b8f0f0e), copied there
from tests.oracles import SATURATED_VOCAB, saturated_case

CHI2_MIN_P = 1e-6
"""A correct sampler's chi-square p-value is uniform on (0, 1): it falls below this with probability 1e-6."""


# ----------------------------------------------------------------------------- helpers

def hf_keep(scores: torch.Tensor, top_p: float, monkeypatch=None) -> torch.Tensor:
    """HF's TopPLogitsWarper mask; with ``monkeypatch``, its sort made stable (HF on CUDA sorts a
    vocabulary with a stable radix sort; on CPU ``torch.sort`` is stable only up to 16 values)."""
    if monkeypatch is not None:
        sort = torch.sort
        monkeypatch.setattr(torch, "sort", lambda *a, **k: sort(*a, **{**k, "stable": True}))
    try:
        return TopPLogitsWarper(top_p)(None, scores.clone()) > float("-inf")
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


def random_scores(rows: int, vocab: int, scale: float, seed: int, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=gen) * scale
    return (scores * 2).round() / 2 if ties else scores  # ties: values on a half-integer grid


def dyadic_rows(rows: int, seed: int) -> torch.Tensor:
    """Logits whose softmax is exact: 1 token of probability 1/4, 2 of 1/8, 4 of 1/16, 8 of 1/32 (sums
    of any of them are exact in fp32), shuffled per row so index order matters inside each tie group."""
    level = torch.tensor([0] + [1] * 2 + [2] * 4 + [3] * 8)
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(15, generator=gen) for _ in range(rows)])
    return (-level[order] * math.log(2)).float()


def keys_of(**kwargs):
    return sampler_key(SamplingConfig(max_new_tokens=1, **kwargs))


# ----------------------------------------------------------------------------- masks equal HF's

@pytest.mark.parametrize("vocab, scale, top_p, seed", [
    (50, 1.0, 0.9, 0), (1000, 3.0, 0.9, 1), (1000, 8.0, 0.5, 2), (3000, 0.3, 0.95, 3), (257, 5.0, 0.05, 4),
    (2048, 2.0, 0.999, 5), (7, 1.0, 0.3, 6), (2, 1.0, 0.5, 7), (1, 1.0, 0.5, 8),
])
def test_top_p_keep_equals_hf_on_random_logits(vocab, scale, top_p, seed):
    scores = random_scores(6, vocab, scale, seed)
    assert torch.equal(top_p_keep(scores, top_p), hf_keep(scores, top_p))


@pytest.mark.parametrize("top_p", [k / 64 for k in range(1, 64)] + [0.9, 0.1, 1e-7])
def test_top_p_keep_equals_hf_on_exact_ties(top_p):
    """Tie groups straddle the boundary at every multiple of 1/64 (cumulative sums equal to 1 - top_p
    included): the lowest-index members of the straddling group go first, as in HF's stable order."""
    scores = dyadic_rows(8, seed=int(top_p * 64))
    assert torch.equal(top_p_keep(scores, top_p), hf_keep(scores, top_p))  # 15 values: HF's CPU sort is stable


@pytest.mark.parametrize("vocab, top_p, seed", [(300, 0.9, 0), (1000, 0.5, 1), (4000, 0.8, 2), (129, 0.2, 3)])
def test_top_p_keep_equals_stable_hf_on_many_ties(monkeypatch, vocab, top_p, seed):
    scores = random_scores(6, vocab, 2.0, seed, ties=True)
    expected = hf_keep(scores, top_p, monkeypatch)
    assert torch.equal(top_p_keep(scores, top_p), expected)


@pytest.mark.parametrize("dtype, shift", [(torch.bfloat16, 16), (torch.float16, 13)])
def test_top_p_keep_with_low_key_bits_dropped(monkeypatch, dtype, shift):
    """Scores cast from bf16/fp16 have zero low mantissa bits: searching the high bits gives the same mask."""
    scores = (random_scores(6, 2000, 3.0, 7) * 4).to(dtype).float()  # many exact ties
    for top_p in (0.3, 0.9):
        assert torch.equal(top_p_keep(scores, top_p, key_shift=shift), hf_keep(scores, top_p, monkeypatch))


@pytest.mark.parametrize("top_k", [1, 3, 10, 100])
def test_top_k_equals_hf_ties_kept(top_k):
    scores = random_scores(5, 300, 2.0, top_k, ties=True)
    expected = TopKLogitsWarper(top_k)(None, scores.clone())
    assert torch.equal(filter_top_k(scores, top_k), expected)


def test_ordered_keys_order_like_the_floats():
    values = torch.tensor([float("-inf"), -3e38, -1.5, -1e-40, -0.0, 0.0, 1e-45, 2.0, 3e38, float("inf")])
    keys = ordered_keys(values)
    assert torch.all(keys[1:] >= keys[:-1])
    assert keys[4] == keys[5]  # -0.0 and +0.0 tie, as a comparison sort sees them
    assert torch.all((keys[1:] > keys[:-1]) == (values[1:] > values[:-1]))


@pytest.mark.parametrize("vocab, density", [(15, 0.5), (256, 0.1), (1000, 0.02), (1000, 0.9)])
def test_nth_member_is_the_nth_index_of_the_group(vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    group = torch.rand(7, vocab, generator=gen) < density
    group[:, -1] = True  # every row has a member
    sizes = group.sum(-1)
    n = (torch.rand(7, generator=gen) * sizes).long()
    expected = torch.stack([group[r].nonzero()[n[r], 0] for r in range(7)])
    assert torch.equal(_nth_member(group, n), expected)


# ----------------------------------------------------------------------------- tokens

CONFIGS = [
    dict(temperature=1.0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.8, top_k=50), dict(temperature=0.9, top_p=0.5, repetition_penalty=1.3),
    dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeds_keep_the_previous_samples(kwargs, dtype):
    """Both nucleus filters draw what the previous implementation drew, for seeds across [0, 2**32). The
    sort-free one is compared with ties in stable order (bf16 logits have many): on the CPU, ``torch.sort``
    orders ties arbitrarily above 16 values; on CUDA a vocabulary sort is stable."""
    sampling = SamplingConfig(max_new_tokens=1, **kwargs)
    logits = (random_scores(16, 700, 3.0, 11)).to(dtype)
    seen = random_scores(16, 700, 1.0, 12) > 1.5
    rows = torch.arange(100, 116)
    for seed in (0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1):
        for step in (0, 7):
            args = (torch.tensor(seed), rows, torch.tensor(step))
            assert torch.equal(select_next_token(logits, sampling, seen, *args),
                               old_select(logits, sampling, seen, *args))
            searched, _ = _select(logits, sampler_key(sampling), seen, *args, False, search=True)
            assert torch.equal(searched, old_select(logits, sampling, seen, *args, stable=True))


def _draws(logits: torch.Tensor, key, num: int, search: bool) -> torch.Tensor:
    """``num`` draws from one row of logits: rows 0..num-1 over two steps, all (row, step) keys distinct."""
    half = num // 2
    return torch.cat([_select(logits.expand(half, -1), key, None, torch.tensor(5), torch.arange(half),
                              torch.tensor(step), False, search)[0] for step in (0, 1)])


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=1.5, top_k=5, top_p=0.9), dict(temperature=1.0, top_p=0.6)])
@pytest.mark.parametrize("search", [False, True])
def test_samples_follow_the_filtered_softmax(kwargs, search):
    """Chi-square on V=8 over 20k draws against softmax(HF-filtered logits / T); filtered tokens never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.5, -0.25, -1.0, -2.0, 0.0]])
    key = keys_of(**kwargs)
    scores = logits / key.temperature
    if key.top_k > 0:
        scores = TopKLogitsWarper(key.top_k)(None, scores)
    scores = TopPLogitsWarper(key.top_p)(None, scores) if key.top_p < 1 else scores
    expected = torch.softmax(scores.double(), dim=-1)[0]
    counts = torch.bincount(_draws(logits, key, 20_000, search), minlength=8).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0
    frequencies = expected[kept] / expected[kept].sum() * counts.sum()
    assert chisquare(counts[kept].numpy(), frequencies.numpy()).pvalue > CHI2_MIN_P


# ----------------------------------------------------------------------------- log-probabilities

@pytest.mark.parametrize("kwargs", CONFIGS)
def test_logprobs_equal_a_direct_computation(kwargs):
    sampling = SamplingConfig(max_new_tokens=1, **kwargs)
    logits = random_scores(8, 500, 3.0, 21)
    seen = random_scores(8, 500, 1.0, 22) > 1.0
    tokens = select_next_token(logits, sampling, seen, torch.tensor(3), torch.arange(8), torch.tensor(1))
    penalty = sampling.repetition_penalty
    scores = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    if not sampling.is_greedy:  # greedy: temperature 1, no filtering
        scores = scores / sampling.temperature
        if sampling.top_k > 0:
            scores = TopKLogitsWarper(sampling.top_k)(None, scores)
        if sampling.top_p < 1:
            scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    expected = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(sampled_logprobs(logits, sampling, seen, tokens), expected, atol=1e-6)
    key = sampler_key(sampling)
    for search in (False, True):
        chosen, logprobs = _select(logits, key, seen, torch.tensor(3), torch.arange(8), torch.tensor(1), True, search)
        assert torch.equal(chosen, tokens)
        assert torch.allclose(logprobs, expected, atol=1e-6)
    assert torch.all(torch.isfinite(expected))


# ----------------------------------------------------------------------------- the compiled sampler

def _call(sampler, logits, with_logprobs=True):
    return sampler(logits, None, torch.tensor(9), torch.arange(logits.shape[0]), torch.tensor(4), with_logprobs)


@pytest.mark.parametrize("kwargs, field", [(dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                           (dict(repetition_penalty=0.0), "repetition_penalty")])
def test_sampler_key_refuses_bad_values(kwargs, field):
    values = {**dict(temperature=1.0, top_k=-1, top_p=1.0, repetition_penalty=1.0), **kwargs}
    with pytest.raises(ValueError, match=field):
        smp.SamplerKey(**values)


def test_sampler_fn_is_cached_per_key():
    a = sampler_fn(SamplingConfig(max_new_tokens=3, temperature=0.8, top_p=0.9, seed=1), compiled=False)
    b = sampler_fn(SamplingConfig(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=2), compiled=False)
    c = sampler_fn(SamplingConfig(max_new_tokens=3, temperature=0.9, top_p=0.9), compiled=False)
    assert a is b and a is not c
    assert not a.is_compiled and a.fallback_reason is None


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", refuse)
    key = keys_of(temperature=0.8, top_p=0.9)
    sampler = Sampler(key, compiled=True)
    assert not sampler.is_compiled and "no compiler here" in sampler.fallback_reason
    logits = random_scores(4, 300, 2.0, 31)
    tokens, logprobs = _call(sampler, logits)
    expected = _select(logits, key, None, torch.tensor(9), torch.arange(4), torch.tensor(4), True, search=False)
    assert torch.equal(tokens, expected[0]) and torch.equal(logprobs, expected[1])


def test_first_call_failure_falls_back_to_eager_for_good(monkeypatch):
    calls = []

    def broken(fn, **kwargs):
        def run(*args):
            calls.append(1)
            raise TypeError("list indices must be integers or slices, not NoneType")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    key = keys_of(temperature=1.0, top_p=0.9)
    sampler = Sampler(key, compiled=True)
    assert sampler.is_compiled
    logits = random_scores(4, 300, 2.0, 32)
    tokens, logprobs = _call(sampler, logits)
    assert "TypeError" in sampler.fallback_reason and not sampler.is_compiled
    expected = _select(logits, key, None, torch.tensor(9), torch.arange(4), torch.tensor(4), True, search=False)
    assert torch.equal(tokens, expected[0]) and torch.equal(logprobs, expected[1])
    _call(sampler, logits, with_logprobs=False)
    assert len(calls) == 1  # never tried again


def test_compiled_sampler_traces_whole_without_a_sort(monkeypatch):
    """torch.compile(fullgraph=True) traces the sort-free path in one graph per sampler (dynamo + AOT
    autograd on the CPU; Inductor's code generation for CUDA is exercised by benchmarks.sampler),
    also when samplers of other keys were compiled before in the same process."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend=record, **kwargs))
    logits = random_scores(6, 1000, 3.0, 33).to(torch.bfloat16)
    for kwargs in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.9, top_k=200),
                   dict(temperature=0.8, top_p=0.7)):
        key = keys_of(**kwargs)
        sampler, first = Sampler(key, compiled=True), len(graphs)
        for rows in (6, 3):  # a second batch size reuses the dynamic-batch graph
            tokens, logprobs = _call(sampler, logits[:rows])
            expected = _select(logits[:rows], key, None, torch.tensor(9), torch.arange(rows), torch.tensor(4), True,
                               search=False)
            assert torch.equal(tokens, expected[0])
            assert torch.allclose(logprobs, expected[1], atol=1e-6)
        assert sampler.fallback_reason is None and len(graphs) == first + 1
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert not any("sort" in t or "cumsum" in t for t in targets), targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_sampler_in_a_cuda_graph():
    """The compiled sampler (Inductor, CUDA) warms up, captures and replays in a CUDA graph; its tokens
    agree with the previous implementation's (stable ties) except where rounding decides, and its
    log-probabilities with the eager ones."""
    from rollout.executors.graphs import capture_graph

    sampling = SamplingConfig(max_new_tokens=1, temperature=1.0, top_p=0.9)
    sampler = sampler_fn(sampling, compiled=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 32000, device="cuda", generator=gen) * 3).bfloat16()
    seed, step = torch.tensor(11, device="cuda"), torch.tensor(2, device="cuda")
    rows = torch.arange(64, device="cuda")
    out = torch.zeros(64, dtype=torch.long, device="cuda")
    graph = capture_graph(lambda: out.copy_(sampler(logits, None, seed, rows, step)[0]), [],
                          torch.cuda.graph_pool_handle())
    graph.replay()
    assert sampler.fallback_reason is None
    expected = old_select(logits, sampling, None, seed, rows, step, stable=True)
    assert (out == expected).float().mean() >= 0.99
    tokens, logprobs = sampler(logits, None, seed, rows, step, True)
    assert torch.allclose(logprobs, sampled_logprobs(logits, sampling, None, tokens), atol=1e-5)


def test_noise_is_capped_below_one():
    """The hash's top values rounded to u = 1.0, whose Gumbel noise is infinite: capped at ``UNIFORM_MAX`` (the
    largest float32 below 1), the noise is finite there and unchanged everywhere else."""
    from benchmarks.sampler import _old_noise

    _, args, token = saturated_case()
    old = _old_noise(*args, SATURATED_VOCAB)
    u = smp.uniform_noise(*args, SATURATED_VOCAB)
    assert old[0, token] == 1.0 and u[0, token] == smp.UNIFORM_MAX < 1.0
    others = torch.arange(SATURATED_VOCAB) != token
    assert torch.equal(u[0, others], old[0, others])
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9),
                                    dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.9, top_k=5)])
@pytest.mark.parametrize("search", [False, True])
def test_a_saturated_variate_draws_no_token_of_its_own(kwargs, search):
    """Where the previous noise was 1.0 for a token 30 below the favourite, the previous sampler drew that token
    (infinite noise; ``-inf + inf`` = NaN for a filtered one, which argmax takes): both nucleus filters now draw the
    favourite, as the scores say, and so does the sampled log-probability's token."""
    logits, args, token = saturated_case()
    sampling = SamplingConfig(max_new_tokens=1, **kwargs)
    assert old_select(logits, sampling, None, *args).item() == token  # the bug, reproduced
    assert select_next_token(logits, sampling, None, *args).item() == 0
    tokens, logprobs = _select(logits, sampler_key(sampling), None, *args, True, search=search)
    assert tokens.item() == 0 and logprobs.item() > -1e-6
