"""Process and DeepSpeed setup of the main job (``scripts/train_opsd.py``): the process group, the
DeepSpeed configs, the student's training engine and the offloaded teacher's inference engine.

``deepspeed`` is imported inside the functions: :func:`init_distributed` must run before anything
imports it (``DS_ACCELERATOR`` is read at import).
"""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch

from rollout.opsd.ds_config_checks import precision_sections, read_deepspeed_config

#: DeepSpeed's CPU shared-memory comm op: its first use JIT-builds C++ for ~60 s; gloo is used instead.
SHM_COMM_OP_NAME = "deepspeed_shm_comm"
#: The attention projections a ``--lora`` student adapts.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed():
    """torch.distributed through DeepSpeed (NCCL on CUDA, gloo on CPU); returns ``(rank, world, device)``.

    Outside a launcher the single-process rendezvous variables are set here. Must run before anything
    imports deepspeed (``DS_ACCELERATOR`` is read at import).
    """
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:  # one GPU per rank, chosen before NCCL starts so its communicator binds to that GPU
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are "
                             "visible; launch at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not cuda:  # what DeepSpeed does where the op cannot be built: plain gloo collectives instead
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP_NAME] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def deepspeed_config(path: Optional[str], zero_stage: Optional[int], rows_per_step: int, cuda: bool) -> dict:
    """The DeepSpeed config: the file's at ``path`` (None: a built-in ZeRO-0 one, bf16 on CUDA), with
    ``zero_stage`` (``--zero-stage``) applied unless None."""
    if path is not None:
        config = read_deepspeed_config(path)
    else:
        config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": cuda}, "gradient_clipping": 1.0,
                  "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 1 << 30}
    if zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
    if "train_batch_size" not in config:
        config.setdefault("train_micro_batch_size_per_gpu", rows_per_step)
    return config


def model_dtype(config: dict) -> torch.dtype:
    """The models' dtype under a (checked) DeepSpeed config: bf16, fp16 or float32, the precision sections read as
    DeepSpeed reads them (:func:`rollout.opsd.ds_config_checks.precision_sections`: ``bfloat16`` where ``bf16`` is
    absent)."""
    bf16, fp16 = precision_sections(config)
    if bf16.get("enabled"):
        return torch.bfloat16
    return torch.float16 if fp16.get("enabled") else torch.float32


def teacher_engine_config(config: dict, rows_per_step: int) -> dict:
    """Inference-only ZeRO-3 with parameters offloaded to pinned host memory, in the student's precision."""
    out = {"train_micro_batch_size_per_gpu": rows_per_step, "steps_per_print": 1 << 30,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "stage3_param_persistence_threshold": 0}}  # every parameter offloaded
    for key, section in zip(("bf16", "fp16"), precision_sections(config)):
        if section:
            out[key] = dict(section)
    return out


def make_offloaded_teacher(model, config: dict, rows_per_step: int):
    """The teacher in a DeepSpeed ZeRO-3 engine without optimizer: its parameters live partitioned in
    host memory and are gathered onto the device module by module for each forward.

    ``OPSDStep`` calls the engine's module (the ZeRO-3 fetch/release hooks live on the modules), so
    its teacher forward stays an ``opsd/teacher_forward`` range. Every rank runs the same number of
    teacher forwards (same rows per step), as the per-module all-gathers require.
    """
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=teacher_engine_config(config, rows_per_step))
    engine.eval()
    return engine


def make_student_engine(model, config: dict, *, lora: Optional[int], lr: float):
    """The student's DeepSpeed training engine: AdamW at ``lr`` unless ``config`` defines an optimizer; with
    ``lora`` (a rank) a peft LoRA model on the attention projections, whose adapters alone train."""
    import deepspeed

    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise SystemExit("--lora needs peft (pip install 'peft>=0.17')") from None

        model = get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=LORA_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else torch.optim.AdamW(params, lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      model_parameters=params if optimizer is None else None)
    engine.train()
    return engine
