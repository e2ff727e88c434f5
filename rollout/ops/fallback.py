"""One policy for our Triton kernels that cannot compile or launch: say it once, record it, run PyTorch.

Each kernel module keeps a dict of failures (its key: a device, or a device and input kind); a recorded failure
makes that module's ``unsupported_reason`` send later calls to its PyTorch path, and the executors read it to
choose the step's pieces."""

from __future__ import annotations

import warnings


def launch_or_fall_back(failed: dict, key, what: str, instead: str, launch, fallback):
    """``launch()``; if it raises, ``failed[key]`` = why, one ``RuntimeWarning`` ("<what> failed: ...;
    <instead>"), and ``fallback()``'s result."""
    try:
        return launch()
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: PyTorch, said once
        why = f"{what} failed: {type(exc).__name__}: {exc}"[:300]
        failed[key] = why
        warnings.warn(f"{why}; {instead}", RuntimeWarning, stacklevel=3)
        return fallback()
