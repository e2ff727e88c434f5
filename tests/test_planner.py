"""The prefill planner against exhaustive enumeration, and its cost model (the route decision that
uses it is tested in tests/test_routes.py)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from rollout.plan.planner import (
    DEFAULT_MAX_TOKENS, CostModel, PrefillPlan, plan_prefill_buckets, reference_plan_prefill_buckets,
)

QWEN25_3B = dict(num_layers=36, num_query_heads=16, num_kv_heads=2, head_dim=128, element_bytes=2)
LONG_TAIL = [512] + [16] * 31


# ----------------------------------------------------------------------------- oracles (independent)

def seed_cost_ms(cm: CostModel, batch: int, length: int, kv: bool = True) -> float:
    """The seed PR's formula written out from its text, term by term."""
    gflops = 4 * batch * length ** 2 * cm.num_layers * cm.num_query_heads * cm.head_dim / 1e9
    mib = 2 * batch * length * cm.num_layers * cm.num_kv_heads * cm.head_dim * cm.element_bytes / 2 ** 20
    return (cm.prefill_fixed_cost_ms + cm.prefill_token_cost_ms * batch * length
            + cm.prefill_attention_cost_ms * gflops + (cm.prefill_kv_cost_ms * mib if kv else 0.0))


def set_partitions(items):
    """Every partition of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first]] + partition
        for k in range(len(partition)):
            yield partition[:k] + [[first] + partition[k]] + partition[k + 1:]


def group_cost(cm, lengths, group, max_tokens):
    longest = max(lengths[i] for i in group)
    if max_tokens is not None and len(group) * longest > max_tokens:
        return math.inf
    return seed_cost_ms(cm, len(group), longest)


def best_over_all_partitions(cm, lengths, max_tokens):
    partitions = set_partitions(list(range(len(lengths))))
    return min(sum(group_cost(cm, lengths, g, max_tokens) for g in p) for p in partitions)


def best_over_sorted_runs(cm, lengths, max_tokens):
    """Minimum over all 2^(n-1) ways to cut the length-sorted order into contiguous runs."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    best = math.inf
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for cut, index in zip(cuts, order[1:]):
            if cut:
                groups.append(current)
                current = []
            current.append(index)
        groups.append(current)
        best = min(best, sum(group_cost(cm, lengths, g, max_tokens) for g in groups))
    return best


def random_cost_model(rng: random.Random) -> CostModel:
    return CostModel(prefill_fixed_cost_ms=rng.choice([0.0, rng.uniform(0, 60)]),
                     prefill_token_cost_ms=rng.uniform(0, 0.3),
                     prefill_attention_cost_ms=rng.choice([0.0, rng.uniform(0, 0.05)]),
                     prefill_kv_cost_ms=rng.choice([0.0, rng.uniform(0, 0.2)]),
                     continuous_decode_cost_ms=rng.uniform(0, 20),
                     num_layers=rng.randint(1, 40), num_query_heads=rng.randint(1, 32),
                     num_kv_heads=rng.randint(1, 8), head_dim=rng.choice([32, 64, 128]),
                     element_bytes=rng.choice([1, 2, 4]))


def random_case(seed: int, max_n: int):
    rng = random.Random(seed)
    n = rng.randint(1, max_n)
    top = rng.choice([3, 40, 2048])
    lengths = [rng.randint(1, top) for _ in range(n)]
    max_tokens = rng.choice([None, DEFAULT_MAX_TOKENS, max(lengths), max(lengths) * rng.randint(2, n + 1)])
    return lengths, random_cost_model(rng), max_tokens


