"""DeepSpeed ZeRO-3 helpers for the rollout core: detection, gathering, and lockstep decoding.

Two gather modes (``RolloutConfig.gather``):

- ``"once"``: every ZeRO-3 parameter is all-gathered once when :func:`gathered` is entered and
  stays resident until it exits. Inside, ZeRO-3's per-module forward hooks are suspended (when the
  DeepSpeed engine is passed) and every parameter is pinned, so forwards neither re-gather nor
  release anything: a plain ``module(...)`` runs on full weights. Costs one full copy of the
  model per rank for the duration.
- ``"per_forward"``: nothing is done here; ZeRO-3's own hooks gather each module's parameters for
  its forward and release them afterwards (low memory, one all-gather per module per forward).
  Every rank must then run the same number of forwards: see :func:`any_rank_busy`.

Nothing here imports DeepSpeed unless a ZeRO-3 model is actually being gathered.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

#: Valid values of the ``gather`` mode, in documentation order.
GATHER_MODES: tuple[str, ...] = ("once", "per_forward")

#: Sentinel added to ``param.ds_active_sub_modules`` while pinned. ZeRO-3 releases a parameter
#: only when that set is empty; real entries are module ``ds_id``s, which are never negative.
_PIN_ID = -1


def world_size() -> int:
    """Number of ranks of the default process group (1 when torch.distributed is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def rank() -> int:
    """This process's rank in the default process group (0 when not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _is_engine(obj) -> bool:
    """True for a DeepSpeed engine (duck-typed: it answers ``zero_optimization_stage()``)."""
    return callable(getattr(obj, "zero_optimization_stage", None)) and hasattr(obj, "module")


def _is_zero_param(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def is_zero3(module_or_engine) -> bool:
    """Whether the parameters of ``module_or_engine`` are ZeRO-3 partitioned.

    A DeepSpeed engine answers from its config (``zero_optimization_stage() == 3``); any other
    module is ZeRO-3 when one of its parameters carries DeepSpeed's ``ds_id``/``ds_status``.
    """
    if _is_engine(module_or_engine):
        return module_or_engine.zero_optimization_stage() == 3
    if not isinstance(module_or_engine, torch.nn.Module):
        raise TypeError(f"module_or_engine must be a torch.nn.Module or a DeepSpeed engine; "
                        f"got {type(module_or_engine).__name__}")
    return any(_is_zero_param(p) for p in module_or_engine.parameters())


def check_gather_mode(mode: str) -> str:
    """Return ``mode`` when valid, else raise ``ValueError`` naming ``gather``."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather must be one of {', '.join(map(repr, GATHER_MODES))}; got {mode!r}")
    return mode


def _zero3_offload(engine):
    """The engine's ZeRO-3 parameter-offload object (owner of the per-module hooks), or None."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    needed = ("forward_hooks", "backward_hooks", "_register_deepspeed_module", "module")
    return offload if all(hasattr(offload, name) for name in needed) else None


def _suspend_hooks(offload) -> bool:
    """Remove ZeRO-3's per-module fetch/release hooks; True when there were hooks to remove."""
    if offload is None or not (offload.forward_hooks or offload.backward_hooks):
        return False
    for handle in (*offload.forward_hooks, *offload.backward_hooks):
        handle.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []
    return True


def _restore_hooks(offload) -> None:
    """Register ZeRO-3's per-module hooks again (DeepSpeed also invalidates its fetch trace)."""
    offload._register_deepspeed_module(offload.module)


def _pin(params: list[torch.nn.Parameter]) -> None:
    for param in params:
        param.ds_active_sub_modules.add(_PIN_ID)


def _unpin(params: list[torch.nn.Parameter]) -> None:
    for param in params:
        param.ds_active_sub_modules.discard(_PIN_ID)


@contextmanager
def gathered(module, mode: str) -> Iterator[None]:
    """Make ZeRO-3 parameters of ``module`` (a module or a DeepSpeed engine) usable per ``mode``.

    ``mode="once"``: all-gather every ZeRO-3 parameter on entry (read-only: ``modifier_rank=None``,
    so in-place changes are not written back and must be undone before exit — the LoRA fuser
    does), keep them resident for any number of forwards, re-partition on exit. Pass the engine to
    also suspend ZeRO-3's per-module hooks for the duration (no hook overhead per decode step);
    with a bare module the hooks still run but cannot release the pinned parameters.
    ``mode="per_forward"``: a no-op (ZeRO-3's hooks gather per forward). For a module that is not
    ZeRO-3 both modes are no-ops. Collective on entry and exit: every rank must enter together.
    """
    check_gather_mode(mode)
    if mode == "per_forward" or not is_zero3(module):
        yield
        return
    import deepspeed

    root = module.module if _is_engine(module) else module
    params = [p for p in root.parameters() if _is_zero_param(p)]
    offload = _zero3_offload(module) if _is_engine(module) else None
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        _pin(params)
        suspended = False
        try:
            suspended = _suspend_hooks(offload)
            yield
        finally:
            if suspended:
                _restore_hooks(offload)
            _unpin(params)


def any_rank_busy(local_busy: bool, device: torch.device | str, group=None) -> bool:
    """Whether any rank still has work (e.g. an unfinished row) — identical on every rank.

    With torch.distributed initialised and more than one rank in ``group`` (default: the world),
    one ``all_reduce(MAX)`` of a 1-element int tensor on ``device`` (the backend's device: CUDA for
    NCCL, CPU for gloo) and a host sync. Otherwise returns ``local_busy`` with no collective.
    ZeRO-3 ``per_forward`` decoding calls it once per step so that every rank runs the same number
    of forwards (their per-module all-gathers must match) whatever its own EOS timing.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return bool(local_busy)
    if torch.distributed.get_world_size(group) <= 1:
        return bool(local_busy)
    flag = torch.tensor([1 if local_busy else 0], dtype=torch.int32, device=device)  # flag: [1]
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())
