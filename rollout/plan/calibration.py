"""Calibrated ``CostModel`` coefficients: the fit, the metadata they are valid for, save and load.

A calibration measures three things on one model/device/dtype/attention backend
(``scripts/calibrate_prefill.py`` does the measuring):

- prefill forwards of shape ``(B, L)``:  ``ms ~ fixed + token * B*L + attention * GFLOPs(B, L)``;
- the copy of a bucket's keys/values into the aligned cache:  ``ms ~ kv * MiB(B, L)`` (measured
  apart from the forward because ``MiB`` is proportional to ``B*L``: one fit could not tell the
  token and KV coefficients apart);
- decode: the continuous route's extra milliseconds per decode step over the ordinary route,
  ``extra_ms ~ decode * steps``;
- the packed prefill's (:mod:`rollout.fast_prefill`) extra milliseconds when the same rows are split
  into ``k`` attention groups instead of one: ``extra_ms ~ group * (k - 1)``.

Prefill samples time the path the engine runs for this model (the packed prefill for Llama-family
models, else the HF forward); the metadata records which (read from the model by
:mod:`rollout.model.costs`; this module is pure: fits, files and their checks).

Each is a non-negative least-squares fit (``scipy.optimize.nnls``). The JSON file records the
metadata the numbers depend on; ``load_cost_model`` refuses a file whose metadata differs from the
current run's, naming the first mismatching key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from rollout.plan.planner import CostModel

FORMAT_VERSION = 1
#: Sources whose behaviour the coefficients describe (relative to the repository root).
FINGERPRINT_SOURCES = ("rollout/plan/planner.py", "rollout/plan/layout.py", "rollout/cache/aligned.py",
                       "rollout/cache/static.py", "rollout/model/prefill.py",
                       "rollout/executors/continuous/loop.py", "rollout/executors/continuous/state.py",
                       "rollout/executors/continuous/prefill.py")


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill forward (no KV copy)."""

    batch_size: int
    length: int
    forward_ms: float


@dataclass(frozen=True)
class CopySample:
    """One measured copy of a ``(batch_size, length)`` bucket's keys/values into the aligned cache."""

    batch_size: int
    length: int
    copy_ms: float


@dataclass(frozen=True)
class DecodeSample:
    """Extra milliseconds of the continuous route over the ordinary one across ``num_steps`` decode steps."""

    num_steps: int
    extra_ms: float


@dataclass(frozen=True)
class GroupSample:
    """Extra milliseconds of a packed prefill split into ``num_groups`` attention groups over one group."""

    num_groups: int
    extra_ms: float


def _nnls(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares with columns scaled to unit max (the columns span many magnitudes)."""
    from scipy.optimize import nnls

    scale = np.abs(columns).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(columns / scale, target)
    return solution / scale


def fit_cost_model(geometry: CostModel, prefill: Sequence[PrefillSample], copies: Sequence[CopySample] = (),
                   decode: Sequence[DecodeSample] = (), groups: Sequence[GroupSample] = ()) -> CostModel:
    """``geometry`` with coefficients fitted to the samples; a term without samples keeps ``geometry``'s value.

    Needs at least 3 prefill samples with distinct ``(B*L, GFLOPs)`` to determine its 3 coefficients.
    """
    if len(prefill) < 3:
        raise ValueError(f"prefill: need at least 3 samples to fit 3 coefficients; got {len(prefill)}")
    columns = np.array([[1.0, s.batch_size * s.length, geometry.attention_gflops(s.batch_size, s.length)]
                        for s in prefill])  # [n, 3]
    fixed, token, attention = _nnls(columns, np.array([s.forward_ms for s in prefill]))
    values = dict(prefill_fixed_cost_ms=fixed, prefill_token_cost_ms=token, prefill_attention_cost_ms=attention)
    if copies:
        mib = np.array([[geometry.kv_mib(s.batch_size, s.length)] for s in copies])
        values["prefill_kv_cost_ms"] = _nnls(mib, np.array([s.copy_ms for s in copies]))[0]
    if decode:
        steps = np.array([[float(s.num_steps)] for s in decode])
        values["continuous_decode_cost_ms"] = _nnls(steps, np.array([s.extra_ms for s in decode]))[0]
    if groups:
        extra = np.array([[float(s.num_groups - 1)] for s in groups])
        values["prefill_group_cost_ms"] = _nnls(extra, np.array([s.extra_ms for s in groups]))[0]
    data = geometry.to_dict()
    data.update({name: float(value) for name, value in values.items()})
    return CostModel.from_dict(data)


def source_fingerprint(root: Path | None = None, sources: Sequence[str] = FINGERPRINT_SOURCES) -> str:
    """sha256 over ``sources`` (path and bytes of each, in order), relative to the repository root.
    A listed file that does not exist raises ``FileNotFoundError``: it must never hash to a constant."""
    root = root or Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for name in sources:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"FINGERPRINT_SOURCES: {name} does not exist under {root}; update the list")
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def save_calibration(path, cost_model: CostModel, metadata: dict, samples: dict | None = None) -> None:
    """Write ``{"format", "cost_model", "metadata", "samples"}`` as JSON (samples: lists of sample dataclasses)."""
    record = {"format": FORMAT_VERSION, "cost_model": cost_model.to_dict(), "metadata": metadata,
              "samples": {name: [asdict(s) for s in rows] for name, rows in (samples or {}).items()}}
    Path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_calibration(path) -> dict:
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        raise ValueError(f"path: {path} is not a calibration file of format {FORMAT_VERSION}")
    for key in ("cost_model", "metadata"):
        if not isinstance(record.get(key), dict):
            raise ValueError(f"path: {path} has no {key!r} object")
    return record


def check_readable(path: str) -> None:
    """``ValueError`` naming ``routing.cost_model`` unless ``path`` reads as a calibration file (one small JSON)."""
    try:
        read_calibration(path)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"routing.cost_model: cannot read {path!r} as a calibration file "
                         f"({type(exc).__name__}: {exc})") from None


def _mismatches(saved: dict, current: dict, prefix: str = "") -> Iterable[tuple[str, object, object]]:
    for key in sorted(set(saved) | set(current)):
        have, want = saved.get(key), current.get(key)
        if isinstance(have, dict) and isinstance(want, dict):
            yield from _mismatches(have, want, f"{prefix}{key}.")
        elif have != want:
            yield f"{prefix}{key}", have, want


def check_metadata(saved: dict, current: dict, ignore: Sequence[str] = ()) -> None:
    """``ValueError`` naming the first key (dotted for geometry) whose saved value differs from the current one."""
    for key, have, want in _mismatches(saved, current):
        if key not in ignore:
            raise ValueError(f"metadata.{key}: the calibration file has {have!r} but this run has {want!r}; "
                             "recalibrate (scripts/calibrate_prefill.py) for this configuration")
