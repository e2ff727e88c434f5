"""Teacher logit cache: the teacher's logits at response positions, kept for the distillation loss.

The teacher runs once per step over prompt + response; only the positions that the loss reads
(the mask of :func:`rollout.losses.response_logit_positions`) are kept, packed in row-major order
as ``[N, V]`` (full vocabulary) or ``[N, K]`` values plus ``[N, K]`` int32 ids (top-k), in a
low-precision dtype (bf16 by default). Storage lives either on the teacher's device or in host
memory. Host memory is page-locked (pinned) when CUDA is available, so device<->host copies are
issued with ``non_blocking=True`` and overlap other work; without CUDA it is plain memory (the
copies are then ordinary synchronous copies). The packed form is what
:func:`rollout.losses.generalized_jsd_loss` takes as ``teacher_logits`` directly::

    cache = TeacherLogitCache.build(teacher_logits[:, :-1], loss_mask, config)
    cached = cache.to_device(student_device)
    loss = generalized_jsd_loss(student_logits[:, :-1], cached.values, cached.mask,
                                beta, temperature, teacher_top_k_ids=cached.ids)
    cache.free()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Storage locations: on the teacher's device, or in (pinned when CUDA is available) host memory.
LOCATIONS = ("device", "host")


@dataclass(frozen=True)
class LogitCacheConfig:
    """How the teacher's logits are cached."""

    #: Keep only the teacher's ``top_k`` largest logits per position (and their ids); ``None``
    #: keeps the full vocabulary.
    top_k: int | None = None
    #: ``"device"``: storage stays on the teacher's device; ``"host"``: host memory, pinned when
    #: CUDA is available.
    location: str = "device"
    #: Storage dtype of the cached logits (the loss computes in float32 regardless).
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1; got {self.top_k!r}")
        if self.location not in LOCATIONS:
            raise ValueError(f"location must be one of {LOCATIONS}; got {self.location!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype; got {self.dtype!r}")


@dataclass(frozen=True)
class CachedTeacherLogits:
    """What the loss needs: packed teacher values, their ids (top-k) or None, and the mask."""

    #: ``[N, V]`` (full vocabulary) or ``[N, K]`` (top-k) teacher logits, N = ``mask.sum()``.
    values: torch.Tensor
    #: ``[N, K]`` int32 vocabulary ids of ``values`` (top-k), or None (full vocabulary).
    ids: torch.Tensor | None
    #: ``[B, T]`` bool mask over logits positions; its True entries, row-major, are the N rows.
    mask: torch.Tensor

    @property
    def num_positions(self) -> int:
        """Number of cached positions (N)."""
        return self.values.shape[0]


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory, pinned when CUDA is available (plain memory otherwise)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())


def _check_build_args(teacher_logits, mask, student_vocab_size, chunk_size) -> None:
    if teacher_logits.dim() != 3:
        raise ValueError(f"teacher_logits must be 3-D [B, T, V]; got {tuple(teacher_logits.shape)}")
    if mask.shape != teacher_logits.shape[:2]:
        raise ValueError(f"mask shape {tuple(mask.shape)} must match teacher_logits [B, T] = "
                         f"{tuple(teacher_logits.shape[:2])}")
    if student_vocab_size is not None and (isinstance(student_vocab_size, bool)
                                           or not isinstance(student_vocab_size, int)
                                           or student_vocab_size < 1):
        raise ValueError(f"student_vocab_size must be None or an int >= 1; got {student_vocab_size!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1; got {chunk_size!r}")


