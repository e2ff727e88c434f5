"""The decode-path choice, made once per call for both routes: CUDA graph, fast eager, or HF layers.

- ``"graph"``: our fused step (:mod:`rollout.model.step`) over static buffers, captured in CUDA graphs
  per shape bucket and replayed (:mod:`rollout.executors.graphs`);
- ``"fast_eager"``: the same step run eagerly (no CUDA, ``cuda_graphs=False``, or a failed capture);
- ``"hf"``: the model's own layers (unsupported models, ``fast_decode=False``, unfused LoRA, ZeRO-3
  per-forward gathering).

``FastStep`` is what both routes share: the model's current weights as ``StepParts`` (through a
persistent weight mirror under ZeRO-3, so captured graphs keep valid addresses across gathers) and the
compiled or eager step pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Collection, Optional

import torch

from rollout.config import KernelConfig, RolloutConfig
from rollout.executors import blas
from rollout.model import prefill
from rollout.ops import decode_attention, rms_scaled, rotary_attention, rotary_write, skinny_linear
from rollout.model.step import (FusedGateUp, FusedQKV, StepFns, StepParts, WeightMirror, compiled_step_fns,
                                spec_and_weights, unsupported_reason)

DECODE_PATHS = ("graph", "fast_eager", "hf")


@dataclass(frozen=True)
class DecodeChoice:
    """How this call decodes and prefills (before any capture has been tried)."""

    path: str
    """One of ``DECODE_PATHS``: what the call's decode steps are meant to run."""
    reason: Optional[str]
    """Why the path is not ``"graph"`` (None when it is): what the profile reports."""
    prefill_path: str
    """``"hf"``, ``"packed"`` or ``"varlen"`` (``routes.PREFILL_PATHS``): how prompts are prefilled."""
    attention: str = "sdpa"
    """The decode step's attention (``CallStats.decode_attention``): ``"triton"``, ``"sdpa"``, or ``"hf"`` on
    the HF path."""
    cuda_graphs: bool = True
    """``RolloutConfig.kernels.cuda_graphs``: with it off the continuous route decodes from per-call tensors
    (nothing kept between calls) instead of its graph-ready static buffers."""
    norms_folded: bool = False
    """Our step's weight copies carry the norm gains (``RolloutConfig.kernels.fold_norms``, :func:`norm_folds`)."""

    @property
    def is_fast(self) -> bool:
        return self.path != "hf"


