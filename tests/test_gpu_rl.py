"""GPU checks of the RL-scale paths that counters alone cannot show: one graph launch per decode step
(compaction included), host syncs per call, and graph/eager/HF equality with compaction in fp32."""

import warnings
from collections import Counter

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig, RoutingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ragged_eos(model, ids, mask, max_new: int = 40, samples: int = 3) -> list[int]:
    """EOS ids under which most rows end well before ``max_new`` (so the batch shrinks below half its
    bucket and compacts) and some row runs on: the most common tokens of the free greedy run, added until
    at least 70% of the rows hold one in their first ``max_new - 8`` tokens, while at least one row holds
    none at all. The free run has the tests' config (compile=False) and batch shape (``samples`` per
    prompt): up to the first compaction a call with these EOS ids computes exactly the same steps, so
    their tokens, and the compaction, follow (fp32 GEMMs of other shapes can round near-ties otherwise)."""
    free = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig(kernels=KernelConfig(
        compile=False))).generate(
        RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=max_new, temperature=0.0,
                                                  n_samples_per_prompt=samples))
    generated = free.input_ids[:, ids.shape[1]:].cpu()
    counts = Counter(generated.flatten().tolist())
    eos: list[int] = []
    for token, _ in counts.most_common():
        trial = eos + [token]
        hit = torch.isin(generated, torch.tensor(trial))
        if bool(hit.any(dim=1).all()):  # no row would run to the budget: skip this token
            continue
        eos = trial
        if hit[:, : max_new - 8].any(dim=1).float().mean() >= 0.7:
            return eos
    raise AssertionError("no EOS set ends 70% of the rows early while one row runs on (change the seed)")


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen2", seed=0, device="cuda")
    ids, mask = random_prompts(20, 9, min_len=1, seed=3, device="cuda")
    return model, ids, mask, TinyTokenizer(pad_token_id=0, eos_token_id=ragged_eos(model, ids, mask))


def _count_replays(monkeypatch):
    replays = []
    original = torch.cuda.CUDAGraph.replay

    def counted(self):
        replays.append(1)
        return original(self)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return replays


@cuda
@pytest.mark.parametrize("route, slots", [("ordinary", None), ("continuous", 24)])
def test_one_graph_launch_per_decode_step(setup, monkeypatch, route, slots):
    model, ids, mask, tok = setup
    # greedy on the ordinary route: rows end at the EOS tokens' steps, so the batch surely shrinks
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.0 if route == "ordinary" else 1.0, top_p=0.9,
                              seed=1, n_samples_per_prompt=3, continuous_batch_size=slots)
    ro = Rollout(model, tok, RolloutConfig(route=route, kernels=KernelConfig(compile=False)))
    ro.generate(RolloutRequest(ids, mask), sampling)  # captures
    replays = _count_replays(monkeypatch)
    ro.generate(RolloutRequest(ids, mask), sampling)
    stats = ro.last_stats
    assert stats.decode.path == "graph", stats.decode.fallback_reason
    assert len(replays) == stats.decode.forwards == stats.decode.graph_steps > 0
    if route == "ordinary":
        assert stats.cache.compactions >= 1  # the batch shrank, and still one launch per step


@cuda
def test_decode_host_syncs_are_the_eos_checks(setup, monkeypatch):
    """The ordinary route's decode steps add no stream sync (compactions none either): its EOS checks wait
    on an event recorded one check earlier, never on the step just launched, so the GPU's queue is never
    drained. Compare a call with decode steps to one without (max_new_tokens=1) under sync-debug mode (which
    flags stream and device syncs, not event waits), and count the event waits: one per counted host sync.
    The measured call is the Rollout's second with these EOS ids: it replays graphs captured by the first,
    which must read a live EOS tensor (a per-call tensor freed after the first call left rows unfinished:
    no compaction, every step run; fixed 2026-12-01)."""
    model, ids, mask, tok = setup
    ro = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(compile=False)))
    waits = []
    original = torch.cuda.Event.synchronize

    def counted(self):
        waits.append(1)
        return original(self)

    def syncs(max_new):
        sampling = SamplingConfig(max_new_tokens=max_new, temperature=0.0, n_samples_per_prompt=3)
        ro.generate(RolloutRequest(ids, mask), sampling)  # warm-up, captures
        torch.cuda.synchronize()
        waits.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
            try:
                ro.generate(RolloutRequest(ids, mask), sampling)
            finally:
                monkeypatch.undo()
                torch.cuda.set_sync_debug_mode("default")
        return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught), len(waits), \
            ro.last_stats

    base, base_waits, _ = syncs(1)
    total, total_waits, stats = syncs(40)
    assert stats.cache.compactions >= 1 and stats.decode.host_syncs > 0
    assert total == base  # no stream sync for the decode steps
    assert total_waits - base_waits == stats.decode.host_syncs


