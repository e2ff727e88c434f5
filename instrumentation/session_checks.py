"""Usage checks of a profiler session (issue 34): each raises one line naming the misuse, before anything runs.

A session is entered once; ``step()`` counts only inside its ``with`` (outside it a step was counted and never
profiled, silently); sessions with timers do not nest (torch.profiler inside torch.profiler crashed the process);
an explicit ``world_size`` must lie above the rank (rank 5 of 2 was accepted).
"""

from __future__ import annotations

from typing import Optional


def check_enter(phase: str, stage_timers: bool, open_sessions: int) -> None:
    """Entering a session: ``phase`` is ``"new"``, ``"open"`` or ``"closed"``."""
    if phase != "new":
        raise RuntimeError(f"opsd_profiler: this session was entered already ({phase}); build a new one with "
                           "opsd_profiler() for each `with`")
    if stage_timers and open_sessions:
        raise RuntimeError("opsd_profiler: another session with timers is open in this process; sessions do not "
                           "nest (close the first, or give this one ProfileConfig(mode='nvtx'))")


def check_step(phase: str) -> None:
    """``prof.step()``: only inside the session's ``with``."""
    if phase != "open":
        raise RuntimeError(f"opsd_profiler: step() called on a session that is {phase}, outside its "
                           "`with opsd_profiler() as prof:` block (the step would be counted, not profiled)")


def check_world(rank: int, world_size: int, given: Optional[int]) -> None:
    """A ``world_size`` given explicitly must be above ``rank``."""
    if given is not None and not rank < world_size:
        raise ValueError(f"world_size must be an int >= 1 above rank {rank}; got {given!r}")
