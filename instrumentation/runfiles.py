"""Where a profiler session writes, and who it is: rank, run directory, CUDA memory snapshots.

Every function here turns a failure into one ``ProfilingWarning`` (profiling never breaks
training), except bad RANK/WORLD_SIZE values and a run directory that belongs to another run (or
leads outside ``OPSD_PROFILE_DIR``), which raise ``ValueError`` before any step.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Optional

import torch

from instrumentation import runmarker, state
from instrumentation.config import PARTIAL_SUFFIX, ProfileConfig


def resolve_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> tuple[int, int]:
    """Explicit values, else ``torch.distributed`` when initialised, else env RANK/WORLD_SIZE, else 0/1."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else env_int("RANK", 0)
    if world_size is None:
        world_size = dist.get_world_size() if initialised else env_int("WORLD_SIZE", 0, default=1)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return rank, world_size


def env_int(name: str, least: int, default: Optional[int] = None) -> int:
    """The launcher's variable ``name`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) as an int >=
    ``least``: ASCII digits, at most 9; ``default`` (None: ``least``) where unset or empty. ValueError naming the
    variable otherwise (the profiler's rank and the main job's checks before it builds anything)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return least if default is None else default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and int(raw) >= least):
        raise ValueError(f"{name}={os.environ[name]!r}: the environment variable must be an int >= {least}")
    return int(raw)


def shared_run(config: ProfileConfig, world_size: int) -> tuple[str, Optional[str]]:
    """(run name, run id) shared by the ranks of this run (see :mod:`instrumentation.runmarker`).

    The name is ``config.run_name``, else a fresh ``run-<date>-<time>-<pid>-<random>``. When several
    ranks write, rank 0's name and id are broadcast (a collective: every rank of the default group
    must open its session). Without ``torch.distributed``, a generated name is this rank's own, and
    the id of an explicit name comes from the launcher's environment: None (any marker accepted, one
    warning) when there is none.
    """
    name = config.run_name or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
    run_id: Optional[str] = runmarker.PROCESS_RUN_ID
    if world_size <= 1 or (config.ranks is not None and len(config.ranks) <= 1):
        return name, run_id
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        try:
            box = [name, run_id]
            dist.broadcast_object_list(box, src=0)
            return box[0], box[1]
        except Exception as exc:
            state.warn_once("run-name", f"could not share the run name across ranks: {exc!r}")
    if config.run_name is None:  # a name of its own: this rank owns its directory
        return name, run_id
    run_id = runmarker.launcher_run_id(os.environ)
    if run_id is None:
        state.warn_once("run-id", "the ranks of this run cannot be told apart from another run's (no "
                                  "torch.distributed, no launcher variables): run names are not checked")
    return name, run_id


def make_run_dir(output_dir: str, run_name: str, run_id: Optional[str]) -> Optional[str]:
    """Create ``<output_dir>/<run_name>`` and claim it for this run; None (and one warning) when it
    cannot be created or written. ``ValueError`` (naming ``OPSD_PROFILE_RUN_NAME``) when it belongs
    to another run or leaves ``output_dir`` (a symbolic link)."""
    path = os.path.join(output_dir, run_name)
    runmarker.refuse_file(path, run_name)
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except Exception as exc:
        state.warn_once("run-dir", f"opsd profiling writes no traces or scalars: cannot use "
                                   f"OPSD_PROFILE_DIR ({exc!r}); training goes on")
        return None
    root, real = os.path.realpath(output_dir), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise runmarker.taken(path, run_name, f"leads outside OPSD_PROFILE_DIR (to {real})")
    try:
        runmarker.claim(path, run_name, run_id)
    except OSError as exc:
        state.warn_once("run-marker", f"could not write the run marker ({exc!r}): another run under the "
                                      "same name would not be detected")
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
    partial = path + PARTIAL_SUFFIX
    try:
        torch.cuda.memory._dump_snapshot(partial)
        os.rename(partial, path)
    except Exception as exc:
        with contextlib.suppress(OSError):
            os.remove(partial)
        state.warn_once("oom-snapshot", f"could not dump the CUDA memory snapshot: {exc!r}")
        return None
    state.warn_once("oom-snapshot-written", f"CUDA OOM: memory snapshot written to {path} "
                                            "(open it at https://pytorch.org/memory_viz)")
    return path
