"""The BLAS backend a rollout call's GEMMs run on (``RolloutConfig.kernels.blas_library``).

PyTorch picks cuBLAS or cuBLASLt for its matrix products from one process-wide setting
(``torch.backends.cuda.preferred_blas_library``). A call sets the backend its config asks for while it runs
and puts the caller's back afterwards, so the training step around it keeps its own; the CUDA graphs a call
captures keep the kernels chosen while they were captured.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from rollout.config import TUNED_BLAS
from rollout.ops import tuned_gemm


#: Our backend names that are another name to torch: the tuned products run on cuBLASLt, as torch's own do.
TORCH_BACKENDS = {"cublaslt-tuned": "cublaslt"}


def _name(backend) -> str:
    """A backend as torch's getter returns it (``_BlasBackend.Cublaslt``), lower-case (``"cublaslt"``)."""
    return str(backend).rsplit(".", 1)[-1].lower()


def current() -> str:
    """The process's preferred BLAS backend, lower-case (``"cublas"``, ``"cublaslt"``, ...)."""
    return _name(torch.backends.cuda.preferred_blas_library())


@contextlib.contextmanager
def blas_library(name: Optional[str], device: torch.device) -> Iterator[str]:
    """Run the block with ``name`` as the preferred BLAS backend on a CUDA ``device`` and restore the previous
    one after it, whatever happens in the block. Yields the backend in effect (``""`` off CUDA, where no
    BLAS backend is chosen). ``None`` changes nothing; a backend this PyTorch build lacks leaves the current
    one and says so in the yielded text."""
    if device.type != "cuda":
        yield ""
        return
    before = torch.backends.cuda.preferred_blas_library()
    in_effect, changed = _name(before), False
    backend = TORCH_BACKENDS.get(name, name)
    if backend is not None and backend != in_effect:
        try:
            torch.backends.cuda.preferred_blas_library(backend)
            in_effect, changed = name, True
        except RuntimeError as exc:  # e.g. a build without cuBLASLt
            in_effect = f"{in_effect} ({name} unavailable: {exc})"
    elif backend is not None:
        in_effect = name
    try:
        yield in_effect
    finally:
        if changed:
            torch.backends.cuda.preferred_blas_library(before)


def tuner_of(name: Optional[str], device: torch.device) -> Optional["tuned_gemm.TunedGemm"]:
    """The process's :class:`rollout.ops.tuned_gemm.TunedGemm` of ``device`` where a call's decode projections are
    tuned (``name`` ``"cublaslt-tuned"`` on CUDA), else None: what ``FastStep`` hands its step
    (``StepFns.tuned``) and what a call's ``CallStats.blas_tune_ms`` and ``blas_untuned`` are counted from."""
    if name != TUNED_BLAS or device.type != "cuda":
        return None
    return tuned_gemm.tuner(device.index if device.index is not None else torch.cuda.current_device())
