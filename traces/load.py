"""Input handling: expand paths, read each file through an event source, assign ranks.

A file is read as an Nsight Systems SQLite export when it ends in ``.sqlite`` or starts with the
SQLite header (named explicitly: directories expand to Chrome traces only), else as a Chrome trace.
Rank of a file: its ``distributedInfo.rank``; else a ``rank{R}`` prefix of the file name; else the
file's index in the sorted input list. Several files of one rank (profiler windows) are merged;
ranges found in two files of one rank with identical name, thread and times are true duplicates:
they are counted once and reported as a warning naming both files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from traces.chrome import read_chrome_trace
from traces.events import EventSource, TraceData, TraceError, collect
from traces.nsys import is_sqlite_file, read_nsys_sqlite

TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
_RANK_PREFIX = re.compile(r"^rank[_-]?(\d+)")


@dataclass
class LoadedSet:
    """The readable files of an input set, the problems of the others, and warnings."""

    files: list[TraceData] = field(default_factory=list)
    errors: list[TraceError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def expand_paths(paths: list[str]) -> tuple[list[str], list[TraceError]]:
    """Files named by ``paths``: a directory stands for every ``*.pt.trace.json[.gz]`` below it."""
    out, errors, seen = [], [], set()
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                           if f.endswith(TRACE_SUFFIXES))
            if not found:
                errors.append(TraceError(path, "directory holds no *.pt.trace.json[.gz] file"))
        else:
            found = [path]
        for f in found:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out, errors


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
    files, errors = expand_paths(paths)
    result = LoadedSet(errors=errors)
    for index, path in enumerate(files):
        try:
            data = collect(path, source(path))
        except TraceError as exc:
            result.errors.append(exc)
            continue
        data.rank = rank_of(data, index)
        if data.num_malformed:
            result.warnings.append(f"{path}: skipped {data.num_malformed} malformed events")
        result.files.append(data)
    result.warnings.extend(drop_duplicates(result.files))
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
