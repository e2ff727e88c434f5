"""Event source over an Nsight Systems SQLite export (``nsys export --type sqlite``).

Yields the tuples of :mod:`traces.events`, so the report is the same as for a Chrome trace:

- ``RANGE`` from ``NVTX_EVENTS``: push/pop ranges (``eventType`` 59, NvtxPushPopRange) and
  start/end ranges (60, NvtxStartEndRange), the documented NVTX event type values; the name is
  ``COALESCE(text, StringIds.value)`` joined on ``textId`` (registered strings, as our ranges use,
  leave ``text`` null). Markers and other rows are not ranges. A range without an end (still open
  when the capture stopped) is skipped and counted as malformed (one warning). The thread of a
  range is the one that opened it.
- Domains: the domain-create rows (``eventType`` 75) give each ``domainId`` its name; domain ids
  are per process. ``domain`` keeps only the ranges of that domain (``"opsd"`` for ours; ``""``
  for the default domain of the non-domain API); None keeps all.
- ``LAUNCH`` from ``CUPTI_ACTIVITY_KIND_RUNTIME`` and, when present, ``CUPTI_ACTIVITY_KIND_DRIVER``
  (kernels launched through the driver API); calls named in ``traces.events.SYNC_CALLS`` (name from
  ``nameId``, a ``_v2``-style suffix ignored) are ``SYNC`` tuples instead. ``GPU`` from
  ``CUPTI_ACTIVITY_KIND_KERNEL`` (name from ``shortName``), ``_MEMCPY`` and ``_MEMSET`` (named
  ``Memcpy`` / ``Memset``), with their ``streamId``. They are linked by ``correlationId``, which is unique only within
  a process: the key is ``(pid << 32) | correlationId`` on both sides (process from ``globalTid`` /
  ``globalPid``), so one report of several processes projects correctly (an export whose GPU
  tables lack ``globalPid`` is keyed by ``correlationId`` alone).
- Process and thread ids are decoded from the serialized ``globalTid`` (``pid = globalTid /
  0x1000000 % 0x1000000``, ``tid = globalTid % 0x1000000``) as the export's documentation says.

Times are nanoseconds in the database and microseconds in the tuples. The export has no
allocator samples in our sense, so peak memory is null; it has no rank either: name one report per
rank ``rank{R}...sqlite`` (e.g. ``nsys profile -o rank%q{RANK}``) or the file's index is used.
Rows are read through cursors (the database is never loaded whole); only the columns a table has
are selected, so older or trimmed exports work.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Iterator, Optional

from traces.events import GPU, LAUNCH, META, RANGE, SYNC, TraceError, is_sync_call

#: NVTX event type values of the export schema: NvtxPushPopRange, NvtxStartEndRange;
#: NvtxDomainCreate (others: 33 NvtxCategory, 34 NvtxMark, 39 NvtxThread, 76 NvtxDomainDestroy).
RANGE_EVENT_TYPES = (59, 60)
DOMAIN_CREATE_EVENT_TYPE = 75
#: Serialized ids: ``globalTid = ... | pid << 24 | tid`` (24 bits each).
_ID_BITS = 24
_ID_MASK = (1 << _ID_BITS) - 1
_CORRELATION_BITS = 32
_SQLITE_MAGIC = b"SQLite format 3\x00"
_LAUNCH_TABLES = ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER")
_GPU_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
_NS_PER_US = 1000.0


def is_sqlite_file(path: str) -> bool:
    """Whether ``path`` is an SQLite database (by its header; False when unreadable)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    except OSError:
        return False


def pid_of(global_id) -> int:
    """The process id of a serialized ``globalTid`` / ``globalPid`` (0 when null)."""
    return (int(global_id) >> _ID_BITS) & _ID_MASK if global_id is not None else 0


def tid_of(global_tid) -> int:
    """The thread id of a serialized ``globalTid`` (0 when null)."""
    return int(global_tid) & _ID_MASK if global_tid is not None else 0


def _correlation_key(pid: int, correlation: int) -> int:
    return (pid << _CORRELATION_BITS) | (int(correlation) & ((1 << _CORRELATION_BITS) - 1))


def _connect(path: str) -> sqlite3.Connection:
    """Open read-only (never creating a file); TraceError for anything that is not a database."""
    if not os.path.exists(path):
        raise TraceError(path, "no such file")
    if os.path.isdir(path):
        raise TraceError(path, "is a directory")
    if os.path.getsize(path) == 0:
        raise TraceError(path, "empty file")
    if not is_sqlite_file(path):
        raise TraceError(path, "not an SQLite database (expected an 'nsys export --type sqlite' file)")
    try:
        from urllib.parse import quote

        return sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise TraceError(path, f"cannot open the database ({exc})") from None


def _columns(conn: sqlite3.Connection, table: str) -> Optional[set]:
    """Column names of ``table``, None when the table does not exist."""
    rows = conn.execute(f"PRAGMA table_info({table})").fetchall()
    return {row[1] for row in rows} if rows else None


def _col(columns: set, name: str, alias: str = "e") -> str:
    return f'{alias}."{name}"' if name in columns else "NULL"


def _name_expr(conn, columns: set) -> tuple[str, str]:
    """(SELECT expression of the name, JOIN clause) for the NVTX table ``e``."""
    has_strings = _columns(conn, "StringIds") is not None and "textId" in columns
    text = _col(columns, "text")
    if has_strings:
        return f"COALESCE({text}, s.value)", 'LEFT JOIN StringIds AS s ON s.id = e."textId"'
    return text, ""


