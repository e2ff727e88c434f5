"""Who owns a run directory: a marker file with the run id, so two runs never share one (no torch).

The ranks of one run share its name and its *run id* (rank 0's id, broadcast with the name by
:func:`instrumentation.runfiles.shared_run`; without ``torch.distributed``, an id derived from the
launcher's environment). The first writing rank to arrive creates ``<run_dir>/.opsd-run``
(``O_CREAT | O_EXCL``: exactly one creator) holding that id; every other writing rank reads it
and compares. A different id means another run already writes there: :func:`claim` raises a
``ValueError`` naming ``OPSD_PROFILE_RUN_NAME`` (the run is refused, not renamed). A directory that
holds files but no marker (written before markers existed, or by hand) is refused the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Mapping, Optional

#: No ``.json`` suffix: Holistic Trace Analysis reads every ``*.json`` of a trace directory as a trace.
MARKER_NAME = ".opsd-run"
#: This process's run id when it is rank 0 or writes alone (random, drawn once per process).
PROCESS_RUN_ID = secrets.token_hex(8)
#: Launcher variables shared by the ranks of one launch (torchrun, the deepspeed launcher).
LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
#: How long a rank waits for a marker that another rank is still writing.
MARKER_WAIT_S = 10.0


@dataclass(frozen=True)
class RunMarker:
    """The content of a run's marker file."""

    run_id: str
    """Id shared by the ranks of the run that owns the directory."""
    host: str = "?"
    """Host name of the rank that created the marker."""
    pid: int = -1
    """Process id of that rank."""
    started: str = "?"
    """Local time the marker was created (``YYYY-mm-dd HH:MM:SS``)."""

    def describe(self) -> str:
        return f"run id {self.run_id}, started {self.started} on host {self.host}, pid {self.pid}"


def launcher_run_id(environ: Mapping[str, str]) -> Optional[str]:
    """An id from the launcher's variables (same on every rank of a launch); None without them."""
    values = {var: environ.get(var, "").strip() for var in LAUNCHER_VARS}
    if values["TORCHELASTIC_RUN_ID"] == "none":  # torchrun's default: not an id
        values["TORCHELASTIC_RUN_ID"] = ""
    if not values["TORCHELASTIC_RUN_ID"] and not (values["MASTER_ADDR"] and values["MASTER_PORT"]):
        return None
    text = "\0".join(values[var] for var in LAUNCHER_VARS)
    return "launch-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def own_run_ids(environ: Mapping[str, str]) -> set:
    """The ids this process may own a run under (its own, and its launch's)."""
    return {PROCESS_RUN_ID} | ({launcher_run_id(environ)} - {None})


def read_marker(run_dir: str, wait_s: float = MARKER_WAIT_S) -> Optional[RunMarker]:
    """The marker of ``run_dir``; None when there is none. Waits up to ``wait_s`` for one that is
    still being written; an unreadable one after that is a marker of an unknown run."""
    path = os.path.join(run_dir, MARKER_NAME)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            return RunMarker(str(doc["run_id"]), str(doc.get("host")), int(doc.get("pid", -1)),
                             str(doc.get("started")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return RunMarker(run_id="<unreadable marker>")
            time.sleep(0.05)


def taken(run_dir: str, run_name: str, why: str) -> ValueError:
    return ValueError(f"OPSD_PROFILE_RUN_NAME={run_name!r}: {run_dir} {why}; choose another name, or "
                      f"leave OPSD_PROFILE_RUN_NAME unset (each run then gets a fresh name)")


def refuse_file(run_dir: str, run_name: str) -> None:
    """``ValueError`` when something that is not a directory sits where the run directory goes."""
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise taken(run_dir, run_name, "is a file, not a run directory")


def check_owner(run_dir: str, run_name: str, run_ids, wait_s: float = MARKER_WAIT_S) -> bool:
    """``ValueError`` when ``run_dir`` belongs to another run; False when it has no marker yet.

    ``run_ids``: the ids of this run (None accepts any marker: the ranks cannot tell).
    """
    refuse_file(run_dir, run_name)
    owner = read_marker(run_dir, wait_s)
    if owner is None:
        try:
            entries = os.listdir(run_dir)
        except OSError:  # missing (a fresh run) or unreadable (make_run_dir warns)
            return False
        if MARKER_NAME in entries:  # another rank created it meanwhile
            owner = read_marker(run_dir, wait_s)
        elif entries:
            count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
            raise taken(run_dir, run_name, f"already holds files of another run ({count}, no {MARKER_NAME})")
    if owner is None:
        return False
    if run_ids is not None and owner.run_id not in run_ids:
        raise taken(run_dir, run_name, f"belongs to another run ({owner.describe()})")
    return True


def claim(run_dir: str, run_name: str, run_id: Optional[str]) -> None:
    """Make ``run_dir`` this run's (see the module docstring); ``ValueError`` when it is another's.

    ``run_id`` None: this rank cannot tell its run's id (accepts any marker; creates none).
    """
    ids = None if run_id is None else {run_id}
    if check_owner(run_dir, run_name, ids) or run_id is None:
        return
    path = os.path.join(run_dir, MARKER_NAME)
    marker = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another rank (of this run or not) was first
        check_owner(run_dir, run_name, ids)
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())


def check_name_free(run_dir: str, run_name: str, environ: Mapping[str, str]) -> None:
    """Before any work (rank 0 only): ``ValueError`` when ``run_dir`` already belongs to another run."""
    check_owner(run_dir, run_name, own_run_ids(environ), wait_s=0.0)
