"""Every route (ordinary, continuous, auto) through ``Rollout``: same tokens, route decisions, errors."""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig, RoutingConfig
from rollout.plan.layout import PromptLayout, check_gather
from rollout.plan.planner import CostModel
from rollout.plan.routes import choose_route
from rollout.testing import TinyTokenizer, tiny_model
from tests.conftest import hf_greedy, response_of

#: Makes bucketing clearly worth it for skewed lengths on the tiny model (fixed cost small, tokens dear).
#: Costs under which Auto buckets skewed prompts, for the HF prefill (padded tokens dominate) and for
#: the packed one (its buckets only group attention, so attention must dominate the group overhead).
CHEAP_FIXED = dict(prefill_fixed_cost_ms=0.1, prefill_token_cost_ms=1.0, prefill_group_cost_ms=0.0,
                   prefill_attention_cost_ms=1e4)


def _skewed(lengths, seed=0, width=None):
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 512, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=7)


def _eos_for(model, ids, mask):
    """An EOS id that some rows emit mid-stream (taken from a free run)."""
    free = Rollout(model, TinyTokenizer(eos_token_id=None)).generate(
        RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10, temperature=0.0))
    return int(free.input_ids[0, ids.shape[1] + 3])


@pytest.mark.parametrize("route, slots", [("ordinary", None), ("continuous", None), ("continuous", 2),
                                          ("auto", None), ("auto", 3)])
@pytest.mark.parametrize("fast_prefill", [True, False], ids=["fast_prefill", "hf_prefill"])
def test_greedy_tokens_equal_hf_per_request_on_every_route(model, route, slots, fast_prefill):
    ids, mask = _skewed([30, 3, 4, 2, 17, 5, 3], seed=1)
    eos = _eos_for(model, ids, mask)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    cfg = RolloutConfig(
        route=route, routing=RoutingConfig(cost_model=CostModel.from_model(model, **CHEAP_FIXED)),
        kernels=KernelConfig(fast_prefill=fast_prefill))
    ro = Rollout(model, tok, cfg)
    batch = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10, temperature=0.0,
                                                                  continuous_batch_size=slots))
    for row in range(7):
        expected = hf_greedy(model, ids[row], mask[row], 10, eos=eos)
        cut = expected.index(eos) + 1 if eos in expected else len(expected)
        assert response_of(batch, row) == expected[:cut], f"row {row}"
    stats = ro.last_stats
    if route == "auto" and slots is None:
        assert stats.route == "ordinary" and stats.prefill.buckets >= 2
        if fast_prefill:  # one packed pass over the weights; attention per bucket
            assert stats.prefill.forwards == 1 and stats.prefill.attention_groups == stats.prefill.buckets
        else:
            assert stats.prefill.forwards == stats.prefill.buckets
    if slots is not None:
        assert stats.route == "continuous"


def test_auto_keeps_one_prefill_for_uniform_lengths(model):
    ids, mask = _skewed([6] * 5, seed=2)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="auto"))
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=3, temperature=0.0))
    assert ro.last_stats.route == "ordinary" and ro.last_stats.prefill.buckets == 1
    assert ro.last_stats.dp_skipped is True


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0, repetition_penalty=1.4, n_samples_per_prompt=2),
    dict(temperature=0.9, top_p=0.9, top_k=30, seed=11, n_samples_per_prompt=3),
])
def test_routes_agree_on_samples_and_penalties(model, sampling):
    ids, mask = _skewed([25, 2, 3, 9], seed=3)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    costs = CostModel.from_model(model, **CHEAP_FIXED)
    outs = {}
    for route, slots in (("ordinary", None), ("auto", None), ("continuous", None), ("continuous", 3)):
        ro = Rollout(model, tok, RolloutConfig(route=route, routing=RoutingConfig(cost_model=costs)))
        cfg = SamplingConfig(max_new_tokens=8, continuous_batch_size=slots, **sampling)
        outs[(route, slots)] = ro.generate(RolloutRequest(ids, mask), cfg).input_ids
    reference = outs[("ordinary", None)]
    for key, out in outs.items():
        assert torch.equal(out, reference), key