def _domains(conn, columns: set, name_expr: str, join: str) -> dict:
    """``(pid, domainId) -> name`` from the domain-create rows."""
    if "eventType" not in columns or "domainId" not in columns:
        return {}
    sql = (f'SELECT {_col(columns, "globalTid")}, e."domainId", {name_expr} FROM NVTX_EVENTS AS e {join} '
           f'WHERE e."eventType" = {DOMAIN_CREATE_EVENT_TYPE}')
    return {(pid_of(gtid), domain_id): name or "" for gtid, domain_id, name in conn.execute(sql)}


def _nvtx_ranges(conn, path: str, domain: Optional[str]) -> Iterator[tuple]:
    columns = _columns(conn, "NVTX_EVENTS")
    if columns is None:
        raise TraceError(path, "no NVTX_EVENTS table (not an nsys SQLite export, or no NVTX range "
                               "was recorded: profile with --trace=nvtx)")
    missing = {"start", "end"} - columns
    if missing or not ({"text", "textId"} & columns):
        need = sorted(missing) or ["text or textId"]
        raise TraceError(path, f"NVTX_EVENTS lacks column(s) {', '.join(need)}")
    name_expr, join = _name_expr(conn, columns)
    domains = _domains(conn, columns, name_expr, join)
    where = f'WHERE e."eventType" IN {RANGE_EVENT_TYPES}' if "eventType" in columns else ""
    sql = (f'SELECT e."start", e."end", {_col(columns, "globalTid")}, {_col(columns, "domainId")}, '
           f"{name_expr} FROM NVTX_EVENTS AS e {join} {where}")
    num_open = 0
    for start, end, gtid, domain_id, name in conn.execute(sql):
        pid = pid_of(gtid)
        if domain is not None and domains.get((pid, domain_id), "") != domain:
            continue
        if end is None or start is None or end < start:
            num_open += 1
            continue
        yield (RANGE, name or "", pid, tid_of(gtid), start / _NS_PER_US, (end - start) / _NS_PER_US)
    if num_open:
        yield (META, "malformed", num_open)


def _present(conn, tables: tuple, required: set) -> list[tuple[str, set]]:
    """``(table, columns)`` of the tables that exist and have the ``required`` columns."""
    found = []
    for table in tables:
        columns = _columns(conn, table)
        if columns is not None and required <= columns:
            found.append((table, columns))
    return found


def _string_join(conn, columns: set, column: str) -> tuple[str, str]:
    """(SELECT expression, JOIN clause) of the registered string named by ``e.<column>``."""
    if column in columns and _columns(conn, "StringIds") is not None:
        return "s.value", f'LEFT JOIN StringIds AS s ON s.id = e."{column}"'
    return "NULL", ""


def _launches(conn, tables, by_process: bool) -> Iterator[tuple]:
    """LAUNCH tuples of the API calls, SYNC tuples of those that wait for the GPU (by name)."""
    for table, columns in tables:
        name, join = _string_join(conn, columns, "nameId")
        sql = (f'SELECT e."start", {_col(columns, "end")}, {_col(columns, "globalTid")}, '
               f'e."correlationId", {name} FROM {table} AS e {join}')
        for start, end, gtid, correlation, api in conn.execute(sql):
            if start is None:
                continue
            pid = pid_of(gtid)
            if api and is_sync_call(api.split("_v", 1)[0]) and end is not None:
                yield (SYNC, pid, tid_of(gtid), start / _NS_PER_US, (end - start) / _NS_PER_US)
            elif correlation is not None:
                key = _correlation_key(pid if by_process else 0, correlation)
                yield (LAUNCH, pid, tid_of(gtid), start / _NS_PER_US, key)


#: Names of the GPU ops of the tables without a name column (the prefixes Kineto uses too).
_OP_NAMES = {"CUPTI_ACTIVITY_KIND_MEMCPY": "Memcpy", "CUPTI_ACTIVITY_KIND_MEMSET": "Memset"}


def _gpu_ops(conn, tables, by_process: bool) -> Iterator[tuple]:
    for table, columns in tables:
        name, join = _string_join(conn, columns, "shortName")
        sql = (f'SELECT e."start", e."end", {_col(columns, "globalPid")}, e."correlationId", '
               f'{_col(columns, "deviceId")}, {name}, {_col(columns, "streamId")} FROM {table} AS e {join}')
        for start, end, gpid, correlation, device, op, stream in conn.execute(sql):
            if correlation is None or start is None or end is None:
                continue
            key = _correlation_key(pid_of(gpid) if by_process else 0, correlation)
            yield (GPU, key, start / _NS_PER_US, (end - start) / _NS_PER_US, device,
                   op or _OP_NAMES.get(table, "kernel"), -1 if stream is None else int(stream))


def read_nsys_sqlite(path: str, domain: Optional[str] = None) -> Iterator[tuple]:
    """Yield the event tuples of an nsys SQLite export (an :class:`~traces.events.EventSource`).

    ``domain`` keeps only the NVTX ranges of that domain (None: every domain). Raises
    :class:`~traces.events.TraceError` for a missing or empty file, a file that is not an SQLite
    database, a corrupt database, or one without an ``NVTX_EVENTS`` table.
    """
    conn = _connect(path)
    try:
        yield from _nvtx_ranges(conn, path, domain)
        launch_tables = _present(conn, _LAUNCH_TABLES, {"start", "correlationId"})
        gpu_tables = _present(conn, _GPU_TABLES, {"start", "end", "correlationId"})
        # correlation ids are per process: key them by process when every GPU table names it
        by_process = all("globalPid" in columns for _, columns in gpu_tables)
        yield from _launches(conn, launch_tables, by_process)
        yield from _gpu_ops(conn, gpu_tables, by_process)
    except sqlite3.Error as exc:
        raise TraceError(path, f"cannot read the database ({exc})") from None
    finally:
        conn.close()
