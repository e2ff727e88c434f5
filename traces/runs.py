"""Which run each trace file belongs to, so that a folder of several runs is reported run by run.

A run of the main job writes its traces into its own run directory, which holds a marker file (``.opsd-run``,
:mod:`instrumentation.runmarker`) with the run's id. A file belongs to the nearest folder above it (up to
:data:`MAX_DEPTH` levels) that holds a marker; files without one form one group of their own (traces written by hand
or before markers existed). ``opsd-summarize opsd_traces/`` therefore reports each run under its name, with its own
step numbers, instead of merging a 24-token run and an 8-token run into steps 0-5.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from typing import Optional

from instrumentation.runmarker import MARKER_NAME, read_marker
from traces.names import printable

#: Folders above a trace file searched for a run marker.
MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's name (its directory's), id (its marker's) and files."""

    name: Optional[str]
    """The run directory's name (printable: :mod:`traces.names`); None for files outside any run directory."""
    run_id: Optional[str]
    files: object
    """The run's files (a ``traces.load.LoadedSet``)."""

    @property
    def label(self) -> str:
        """``run <name> (id <id>)``: a report's heading."""
        if self.name is None:
            return "files outside any run"
        return f"run {self.name}" + (f" (id {self.run_id})" if self.run_id else "")


def csv_cell(text: Optional[str]) -> str:
    """``text`` as one CSV cell (quoted where it must be; empty for None)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(["" if text is None else text])
    return out.getvalue()


def by_run_dir(items: list, path_of) -> dict[Optional[str], list]:
    """``items`` by run directory (:func:`run_dir_of` of ``path_of(item)``; None outside any), in order."""
    groups: dict[Optional[str], list] = {}
    for item in items:
        groups.setdefault(run_dir_of(path_of(item)), []).append(item)
    return groups


def run_dir_of(path: str) -> Optional[str]:
    """The nearest folder above ``path`` that holds a run marker, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(MAX_DEPTH):
        if os.path.isfile(os.path.join(folder, MARKER_NAME)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return None


def group_by_run(loaded) -> list[Run]:
    """The runs of ``loaded``'s files, by name (files outside run directories last); errors and warnings stay
    with ``loaded``."""
    by_dir = by_run_dir(loaded.files, lambda data: data.path)
    runs = []
    for folder in sorted(by_dir, key=lambda f: (f is None, f or "")):
        marker = read_marker(folder, wait_s=0.0) if folder else None
        runs.append(Run(None if folder is None else printable(os.path.basename(folder)),
                        printable(marker.run_id) if marker else None,
                        dataclasses.replace(loaded, files=by_dir[folder], errors=[], warnings=[])))
    return runs