def test_route_decision_table():
    costs = CostModel(**CHEAP_FIXED)
    skewed = PromptLayout((512,) + (16,) * 31, (512,) + (16,) * 31, 512)
    auto = choose_route("auto", skewed, 1, None, costs, 65536)
    assert auto.route == "ordinary" and len(auto.buckets) == 2 and sorted(auto.bucket_lengths) == [16, 512]
    assert sorted(len(b) for b in auto.buckets) == [1, 31]
    assert choose_route("auto", skewed, 1, 8, costs, 65536).route == "continuous"  # 32 rows > 8 slots
    uniform = PromptLayout((16,) * 8, (16,) * 8, 16)
    assert choose_route("auto", uniform, 1, None, costs, 65536).buckets is None
    assert choose_route("ordinary", skewed, 1, None, costs, 65536).buckets is None
    # n samples share their prompt's prefill: buckets group prompts
    two = choose_route("auto", PromptLayout((100, 2, 2), (100, 2, 2), 100), 2, None, costs, None)
    assert sorted(sorted(b) for b in two.buckets) == [[0], [1, 2]]


def test_packed_prefill_buckets_only_for_attention():
    """Packed: padded tokens cost nothing extra, so only attention GFLOPs against the group overhead
    decide; the HF prefill pays for padded tokens and buckets the same layout."""
    skewed = PromptLayout((512,) + (16,) * 31, (512,) + (16,) * 31, 512)
    token_bound = CostModel(prefill_fixed_cost_ms=5.0, prefill_token_cost_ms=0.01, prefill_attention_cost_ms=0.0,
                            prefill_group_cost_ms=1.0)
    assert len(choose_route("auto", skewed, 1, None, token_bound, None).buckets) == 2
    assert choose_route("auto", skewed, 1, None, token_bound, None, prefill="packed").buckets is None
    attention_bound = CostModel(prefill_fixed_cost_ms=50.0, prefill_token_cost_ms=0.0, prefill_attention_cost_ms=1.0,
                                prefill_group_cost_ms=0.5)
    packed = choose_route("auto", skewed, 1, None, attention_bound, None, prefill="packed")
    assert sorted(packed.bucket_lengths) == [16, 512]
    # the packed estimate of the single group is its group overhead plus its attention
    assert packed.estimates_ms["single"] == pytest.approx(0.5 + attention_bound.attention_gflops(32, 512))
    # variable-length attention per row: nothing to plan, whatever the costs; slots still decide
    assert choose_route("auto", skewed, 1, None, attention_bound, None, prefill="varlen").buckets is None
    assert choose_route("auto", skewed, 1, 8, attention_bound, None, prefill="varlen").route == "continuous"
    with pytest.raises(ValueError, match="prefill: must be one of"):
        choose_route("auto", skewed, 1, None, attention_bound, None, prefill="flash")


def test_short_similar_prompts_keep_one_prefill():
    """Seed 004's short-similar workload (20..13 repeated four times): one padded prefill."""
    spans = tuple(20 - (i % 8) for i in range(32))
    choice = choose_route("auto", PromptLayout(spans, spans, 20), 1, None, CostModel(), 65536)
    assert choice.route == "ordinary" and choice.buckets is None


