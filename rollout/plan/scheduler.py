"""Continuous-batching bookkeeping for a fixed number of cache rows (pure Python, no torch).

The scheduler owns which request sample lives in which row of the aligned KV cache. Live rows are
always the contiguous prefix ``[0, num_live)``. Requests wait in a FIFO queue; a request with
``num_samples = n`` is admitted whole into ``n`` consecutive free rows (so one shared prefill can be
copied into them), and only when the request at the head of the queue fits (strict FIFO: nothing
overtakes it). Each sample retires on its own at EOS or when it reaches its token budget (one per request,
or one per sample).

Loop contract: every ``step`` call means "each row that was live after the previous update has
produced exactly one more token", the first token of a newly admitted row coming from its
prefill. A runner therefore does, per iteration::

    update = scheduler.step(eos)              # eos[r]: did live row r's newest token end it?
    copy cache rows per update.moves          # compaction; survivors keep their tokens
    decode rows [0, update.num_survivors)     # one token each
    prefill update.admitted into their rows   # e.g. plan_prefill_buckets(update.prefill_lengths)
    eos = <one flag per row in [0, update.num_live)>   # one host sync

The first call is ``step()`` with no live rows; the run is over when ``scheduler.idle``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

from rollout.checks import is_int

REASON_EOS = "eos"
REASON_BUDGET = "budget"


@dataclass(frozen=True)
class SchedulerConfig:
    """Shape of the continuous batch."""

    num_slots: int
    """Rows of the KV cache (maximum samples decoding at once), > 0."""
    max_new_tokens: int
    """Default token budget per sample (>= 1); ``submit`` may override it per request."""
    min_free_slots: int = 1
    """Refill only once at least this many rows are free (1..num_slots): fewer, larger prefill batches."""

    def __post_init__(self) -> None:
        if not is_int(self.num_slots) or self.num_slots <= 0:
            raise ValueError(f"num_slots: must be an int > 0; got {self.num_slots!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an int >= 1; got {self.max_new_tokens!r}")
        if not is_int(self.min_free_slots) or not 1 <= self.min_free_slots <= self.num_slots:
            raise ValueError(f"min_free_slots: must be an int in [1, num_slots={self.num_slots}]; "
                             f"got {self.min_free_slots!r}")


@dataclass(frozen=True)
class Admission:
    """A request admitted this step: prefill it once and give its samples rows ``first_row ..``."""

    request_id: Hashable
    prompt_length: int
    """Unpadded prompt tokens."""
    first_row: int
    """Row of sample 0; sample ``s`` lives in row ``first_row + s`` (after this step's compaction)."""
    num_samples: int

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.num_samples)


@dataclass(frozen=True)
class Retirement:
    """A sample that finished this step."""

    row: int
    """Its row *before* this step's compaction."""
    request_id: Hashable
    sample_index: int
    num_generated: int
    """Tokens it produced, the final (EOS) token included."""
    reason: str
    """``"eos"`` or ``"budget"`` (EOS wins when both hold)."""


@dataclass(frozen=True)
class RowState:
    """What occupies one live row."""

    request_id: Hashable
    sample_index: int
    num_generated: int
    max_new_tokens: int


@dataclass(frozen=True)
class SchedulerUpdate:
    """The outcome of one ``step``: retirements, the compaction, then admissions into the freed rows."""

    retired: tuple[Retirement, ...]
    keep: tuple[int, ...]
    """New row ``r`` (``r < num_survivors``) holds what old row ``keep[r]`` held (a gather index)."""
    moves: tuple[tuple[int, int], ...]
    """``(src, dst)`` row copies doing that compaction; every src >= num_survivors > every dst, so the
    copies never overlap and may run in any order (or as one indexed copy)."""
    admitted: tuple[Admission, ...]
    """FIFO order; their rows are ``[num_survivors, num_live)``, consecutive per request. Apply ``moves``
    before writing them: a move's source row may be an admitted request's row."""
    completed: tuple[Hashable, ...]
    """Requests whose last sample retired this step."""
    num_live: int
    """Live rows after admission."""

    @property
    def num_survivors(self) -> int:
        """Rows that were live before and still are: ``[0, num_survivors)`` after compaction."""
        return len(self.keep)

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        """One prompt length per admitted request (shared prefill): the planner's ``lengths``."""
        return tuple(a.prompt_length for a in self.admitted)