@cuda
@pytest.mark.parametrize("n", [1, 3])
def test_graph_decode_with_compaction_equals_eager_and_hf_fp32(setup, n):
    model, ids, mask, tok = setup
    for sampling in (SamplingConfig(max_new_tokens=40, temperature=0.0, n_samples_per_prompt=n),
                     SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=100, top_p=0.8, seed=2,
                                    repetition_penalty=1.2, n_samples_per_prompt=n)):
        graph = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(compile=False)))
        got = graph.generate(RolloutRequest(ids, mask), sampling)
        assert graph.last_stats.decode.path == "graph", graph.last_stats.decode.fallback_reason
        assert graph.last_stats.decode.attention == "triton"  # the default: our kernel inside the graphs
        eager = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(cuda_graphs=False, compile=False)))
        hf = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(fast_decode=False)))
        assert torch.equal(got.input_ids, eager.generate(RolloutRequest(ids, mask), sampling).input_ids)
        assert torch.equal(got.input_ids, hf.generate(RolloutRequest(ids, mask), sampling).input_ids)


@cuda
def test_continuous_eos_check_interval_on_graphs(setup):
    """``eos_check_interval=4`` on the continuous route's graph path: the same responses as every-step
    checks (fp32, greedy and seeded top-p), one host sync per check."""
    model, ids, mask, tok = setup
    for sampling in (SamplingConfig(max_new_tokens=40, temperature=0.0, n_samples_per_prompt=3,
                                    continuous_batch_size=24),
                     SamplingConfig(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=4, n_samples_per_prompt=3,
                                    continuous_batch_size=24)):
        outs = {}
        for interval in (1, 4):
            ro = Rollout(model, tok, RolloutConfig(
                route="continuous", kernels=KernelConfig(compile=False), routing=RoutingConfig(
                    eos_check_interval=interval)))
            outs[interval] = ro.generate(RolloutRequest(ids, mask), sampling)
            stats = ro.last_stats
            assert stats.decode.path == "graph", stats.decode.fallback_reason
            assert stats.decode.host_syncs == stats.decode.steps // interval
        width = min(outs[1].input_ids.shape[1], outs[4].input_ids.shape[1])
        for row in range(outs[1].input_ids.shape[0]):
            a, b = outs[1], outs[4]
            assert torch.equal(a.input_ids[row, :width][a.attention_mask[row, :width].bool()],
                               b.input_ids[row, :width][b.attention_mask[row, :width].bool()])
            assert int(a.attention_mask[row].sum()) == int(b.attention_mask[row].sum())


def _same_tokens_for_each(setup, route, slots, field, values, check=None, **fixed):
    """Greedy and seeded top-p calls (fp32, graphs, both samples of every prompt) with ``RolloutConfig.kernels`` field
    ``field`` at each of ``values`` (``fixed``: the other fields) give the same tokens; ``check(ro, value)`` runs
    after each call."""
    model, ids, mask, tok = setup
    for sampling in (SamplingConfig(max_new_tokens=40, temperature=0.0, n_samples_per_prompt=2,
                                    continuous_batch_size=slots),
                     SamplingConfig(max_new_tokens=40, temperature=1.0, top_p=0.8, seed=5, n_samples_per_prompt=2,
                                    continuous_batch_size=slots)):
        outs = []
        for value in values:
            settings = {f"kernels.{name}": fixed_value for name, fixed_value in fixed.items()}
            ro = Rollout(model, tok, RolloutConfig(route=route).with_settings({**settings, f"kernels.{field}": value}))
            outs.append(ro.generate(RolloutRequest(ids, mask), sampling).input_ids)
            assert ro.last_stats.decode.path == "graph", ro.last_stats.decode.fallback_reason
            if check is not None:
                check(ro, value)
        assert all(torch.equal(out, outs[0]) for out in outs[1:])


ROUTES_AND_SLOTS = pytest.mark.parametrize("route, slots", [("ordinary", None), ("continuous", 24)])


