"""Where a profiler session writes, and who it is: rank, run directory, CUDA memory snapshots.

Every function here turns a failure into one ``ProfilingWarning`` (profiling never breaks
training), except bad RANK/WORLD_SIZE values, which raise ``ValueError``.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Optional

import torch

from instrumentation import state
from instrumentation.config import ProfileConfig


def resolve_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> tuple[int, int]:
    """Explicit values, else ``torch.distributed`` when initialised, else env RANK/WORLD_SIZE, else 0/1."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else _env_int("RANK", 0)
    if world_size is None:
        world_size = dist.get_world_size() if initialised else _env_int("WORLD_SIZE", 1)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return rank, world_size


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}={raw!r} is not valid; accepted: an integer >= 0")
    return int(raw)


def shared_run_name(config: ProfileConfig, world_size: int) -> str:
    """``config.run_name``, else a fresh name; rank 0's is broadcast when several ranks write.

    The broadcast is a collective: every rank of the default group must open its session.
    """
    if config.run_name:
        return config.run_name
    name = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
    dist = torch.distributed
    several_writers = config.ranks is None or len(config.ranks) > 1
    if world_size > 1 and several_writers and dist.is_available() and dist.is_initialized():
        try:
            box = [name]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
        except Exception as exc:
            state.warn_once("run-name", f"could not share the run name across ranks: {exc!r}")
    return name


def make_run_dir(path: str) -> Optional[str]:
    """Create ``path``; None (and one warning) when it cannot be created or written."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except Exception as exc:
        state.warn_once("run-dir", f"opsd profiling writes no traces or scalars: cannot use "
                                   f"OPSD_PROFILE_DIR ({exc!r}); training goes on")
        return None
    return path


def record_memory_history(enabled: bool) -> None:
    """Start/stop the CUDA allocator history that a snapshot needs (no-op without CUDA)."""
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.memory._record_memory_history(enabled="all" if enabled else None,
                                                 max_entries=100_000)
    except Exception as exc:
        state.warn_once("memory-history", f"CUDA memory history unavailable: {exc!r}")


def dump_oom_snapshot(run_dir: str, rank: int) -> Optional[str]:
    """Write ``<run_dir>/rank{R}.oom.<time_ns>.pickle`` (for https://pytorch.org/memory_viz)."""
    path = os.path.join(run_dir, f"rank{rank}.oom.{time.time_ns()}.pickle")
    try:
        torch.cuda.memory._dump_snapshot(path)
    except Exception as exc:
        state.warn_once("oom-snapshot", f"could not dump the CUDA memory snapshot: {exc!r}")
        return None
    state.warn_once("oom-snapshot-written", f"CUDA OOM: memory snapshot written to {path} "
                                            "(open it at https://pytorch.org/memory_viz)")
    return path
