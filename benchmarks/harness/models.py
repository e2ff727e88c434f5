"""The models and inputs the benchmarks run: the random Qwen2.5-3B shape or the tiny model, prompts, DeepSpeed.

``--model tiny|3b``, ``--device`` and ``--dtype`` mean the same in every benchmark (:func:`add_model_args`,
:func:`load_model`): the 3B shape in bf16 on CUDA, the tiny model in fp32 elsewhere, unless given.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation.geometry import model_geometry, weight_bytes  # noqa: F401  (the suite's names)
from rollout.testing import shaped_model, tiny_model

MODELS = ("tiny", "3b")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


#: ``--dtype`` values: the floating dtypes the models run in.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def device_arg(text: str) -> str:
    """An argparse ``type``: ``cpu`` or ``cuda[:N]`` of this machine, checked before any model is built (``cuda:7``
    on a CPU host failed in torch's lazy init with an AssertionError)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N]; got {text!r}")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (count == 0 or (device.index or 0) >= count):
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s)")
    return text


def add_model_args(parser: argparse.ArgumentParser, dtype: bool = True) -> None:
    """``--model``, ``--device`` (and ``--dtype``): what :func:`load_model` reads."""
    parser.add_argument("--model", choices=MODELS, default=None, help="3b on CUDA, tiny elsewhere")
    parser.add_argument("--device", type=device_arg, default=default_device())
    if dtype:
        parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                            help="bfloat16 on CUDA, float32 on CPU by default")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    name: str
    """``"tiny"`` or ``"3b"``."""
    dtype: torch.dtype
    device: str


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model ``--model``/``--device``/``--dtype`` ask for (the defaults follow the device)."""
    cuda = args.device.startswith("cuda")
    name = args.model or ("3b" if cuda else "tiny")
    dtype_name = getattr(args, "dtype", None)
    dtype = getattr(torch, dtype_name) if dtype_name else (torch.bfloat16 if cuda else torch.float32)
    return LoadedModel(build_model(name, dtype, args.device), name, dtype, args.device)


def build_model(name: str, dtype: torch.dtype, device: str):
    """The tiny Qwen2 model (16k positions) or the random Qwen2.5-3B-shaped model, seed 0."""
    if name == "tiny":
        return tiny_model("qwen2", seed=0, dtype=dtype, device=device, max_position_embeddings=16384)
    return shaped_model("qwen25-3b", seed=0, dtype=dtype, device=device)


def left_padded(lengths: list[int], vocab: int, device: str, token: Optional[int] = None, seed: int = 0):
    """``(ids, mask)`` of prompts with these real lengths, left-padded with 0: random ids in ``[3, vocab)``
    (generator ``seed``), or every real token ``token``."""
    width = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)  # ids: [B, T_p]
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        fill = torch.full((length,), token) if token is not None else torch.randint(3, vocab, (length,), generator=gen)
        ids[row, width - length:] = fill
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def set_single_process_env(port: int) -> None:
    """The rendezvous variables of a one-process DeepSpeed run (kept where already set)."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)


def upstream_rollout(model, tok, continuous: bool = False):
    """DeepSpeed 0.19.8's ``HybridEngineRollout`` on a ZeRO-0 engine (single process)."""
    import deepspeed
    from deepspeed.runtime.rollout import HybridEngineRollout
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    set_single_process_env(29511)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    cfg = HybridEngineRolloutConfig(align_decode_fronts=continuous) if continuous else HybridEngineRolloutConfig()
    return HybridEngineRollout(engine, tok, cfg)
