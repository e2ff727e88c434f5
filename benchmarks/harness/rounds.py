"""Interleaved rounds: which candidate runs when, with which seed, and the wall timer around each timed call.

Every benchmark times its candidates the same way:

- a warm-up first: each candidate ``warmup`` untimed calls per seed the rounds will draw, so no timed call
  meets a batch shape (compile, graph capture, allocator growth) first;
- then ``rounds`` timed rounds whose order alternates, A B C, then C B A, ... (:func:`round_order`), so no
  candidate always sits in the same place or follows the same one, and drift hits all alike;
- round ``r`` draws seed ``base_seed + r % seeds`` for every candidate of the round (:meth:`Rounds.seed`), so
  means over the rounds average the drawn tokens (and realised lengths) out while candidates stay paired;
- the timer synchronises the device before and after each timed call (:class:`Timer`).

:func:`schedule` is the plan as data (tested without running anything); :func:`run_rounds` walks it with the
benchmark's own call, :func:`time_rounds` with a plain timer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Sequence, TypeVar

T = TypeVar("T")


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order of one timed round: as given in even rounds, reversed in odd ones (A B C, C B A, A B C ...).

    With a fixed order, seed 004's 16..512 ran 3.5-4.5% slower at the default than its twin that always ran last;
    with rounds alternating the gap stayed (157.0 against 149.3 ms), so the order was not its cause, but no
    candidate is favoured by its place any more (docs/BENCHMARKS.md, 2026-12-02)."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


@dataclass(frozen=True)
class Rounds:
    """How a benchmark's candidates are timed."""

    rounds: int
    """Timed rounds (each candidate once a round)."""
    warmup: int = 1
    """Untimed calls per candidate and seed before the first timed round."""
    seeds: int = 1
    """Seeds the rounds cycle through (round ``r``: ``base_seed + r % seeds``)."""
    base_seed: Optional[int] = None
    """None: the calls draw with their own seed (every call the same); then ``seeds`` must be 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds: must be an int >= 1; got {self.rounds!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: must be an int >= 0; got {self.warmup!r}")
        if not isinstance(self.seeds, int) or not 1 <= self.seeds <= self.rounds:
            raise ValueError(f"seeds: must be an int in 1..rounds ({self.rounds}); got {self.seeds!r}")
        if self.base_seed is None and self.seeds > 1:
            raise ValueError(f"seeds: {self.seeds} seeds need a base_seed to count from")

    def seed(self, round_index: int) -> Optional[int]:
        """The seed every candidate of round ``round_index`` draws with (None: the call's own)."""
        return None if self.base_seed is None else self.base_seed + round_index % self.seeds

    def warmup_seeds(self) -> list[Optional[int]]:
        """The seeds of one candidate's warm-up calls: every seed of the rounds, ``warmup`` times each."""
        return [self.seed(s) for s in range(self.seeds) for _ in range(self.warmup)]


@dataclass(frozen=True)
class Call:
    """One call of the plan."""

    item: object
    seed: Optional[int]
    round: Optional[int]
    """The timed round, or None for a warm-up call."""

    @property
    def timed(self) -> bool:
        return self.round is not None


def schedule(items: Sequence[T], rounds: Rounds) -> list[Call]:
    """Every call, in order: each item's warm-up calls (item by item), then the timed rounds."""
    calls = [Call(item, seed, None) for item in items for seed in rounds.warmup_seeds()]
    for r in range(rounds.rounds):
        calls += [Call(item, rounds.seed(r), r) for item in round_order(items, r)]
    return calls


def run_rounds(items: Sequence[T], rounds: Rounds, call: Callable[[T, Optional[int], bool], None]) -> None:
    """``call(item, seed, timed)`` for every call of :func:`schedule`: the benchmark times and records the
    timed ones its own way (peak memory, realised lengths, errors)."""
    for planned in schedule(items, rounds):
        call(planned.item, planned.seed, planned.timed)


def _sync_for(device: str) -> Callable[[], None]:
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


class Timer:
    """Wall milliseconds of a call, the device synchronised before and after it (CUDA: queued work is done
    before the clock starts and counted before it stops). ``clock`` and ``sync`` may be replaced (tests)."""

    def __init__(self, device: str = "cpu", clock: Callable[[], float] = time.perf_counter,
                 sync: Optional[Callable[[], None]] = None):
        self.clock = clock
        self.sync = sync if sync is not None else _sync_for(device)

    def __call__(self, fn: Callable[[], T]) -> tuple[float, T]:
        self.sync()
        start = self.clock()
        out = fn()
        self.sync()
        return (self.clock() - start) * 1000.0, out


def time_rounds(candidates: Mapping[Hashable, Callable], rounds: Rounds, timer: Timer) -> dict[Hashable, list[float]]:
    """Wall ms of every timed call per candidate, in round order. A candidate is called with the round's seed when
    ``rounds.base_seed`` is set, else without arguments."""
    times: dict[Hashable, list[float]] = {name: [] for name in candidates}

    def call(name, seed, timed):
        fn = candidates[name] if seed is None else (lambda: candidates[name](seed))
        if timed:
            times[name].append(timer(fn)[0])
        else:
            fn()

    run_rounds(list(candidates), rounds, call)
    return times
