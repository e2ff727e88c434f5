"""The ordinary route at RL scale: one prefill per prompt shared by its samples, and a batch that shrinks
(compaction into a smaller batch bucket) as rows finish."""

from collections import Counter

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig, RoutingConfig
from rollout.executors.ordinary.order import RowOrder
from rollout.plan.layout import PromptLayout
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, 9, min_len=1, seed=3)


@pytest.fixture(scope="module")
def frequent_eos(model, prompts):
    """Three tokens the free-running model emits often: rows end at many different steps."""
    free = Rollout(model, NO_EOS).generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=30,
                                                                                   temperature=0.0))
    counts = Counter(free.input_ids[:, 9:].flatten().tolist())
    return [token for token, _ in counts.most_common(6)][3:6]


def _lengths(batch, prompt_len):
    return batch.attention_mask[:, prompt_len:].sum(1).tolist()


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=30, temperature=0.0, n_samples_per_prompt=3),
    SamplingConfig(max_new_tokens=30, temperature=1.0, top_p=0.9, top_k=200, seed=5, n_samples_per_prompt=3,
                   repetition_penalty=1.3),
], ids=["greedy", "sampled"])
def test_compaction_keeps_every_token(model, prompts, frequent_eos, sampling):
    """Rows ending at different steps: the static path compacts the batch into smaller buckets; its tokens
    equal the HF-layer path's (which never compacts) and the continuous route's."""
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=frequent_eos)
    fast = Rollout(model, tok, RolloutConfig())
    got = fast.generate(RolloutRequest(*prompts), sampling)
    hf = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(fast_decode=False)))
    want = hf.generate(RolloutRequest(*prompts), sampling)
    continuous = Rollout(model, tok, RolloutConfig(route="continuous")).generate(RolloutRequest(*prompts), sampling)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.attention_mask, want.attention_mask)
    assert torch.equal(got.input_ids, continuous.input_ids)
    assert len(set(_lengths(got, 9))) > 3  # the rows really end at different steps
    stats = fast.last_stats
    if sampling.is_greedy:  # greedy rows end early enough to shrink the 64-row bucket
        assert stats.cache.compactions >= 1 and stats.cache.row_moves > 0 and stats.cache.bytes_moved > 0
        assert stats.decode.rows < hf.last_stats.decode.rows  # finished rows stopped costing
        for row in range(0, 60, 7):
            expected = hf_greedy(model, prompts[0][row // 3], prompts[1][row // 3], 30, eos=frequent_eos)
            assert response_of(got, row) == expected[:len(response_of(got, row))], f"row {row}"


def test_compaction_checks_once_per_eos_check_interval(model, prompts, frequent_eos):
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=frequent_eos)
    sampling = SamplingConfig(max_new_tokens=30, temperature=0.0, n_samples_per_prompt=3)
    every = Rollout(model, tok, RolloutConfig())
    sparse = Rollout(model, tok, RolloutConfig(routing=RoutingConfig(eos_check_interval=4)))
    assert torch.equal(every.generate(RolloutRequest(*prompts), sampling).input_ids,
                       sparse.generate(RolloutRequest(*prompts), sampling).input_ids)
    assert sparse.last_stats.decode.host_syncs < every.last_stats.decode.host_syncs
    assert sparse.last_stats.decode.host_syncs <= -(-every.last_stats.decode.num_steps // 4)


def test_samples_share_one_prefill_per_prompt(model, prompts):
    """n = 4 samples of each prompt: one prefill per prompt (prefill_rows = prompts), and greedy sample rows
    equal the n = 1 run's row of their prompt."""
    ids, mask = prompts
    many = Rollout(model, NO_EOS)
    got = many.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0,
                                                                  n_samples_per_prompt=4))
    assert many.last_stats.prefill.rows == 20 and got.batch_size == 80
    one = Rollout(model, NO_EOS).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6,
                                                                                    temperature=0.0))
    assert torch.equal(got.input_ids, one.input_ids.repeat_interleave(4, dim=0))


