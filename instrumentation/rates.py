"""The device's peak rates that work is divided by: bf16 FLOP/s and copy bytes/s (torch imported lazily).

Each rate is the user's (``OPSD_PEAK_TFLOPS``, ``OPSD_PEAK_TBPS``: a number > 0; ``scripts/train_opsd.py``'s
``--peak-tflops`` / ``--peak-tbps`` set them), else the one measured on the GPU once per profiler session
(:func:`instrumentation.probe.probe_rates`: a device copy and a bf16 GEMM timed with CUDA events, well under a second), else the data
sheet's for a known GPU (:data:`instrumentation.mfu.PEAK_TFLOPS`, :data:`PEAK_TBPS`), else None (the CPU, an
unknown GPU: work is recorded, no roofline). :func:`resolve_rates` says which (``env``, ``measured``,
``datasheet``). Copy bytes/s counts bytes read + written, as :class:`instrumentation.roofline.Rates`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

from instrumentation.mfu import peak_flops
from instrumentation.roofline import Rates

ENV_PEAK_TFLOPS = "OPSD_PEAK_TFLOPS"
ENV_PEAK_TBPS = "OPSD_PEAK_TBPS"
#: Device name substring -> memory bandwidth of the data sheet, TB/s (SXM parts; the first match wins).
PEAK_TBPS: dict[str, float] = {"H200": 4.8, "H100": 3.35, "A100-SXM4-80GB": 2.039, "A100": 1.555}


def parse_rate(raw: str, var: str) -> Optional[float]:
    """The value of ``var`` (empty: None); ``ValueError`` naming ``var`` unless a finite number > 0."""
    text = raw.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        shown = repr(raw) if len(raw) <= 40 else f"{raw[:30]!r}...({len(raw)} characters)"
        raise ValueError(f"{var}={shown} is not valid; accepted: a finite number > 0")
    return value


def check_rates(environ: Mapping[str, str]) -> None:
    """``ValueError`` naming the variable when ``OPSD_PEAK_TFLOPS`` or ``OPSD_PEAK_TBPS`` is set but not valid."""
    for var in (ENV_PEAK_TFLOPS, ENV_PEAK_TBPS):
        parse_rate(environ.get(var, ""), var)


def peak_tbps(device_name: str) -> Optional[float]:
    """Data-sheet memory bandwidth of ``device_name`` (TB/s), None when unknown."""
    return next((tbps for part, tbps in PEAK_TBPS.items() if part in device_name), None)


def device_name() -> str:
    """``torch.cuda.get_device_name()`` when torch is loaded with a GPU, else ``"cpu"``."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.get_device_name() if torch is not None and torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no name, no table rate
        return "cpu"


@dataclass(frozen=True)
class DeviceRates:
    """The rates a run's work is divided by, and where each came from (None: unknown)."""

    peak_flops_s: Optional[float]
    copy_bytes_s: Optional[float]
    peak_flops_source: Optional[str] = None
    """``env``, ``measured`` or ``datasheet``."""
    copy_bytes_source: Optional[str] = None


def _pick(user: Optional[float], measured: Optional[float], sheet: Optional[float]) -> tuple:
    for value, source in ((user, "env"), (measured, "measured"), (sheet, "datasheet")):
        if value is not None:
            return value, source
    return None, None


def resolve_rates(environ: Mapping[str, str], name: str, measured: Optional[Rates] = None) -> DeviceRates:
    """The rates of device ``name``: the user's, else ``measured``, else the data sheet's (module docstring)."""
    tflops, tbps = parse_rate(environ.get(ENV_PEAK_TFLOPS, ""), ENV_PEAK_TFLOPS), \
        parse_rate(environ.get(ENV_PEAK_TBPS, ""), ENV_PEAK_TBPS)
    sheet_tbps = peak_tbps(name)
    flops_s = _pick(tflops * 1e12 if tflops is not None else None,
                    measured.gemm_flops_s if measured is not None else None, peak_flops(name))
    copy_s = _pick(tbps * 1e12 if tbps is not None else None, measured.copy_bytes_s if measured is not None else None,
                   sheet_tbps * 1e12 if sheet_tbps is not None else None)
    return DeviceRates(flops_s[0], copy_s[0], flops_s[1], copy_s[1])


def device_rates(environ: Mapping[str, str], name: str) -> tuple[Optional[float], Optional[float]]:
    """``(peak FLOP/s, copy bytes/s)`` of device ``name`` without a measurement (the user's, else the data sheet's)."""
    rates = resolve_rates(environ, name)
    return rates.peak_flops_s, rates.copy_bytes_s
