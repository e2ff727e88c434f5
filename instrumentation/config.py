"""``ProfileConfig``: the profiling switches, read once from the environment (no torch).

Explicit arguments > environment > defaults; a bad value raises ``ValueError`` naming it and what is accepted.

==========================  =========================================================  ================
variable                    accepted values                                            default
==========================  =========================================================  ================
``OPSD_PROFILE``            unset / ``0`` (off), ``1`` (ranges + timers + traces),      off
                            ``nvtx`` (ranges only, for ``nsys profile``), ``timers``
                            (ranges + device timers and scalars every step, no traces)
``OPSD_PROFILE_DIR``        any path; each run writes into its own subdirectory        ``./opsd_traces``
``OPSD_PROFILE_STEPS``      ``A-B`` (inclusive) or a list such as ``1,3,5-7``          ``1-3``
``OPSD_PROFILE_RANKS``      ``all`` or a list such as ``0`` / ``0,2`` / ``0-3``        ``0``
``OPSD_PROFILE_MEMORY``     ``1/0``, ``true/false``, ``yes/no``, ``on/off``            on when ``1``
``OPSD_PROFILE_RUN_NAME``   a plain name (letters, digits, ``._-``; not ``.``/``..``)  generated
``OPSD_PROFILE_OOM_SNAPSHOT``  same as ``OPSD_PROFILE_MEMORY``                         off
``OPSD_PROFILE_EVERY``      an integer >= 1: ``timers`` mode times every N-th step     ``1``
``OPSD_PROFILE_TEARDOWN_CUPTI``  same as ``OPSD_PROFILE_MEMORY``: set ``TEARDOWN_CUPTI=1`` on, CUDA
                            for Kineto (finalize CUPTI after each trace window)       >= 12.6
==========================  =========================================================  ================

An empty variable counts as unset. :func:`instrumentation.check_environment` validates every
``OPSD_*`` variable at once (unknown ``OPSD_PROFILE*`` names included).
"""

from __future__ import annotations

import itertools
import numbers
import os
import re
from dataclasses import dataclass, fields
from typing import Mapping, Optional

MODE_OFF = "0"
MODE_FULL = "1"
MODE_NVTX = "nvtx"
MODE_TIMERS = "timers"
MODES = (MODE_OFF, MODE_FULL, MODE_NVTX, MODE_TIMERS)

#: Environment variable of each field.
ENV_VARS = {
    "mode": "OPSD_PROFILE",
    "output_dir": "OPSD_PROFILE_DIR",
    "steps": "OPSD_PROFILE_STEPS",
    "ranks": "OPSD_PROFILE_RANKS",
    "profile_memory": "OPSD_PROFILE_MEMORY",
    "run_name": "OPSD_PROFILE_RUN_NAME",
    "oom_snapshot": "OPSD_PROFILE_OOM_SNAPSHOT",
    "every": "OPSD_PROFILE_EVERY",
    "teardown_cupti": "OPSD_PROFILE_TEARDOWN_CUPTI",
}

#: Upper bound on the number of steps or ranks a list may name (guards ``0-1000000000``).
MAX_LIST_ITEMS = 100_000

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_STEPS_ACCEPTED = "'A-B' (inclusive, A <= B) or a comma list such as '1,3,5-7' of integers >= 0"
_RANKS_ACCEPTED = "'all' or a comma list such as '0', '0,2' or '0-3' of integers >= 0"
_BOOL_ACCEPTED = "one of " + ", ".join(_TRUE + _FALSE)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}", re.ASCII)
#: Non-negative integers as ASCII digits (``"²".isdigit()`` is True; ``int()`` refuses it), bounded.
_UINT_RE = re.compile(r"[0-9]{1,18}", re.ASCII)
#: Suffix of the files and directories of an export in progress (see instrumentation.export).
PARTIAL_SUFFIX = ".partial"
RUN_NAME_ACCEPTED = ("a name of 1-200 letters, digits, '.', '_', '-' that stays inside OPSD_PROFILE_DIR "
                     "(not '.' or '..', not ending in '.partial')")


def _is_uint(text: str) -> bool:
    return _UINT_RE.fullmatch(text) is not None


def parse_run_name(value, source: str = "run_name") -> Optional[str]:
    """None, or a plain directory name that cannot leave the output directory."""
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else None
    if (text is None or _NAME_RE.fullmatch(text) is None or set(text) == {"."}
            or text.endswith(PARTIAL_SUFFIX)):
        raise _bad(source, value, RUN_NAME_ACCEPTED)
    return text