class TeacherLogitCache:
    """Teacher logits at the masked (response) positions, in bf16, on the device or the host.

    Build with :meth:`build`; read with :meth:`get` (storage where it lives) or :meth:`to_device`;
    release with :meth:`free` once the step's loss is computed.
    """

    def __init__(self, values: torch.Tensor, ids: torch.Tensor | None, mask: torch.Tensor,
                 config: LogitCacheConfig, ready: "torch.cuda.Event | None" = None):
        self.config = config
        self._values, self._ids, self._mask = values, ids, mask
        self._ready = ready  # recorded after device->host copies; None when nothing is pending

    @classmethod
    @torch.no_grad()
    def build(cls, teacher_logits: torch.Tensor, mask: torch.Tensor, config: LogitCacheConfig, *,
              student_vocab_size: int | None = None, chunk_size: int = 512) -> "TeacherLogitCache":
        """Cache ``teacher_logits`` ``[B, T, V_t]`` at the positions where ``mask`` ``[B, T]`` is 1.

        ``teacher_logits`` must already be aligned with ``mask`` (e.g. ``logits[:, :-1]`` with the
        mask of :func:`rollout.losses.response_logit_positions`). ``student_vocab_size``: when the
        teacher's vocabulary is larger, ids ``>= student_vocab_size`` are dropped before the top-k
        selection and storage (the shared-ids rule of :func:`rollout.losses.align_vocab`).
        Positions are processed ``chunk_size`` at a time, so no ``[N, V]`` copy in the teacher's
        dtype is made beyond the storage itself. Copies to host memory are non-blocking.
        """
        _check_build_args(teacher_logits, mask, student_vocab_size, chunk_size)
        vocab = teacher_logits.shape[-1] if student_vocab_size is None else min(
            teacher_logits.shape[-1], student_vocab_size)
        if config.top_k is not None and config.top_k > vocab:
            raise ValueError(f"top_k={config.top_k} exceeds the cached vocabulary size {vocab}")
        mask = mask.to(teacher_logits.device) != 0  # mask: [B, T] bool (a new tensor)
        rows = torch.nonzero(mask, as_tuple=True)  # 2 x [N]
        num_positions = rows[0].numel()
        if num_positions == 0:
            raise ValueError("mask selects no response position (it is all zeros)")
        width = vocab if config.top_k is None else config.top_k
        to_host = config.location == "host"
        values, ids = cls._allocate(num_positions, width, config, teacher_logits.device, to_host)
        for start in range(0, num_positions, chunk_size):
            stop = min(start + chunk_size, num_positions)
            part = teacher_logits[rows[0][start:stop], rows[1][start:stop], :vocab]  # part: [C, V]
            if config.top_k is not None:
                part, top_ids = torch.topk(part, config.top_k, dim=-1)  # both: [C, K]
                ids[start:stop].copy_(top_ids.to(torch.int32), non_blocking=to_host)
            values[start:stop].copy_(part.to(config.dtype), non_blocking=to_host)
        ready = None
        if to_host and teacher_logits.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(teacher_logits.device))
        return cls(values, ids, mask, config, ready)

    @classmethod
    @torch.no_grad()
    def from_rows(cls, values: torch.Tensor, config: LogitCacheConfig) -> "TeacherLogitCache":
        """Cache rows already packed at the loss positions (``[N, W]``, e.g. the teacher's final hidden
        states of :mod:`rollout.opsd.packed`), stored as :meth:`build` stores logits (dtype, location)."""
        if values.dim() != 2 or values.shape[0] == 0:
            raise ValueError(f"values must be [N, W] with N >= 1; got {tuple(values.shape)}")
        if config.top_k is not None:
            raise ValueError("packed rows are cached whole: top_k must be None")
        to_host = config.location == "host"
        storage, _ = cls._allocate(values.shape[0], values.shape[1], config, values.device, to_host)
        storage.copy_(values.to(config.dtype), non_blocking=to_host)
        ready = None
        if to_host and values.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(values.device))
        return cls(storage, None, None, config, ready)

    @staticmethod
    def _allocate(num_positions, width, config, device, to_host):
        """Storage: values ``[N, width]`` in ``config.dtype`` and ids ``[N, K]`` int32 (top-k)."""
        if to_host:
            values = _host_empty((num_positions, width), config.dtype)
            ids = None if config.top_k is None else _host_empty((num_positions, width), torch.int32)
            return values, ids
        values = torch.empty((num_positions, width), dtype=config.dtype, device=device)
        ids = None if config.top_k is None else torch.empty(
            (num_positions, width), dtype=torch.int32, device=device)
        return values, ids

    @property
    def is_freed(self) -> bool:
        """Whether :meth:`free` has released the storage."""
        return self._values is None

    @property
    def num_positions(self) -> int:
        """Number of cached positions (0 once freed)."""
        return 0 if self._values is None else self._values.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached values and ids (the small ``[B, T]`` mask not counted)."""
        if self._values is None:
            return 0
        return self._values.nbytes + (0 if self._ids is None else self._ids.nbytes)

    def _require_storage(self) -> None:
        if self._values is None:
            raise RuntimeError("TeacherLogitCache was freed; build a new one for the next step")

    def get(self) -> CachedTeacherLogits:
        """The cached tensors where they live; waits for pending device->host copies first."""
        self._require_storage()
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return CachedTeacherLogits(self._values, self._ids, self._mask)

    def _ordered_for(self, device: torch.device | str) -> torch.device:
        """``device``, once reads there are ordered after the build's pending copies (a stream wait
        on CUDA, a host wait otherwise)."""
        self._require_storage()
        device = torch.device(device)
        if self._ready is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._ready)
        elif self._ready is not None:
            self.get()
        return device

    def to_device(self, device: torch.device | str) -> CachedTeacherLogits:
        """The cached tensors on ``device``, copied with ``non_blocking=True`` (async from pinned
        host memory; ordered after the build's copies). Tensors already there are not copied."""
        device = self._ordered_for(device)
        async_copy = device.type == "cuda"  # device->host non_blocking would need a sync: avoid

        def move(tensor):
            return None if tensor is None else tensor.to(device, non_blocking=async_copy)

        return CachedTeacherLogits(move(self._values), move(self._ids), move(self._mask))

    def take(self, start: int, stop: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed positions ``start:stop`` (values ``[n, V|K]`` and top-k ids or None) on ``device``:
        views where the storage already lives there, else non-blocking copies as in :meth:`to_device`."""
        self._require_storage()
        if not 0 <= start <= stop <= self.num_positions:
            raise ValueError(f"positions {start}:{stop} lie outside the cache's {self.num_positions}")
        device = self._ordered_for(device)
        async_copy = device.type == "cuda"
        ids = None if self._ids is None else self._ids[start:stop].to(device, non_blocking=async_copy)
        return self._values[start:stop].to(device, non_blocking=async_copy), ids

    def free(self) -> None:
        """Release the storage (idempotent). Later :meth:`get`/:meth:`to_device` raise."""
        self._values = self._ids = self._mask = None
        self._ready = None

    def __repr__(self) -> str:
        if self.is_freed:
            return "TeacherLogitCache(freed)"
        return (f"TeacherLogitCache(num_positions={self.num_positions}, width={self._values.shape[1]}, "
                f"top_k={self.config.top_k}, location={self.config.location!r}, "
                f"dtype={self.config.dtype}, nbytes={self.nbytes})")
