"""Worker-side helpers for DeepSpeed tests (imported by the scripts in this folder).

Every DeepSpeed test runs in a fresh subprocess started by ``tests/ds_util.run_worker``: DeepSpeed
keeps process-global state (the comm backend, ZeRO hooks, the accelerator, patched ``nn.Module``
init) that leaks from one test into the next. The launcher sets ``DS_ACCELERATOR=cpu``,
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``OPSD_WORKER_RESULT`` (where :func:`emit` writes this rank's JSON result).

Shared-memory comm op. ``deepspeed.comm`` builds its CPU shared-memory all-reduce op
(``ShareMemCommBuilder``, ``deepspeed_shm_comm``) with a JIT C++ compile of about 60 s the first
time a process group is created, whenever the op's compatibility probe says it can be built.
There is no environment switch for it. DeepSpeed consults the per-process compatibility table
``deepspeed.ops.__compatible_ops__`` before building (``build_shm_op`` returns ``None`` when the
op is marked incompatible, and the backend then uses plain gloo collectives); that table is built
once per process and DeepSpeed documents that edits to it persist. :func:`init_deepspeed_cpu`
marks the op incompatible in that table for this worker process only, which is exactly what
DeepSpeed does on platforms where the op cannot be built. No library code is changed.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch

#: Name of the op in DeepSpeed's compatibility table whose JIT build we skip in tests.
SHM_COMM_OP_NAME = "deepspeed_shm_comm"
#: Per-collective timeout inside test workers: a hung peer fails the test instead of blocking CI.
COLLECTIVE_TIMEOUT_S = 120


def rank() -> int:
    """This worker's global rank (``RANK`` set by the launcher, 0 when absent)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of workers (``WORLD_SIZE`` set by the launcher, 1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def skip_shm_comm_build() -> None:
    """Mark DeepSpeed's shared-memory comm op incompatible in this process (see module docstring)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP_NAME] = False


def init_deepspeed_cpu() -> tuple[int, int]:
    """Initialise ``deepspeed.comm`` over gloo on the CPU accelerator; returns ``(rank, world_size)``.

    Idempotent within a process. Must run before ``deepspeed.initialize``.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def ds_config(zero_stage: int, *, gather_tiny: bool = True, bf16: bool = False) -> dict:
    """A DeepSpeed config dict for a one-sample micro-batch on CPU.

    ``gather_tiny=True`` (ZeRO-3 only) makes a tiny model really partitioned: no parameter is kept
    persistent (``stage3_param_persistence_threshold=0``), at most one module's parameters live at
    once (``stage3_max_live_parameters=0``) and the buckets are small, so every parameter is
    gathered on use and released afterwards, as it would be for a large model.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}")
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3 and gather_tiny:
        zero.update({
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": 4096,
            "allgather_bucket_size": 4096,
            "sub_group_size": 4096,
        })
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(model: torch.nn.Module, zero_stage: int, *, gather_tiny: bool = True,
                optimizer: bool = True, lr: float = 1e-3, bf16: bool = False,
                config_overrides: dict | None = None):
    """Wrap ``model`` in a DeepSpeed engine (initialising gloo comm first when needed).

    ``optimizer=True`` passes a client ``torch.optim.AdamW`` over the parameters that require grad
    (no DeepSpeed C++ optimizer, so nothing is JIT-built); ``optimizer=False`` builds an engine
    without one (inference-style; ZeRO-3 still partitions). ``config_overrides`` is merged into
    the top level of the config from :func:`ds_config`.
    """
    import deepspeed

    init_deepspeed_cpu()
    config = ds_config(zero_stage, gather_tiny=gather_tiny, bf16=bf16)
    config.update(config_overrides or {})
    opt = None
    if optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def emit(result) -> None:
    """Record this rank's JSON-serialisable ``result`` for the launcher and end the process
    (:func:`end_process`: collective where torch.distributed is initialised; every rank must call it)."""
    path = os.environ.get("OPSD_WORKER_RESULT")
    payload = json.dumps(result)
    if path is None:
        print(payload)
    else:
        with open(path, "w") as handle:
            handle.write(payload)
    end_process()


def end_process() -> None:
    """End a test child process that has done its work, with exit status 0.

    With torch.distributed initialised this is collective: it waits for all ranks (barrier) and destroys
    the process group, so no rank tears gloo down under a peer still using it (which aborts the peer:
    "terminate called without an active exception"). Then it flushes and leaves without interpreter
    finalization, as ``scripts/train_opsd.py`` does: communication objects freed there can abort a finished
    rank the same way (seen once in CI after a rank had written its traces).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