def _bad(source: str, value, accepted: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 60:
        shown = f"{shown[:40]}...({len(shown)} characters)"
    return ValueError(f"{source}={shown} is not valid; accepted: {accepted}")


def parse_mode(value, source: str = "mode") -> str:
    """``0``/``1``/``nvtx`` (also ints 0/1, any case) -> one of :data:`MODES`."""
    if isinstance(value, bool):
        raise _bad(source, value, "'0', '1' or 'nvtx'")
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text == "":
        return MODE_OFF
    if text not in MODES:
        raise _bad(source, value, "'0' (or unset) for off, '1' for ranges + timers + traces, "
                                  "'nvtx' for NVTX ranges only, 'timers' for device timers and "
                                  "scalars every step")
    return text


def parse_int_list(value, source: str, accepted: str = _STEPS_ACCEPTED) -> tuple[int, ...]:
    """``"1,3,5-7"`` / ``"2-4"`` / an iterable of ints -> sorted tuple of distinct ints >= 0."""
    if isinstance(value, str):
        items: set[int] = set()
        tokens = [token.strip() for token in value.split(",")]
        if not value.strip() or any(not token for token in tokens):
            raise _bad(source, value, accepted)
        for token in tokens:
            low, sep, high = token.partition("-")
            low, high = low.strip(), (high.strip() if sep else low.strip())
            if not (_is_uint(low) and _is_uint(high)) or int(low) > int(high):
                raise _bad(source, value, accepted)
            if int(high) - int(low) + len(items) >= MAX_LIST_ITEMS:
                raise _bad(source, value, f"{accepted}; at most {MAX_LIST_ITEMS} items")
            items.update(range(int(low), int(high) + 1))
        return tuple(sorted(items))
    raw = None if isinstance(value, (bytes, bytearray, memoryview)) else value  # b"1-3" iterated as (45, 49, 51)
    try:
        items_list = list(itertools.islice(raw, MAX_LIST_ITEMS + 1))  # bounded: range(10**9) is refused at once
    except TypeError:
        raise _bad(source, value, accepted) from None
    if len(items_list) > MAX_LIST_ITEMS:
        raise _bad(source, value, f"{accepted}; at most {MAX_LIST_ITEMS} items")
    if not items_list or any(not _is_index(v) or v < 0 for v in items_list):
        raise _bad(source, value, accepted)
    return tuple(sorted({int(v) for v in items_list}))


def _is_index(value) -> bool:  # an integer that is not a bool, numpy's included
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def parse_ranks(value, source: str = "ranks") -> Optional[tuple[int, ...]]:
    """``"all"`` / None -> None (every rank); otherwise a sorted tuple of ranks."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if _is_index(value):
        value = (value,)
    return parse_int_list(value, source, _RANKS_ACCEPTED)


def parse_every(value, source: str = "every") -> int:
    """An integer >= 1 (also its text)."""
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and _is_uint(text):
        text = int(text)
    if not _is_index(text) or text < 1:
        raise _bad(source, value, "an integer >= 1")
    return int(text)


def parse_bool(value, source: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case) or a bool -> bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _bad(source, value, _BOOL_ACCEPTED)


#: The CUDA runtime from which torch allows CUPTI teardown with CUDA graphs (below it, torch resets
#: ``TEARDOWN_CUPTI`` to 0: teardown crashed graph capture on CUDA 11-12).
TEARDOWN_MIN_CUDA = (12, 6)


def teardown_by_default(cuda_version: Optional[str]) -> bool:
    """Whether CUPTI is torn down after trace windows by default: torch built for CUDA >= 12.6
    (``cuda_version`` as ``torch.version.cuda`` spells it; None, a CPU build: False)."""
    if not cuda_version:
        return False
    try:
        major_minor = tuple(int(part) for part in str(cuda_version).split(".")[:2])
    except ValueError:
        return False
    return major_minor >= TEARDOWN_MIN_CUDA


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile; built once per process (see :func:`instrumentation.get_config`)."""

    mode: str = MODE_OFF
    """``"0"`` off (ranges are a shared do-nothing object), ``"1"`` NVTX + ``record_function``
    ranges, stage timers and torch.profiler traces on the recorded steps, ``"nvtx"`` ranges only,
    ``"timers"`` NVTX ranges + per-stage timers (CUDA events) and TensorBoard scalars every step,
    no torch.profiler."""
    output_dir: str = "./opsd_traces"
    """Root directory of traces and scalars; each run writes into ``<output_dir>/<run_name>/``."""
    steps: tuple[int, ...] = (1, 2, 3)
    """Training steps (0-based, counted by ``prof.step()``) that are recorded; consecutive steps form
    one trace window. The default leaves step 0 to warm up."""
    ranks: Optional[tuple[int, ...]] = (0,)
    """Ranks that write traces and scalars (None = all). NVTX ranges are emitted on every rank."""
    profile_memory: Optional[bool] = None
    """torch.profiler ``profile_memory`` (``[memory]`` events); None resolves to ``mode == "1"``."""
    run_name: Optional[str] = None
    """Subdirectory of this run; None generates ``run-<time>-<pid>-<random>`` (shared by all ranks)."""
    oom_snapshot: bool = False
    """On CUDA OOM inside a recorded step, dump ``torch.cuda.memory._dump_snapshot`` and re-raise."""
    every: int = 1
    """Mode ``"timers"``: time the stages of every ``every``-th step (steps 0, N, 2N, ...)."""
    teardown_cupti: Optional[bool] = None
    """Mode ``"1"``: set ``TEARDOWN_CUPTI=1`` before torch.profiler starts and stops, so that Kineto
    finalizes CUPTI after each trace window (no lingering CUPTI callbacks on unrecorded steps). None
    (default): on where torch's CUDA runtime is >= 12.6 (:func:`teardown_by_default`, resolved when the
    profiler starts, so that reading the config never imports torch), off elsewhere.
    On an H200 (CUDA 13) CUDA graphs capture and replay after windows with it (docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "mode", parse_mode(self.mode, "mode"))
        if (not isinstance(self.output_dir, (str, os.PathLike)) or not str(self.output_dir).strip()
                or "\0" in str(self.output_dir)):
            raise ValueError(f"output_dir must be a non-empty path without NUL characters; got {self.output_dir!r}")
        set_(self, "output_dir", os.fspath(self.output_dir))
        set_(self, "steps", parse_int_list(self.steps, "steps"))
        set_(self, "ranks", parse_ranks(self.ranks, "ranks"))
        memory = self.mode == MODE_FULL if self.profile_memory is None else self.profile_memory
        set_(self, "profile_memory", parse_bool(memory, "profile_memory"))
        set_(self, "run_name", parse_run_name(self.run_name, "run_name"))
        set_(self, "oom_snapshot", parse_bool(self.oom_snapshot, "oom_snapshot"))
        set_(self, "every", parse_every(self.every, "every"))
        if self.teardown_cupti is not None:
            set_(self, "teardown_cupti", parse_bool(self.teardown_cupti, "teardown_cupti"))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "ProfileConfig":
        """Build from ``environ`` (default ``os.environ``); keyword ``overrides`` win over it."""
        environ = os.environ if environ is None else environ
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"unknown ProfileConfig argument(s) {unknown}; accepted: {names}")
        values = dict(overrides)
        for name in names:
            raw = environ.get(ENV_VARS[name], "")
            if name in values or raw.strip() == "":
                continue
            values[name] = _parse_env(name, raw)
        return cls(**values)

    @property
    def enabled(self) -> bool:
        """Any instrumentation at all (ranges are emitted)."""
        return self.mode != MODE_OFF

    @property
    def timing(self) -> bool:
        """``collect_stages``, torch.profiler traces and timers on the recorded steps (mode ``1``)."""
        return self.mode == MODE_FULL

    @property
    def light(self) -> bool:
        """Timers and scalars every (``every``-th) step, no traces (mode ``timers``)."""
        return self.mode == MODE_TIMERS

    @property
    def stage_timers(self) -> bool:
        """Ranges open timer frames while a sink listens (modes ``1`` and ``timers``)."""
        return self.mode in (MODE_FULL, MODE_TIMERS)

    def times_step(self, step: int) -> bool:
        """Whether the stages of training step ``step`` are timed (recorded in mode ``1``)."""
        if self.light:
            return step % self.every == 0
        return self.timing and step in self.steps

    def records_step(self, step: int) -> bool:
        """Whether training step ``step`` is in the recorded set."""
        return step in self.steps

    def selects_rank(self, rank: int) -> bool:
        """Whether ``rank`` writes traces and scalars."""
        return self.ranks is None or rank in self.ranks


def _parse_env(name: str, raw: str):
    var = ENV_VARS[name]
    if name == "mode":
        return parse_mode(raw, var)
    if name == "steps":
        return parse_int_list(raw, var)
    if name == "ranks":
        return parse_ranks(raw, var)
    if name in ("profile_memory", "oom_snapshot", "teardown_cupti"):
        return parse_bool(raw, var)
    if name == "every":
        return parse_every(raw, var)
    if name == "run_name":
        return parse_run_name(raw, var)
    return raw.strip()
