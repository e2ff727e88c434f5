"""``RolloutRequest.row_max_new_tokens``: each output row's own budget, on every route and decode path.

Oracle: HF ``generate`` on each prompt alone with that row's budget (fp32, greedy); the rows that end early stop
costing decode steps (the routes' own counters); seeded samples equal the unbudgeted call's up to each budget."""

import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, RoutingConfig, SamplingConfig
from rollout.plan.planner import CostModel
from rollout.plan.scheduler import ContinuousScheduler, SchedulerConfig
from rollout.request import FINISH_BUDGET, FINISH_EOS
from rollout.stats import CallStats
from rollout.testing import TinyTokenizer, tiny_model
from tests.conftest import hf_greedy, response_of
from tests.test_routes import CHEAP_FIXED, _eos_for, _skewed

BUDGET = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=7)


def _rollout(model, route, tokenizer, **kernels):
    cfg = RolloutConfig(route=route, routing=RoutingConfig(cost_model=CostModel.from_model(model, **CHEAP_FIXED)),
                        kernels=KernelConfig(**kernels))
    return Rollout(model, tokenizer, cfg)


@pytest.mark.parametrize("route, slots", [("ordinary", None), ("continuous", None), ("continuous", 3),
                                          ("auto", None)])
@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "no_eos"])
def test_each_row_stops_at_its_budget_and_equals_hf_with_that_budget(model, route, slots, with_eos):
    ids, mask = _skewed([30, 3, 4, 2, 17, 5], seed=1)
    n = 2
    budgets = torch.tensor([1, 10, 3, 7, 2, 10, 5, 4, 9, 1, 6, 8])  # [B*n]
    eos = _eos_for(model, ids, mask) if with_eos else None
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    ro = _rollout(model, route, tok)
    batch = ro.generate(RolloutRequest(ids, mask, row_max_new_tokens=budgets),
                        SamplingConfig(max_new_tokens=BUDGET, temperature=0.0, n_samples_per_prompt=n,
                                       continuous_batch_size=slots, return_finish_reasons=True))
    reasons = batch.finish_reason_names()
    for row in range(ids.shape[0] * n):
        budget = int(budgets[row])
        expected = hf_greedy(model, ids[row // n], mask[row // n], budget, eos=eos)
        ended = eos is not None and eos in expected
        cut = expected.index(eos) + 1 if ended else len(expected)
        assert response_of(batch, row) == expected[:cut], f"row {row} (budget {budget})"
        assert reasons[row] == ("eos" if ended else "budget"), f"row {row}"
    assert batch.seq_len - ids.shape[1] == max(len(response_of(batch, r)) for r in range(batch.batch_size))


@pytest.mark.parametrize("route, fast_decode", [("ordinary", True), ("ordinary", False), ("continuous", True),
                                                 ("continuous", False)], ids=["ordinary", "ordinary-hf",
                                                                              "continuous", "continuous-hf"])
@pytest.mark.parametrize("budgets", [[3, 2, 4, 3], [1, 1, 1, 1]])
def test_rows_that_stop_early_stop_costing_decode_steps(model, route, fast_decode, budgets):
    ids, mask = _skewed([6, 5, 7, 4], seed=2)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    ro = _rollout(model, route, tok, fast_decode=fast_decode)
    full = ro.generate(RolloutRequest(ids, mask), sampling)
    full_steps = ro.last_stats.decode.num_steps
    short = ro.generate(RolloutRequest(ids, mask, row_max_new_tokens=torch.tensor(budgets)), sampling)
    assert full_steps == 12 and ro.last_stats.decode.num_steps == max(budgets)  # the longest budget, not the call's
    assert short.seq_len == ids.shape[1] + max(budgets)
    for row, budget in enumerate(budgets):
        assert response_of(short, row) == response_of(full, row)[:budget]


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_seeded_samples_equal_the_unbudgeted_calls_up_to_each_budget(model, route):
    ids, mask = _skewed([6, 3, 8], seed=3)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, n_samples_per_prompt=2, seed=11)
    ro = _rollout(model, route, tok)
    free = ro.generate(RolloutRequest(ids, mask), sampling)
    budgets = [2, 8, 5, 1, 7, 3]
    cut = ro.generate(RolloutRequest(ids, mask, row_max_new_tokens=torch.tensor(budgets)), sampling)
    for row, budget in enumerate(budgets):
        assert response_of(cut, row) == response_of(free, row)[:budget]


def test_finish_reasons_ignore_eos_tokens_past_a_rows_budget(model):
    ids, mask = _skewed([6, 5], seed=4)
    eos = _eos_for(model, ids, mask)  # row 0 emits it at token 4 in a free run
    ro = _rollout(model, "continuous", TinyTokenizer(pad_token_id=0, eos_token_id=eos))
    batch = ro.generate(RolloutRequest(ids, mask, row_max_new_tokens=torch.tensor([2, 10])),
                        SamplingConfig(max_new_tokens=10, temperature=0.0, return_finish_reasons=True))
    assert batch.finish_reasons[0].item() == FINISH_BUDGET
    assert len(response_of(batch, 0)) == 2
    expected = hf_greedy(model, ids[1], mask[1], 10, eos=eos)
    assert batch.finish_reasons[1].item() == (FINISH_EOS if eos in expected else FINISH_BUDGET)


@pytest.mark.parametrize("budgets, match", [
    (torch.tensor([1, 2, 3]), r"row_max_new_tokens: needs one budget per output row \(B\*n = 2\*1 = 2\); got 3"),
    (torch.tensor([0, 2]), r"row_max_new_tokens: every budget must be in \[1, max_new_tokens=4\]; got 0"),
    (torch.tensor([2, 5]), r"row_max_new_tokens: every budget must be in \[1, max_new_tokens=4\]; got 5"),
])
def test_bad_budgets_are_refused_before_any_work(model, budgets, match):
    ids, mask = _skewed([3, 2], seed=5)
    ro = _rollout(model, "auto", TinyTokenizer(pad_token_id=0, eos_token_id=None))
    with pytest.raises(ValueError, match=match):
        ro.generate(RolloutRequest(ids, mask, row_max_new_tokens=budgets), SamplingConfig(max_new_tokens=4))
    assert ro.last_stats == CallStats()  # no call ran


@pytest.mark.parametrize("value", [torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), [1, 2],
                                   torch.tensor([True, False])])
def test_budgets_that_are_not_a_1d_integer_tensor_are_refused(value):
    ids, mask = _skewed([3, 2], seed=5)
    with pytest.raises(ValueError, match="row_max_new_tokens: must be None or a 1-D integer tensor"):
        RolloutRequest(ids, mask, row_max_new_tokens=value)


def test_scheduler_retires_each_sample_at_its_own_budget():
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=4, max_new_tokens=9))
    scheduler.submit("a", 3, 2, max_new_tokens=(1, 3))
    scheduler.submit("b", 2, 2)
    scheduler.step()
    assert [r.max_new_tokens for r in scheduler.rows()] == [1, 3, 9, 9]
    update = scheduler.step([False] * 4)  # every row has one token: a's sample 0 is done
    assert [(r.request_id, r.sample_index, r.reason) for r in update.retired] == [("a", 0, "budget")]
    scheduler.step([False] * 3)
    update = scheduler.step([False] * 3)
    assert [(r.request_id, r.sample_index, r.num_generated) for r in update.retired] == [("a", 1, 3)]
    with pytest.raises(ValueError, match="one such int per sample"):
        scheduler.submit("c", 2, 2, max_new_tokens=(1,))