@pytest.mark.parametrize("fast_prefill", [True, False])
def test_shared_prefill_with_planned_buckets(model, fast_prefill):
    """Skewed prompts that Auto buckets: the buckets group prompts, every sample row gets its prompt's keys."""
    from rollout.plan.planner import CostModel
    ids, mask = random_prompts(6, 40, min_len=1, seed=11)
    mask[1:, :30] = 0  # one long prompt, five short ones
    ids[1:, :30] = 0
    costs = CostModel.from_model(model, prefill_fixed_cost_ms=0.0, prefill_group_cost_ms=0.0,
                                 prefill_attention_cost_ms=10.0)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0, n_samples_per_prompt=2)
    auto = Rollout(model, NO_EOS, RolloutConfig(
        route="auto", routing=RoutingConfig(cost_model=costs), kernels=KernelConfig(fast_prefill=fast_prefill)))
    got = auto.generate(RolloutRequest(ids, mask), sampling)
    assert auto.last_stats.prefill.buckets >= 2 and auto.last_stats.prefill.rows == 6
    for row in range(12):
        assert response_of(got, row) == hf_greedy(model, ids[row // 2], mask[row // 2], 5), f"row {row}"


def test_row_order_fans_prompts_out_to_adjacent_rows():
    layout = PromptLayout((5, 2, 9), (5, 2, 8), 9)
    order = RowOrder.plan(layout, 2, [(1,), (0, 2)], [2, 9])
    assert order.prompt_order == (1, 0, 2) and order.row_order == (2, 3, 0, 1, 4, 5)
    assert order.groups == ((0, 1, 2), (1, 3, 9)) and order.group_spans(9) == [(0, 1, 2), (1, 3, 9)]
    assert order.prompt_rows.real_counts == (2, 5, 8) and order.prompt_rows.first_cols == (7, 4, 0)
    plain = RowOrder.plan(layout, 3)
    assert plain.row_order is None and plain.group_spans(9) == [(0, 3, 9)]


def test_continuous_refills_come_in_waves(model, prompts, frequent_eos, monkeypatch):
    """Admissions wait until an eighth of the slots is free: fewer prefill passes, the same tokens."""
    from rollout.executors.continuous import loop
    from rollout.plan.layout import refill_threshold
    assert (refill_threshold(32, 1), refill_threshold(32, 4), refill_threshold(3, 2), refill_threshold(4, 8)) == \
        (4, 4, 2, 4)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=frequent_eos)
    sampling = SamplingConfig(max_new_tokens=30, temperature=0.0, continuous_batch_size=16)
    # EOS checks every step: with the default (every 4th) retirements already come 4 steps apart
    config = RolloutConfig(route="continuous", routing=RoutingConfig(eos_check_interval=1))
    waves = Rollout(model, tok, config)
    got = waves.generate(RolloutRequest(*prompts), sampling)
    monkeypatch.setattr(loop, "refill_threshold", lambda slots, n: n)
    eager = Rollout(model, tok, config)
    assert torch.equal(eager.generate(RolloutRequest(*prompts), sampling).input_ids, got.input_ids)
    assert waves.last_stats.plans < eager.last_stats.plans


@pytest.mark.parametrize("late", [True, False])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_late_eos_count_cuts_the_overrun_steps(model, prompts, interval, late):
    """The static loop reads each EOS check's finished count one check late. Every row ending early (its
    EOS ids: each row's 2nd to 4th free-run tokens), the output still ends where an up-to-date check ends
    it: equal to the HF-layer path's (which checks at once), over budgets that end the call at a check and
    at the budget; the steps run after the last row ended are counted, never output. ``late_eos_count=False``
    reads each count at once: no step runs past the end."""
    free = Rollout(model, NO_EOS).generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=4,
                                                                                   temperature=0.0))
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=sorted(set(free.input_ids[:, 10:13].flatten().tolist())))
    overruns = []
    for max_new in range(2, 9):
        sampling = SamplingConfig(max_new_tokens=max_new, temperature=0.0)
        fast = Rollout(model, tok, RolloutConfig(routing=RoutingConfig(
            eos_check_interval=interval, late_eos_count=late)))
        got = fast.generate(RolloutRequest(*prompts), sampling)
        want = Rollout(model, tok, RolloutConfig(kernels=KernelConfig(fast_decode=False), routing=RoutingConfig(
            eos_check_interval=interval))).generate(
            RolloutRequest(*prompts), sampling)
        assert fast.last_stats.decode.path == "fast_eager"
        assert torch.equal(got.input_ids, want.input_ids), (interval, max_new)
        assert torch.equal(got.attention_mask, want.attention_mask), (interval, max_new)
        stats = fast.last_stats
        assert stats.decode.forwards == stats.decode.num_steps - 1 + stats.decode.eos_overrun_steps
        overruns.append(stats.decode.eos_overrun_steps)
    assert max(overruns) >= 1 if late else max(overruns) == 0  # late: some call ran past the end and cut it
    assert _lengths(got, 9) and max(_lengths(got, 9)) <= 4  # precondition: every row ended within 4 tokens


def test_lagged_reads_take_in_posting_order():
    from rollout.ops.host import LaggedReads
    reads = LaggedReads(torch.device("cpu"))
    reads.post(torch.tensor(3), "a")
    reads.post(torch.tensor(5), ("b", 1))
    with pytest.raises(RuntimeError, match="none taken"):
        reads.post(torch.tensor(7))
    assert (len(reads), reads.take(), len(reads)) == (2, (3, "a"), 1)
    reads.post(torch.tensor(7), "c")  # into the slot "a" held
    assert [reads.take(), reads.take()] == [(5, ("b", 1)), (7, "c")] and not reads