@cuda
@ROUTES_AND_SLOTS
def test_triton_and_sdpa_attention_give_the_same_tokens_fp32(setup, route, slots):
    """Both decode attentions, captured in graphs, give the same greedy and seeded-sampled tokens in fp32 on
    both routes (compaction and refills included); each call reports the attention it ran."""
    def reports(ro, attention):
        assert ro.last_stats.decode.attention == attention
    _same_tokens_for_each(setup, route, slots, "decode_attention", ("triton", "sdpa"), reports, compile=False)


@cuda
@ROUTES_AND_SLOTS
def test_fused_gate_up_gives_the_same_tokens_fp32(setup, route, slots):
    """``fuse_gate_up``: the same greedy and seeded-sampled tokens in fp32 as two projections, captured in
    graphs on both routes, with the compiled pieces (where the gate|up piece is a compiled graph of its own)."""
    _same_tokens_for_each(setup, route, slots, "fuse_gate_up", (True, False))


@cuda
@ROUTES_AND_SLOTS
def test_rotary_kernel_gives_the_same_tokens_fp32(setup, route, slots):
    """``rotary_kernel``: the same greedy and seeded-sampled tokens in fp32 as inductor's rotary and cache
    writes, captured in graphs on both routes (compaction and refills included)."""
    _same_tokens_for_each(setup, route, slots, "rotary_kernel", (True, False))


@cuda
@ROUTES_AND_SLOTS
def test_skinny_projections_give_the_same_tokens_fp32(setup, route, slots, monkeypatch):
    """``skinny_rows``: the same greedy and seeded-sampled tokens in fp32 as the compiled pieces, captured in
    graphs on both routes (the batch buckets at or below the limit run the Triton projections)."""
    from rollout.ops import skinny_linear
    calls = []
    original = skinny_linear.skinny_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    def used_where_asked(ro, rows):
        assert bool(calls) == (rows > 0) and all(n <= 64 for n in calls)  # calls made while capturing
        calls.clear()

    monkeypatch.setattr(skinny_linear, "skinny_linear", counted)
    _same_tokens_for_each(setup, route, slots, "skinny_rows", (64, 0), used_where_asked)


@cuda
@ROUTES_AND_SLOTS
def test_residual_in_place_gives_the_same_tokens_fp32(setup, route, slots):
    """``residual_in_place``: the same greedy and seeded-sampled tokens in fp32 as the compiled pieces that copy the
    residual, captured in graphs on both routes (with the skinny o projection at its default rows and without it)."""
    _same_tokens_for_each(setup, route, slots, "residual_in_place", (True, False))
    _same_tokens_for_each(setup, route, slots, "residual_in_place", (True, False), skinny_rows=0)


@cuda
@ROUTES_AND_SLOTS
def test_fold_norms_gives_the_same_tokens_fp32(setup, route, slots, monkeypatch):
    """``fold_norms`` (norm gains drawn from [0.5, 1.5], the model's ragged EOS kept): the same greedy and
    seeded-sampled tokens in fp32 as the unfolded step, captured in graphs on both routes (with the skinny o projection
    at its default rows and without it); the folded call ran the kernels that scale by 1/RMS, compiled: SiLU·mul's and
    the rotary's, alone or inside the attention (``rotary_in_attention_rows``)."""
    import copy

    from rollout.ops import rms_scaled, rotary_attention
    from tests.conftest import counter
    from tests.test_fold_norms import _gained

    model, ids, mask, tok = setup
    gained = _gained(copy.deepcopy(model), seed=7)
    calls = Counter()
    counted = counter(calls)
    for module, name in ((rms_scaled, "rotary_write_rms"), (rms_scaled, "silu_mul_rms"),
                         (rotary_attention, "rotary_attention")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))

    def ran_kernels(ro, fold):
        rotary = calls["rotary_write_rms"] + calls["rotary_attention"]
        assert (rotary > 0 and calls["silu_mul_rms"] > 0) == fold
        assert ro.last_stats.decode.norms_folded == fold
        assert rms_scaled.failure(ids.device) is None
        calls.clear()

    _same_tokens_for_each((gained, ids, mask, tok), route, slots, "fold_norms", (True, False), ran_kernels)
    _same_tokens_for_each((gained, ids, mask, tok), route, slots, "fold_norms", (True, False), ran_kernels,
                          skinny_rows=0)