def assert_valid_plan(plan: PrefillPlan, lengths, cm, max_tokens):
    flat = [i for bucket in plan.buckets for i in bucket]
    assert sorted(flat) == list(range(len(lengths)))
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))   # contiguous in sorted order
    for bucket in plan.buckets:
        assert max_tokens is None or len(bucket) * max(lengths[i] for i in bucket) <= max_tokens
    expected = sum(seed_cost_ms(cm, len(b), max(lengths[i] for i in b)) for b in plan.buckets)
    assert plan.cost_ms == pytest.approx(expected, rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------- planner optimality

@pytest.mark.parametrize("seed", range(150))
def test_plan_equals_best_of_all_set_partitions(seed):
    lengths, cm, max_tokens = random_case(seed, max_n=7)
    plan = plan_prefill_buckets(lengths, cm, max_tokens)
    assert_valid_plan(plan, lengths, cm, max_tokens)
    assert plan.cost_ms == pytest.approx(best_over_all_partitions(cm, lengths, max_tokens), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(150))
def test_plan_equals_best_of_all_sorted_runs(seed):
    lengths, cm, max_tokens = random_case(1000 + seed, max_n=12)
    plan = plan_prefill_buckets(lengths, cm, max_tokens)
    assert_valid_plan(plan, lengths, cm, max_tokens)
    assert plan.cost_ms == pytest.approx(best_over_sorted_runs(cm, lengths, max_tokens), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_plan_equals_reference_dp_on_larger_inputs(seed):
    lengths, cm, max_tokens = random_case(5000 + seed, max_n=200)
    plan = plan_prefill_buckets(lengths, cm, max_tokens)
    assert_valid_plan(plan, lengths, cm, max_tokens)
    assert plan.cost_ms == pytest.approx(reference_plan_prefill_buckets(lengths, cm, max_tokens).cost_ms, rel=1e-9)


@pytest.mark.parametrize("seed", range(300))
def test_tie_breaking_matches_reference_exactly(seed):
    """Integer costs (no attention/KV terms) make float sums exact and ties frequent: buckets must match."""
    rng = random.Random(9000 + seed)
    lengths = [rng.randint(1, rng.choice([2, 4, 9])) for _ in range(rng.randint(1, 40))]
    cm = CostModel(prefill_fixed_cost_ms=rng.randint(0, 12), prefill_token_cost_ms=rng.randint(0, 3),
                   prefill_attention_cost_ms=0, prefill_kv_cost_ms=0)
    max_tokens = rng.choice([None, max(lengths), max(lengths) * rng.randint(2, 8)])
    plan = plan_prefill_buckets(lengths, cm, max_tokens)
    assert plan == reference_plan_prefill_buckets(lengths, cm, max_tokens)
    if len(lengths) <= 12:
        assert plan.cost_ms == best_over_sorted_runs(cm, lengths, max_tokens)


@pytest.mark.parametrize("lengths, max_tokens, expected", [
    ([5, 5, 5, 5], None, ((0, 1, 2, 3),)),                     # all ties: one bucket
    ([5, 5, 5, 5], 10, ((0, 1), (2, 3))),                      # limit forces pairs
    ([5, 5, 5, 5, 5], 10, ((0,), (1, 2), (3, 4))),             # remainder first: later buckets are large
])
def test_ties_with_zero_fixed_cost_prefer_large_late_buckets(lengths, max_tokens, expected):
    cm = CostModel(prefill_fixed_cost_ms=0.0, prefill_token_cost_ms=1.0, prefill_attention_cost_ms=0.0,
                   prefill_kv_cost_ms=0.0)
    assert plan_prefill_buckets(lengths, cm, max_tokens).buckets == expected


def test_indices_inside_a_bucket_ascend_by_length_then_index():
    assert plan_prefill_buckets([3, 1, 2, 1], CostModel()).buckets == ((1, 3, 2, 0),)


def test_seed_long_tail_example_gives_two_buckets():
    plan = plan_prefill_buckets(LONG_TAIL, CostModel())
    assert plan.buckets == (tuple(range(1, 32)), (0,))
    assert plan.cost_ms == pytest.approx(seed_cost_ms(CostModel(), 31, 16) + seed_cost_ms(CostModel(), 1, 512))


def test_prompts_at_the_token_limit_get_one_bucket_each():
    plan = plan_prefill_buckets([65536] * 4, CostModel())
    assert plan.buckets == ((0,), (1,), (2,), (3,))


def test_empty_lengths_give_an_empty_plan():
    assert plan_prefill_buckets([], CostModel()) == PrefillPlan(buckets=(), cost_ms=0.0)


def test_numpy_integer_lengths_are_accepted():
    np = pytest.importorskip("numpy")
    assert plan_prefill_buckets(np.array(LONG_TAIL), CostModel()) == plan_prefill_buckets(LONG_TAIL, CostModel())


@pytest.mark.parametrize("lengths, max_tokens, match", [
    ([4, 0], None, r"lengths\[1\]"),
    ([-3], None, r"lengths\[0\]"),
    ([2.0], None, r"lengths\[0\]"),
    ([True], None, r"lengths\[0\]"),
    (["7"], None, r"lengths\[0\]"),
    ([3, 70000], DEFAULT_MAX_TOKENS, r"lengths\[1\]=70000 exceeds max_tokens"),
    ([3], 0, "max_tokens"),
    ([3], 2.5, "max_tokens"),
])
def test_bad_planner_input_names_the_argument(lengths, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        plan_prefill_buckets(lengths, CostModel(), max_tokens)


# ----------------------------------------------------------------------------- cost model

@pytest.mark.parametrize("batch, length", [(1, 1), (1, 512), (31, 16), (32, 512), (7, 4096)])
def test_prefill_cost_matches_the_seed_formula(batch, length):
    cm = CostModel()
    assert cm.prefill_cost_ms(batch, length) == pytest.approx(seed_cost_ms(cm, batch, length), rel=1e-12)
    assert cm.ordinary_prefill_cost_ms(batch, length) == pytest.approx(seed_cost_ms(cm, batch, length, kv=False))
    assert cm.prefill_fixed_cost_ms + batch * cm.row_cost_ms(length) == pytest.approx(
        seed_cost_ms(cm, batch, length), rel=1e-12)


def test_default_kv_and_attention_figures():
    cm = CostModel()   # Qwen2.5-3B geometry, bf16: 36 KiB of KV per token, 294,912 attention FLOPs per L^2
    assert cm.kv_mib(1, 1) == pytest.approx(36 * 1024 / 2 ** 20)
    assert cm.attention_gflops(1, 1000) == pytest.approx(294912 * 1e6 / 1e9)


@pytest.mark.parametrize("field", ["prefill_fixed_cost_ms", "prefill_token_cost_ms", "prefill_attention_cost_ms",
                                   "prefill_kv_cost_ms", "continuous_decode_cost_ms"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "1", True, None])
def test_bad_coefficient_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: value})


@pytest.mark.parametrize("field", list(QWEN25_3B))
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_bad_geometry_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: value})


