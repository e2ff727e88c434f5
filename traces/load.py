"""Input handling: expand paths, read each file through an event source, assign ranks.

A file is read as an Nsight Systems SQLite export when it ends in ``.sqlite`` or starts with the
SQLite header (named explicitly: directories expand to Chrome traces only), else as a Chrome trace.
Rank of a file: its ``distributedInfo.rank``; else a ``rank{R}`` prefix of the file name; else the
file's index in the sorted input list. Several files of one rank (profiler windows) are merged;
ranges found in two files of one rank of one run (:mod:`traces.runs`) with identical name, thread and times are
true duplicates: they are counted once and reported as a warning naming both files. Within one file, a range
repeated exactly or nested in a range of the same name on its thread is counted once too (:mod:`traces.repeats`),
with one warning line naming the stage and the rank.

Failures stay with their file: a file that cannot be read (for whatever reason) is an error naming
it, and the others are still read; bad events are skipped and counted (one warning line per file).
``*.partial`` entries (exports in progress or killed, see ``instrumentation.export``) and files
that are not regular files (FIFOs, devices: opening one could block or never end) are skipped,
without opening them, with a warning; a directory that cannot be listed is an error.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from instrumentation.config import PARTIAL_SUFFIX
from traces.chrome import read_chrome_trace
from traces.events import EventSource, TraceData, TraceError, collect
from traces.nsys import is_sqlite_file, read_nsys_sqlite
from traces.repeats import describe, drop_repeats
from traces.runs import by_run_dir

TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
_RANK_PREFIX = re.compile(r"^rank[_-]?(\d+)")


@dataclass
class LoadedSet:
    """The readable files of an input set, the problems of the others, and warnings."""

    files: list[TraceData] = field(default_factory=list)
    errors: list[TraceError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def expand_paths(paths: list[str]) -> tuple[list[str], list[TraceError], list[str]]:
    """``(files, errors, warnings)`` of ``paths``: a directory stands for every
    ``*.pt.trace.json[.gz]`` below it; see the module docstring for what is skipped."""
    out, errors, warnings, seen = [], [], [], set()
    for path in paths:
        if path.endswith(PARTIAL_SUFFIX):
            warnings.append(f"{path}: an incomplete export (*{PARTIAL_SUFFIX}); skipped")
            continue
        found = _walk(path, errors, warnings) if os.path.isdir(path) else [path]
        for f in found:
            key = os.path.realpath(f)
            if key in seen:
                continue
            seen.add(key)
            kind = _not_regular(f)
            if kind is not None:
                warnings.append(f"{f}: not a regular file ({kind}); skipped without opening it")
                continue
            out.append(f)
    return out, errors, warnings


def _walk(top: str, errors: list, warnings: list) -> list[str]:
    """The trace files below directory ``top``; unreadable directories become errors."""
    found, partial, unreadable = [], [], []

    def on_error(exc: OSError) -> None:
        unreadable.append(exc.filename or top)
        errors.append(TraceError(exc.filename or top, f"cannot read directory ({exc.strerror or exc}); "
                                                      "the traces below it are not in the report"))

    for d, dirs, files in os.walk(top, onerror=on_error):
        partial += [os.path.join(d, n) for n in dirs + files if n.endswith(PARTIAL_SUFFIX)]
        dirs[:] = sorted(n for n in dirs if not n.endswith(PARTIAL_SUFFIX))
        found += [os.path.join(d, f) for f in files if f.endswith(TRACE_SUFFIXES)]
    if partial:
        warnings.append(f"{top}: skipped {len(partial)} incomplete export(s) (*{PARTIAL_SUFFIX}: still being "
                        f"written, or left by a killed run): {', '.join(sorted(partial))}")
    if not found and top not in unreadable:
        errors.append(TraceError(top, "directory holds no *.pt.trace.json[.gz] file"))
    return sorted(found)


def _not_regular(path: str):
    """What ``path`` is when it is not a regular file (``"a FIFO"`` ...); None for a regular or
    missing file (reading a missing one gives the error)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def rank_of(data: TraceData, index: int) -> int:
    """The rank of a file (see the module docstring)."""
    if data.rank is not None:
        return data.rank
    m = _RANK_PREFIX.match(os.path.basename(data.path))
    return int(m.group(1)) if m else index


def read_trace(path: str, nvtx_domain: str | None = None):
    """The event tuples of ``path``: an Nsight Systems SQLite export (``.sqlite`` or an SQLite
    header; ``nvtx_domain`` keeps one NVTX domain) or else a Chrome trace."""
    if path.endswith(".sqlite") or is_sqlite_file(path):
        return read_nsys_sqlite(path, nvtx_domain)
    return read_chrome_trace(path)


def load(paths: list[str], source: EventSource = read_trace) -> LoadedSet:
    """Read every file of ``paths``; unreadable files become errors, the rest are returned."""
    files, errors, warnings = expand_paths(paths)
    result = LoadedSet(errors=errors, warnings=warnings)
    for index, path in enumerate(files):
        try:
            data = collect(path, source(path))
        except TraceError as exc:
            result.errors.append(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - whatever breaks on one file stays with that file
            result.errors.append(TraceError(path, f"cannot be read ({type(exc).__name__}: {exc})"))
            continue
        data.rank = rank_of(data, index)
        result.warnings.extend(f"{path}: {note}" for note in data.notes)
        if data.bad.total:
            result.warnings.append(f"{path}: {data.bad.describe()}")
        data.ranges, repeated, nested = drop_repeats(data.ranges)
        if repeated or nested:
            result.warnings.append(f"{path}: {describe(data.rank, repeated, nested)}")
        result.files.append(data)
    for run in by_run_dir(result.files, lambda data: data.path).values():  # two runs never duplicate each other
        result.warnings.extend(drop_duplicates(run))
    return result


def drop_duplicates(files: list[TraceData]) -> list[str]:
    """Remove ranges repeated across files of one rank; one warning per pair of files."""
    seen: dict[tuple, str] = {}
    warnings = []
    for data in files:
        counts: dict[str, int] = {}
        kept = []
        for r in data.ranges:
            key = (data.rank,) + r
            first = seen.get(key)
            if first is None:
                seen[key] = data.path
                kept.append(r)
            elif first != data.path:
                counts[first] = counts.get(first, 0) + 1
            else:
                kept.append(r)
        if counts:
            data.ranges = kept
            for first, n in counts.items():
                warnings.append(f"{data.path}: {n} ranges duplicate those of {first} "
                                f"(rank {data.rank}); counted once")
    return warnings