@pytest.mark.parametrize("seed", range(100))
def test_auto_equals_the_full_comparison_and_its_bound_is_valid(seed):
    """Whatever Auto skips, the lower bound never exceeds a plan's cost, and the choice is the cheaper one."""
    import random
    rng = random.Random(seed)
    spans = [rng.randint(1, 600) for _ in range(rng.randint(2, 40))]
    n = rng.choice([1, 2, 4])
    costs = CostModel(prefill_fixed_cost_ms=rng.uniform(0, 30), prefill_token_cost_ms=rng.uniform(0, 0.2),
                      prefill_attention_cost_ms=rng.uniform(0, 0.05), prefill_kv_cost_ms=0.0)
    layout = PromptLayout(tuple(spans), tuple(spans), max(spans))
    choice = choose_route("auto", layout, n, None, costs, None)
    from rollout.plan.planner import plan_prefill_buckets
    plan = plan_prefill_buckets(spans, costs, None)
    # a prompt's n samples share its prefill: the costs count prompts
    planned = sum(costs.ordinary_prefill_cost_ms(len(b), max(spans[i] for i in b)) for b in plan.buckets)
    single = costs.ordinary_prefill_cost_ms(len(spans), max(spans))
    bound = costs.prefill_fixed_cost_ms + sum(costs.row_cost_ms(s) for s in spans)
    assert bound <= planned * (1 + 1e-12) + 1e-9
    expect_buckets = len(plan.buckets) > 1 and planned < single
    assert (choice.buckets is not None) == expect_buckets
    if choice.buckets is not None:  # every prompt exactly once, each bucket padded to its longest span
        prompts = sorted(p for b in choice.buckets for p in b)
        assert prompts == list(range(len(spans)))
        for bucket, length in zip(choice.buckets, choice.bucket_lengths):
            assert length == max(spans[p] for p in bucket)


def test_continuous_with_per_forward_zero3_is_rejected():
    with pytest.raises(ValueError, match="gather"):
        check_gather("continuous", "per_forward", True)
    check_gather("continuous", "once", True)
    check_gather("auto", "per_forward", False)


def test_mismatched_calibration_file_is_refused(model, tmp_path):
    from rollout.model.costs import calibration_metadata
    from rollout.plan.calibration import save_calibration
    meta = calibration_metadata(model, torch.device("cpu"), torch.bfloat16)  # the model runs in fp32
    save_calibration(tmp_path / "costs.json", CostModel(), meta)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None),
                 RolloutConfig(route="auto", routing=RoutingConfig(cost_model=str(tmp_path / "costs.json"))))
    ids, mask = _skewed([5, 2], seed=4)
    with pytest.raises(ValueError, match="dtype"):
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=2))


def test_continuous_route_decodes_through_the_fast_step_and_reports_it(model):
    ids, mask = _skewed([9, 3, 5], seed=5)
    fast = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="continuous"))
    slow = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="continuous", kernels=KernelConfig(
        fast_decode=False)))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, continuous_batch_size=2)
    assert torch.equal(fast.generate(RolloutRequest(ids, mask), sampling).input_ids,
                       slow.generate(RolloutRequest(ids, mask), sampling).input_ids)
    assert fast.last_stats.decode.path == "fast_eager" and slow.last_stats.decode.path == "hf"


def test_auto_keeps_the_ordinary_batch_for_eos_over_long_budgets():
    """Rows that fit at once stay in the ordinary batch, EOS or not (compaction retires finished rows;
    measured faster than continuous batching on the H200, docs/BENCHMARKS.md); only a slot bound below
    the number of rows sends a call to continuous batching."""
    layout = PromptLayout((16,) * 8, (16,) * 8, 16)
    costs = CostModel(**CHEAP_FIXED)
    assert choose_route("auto", layout, 4, None, costs, None).route == "ordinary"
    assert choose_route("auto", layout, 4, 32, costs, None).route == "ordinary"
    bounded = choose_route("auto", layout, 4, 31, costs, None)
    assert bounded.route == "continuous" and "32 rows exceed continuous_batch_size=31" in bounded.reason


@pytest.mark.parametrize("max_new, eos, slots, route", [(300, 2, None, "ordinary"), (300, None, None, "ordinary"),
                                                        (16, 2, None, "ordinary"), (300, 2, 1, "continuous")])
def test_engine_auto_route_follows_the_slot_bound(max_new, eos, slots, route):
    model = tiny_model("qwen2", seed=0, max_position_embeddings=1024)
    ids, mask = torch.randint(3, 500, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=eos), RolloutConfig(route="auto"))
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=max_new, temperature=0.0,
                                                          continuous_batch_size=slots))
    assert ro.last_stats.route == route
