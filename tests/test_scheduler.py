"""Continuous-batching scheduler: hand-written event tables, compaction maps and a randomised simulation."""

from __future__ import annotations

import random

import pytest

from rollout.plan.scheduler import Admission, ContinuousScheduler, SchedulerConfig, compaction

T, F = True, False


# ----------------------------------------------------------------------------- compaction

@pytest.mark.parametrize("retired, keep, moves", [
    ([], (), ()),
    ([F, F, F], (0, 1, 2), ()),
    ([T, T, T], (), ()),
    ([F, F, T], (0, 1), ()),
    ([T, F], (1,), ((1, 0),)),
    ([T, F, F, F], (3, 1, 2), ((3, 0),)),
    ([F, T, F, T, F], (0, 4, 2), ((4, 1),)),
    ([T, T, F, F, F, T], (3, 4, 2), ((3, 0), (4, 1))),
])
def test_compaction_map(retired, keep, moves):
    assert compaction(retired) == (keep, moves)


@pytest.mark.parametrize("seed", range(50))
def test_moves_applied_in_place_equal_the_gather(seed):
    rng = random.Random(seed)
    retired = [rng.random() < 0.4 for _ in range(rng.randint(0, 12))]
    keep, moves = compaction(retired)
    rows = [f"row{r}" for r in range(len(retired))]
    in_place = list(rows)
    for src, dst in reversed(moves):      # any order must do
        in_place[dst] = in_place[src]
    assert sorted(keep) == [r for r, gone in enumerate(retired) if not gone]
    assert in_place[:len(keep)] == [rows[k] for k in keep]
    assert all(src >= len(keep) > dst for src, dst in moves)


# ----------------------------------------------------------------------------- event tables
# Each step: (eos flags in, admitted [(id, first_row, n)], retired [(row, id, sample, generated, reason)],
#             keep, moves, rows after [(id, sample, generated)], completed)

ONE_SAMPLE_EACH = dict(
    config=SchedulerConfig(num_slots=3, max_new_tokens=3),
    requests=[("a", 5, 1), ("b", 6, 1), ("c", 7, 1), ("d", 8, 1), ("e", 9, 1)],
    steps=[
        ((), [("a", 0, 1), ("b", 1, 1), ("c", 2, 1)], [], (), (), [("a", 0, 0), ("b", 0, 0), ("c", 0, 0)], ()),
        ((F, T, F), [("d", 2, 1)], [(1, "b", 0, 1, "eos")], (0, 2), ((2, 1),),
         [("a", 0, 1), ("c", 0, 1), ("d", 0, 0)], ("b",)),
        ((F, F, F), [], [], (0, 1, 2), (), [("a", 0, 2), ("c", 0, 2), ("d", 0, 1)], ()),
        ((F, F, F), [("e", 1, 1)], [(0, "a", 0, 3, "budget"), (1, "c", 0, 3, "budget")], (2,), ((2, 0),),
         [("d", 0, 2), ("e", 0, 0)], ("a", "c")),
        ((T, F), [], [(0, "d", 0, 3, "eos")], (1,), ((1, 0),), [("e", 0, 1)], ("d",)),
        ((F,), [], [], (0,), (), [("e", 0, 2)], ()),
        ((F,), [], [(0, "e", 0, 3, "budget")], (), (), [], ("e",)),
    ],
)

GROUPS_FIFO = dict(
    config=SchedulerConfig(num_slots=4, max_new_tokens=10),
    requests=[("p", 3, 2), ("q", 4, 3), ("r", 5, 1)],
    steps=[
        # q needs 3 rows but only 2 are free: it waits, and r (which would fit) must not overtake it.
        ((), [("p", 0, 2)], [], (), (), [("p", 0, 0), ("p", 1, 0)], ()),
        ((T, F), [("q", 1, 3)], [(0, "p", 0, 1, "eos")], (1,), ((1, 0),),
         [("p", 1, 1), ("q", 0, 0), ("q", 1, 0), ("q", 2, 0)], ()),
        ((F, F, T, F), [("r", 3, 1)], [(2, "q", 1, 1, "eos")], (0, 1, 3), ((3, 2),),
         [("p", 1, 2), ("q", 0, 1), ("q", 2, 1), ("r", 0, 0)], ()),
        ((T, T, T, T), [], [(0, "p", 1, 3, "eos"), (1, "q", 0, 2, "eos"), (2, "q", 2, 2, "eos"),
                            (3, "r", 0, 1, "eos")], (), (), [], ("p", "q", "r")),
    ],
)

MIN_FREE_SLOTS = dict(
    config=SchedulerConfig(num_slots=3, max_new_tokens=5, min_free_slots=2),
    requests=[("a", 1, 1), ("b", 1, 1), ("c", 1, 1), ("d", 1, 1)],
    steps=[
        ((), [("a", 0, 1), ("b", 1, 1), ("c", 2, 1)], [], (), (), [("a", 0, 0), ("b", 0, 0), ("c", 0, 0)], ()),
        ((T, F, F), [], [(0, "a", 0, 1, "eos")], (2, 1), ((2, 0),), [("c", 0, 1), ("b", 0, 1)], ("a",)),
        ((F, T), [("d", 1, 1)], [(1, "b", 0, 2, "eos")], (0,), (), [("c", 0, 2), ("d", 0, 0)], ("b",)),
    ],
)


@pytest.mark.parametrize("table", [ONE_SAMPLE_EACH, GROUPS_FIFO, MIN_FREE_SLOTS],
                         ids=["one_sample_each", "groups_fifo", "min_free_slots"])