class FastStep:
    """Our fused step for one model: ``StepParts`` read at each call (weights may move between calls)."""

    def __init__(self, model: torch.nn.Module, kernels: KernelConfig, mirror_weights: bool):
        self.model = model
        self.kernels = kernels
        """``RolloutConfig.kernels``: which pieces the step runs (each where its device allows)."""
        self.mirror = WeightMirror() if mirror_weights else None
        self.fused_qkv = FusedQKV() if kernels.fuse_qkv else None
        self.fused_gate_up = FusedGateUp() if kernels.fuse_gate_up else None
        self.last_weight_signature: Optional[tuple[int, ...]] = None
        """Addresses of the weights the last captured-step parts read (stable across calls under ZeRO-3)."""
        self._refreshed: Optional[set[str]] = None
        """Inside :meth:`one_call`: the kept copies (``"mirror"``, ``"copies"``) already refreshed in it."""

    @contextlib.contextmanager
    def one_call(self):
        """Within it, the first :meth:`parts` refreshes the kept copies (weight mirror, fused q|k|v and gate|up)
        from the model's weights and later ones reuse them: weights change between calls, not within one (the
        engine enters it inside the ZeRO-3 gather and after the LoRA fuse). Outside it every ``parts``
        refreshes."""
        self._refreshed = set()
        try:
            yield
        finally:
            self._refreshed = None

    def parts(self, device: torch.device, mirrored: bool) -> StepParts:
        """This call's parts: the model's current weights (``mirrored``: through the ZeRO-3 weight mirror,
        for captured steps, whose weights need fixed addresses) and the ``torch.compile``d pieces on CUDA
        when compiling is on, else the eager ones."""
        spec, weights = spec_and_weights(self.model)
        done = self._refreshed if self._refreshed is not None else set()
        rotary_kernel = rotary_kernel_runs(self.kernels, device)
        qkv_folds, gate_up_folds = self._folds(device, rotary_kernel)
        copies = [c for c in (self.fused_qkv, self.fused_gate_up) if c is not None]
        for held, fold in zip((self.fused_qkv, self.fused_gate_up), (qkv_folds, gate_up_folds)):
            if held is not None:  # q, k, v, gate, up become views of these kept buffers
                weights = held.refresh(weights, copy="copies" not in done, fold=fold)
        done.add("copies")
        if mirrored and self.mirror is not None:  # the rest through the mirror (the copies' views pass as they are)
            weights = self.mirror.refresh(weights, copy="mirror" not in done,
                                          stable=tuple(b for held in copies for b in held.buffers))
            done.add("mirror")
        if mirrored:
            self.last_weight_signature = weights.signature()
        kernels = self.kernels
        if kernels.compile and device.type == "cuda":
            kv_write = kernels.fused_kv_write and self.fused_qkv is not None
            fns = compiled_step_fns(kernels.compile_mode, kv_write=kv_write)
        else:
            fns = StepFns()
        fns = dataclasses.replace(fns, residual_in_place=kernels.residual_in_place)
        tuner = blas.tuner_of(kernels.blas_library, device)
        if tuner is not None:
            fns = dataclasses.replace(fns, tuned=tuner)
        if attention_path(kernels.decode_attention, device) == "triton":
            fns = dataclasses.replace(fns, attention=decode_attention.attention,
                                      shared_prefix_rows=kernels.shared_prefix_rows,
                                      first_row_rows=kernels.shared_prefix_first_row_rows)
        if qkv_folds:
            fns = dataclasses.replace(fns, rotary_write_rms=rms_scaled.rotary_write_rms)
            if (kernels.rotary_in_attention_rows and fns.attention is decode_attention.attention
                    and rotary_attention.failure(device) is None):
                fns = dataclasses.replace(fns, rotary_attention=rotary_attention.rotary_attention,
                                          rotary_attention_rows=kernels.rotary_in_attention_rows)
        if gate_up_folds:
            fns = dataclasses.replace(fns, silu_mul_rms=rms_scaled.silu_mul_rms)
        if rotary_kernel:
            fns = dataclasses.replace(fns, rotary_write=rotary_write.rotary_write)
            if kernels.skinny_rows and self.fused_gate_up is not None and skinny_linear.failure(device) is None:
                fns = dataclasses.replace(fns, skinny_linear=skinny_linear.skinny_linear,
                                          skinny_rows=min(kernels.skinny_rows, skinny_linear.MAX_ROWS))
        return StepParts(spec, weights, fns)

    def _folds(self, device: torch.device, rotary_kernel: bool) -> tuple[bool, bool]:
        """:func:`norm_folds` of this step's settings (``rotary_kernel``: :func:`rotary_kernel_runs` on ``device``)."""
        return norm_folds(self.kernels, device, rotary_kernel, next(self.model.parameters()).dtype)

    def release_copies(self) -> None:
        """Drop the fused q|k|v and gate|up weights (``keep_cache=False``: rebuilt at the next call)."""
        for copies in (self.fused_qkv, self.fused_gate_up):
            if copies is not None:
                copies.clear()

    def new_copy_bytes(self, device: Optional[torch.device] = None) -> int:
        """Device bytes the fused weight copies will allocate at the next call (0 for those already held),
        from the model's config (so also under ZeRO-3, whose parameters are partitioned): the memory budget
        counts them before the call allocates anything. ``device``: the call's (None: as if no norm is folded)."""
        config = self.model.config
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        itemsize = next(self.model.parameters()).element_size()
        total = 0
        if self.fused_qkv is not None and not self.fused_qkv.nbytes:
            attn = self.model.model.layers[0].self_attn
            has_bias = any(getattr(getattr(p, "base_layer", p), "bias", None) is not None
                           for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            total += layers * (heads + 2 * kv_heads) * head_dim * (hidden + int(has_bias)) * itemsize
        if self.fused_gate_up is not None and not self.fused_gate_up.nbytes:
            total += layers * 2 * config.intermediate_size * hidden * itemsize
        if device is not None:  # each folded copy also holds a vector of ones (the record's gain)
            folds = self._folds(device, rotary_kernel_runs(self.kernels, device))
            total += sum(hidden * itemsize for held, fold in zip((self.fused_qkv, self.fused_gate_up), folds)
                         if fold and not held.nbytes)
        return total

    @property
    def nbytes(self) -> int:
        """Bytes held between calls: the weight mirror (ZeRO-3 only) and the fused q|k|v and gate|up weights."""
        return sum(held.nbytes for held in (self.mirror, self.fused_qkv, self.fused_gate_up) if held is not None)


#: Weight dtypes whose models fold their norms: float16 does not, since the raw residual's products (the row's RMS
#: times the normalized ones) can pass its largest value (65,504) where the normalized products do not.
FOLD_DTYPES = (torch.bfloat16, torch.float32)


def norm_folds(kernels: KernelConfig, device: torch.device, rotary_kernel: bool,
               dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether the norm gains go into the q|k|v and the gate|up copies (``kernels.fold_norms``): only where the
    decode step's kernels that scale by 1/RMS run (CUDA, triton, no earlier failure) and the weights' ``dtype`` is
    one of :data:`FOLD_DTYPES`; q|k|v where the rotary kernel runs (``rotary_kernel``), gate|up where it is fused and
    the residual is added in place."""
    ok = (kernels.fold_norms and device.type == "cuda" and dtype in FOLD_DTYPES
          and decode_attention.available() is None and rms_scaled.failure(device) is None)
    return ok and rotary_kernel, ok and kernels.fuse_gate_up and kernels.residual_in_place


def rotary_kernel_runs(kernels: KernelConfig, device: torch.device) -> bool:
    """Whether decode steps rotate and write the cache with the Triton kernel (``kernels.rotary_kernel``, with fused
    q|k|v, on CUDA, triton importable, no earlier failure)."""
    return (kernels.rotary_kernel and kernels.fuse_qkv and device.type == "cuda" and decode_attention.available() is None
            and rotary_write.failure(device) is None)


def attention_path(setting: str, device: torch.device) -> str:
    """The attention our step runs for ``RolloutConfig.kernels.decode_attention``: ``"triton"`` where the kernel can
    (CUDA, triton importable, no earlier failure of the kernel on this device), else ``"sdpa"``."""
    if (setting == "triton" and device.type == "cuda" and decode_attention.available() is None
            and decode_attention.failure(device) is None):
        return "triton"
    return "sdpa"


def choose_decode(config: RolloutConfig, model: torch.nn.Module, is_zero3: bool, device: torch.device,
                  fused: Collection[torch.nn.Module] = ()) -> DecodeChoice:
    """The decode and prefill paths of a call (one place for both routes). ``fused``: the LoRA layers the call
    fuses before it decodes (chosen before the fuse: the choice sizes the call's memory)."""
    kernels = config.kernels
    reason = _hf_reason(config, model, is_zero3, fused)
    if reason is not None:
        return DecodeChoice("hf", reason, "hf", "hf", kernels.cuda_graphs)
    prefill_path = prefill.attention_path(device, next(model.parameters()).dtype) if kernels.fast_prefill else "hf"
    attention = attention_path(kernels.decode_attention, device)
    folded = any(norm_folds(kernels, device, rotary_kernel_runs(kernels, device), next(model.parameters()).dtype))
    if not kernels.cuda_graphs:
        return DecodeChoice("fast_eager", "eager fast step: kernels.cuda_graphs disabled in RolloutConfig",
                            prefill_path, attention, cuda_graphs=False, norms_folded=folded)
    if device.type != "cuda":
        return DecodeChoice("fast_eager", f"eager fast step: device {device.type} has no CUDA graphs", prefill_path,
                            attention, norms_folded=folded)
    return DecodeChoice("graph", None, prefill_path, attention, norms_folded=folded)


def _hf_reason(config: RolloutConfig, model: torch.nn.Module, is_zero3: bool,
               fused: Collection[torch.nn.Module]) -> Optional[str]:
    """Why the HF layers decode (None: our step can)."""
    if not config.kernels.fast_decode:
        return "kernels.fast_decode disabled in RolloutConfig"
    if is_zero3 and config.gather == "per_forward":
        return "ZeRO-3 per-forward gathering (parameters are not resident)"
    return unsupported_reason(model, fused)


def shares_prefix(parts: StepParts, bucket: int, samples: int, first_row: bool = False) -> bool:
    """Whether an ordinary-route decode step of ``bucket`` rows reads each prompt's columns once for its ``samples``
    rows (``RolloutConfig.kernels.shared_prefix_rows``, set only where the Triton attention runs): ``first_row``, each
    row from its run's first row (any ``samples`` > 1, buckets of at most ``shared_prefix_first_row_rows``), else in a
    pass of their own (the kernel's tile limit: :func:`decode_attention.one_tile`)."""
    rows = parts.fns.shared_prefix_rows
    if first_row:
        return 0 < rows <= bucket <= parts.fns.first_row_rows and samples > 1
    return 0 < rows <= bucket and decode_attention.one_tile(samples, parts.spec.num_heads, parts.spec.num_kv_heads)


def prompt_sharing(kernels: Optional[KernelConfig], width: int, samples: int) -> tuple[int, bool, bool]:
    """How an ordinary-route call's decode steps may read prompts of ``width`` columns with ``samples`` rows each
    (``kernels``: our step's settings; None on the HF path): ``(sharing, first_row, align)``, the rows per prompt that
    may read its columns once (1: every row its own copy), whether each then reads them from its run's first row
    (``shared_prefix_first_row_rows``, below ``shared_prefix_columns``; else a pass of their own) and whether the
    prompts are padded in front to end at a tile edge (``shared_prefix_align``: :data:`decode_attention.BLOCK_L`).
    Which steps share is :func:`shares_prefix`."""
    if kernels is None:
        return 1, False, False
    long_prompts = width >= kernels.shared_prefix_columns
    first_row = not long_prompts and 0 < kernels.shared_prefix_rows <= kernels.shared_prefix_first_row_rows
    sharing = samples if long_prompts or first_row else 1
    return sharing, first_row, first_row and sharing > 1 and kernels.shared_prefix_align