def compaction(retired_rows: Sequence[bool]) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """``(keep, moves)`` that make survivors contiguous with the fewest row copies.

    Survivors already below the new live count stay put; each hole below it is filled, in ascending
    order, by the survivors above it, also in ascending order.
    """
    survivors = [row for row, gone in enumerate(retired_rows) if not gone]
    num_survivors = len(survivors)
    movers = iter(row for row in survivors if row >= num_survivors)
    keep = [row if not retired_rows[row] else next(movers) for row in range(num_survivors)]
    moves = tuple((src, dst) for dst, src in enumerate(keep) if src != dst)
    return tuple(keep), moves


class ContinuousScheduler:
    """FIFO admission, retirement, compaction and refill over ``config.num_slots`` rows."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._pending: deque[Admission] = deque()   # first_row unused (-1) while pending
        self._budgets: dict[Hashable, int] = {}
        self._samples_left: dict[Hashable, int] = {}
        self._rows: list[list] = []   # per live row: [request_id, sample_index, num_generated]

    @property
    def num_live(self) -> int:
        return len(self._rows)

    @property
    def num_pending(self) -> int:
        """Requests waiting for admission."""
        return len(self._pending)

    @property
    def idle(self) -> bool:
        """Nothing live and nothing pending."""
        return not self._rows and not self._pending

    def rows(self) -> tuple[RowState, ...]:
        """The occupant of each live row ``[0, num_live)``."""
        return tuple(RowState(rid, s, g, self._budgets[rid][s]) for rid, s, g in self._rows)

    def submit(self, request_id: Hashable, prompt_length: int, num_samples: int = 1,
               max_new_tokens: Optional[int | Sequence[int]] = None) -> None:
        """Queue a request (FIFO). Its id must not belong to a request that is still pending or live.
        ``max_new_tokens``: None (the config's), one budget for every sample, or one per sample."""
        if request_id in self._samples_left:
            raise ValueError(f"request_id: {request_id!r} is already pending or live")
        if not is_int(prompt_length) or prompt_length <= 0:
            raise ValueError(f"prompt_length: must be an int > 0; got {prompt_length!r}")
        if not is_int(num_samples) or not 1 <= num_samples <= self.config.num_slots:
            raise ValueError(f"num_samples: must be an int in [1, num_slots={self.config.num_slots}]; "
                             f"got {num_samples!r}")
        budget = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        budgets = tuple(budget) if isinstance(budget, (list, tuple)) else (budget,) * num_samples
        if len(budgets) != num_samples or not all(is_int(b) and b >= 1 for b in budgets):
            raise ValueError(f"max_new_tokens: must be None, an int >= 1 or one such int per sample ({num_samples}); "
                             f"got {max_new_tokens!r}")
        self._budgets[request_id] = budgets
        self._samples_left[request_id] = num_samples
        self._pending.append(Admission(request_id, prompt_length, -1, num_samples))

    def step(self, eos: Sequence[bool] = ()) -> SchedulerUpdate:
        """Count one new token per live row, retire (``eos[r]`` or budget), compact, then admit FIFO."""
        if len(eos) != len(self._rows):
            raise ValueError(f"eos: need one flag per live row ({len(self._rows)}); got {len(eos)}")
        retired, gone, completed = [], [], []
        for row, (state, ended) in enumerate(zip(self._rows, eos)):
            state[2] += 1
            out_of_budget = state[2] >= self._budgets[state[0]][state[1]]
            gone.append(bool(ended) or out_of_budget)
            if gone[-1]:
                retired.append(Retirement(row, state[0], state[1], state[2],
                                          REASON_EOS if ended else REASON_BUDGET))
                if self._finish_sample(state[0]):
                    completed.append(state[0])
        keep, moves = compaction(gone)
        self._rows = [self._rows[row] for row in keep]
        admitted = self._admit()
        return SchedulerUpdate(tuple(retired), keep, moves, admitted, tuple(completed), len(self._rows))

    def _finish_sample(self, request_id: Hashable) -> bool:
        self._samples_left[request_id] -= 1
        if self._samples_left[request_id]:
            return False
        del self._samples_left[request_id], self._budgets[request_id]
        return True

    def _admit(self) -> tuple[Admission, ...]:
        free = self.config.num_slots - len(self._rows)
        if free < self.config.min_free_slots:
            return ()
        admitted = []
        while self._pending and self._pending[0].num_samples <= free:
            request = self._pending.popleft()
            admission = Admission(request.request_id, request.prompt_length, len(self._rows), request.num_samples)
            self._rows.extend([request.request_id, s, 0] for s in range(request.num_samples))
            free -= request.num_samples
            admitted.append(admission)
        return tuple(admitted)