def test_zero_coefficients_are_allowed():
    cm = CostModel(prefill_fixed_cost_ms=0, prefill_kv_cost_ms=0.0, continuous_decode_cost_ms=0)
    assert cm.prefill_cost_ms(2, 3) == pytest.approx(seed_cost_ms(cm, 2, 3), rel=1e-12)
    assert cm.prefill_cost_ms(2, 3) > 0


def test_json_round_trip_and_unknown_keys():
    cm = CostModel(prefill_fixed_cost_ms=28.8, num_layers=2, element_bytes=4)
    assert CostModel.from_dict(json.loads(json.dumps(cm.to_dict()))) == cm
    with pytest.raises(ValueError, match="unknown CostModel fields"):
        CostModel.from_dict({**cm.to_dict(), "prefill_max_tokens": 1})


def test_from_model_reads_geometry_and_dtype():
    torch = pytest.importorskip("torch")
    from rollout.testing import tiny_config, tiny_model

    model = tiny_model("qwen2", dtype=torch.bfloat16)   # hidden 64, 4 heads, 2 KV heads, 2 layers
    cm = CostModel.from_model(model, prefill_fixed_cost_ms=3.0)
    assert (cm.num_layers, cm.num_query_heads, cm.num_kv_heads, cm.head_dim, cm.element_bytes) == (2, 4, 2, 16, 2)
    assert cm.prefill_fixed_cost_ms == 3.0 and cm.prefill_token_cost_ms == CostModel().prefill_token_cost_ms
    assert CostModel.from_model(tiny_model("llama")).element_bytes == 4
    assert CostModel.from_model(tiny_config("llama"), dtype=torch.float16).num_kv_heads == 4
    assert CostModel.from_model(tiny_config("qwen2", head_dim=32), dtype="bfloat16").head_dim == 32


def test_from_model_errors_name_the_argument():
    from rollout.testing import tiny_config

    with pytest.raises(ValueError, match="dtype"):
        CostModel.from_model(tiny_config("qwen2"))      # a bare config carries no dtype here
    with pytest.raises(ValueError, match="coefficients"):
        CostModel.from_model(tiny_config("qwen2"), dtype="float32", prefill_fixd_cost_ms=1.0)
    with pytest.raises(ValueError, match="model_or_config"):
        CostModel.from_model(object(), dtype="float32")
