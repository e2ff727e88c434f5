"""Event source over an Nsight Systems SQLite export (``nsys export --type sqlite``).

Yields the tuples of :mod:`traces.events`, so the report is the same as for a Chrome trace:

- ``RANGE`` from ``NVTX_EVENTS``: push/pop ranges (``eventType`` 59, NvtxPushPopRange) and
  start/end ranges (60, NvtxStartEndRange), the documented NVTX event type values; the name is
  ``COALESCE(text, StringIds.value)`` joined on ``textId`` (registered strings, as our ranges use,
  leave ``text`` null). Markers and other rows are not ranges. A range without an end (still open
  when the capture stopped) is skipped as a bad event (one warning per file). The thread of a
  range is the one that opened it.
- A row holding text (or anything but a number) where a number belongs is skipped as a bad event;
  the other rows are read.
- Domains: the domain-create rows (``eventType`` 75) give each ``domainId`` its name; domain ids
  are per process. ``domain`` keeps only the ranges of that domain (``"opsd"`` for ours; ``""``
  for the default domain of the non-domain API); None keeps all. A domain that no range of the file is in,
  while ranges of other domains are, is a note naming those (a misspelt domain would drop the file's ranges).
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

from traces.bad import BAD, BadEvent, example
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


def _int(value, what: str) -> int:
    if type(value) is not int:
        raise BadEvent(f"{what} not an integer")
    return value


def _us(value, what: str) -> float:
    """Nanoseconds of the database as microseconds; :class:`BadEvent` for anything but a number."""
    if type(value) not in (int, float):
        raise BadEvent(f"{what} not a number")
    return value / _NS_PER_US


def pid_of(global_id) -> int:
    """The process id of a serialized ``globalTid`` / ``globalPid`` (0 when null)."""
    return (_int(global_id, "globalTid") >> _ID_BITS) & _ID_MASK if global_id is not None else 0


def tid_of(global_tid) -> int:
    """The thread id of a serialized ``globalTid`` (0 when null)."""
    return _int(global_tid, "globalTid") & _ID_MASK if global_tid is not None else 0


def _example(name, start_ns) -> str:
    """The warning's example of a row: its name and start in microseconds (as in the tuples)."""
    start = start_ns / _NS_PER_US if type(start_ns) in (int, float) else None
    return example(name if isinstance(name, str) else None, start)


def _rows(conn, sql: str, convert) -> Iterator[tuple]:
    """``convert(row)`` of each row (a tuple or None); a row that cannot be converted is a BAD tuple."""
    for row in conn.execute(sql):
        try:
            tup = convert(row)
        except (BadEvent, TypeError, ValueError, OverflowError) as exc:
            reason = exc.reason if isinstance(exc, BadEvent) else f"fields of the wrong type ({type(exc).__name__})"
            tup = (BAD, reason, _example(row[-1], row[0]))
        if tup is not None:
            yield tup


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
    domains = {}
    for gtid, domain_id, name in conn.execute(sql):
        try:
            domains[(pid_of(gtid), domain_id)] = str(name or "")
        except BadEvent:  # its ranges fall in the default domain; they are counted there if bad
            continue
    return domains


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

    kept, other = [0], set()  # ranges of the domain; names of the other domains met

    def convert(row):
        start, end, gtid, domain_id, name = row
        pid = pid_of(gtid)
        if domain is not None and domains.get((pid, domain_id), "") != domain:
            other.add(domains.get((pid, domain_id), ""))
            return None
        kept[0] += 1
        if start is None or end is None:
            return (BAD, "no end (range still open)", _example(name, start))
        start_us, end_us = _us(start, "start"), _us(end, "end")
        return (RANGE, str(name or ""), pid, tid_of(gtid), start_us, end_us - start_us)

    yield from _rows(conn, sql, convert)
    if other and not kept[0]:  # a misspelt domain would otherwise leave this file's ranges out silently
        names = ", ".join(repr(d) if d else "the default domain" for d in sorted(other))
        yield (META, "note", f"--nvtx-domain {domain!r}: no NVTX range of that domain here, only of {names}: "
                             "every range left out")


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
        yield from _rows(conn, sql, lambda row: _launch(row, by_process))


def _launch(row, by_process: bool):
    start, end, gtid, correlation, api = row
    if start is None:
        return None
    pid = pid_of(gtid)
    if isinstance(api, str) and is_sync_call(api.split("_v", 1)[0]) and end is not None:
        return (SYNC, pid, tid_of(gtid), _us(start, "start"), _us(end, "end") - _us(start, "start"))
    if correlation is None:
        return None
    key = _correlation_key(pid if by_process else 0, _int(correlation, "correlationId"))
    return (LAUNCH, pid, tid_of(gtid), _us(start, "start"), key)


#: Names of the GPU ops of the tables without a name column (the prefixes Kineto uses too).
_OP_NAMES = {"CUPTI_ACTIVITY_KIND_MEMCPY": "Memcpy", "CUPTI_ACTIVITY_KIND_MEMSET": "Memset"}


def _gpu_ops(conn, tables, by_process: bool) -> Iterator[tuple]:
    for table, columns in tables:
        name, join = _string_join(conn, columns, "shortName")
        sql = (f'SELECT e."start", e."end", {_col(columns, "globalPid")}, e."correlationId", '
               f'{_col(columns, "deviceId")}, {_col(columns, "streamId")}, {name} FROM {table} AS e {join}')
        default = _OP_NAMES.get(table, "kernel")
        yield from _rows(conn, sql, lambda row: _gpu_op(row, by_process, default))


def _gpu_op(row, by_process: bool, default_name: str):
    start, end, gpid, correlation, device, stream, op = row
    if correlation is None or start is None or end is None:
        return None
    key = _correlation_key(pid_of(gpid) if by_process else 0, _int(correlation, "correlationId"))
    start_us = _us(start, "start")
    return (GPU, key, start_us, _us(end, "end") - start_us, device, str(op or default_name),
            -1 if stream is None else _int(stream, "streamId"))


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
