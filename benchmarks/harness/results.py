"""Result files: one JSON schema for every benchmark, written atomically, and a reader of every older file.

A result file (``SCHEMA`` 1)::

    {"schema": 1,
     "meta": {"benchmark": "rl", "date": "2026-12-03 09:30", "gpu": "NVIDIA H200",
              "versions": {"python": ..., "torch": ..., "cuda": ..., "transformers": ..., "triton": ...,
                           "deepspeed": ...},
              "commit": "<git sha or label>", "command": ["python", "-m", "benchmarks.rl", "--cells", ...],
              ...what the benchmark adds (its settings, measured rates)},
     "rows": [{...one dataclass row...}, ...]}

Rows are dataclasses (``dataclasses.asdict``); non-finite floats are written as null (strict JSON:
``instrumentation.table.finite_json``).

:func:`read` also loads what the benchmarks wrote before this schema (``schema`` 0): ``{"meta": ..., "rows":
[...]}`` (``bench_rl``), a bare list of rows (``bench_rollout``, ``profile_decode_step``, ``bench_sampler``,
``bench_postprocess``), ``{"schema": "opsd-bench-multigpu/1", <meta keys>, "rows": [...]}`` (``bench_multigpu``)
and ``{..., "rows": [...]}`` with other keys beside the rows (``bench_ab``). Their rows carry the flat
``CallStats`` names of before 0.2 (``decode_path``, ``num_slots``, ...): :func:`upgrade_row` maps them to today's
dotted names (``rollout.stats.renamed``), at the top of a row (a dotted name there moves into its ``stats``) and
inside its ``stats`` and ``extra`` dicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rollout.stats import renamed
from instrumentation.export import write_atomic
from instrumentation.table import finite_json as finite

#: Version of the result files this module writes.
SCHEMA = 1
#: Nested dicts of a row that hold ``CallStats`` fields (``benchmarks.rl`` rows' ``stats``, ``benchmarks.suites``
#: rows' ``extra``).
STATS_KEYS = ("stats", "extra")
#: Meta keys of the older files -> today's (``versions`` is built from ``torch`` and ``transformers``).
OLD_META = {"bw_gbps": "copy_gbps", "started": "date"}


@dataclass
class Document:
    """A result file: its schema version (0: written before the schema), meta and rows (dicts)."""

    meta: dict
    rows: list
    schema: int = SCHEMA
    path: Optional[str] = field(default=None, compare=False)


def write(path: str, meta: dict, rows: Sequence) -> None:
    """``{"schema", "meta", "rows"}`` to ``path``, atomically (a temporary file renamed over it), so a run cut
    short leaves the last complete file. ``rows``: dataclasses (or dicts)."""
    plain = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]
    payload = finite({"schema": SCHEMA, "meta": meta, "rows": plain})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(payload, indent=1, allow_nan=False, default=str)  # a setting that is an object: its repr
    write_atomic(path, (text + "\n").encode("utf-8"))


def upgrade_row(row: dict) -> dict:
    """A row of any version with today's ``CallStats`` names: renamed at the top (a dotted name there, such as
    ``decode_path`` -> ``decode.path``, moves into the row's ``stats``) and inside its ``stats`` and ``extra``."""
    out = {}
    moved = {}
    for name, value in renamed(row).items():
        (moved if "." in name else out)[name] = value
    for key in STATS_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = renamed(out[key])
    if moved:
        out["stats"] = {**moved, **(out.get("stats") or {})}
    return out


def upgrade_meta(meta: dict) -> dict:
    """Meta of an older file with today's keys: ``versions`` from its flat ``torch``/``transformers``."""
    out = {OLD_META.get(k, k): v for k, v in meta.items()}
    if "versions" not in out:
        out["versions"] = {k: out.pop(k) for k in ("torch", "transformers") if k in out}
    return out


def parse(data, path: Optional[str] = None) -> Document:
    """A :class:`Document` of a file's parsed JSON (any version); ``ValueError`` when it holds no rows."""
    where = path or "<data>"
    if isinstance(data, list):
        return Document({}, [upgrade_row(r) for r in _row_dicts(data, where)], 0, path)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{where}: not a result file (no list of rows)")
    schema = data.get("schema")
    if schema == SCHEMA:
        return Document(dict(data.get("meta") or {}), _row_dicts(data["rows"], where), SCHEMA, path)
    if isinstance(schema, int):
        raise ValueError(f"{where}: schema {schema} is newer than this reader's ({SCHEMA})")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {
        k: v for k, v in data.items() if k not in ("rows", "schema")}
    if isinstance(schema, str):
        meta = {**meta, "format": schema}
    return Document(upgrade_meta(meta), [upgrade_row(r) for r in _row_dicts(data["rows"], where)], 0, path)


def _row_dicts(rows: list, where: str) -> list:
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{where}: rows must be JSON objects")
    return rows


def read(path: str) -> Document:
    """The result file at ``path``, of this schema or an older one (:func:`parse`)."""
    with open(path) as f:
        return parse(json.load(f), path)


def rows_of(cls, doc: Document, **defaults) -> list:
    """The document's rows as ``cls`` dataclasses: fields the class lacks are dropped, ``defaults`` fill the
    fields a row lacks (e.g. ``source``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return [cls(**{**defaults, **{k: v for k, v in row.items() if k in names}}) for row in doc.rows]