def test_event_table(table):
    scheduler = ContinuousScheduler(table["config"])
    for request_id, length, num_samples in table["requests"]:
        scheduler.submit(request_id, length, num_samples)
    lengths = {rid: length for rid, length, _ in table["requests"]}
    for index, (eos, admitted, retired, keep, moves, rows, completed) in enumerate(table["steps"]):
        update = scheduler.step(list(eos))
        assert [(a.request_id, a.first_row, a.num_samples) for a in update.admitted] == admitted, index
        assert update.prefill_lengths == tuple(lengths[rid] for rid, _, _ in admitted)
        assert [(r.row, r.request_id, r.sample_index, r.num_generated, r.reason) for r in update.retired] == retired
        assert (update.keep, update.moves, update.completed) == (keep, moves, completed), index
        assert [(s.request_id, s.sample_index, s.num_generated) for s in scheduler.rows()] == rows, index
        assert update.num_live == scheduler.num_live == len(rows)
        assert update.num_survivors + sum(a.num_samples for a in update.admitted) == update.num_live
    assert scheduler.idle or table is MIN_FREE_SLOTS


def test_per_request_budget_override_and_budget_of_one():
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=2, max_new_tokens=4))
    scheduler.submit("short", 3, max_new_tokens=1)     # prefill's token is its whole budget
    scheduler.submit("long", 3)
    scheduler.step()
    update = scheduler.step([F, F])
    assert [(r.request_id, r.num_generated, r.reason) for r in update.retired] == [("short", 1, "budget")]
    assert [s.max_new_tokens for s in scheduler.rows()] == [4]


def test_request_id_can_be_reused_after_completion():
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=1, max_new_tokens=1))
    scheduler.submit(7, 3)
    scheduler.step()
    assert scheduler.step([F]).completed == (7,)
    scheduler.submit(7, 4)
    assert scheduler.step().admitted == (Admission(7, 4, 0, 1),)


# ----------------------------------------------------------------------------- randomised simulation

def simulate(seed: int):
    """A fake runner: per-sample EOS positions; checks every update against its own row bookkeeping."""
    rng = random.Random(seed)
    num_slots = rng.randint(1, 8)
    config = SchedulerConfig(num_slots, max_new_tokens=rng.randint(1, 6), min_free_slots=rng.randint(1, num_slots))
    scheduler = ContinuousScheduler(config)
    requests = [(f"r{i}", rng.randint(1, 50), rng.randint(1, config.num_slots)) for i in range(rng.randint(0, 15))]
    eos_at = {}
    for rid, length, n in requests:
        scheduler.submit(rid, length, n)
        for s in range(n):
            eos_at[rid, s] = rng.choice([None, rng.randint(1, 8)])
    occupant, generated, admitted_order, finished, completed = [], {}, [], {}, []
    eos: list[bool] = []
    while True:
        update = scheduler.step(eos)
        for r in update.retired:
            assert occupant[r.row] == (r.request_id, r.sample_index)
            finished[r.request_id, r.sample_index] = (r.num_generated, r.reason)
        occupant = [occupant[k] for k in update.keep]
        for a in update.admitted:
            assert a.first_row == len(occupant)           # consecutive rows right after the survivors
            occupant += [(a.request_id, s) for s in range(a.num_samples)]
            admitted_order.append(a.request_id)
        assert len(occupant) == update.num_live <= config.num_slots
        assert [(s.request_id, s.sample_index) for s in scheduler.rows()] == occupant
        completed += update.completed
        if scheduler.idle:
            break
        eos = []
        for key in occupant:                               # each live row produces one token
            generated[key] = generated.get(key, 0) + 1
            eos.append(generated[key] == eos_at[key])
    return requests, config, eos_at, admitted_order, finished, completed


@pytest.mark.parametrize("seed", range(200))
def test_random_workloads_finish_every_sample_correctly(seed):
    requests, config, eos_at, admitted_order, finished, completed = simulate(seed)
    assert admitted_order == [rid for rid, _, _ in requests]          # FIFO
    assert sorted(completed) == sorted(admitted_order)
    for key, position in eos_at.items():
        budget = config.max_new_tokens
        if position is not None and position <= budget:
            assert finished[key] == (position, "eos")
        else:
            assert finished[key] == (budget, "budget")


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=0, max_new_tokens=4), "num_slots"),
    (dict(num_slots=2.0, max_new_tokens=4), "num_slots"),
    (dict(num_slots=2, max_new_tokens=0), "max_new_tokens"),
    (dict(num_slots=2, max_new_tokens=True), "max_new_tokens"),
    (dict(num_slots=2, max_new_tokens=4, min_free_slots=0), "min_free_slots"),
    (dict(num_slots=2, max_new_tokens=4, min_free_slots=3), "min_free_slots"),
])
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("args, kwargs, match", [
    (("x", 0), {}, "prompt_length"),
    (("x", 3.0), {}, "prompt_length"),
    (("x", 3), dict(num_samples=3), "num_samples"),
    (("x", 3), dict(num_samples=0), "num_samples"),
    (("x", 3), dict(max_new_tokens=0), "max_new_tokens"),
    (("dup", 3), {}, "request_id"),
])
def test_bad_submit_names_the_argument(args, kwargs, match):
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=2, max_new_tokens=4))
    scheduler.submit("dup", 1)
    with pytest.raises(ValueError, match=match):
        scheduler.submit(*args, **kwargs)


def test_eos_flags_must_cover_every_live_row():
    scheduler = ContinuousScheduler(SchedulerConfig(num_slots=2, max_new_tokens=4))
    scheduler.submit("a", 3)
    with pytest.raises(ValueError, match="eos"):
        scheduler.step([F])
    scheduler.step()
    with pytest.raises(ValueError, match="eos"):
        scheduler.step([F, F])
