"""Fuse peft LoRA adapters into their base weights for generation, and restore them bit-exactly.

Merging in place and subtracting afterwards is not exact in low precision (in bf16,
``W + Δ - Δ != W``), so :class:`LoraFuser` never writes to a base weight. ``fuse()`` computes
``W + Δ`` into a separate buffer of the weight's shape (one per layer, allocated on first use and
reused across calls by default) and points the parameter's ``.data`` at it; ``unfuse()`` points
``.data`` back at the untouched original tensor. The merge itself is one ``addmm`` per adapter
for peft ``Linear`` layers whose adapter weights have the base weight's dtype (no full-size
temporaries); otherwise it is peft's own ``merge`` applied to the buffer, bit-identical to
``merge_and_unload`` (e.g. bf16 base weights with peft's default fp32 adapters). The parameter objects, their storage, their
version counters and peft's per-layer state (``merged_adapters``) are exactly as before, so the
merged state cannot leak into training: after ``unfuse()`` forward/backward go through the
adapters as usual and adapter gradients flow.

While fused, each fused layer's ``merged_adapters`` lists its active adapters, so peft's forward
takes its merged path (base layer only). Layers that cannot be fused this way are left unmerged —
peft's unmerged forward is still exact for them: layers with adapters disabled or already merged
by the user, LoRA variants (DoRA, ...), ``lora_bias``, non-floating (quantized) base weights, and
nested tuner layers.

ZeRO-3: base weights are partitioned, so ``fuse()`` must run inside
``rollout.zero.gathered(engine, "once")`` and ``unfuse()`` before leaving it. ``fuse()`` raises
``RuntimeError`` (before changing anything) when a weight it needs is not gathered; with
``gather="per_forward"`` the rollout core does not fuse (see :meth:`LoraFuser.can_fuse`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


def _lora_layer_class():
    """peft's ``LoraLayer`` base class, or None when peft is not installed."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None
    return LoraLayer


def _is_materialised(param: torch.Tensor) -> bool:
    """False for a ZeRO-3 parameter whose full data is not gathered right now."""
    if not hasattr(param, "ds_id"):
        return True
    return param.numel() == param.ds_numel and param.numel() > 0


def _adapter_weights(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    if adapter in layer.lora_A:
        return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]


@dataclass
class _Fused:
    """What one fused layer needs for unfuse: the original weight data and peft's list."""

    layer: torch.nn.Module
    weight: torch.nn.Parameter
    original: torch.Tensor
    merged_adapters: list


class LoraFuser:
    """Fuses the active peft LoRA adapters of one model for generation (see module docstring).

    Build with :meth:`for_model`. ``fuse()`` while fused raises ``RuntimeError``; ``unfuse()`` when
    not fused is a no-op (safe in ``finally``). ``keep_buffers=True`` keeps one merged-weight
    buffer per layer across calls (no allocation per rollout, stable addresses for CUDA graphs;
    costs one extra copy of every adapted weight); ``False`` frees them at ``unfuse()`` (for
    ZeRO-3, where that copy would be a full, unpartitioned weight).
    """

    def __init__(self, layers: list[torch.nn.Module], *, keep_buffers: bool = True):
        if not layers:
            raise ValueError("layers must contain at least one peft LoRA layer")
        self._layers = layers
        self.keep_buffers = keep_buffers
        self._buffers: dict[int, torch.Tensor] = {}
        self._fused: list[_Fused] | None = None

    @classmethod
    def for_model(cls, module, *, keep_buffers: bool = True) -> "LoraFuser | None":
        """A fuser for ``module`` (a model, a peft model or a DeepSpeed engine); None without LoRA."""
        lora_layer = _lora_layer_class()
        if lora_layer is None:
            return None
        root = module.module if callable(getattr(module, "zero_optimization_stage", None)) else module
        if not isinstance(root, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or a DeepSpeed engine; got {type(module).__name__}")
        layers = [m for m in root.modules() if isinstance(m, lora_layer)]
        return cls(layers, keep_buffers=keep_buffers) if layers else None

    @property
    def num_layers(self) -> int:
        """Number of peft LoRA layers found in the model."""
        return len(self._layers)

    @property
    def is_fused(self) -> bool:
        """True between ``fuse()`` and ``unfuse()``."""
        return self._fused is not None

    @property
    def num_fused(self) -> int:
        """Layers fused by the current ``fuse()`` (0 when not fused)."""
        return len(self._fused) if self._fused is not None else 0

    def fusable_layers(self) -> list[torch.nn.Module]:
        """The layers :meth:`fuse` would fuse now (the others keep peft's unmerged forward)."""
        return [layer for _, layer, _ in self._plan()]

    def _plan(self) -> list[tuple[int, torch.nn.Module, list[str]]]:
        """(index, layer, adapters to fuse) for every layer that can be fused right now."""
        plan = []
        for index, layer in enumerate(self._layers):
            adapters = _fusable_adapters(layer)
            if adapters:
                plan.append((index, layer, adapters))
        return plan

    def can_fuse(self) -> bool:
        """False when a weight that ``fuse()`` needs is a ZeRO-3 parameter not gathered now."""
        return all(_missing_param(layer, adapters) is None for _, layer, adapters in self._plan())

    def fuse(self) -> int:
        """Fuse every fusable layer's active adapters; returns the number of fused layers.

        Atomic: on error every layer fused so far is restored before the exception propagates.
        """
        if self._fused is not None:
            raise RuntimeError("LoRA adapters are already fused; call unfuse() before fuse()")
        plan = self._plan()
        for _, layer, adapters in plan:
            missing = _missing_param(layer, adapters)
            if missing is not None:
                raise RuntimeError(
                    f"cannot fuse LoRA: {missing} is a ZeRO-3 parameter that is not gathered; call "
                    "fuse() inside rollout.zero.gathered(engine, 'once') (with gather='per_forward' "
                    "do not fuse: peft's unmerged forward is exact)")
        self._fused = []
        try:
            with torch.no_grad():
                for index, layer, adapters in plan:
                    self._fuse_layer(index, layer, adapters)
        except BaseException:
            self.unfuse()
            raise
        return len(self._fused)

    def _fuse_layer(self, index: int, layer, adapters: list[str]) -> None:
        """Point the layer's base weight at ``W + deltas`` in this layer's buffer; record first."""
        weight = layer.get_base_layer().weight
        original = weight.data
        buffer = self._buffers.get(index)
        if (buffer is None or buffer.shape != original.shape or buffer.dtype != original.dtype
                or buffer.device != original.device):
            buffer = torch.empty_like(original)  # buffer: the weight's shape, e.g. [out, in]
            if self.keep_buffers:
                self._buffers[index] = buffer
        self._fused.append(_Fused(layer, weight, original, layer.merged_adapters))
        if _can_addmm(layer, adapters, original.dtype):
            _addmm_merge(buffer, original, layer, adapters)
            weight.data = buffer
            layer.merged_adapters = list(adapters)
        else:
            buffer.copy_(original)
            weight.data = buffer
            layer.merged_adapters = []
            layer.merge(adapter_names=list(adapters))  # peft's own merge, into our buffer

    def unfuse(self) -> None:
        """Restore every fused layer's original weight data and peft state; no-op when not fused."""
        if self._fused is None:
            return
        for record in reversed(self._fused):
            record.weight.data = record.original
            record.layer.merged_adapters = record.merged_adapters
        self._fused = None
        if not self.keep_buffers:
            self._buffers.clear()

    @contextmanager
    def fused(self) -> Iterator[int]:
        """``with fuser.fused() as num_fused:`` — fuse on entry, always unfuse on exit."""
        num_fused = self.fuse()
        try:
            yield num_fused
        finally:
            self.unfuse()


def _active_adapters(layer) -> list[str]:
    """The adapters peft's forward of ``layer`` applies now: none while it is merged or its adapters are disabled."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return []
    known = set(layer.lora_A.keys()) | set(getattr(layer, "lora_embedding_A", {}).keys())
    return [name for name in layer.active_adapters if name in known]


def _not_low_rank(layer, name: str) -> str | None:
    """Why adapter ``name`` of ``layer`` is more than a low-rank update of the weight (a LoRA variant such as DoRA,
    ``lora_bias``): neither fusing nor the training pieces compute it. None for a plain one."""
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
        return f"adapter {name!r} is a LoRA variant (DoRA, ...)"
    if getattr(layer, "lora_bias", {}).get(name, False):
        return f"adapter {name!r} has lora_bias"
    return None


def _fusable_adapters(layer) -> list[str]:
    """Active adapters of ``layer`` to fuse, or [] when the layer must stay unmerged."""
    adapters = _active_adapters(layer)
    if isinstance(getattr(layer, "base_layer", None), _lora_layer_class()):
        return []  # nested tuner layers
    if any(_not_low_rank(layer, name) for name in adapters):
        return []
    weight = getattr(layer.get_base_layer(), "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or not weight.dtype.is_floating_point:
        return []
    return adapters


def _missing_param(layer, adapters: list[str]) -> str | None:
    """Name of the first weight needed for fusing that is not materialised, or None."""
    if not _is_materialised(layer.get_base_layer().weight):
        return "the base weight"
    for name in adapters:
        if not all(_is_materialised(w) for w in _adapter_weights(layer, name)):
            return f"adapter {name!r}"
    return None


def _can_addmm(layer, adapters: list[str], dtype: torch.dtype) -> bool:
    """Whether the one-``addmm``-per-adapter fast path applies (peft Linear, same dtypes)."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(layer, LoraLinear):
        return False
    return all(name in layer.lora_A and layer.lora_A[name].weight.dtype == dtype
               and layer.lora_B[name].weight.dtype == dtype for name in adapters)


def _addmm_merge(out: torch.Tensor, weight: torch.Tensor, layer, adapters: list[str]) -> None:
    """``out = weight + sum_a scaling_a * B_a @ A_a`` (transposed for ``fan_in_fan_out``).

    Reads ``weight`` once and writes ``out`` once per adapter, with no full-size temporaries
    (peft's ``merge`` materialises the delta, scales it, then adds it). ``weight`` is not modified.
    """
    source = weight
    for name in adapters:
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight  # a: [r, in], b: [out, r]
        left, right = (a.T, b.T) if layer.fan_in_fan_out else (b, a)
        torch.addmm(source, left, right, alpha=layer.scaling[name], out=out)
        source = out


# ---- a LoRA student's training pass (rollout.opsd.fast_passes) -------------------------------------------------------
#: The projections of a decoder layer whose LoRA updates the training pieces compute, in their argument order
#: (:func:`rollout.model.pieces.lora_attention_inputs`, :func:`~rollout.model.pieces.lora_attention_output_and_mlp`).
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Adapter:
    """One projection's active LoRA adapter, as peft's unmerged forward applies it: ``y + B(A(x)) * scale``."""

    down: torch.Tensor
    """``lora_A``'s weight ``[r, in]`` (the parameter itself: gradients accumulate into it)."""
    up: torch.Tensor
    """``lora_B``'s weight ``[out, r]``."""
    scale: float


@dataclass(frozen=True)
class TrainingAdapters:
    """The active LoRA adapters of a model's decoder layers (:func:`training_adapters`)."""

    layers: tuple
    """Per decoder layer, one ``Adapter`` or None per entry of :data:`PROJECTIONS`; () when ``reason`` is set."""
    modules: tuple
    """The peft layers whose updates ``layers`` holds (their unmerged forward is what the pieces compute)."""
    reason: str | None = None
    """Why an active adapter cannot be computed by the pieces (None: every one can)."""

    @property
    def any(self) -> bool:
        return bool(self.modules)


#: A model without active adapters.
NO_ADAPTERS = TrainingAdapters((), ())


def _training_adapter(module, evaluating: bool = False) -> tuple[Adapter | None, str | None]:
    """``(adapter, None)`` for a peft layer the pieces compute exactly, ``(None, None)`` for one that adds nothing
    (merged, disabled, no active adapter, or no peft layer), ``(None, why)`` otherwise. ``evaluating``: the pass
    runs in eval mode (the teacher's), where dropout draws nothing."""
    names = _active_adapters(module) if hasattr(module, "lora_A") else []
    if not names:
        return None, None
    from peft.tuners.lora import Linear as LoraLinear
    if not isinstance(module, LoraLinear) or type(module.get_base_layer()) is not torch.nn.Linear:
        return None, f"{type(module).__name__} over {type(module.get_base_layer()).__name__} (not a LoRA Linear)"
    if len(names) > 1:
        return None, f"{len(names)} active adapters (one is computed)"
    name = names[0]
    if (why := _not_low_rank(module, name)) is not None:
        return None, why
    if getattr(module, "fan_in_fan_out", False):
        return None, "fan_in_fan_out"
    dropout = module.lora_dropout[name]
    if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training and not evaluating:
        return None, f"lora_dropout {dropout.p} in training (the pieces draw no dropout masks)"
    down, up = _adapter_weights(module, name)
    if (down.dtype != module.get_base_layer().weight.dtype
            and not getattr(module, "cast_input_dtype_enabled", True)):
        return None, "adapter weights in another dtype with the input cast off"
    return Adapter(down, up, float(module.scaling[name])), None


def training_adapters(causal_lm: torch.nn.Module, present: list | None = None,
                      evaluating: bool = False) -> TrainingAdapters:
    """The active LoRA adapters of an HF Llama-family model's decoder layers, for the student's pass through the
    compiled pieces, or the reason they cannot run there: an active adapter anywhere else (embedding, head),
    several active adapters on one layer, variants (DoRA), ``lora_bias``, dropout in training, other base layers.
    ``present``: :func:`lora_layers` of the model, where the caller has them (one walk over a model's modules costs
    milliseconds of host time); ``evaluating``: for a pass in eval mode (a teacher's), where dropout is off."""
    present = lora_layers(causal_lm) if present is None else present
    if not present:  # the common case, one pass of isinstance checks
        return NO_ADAPTERS
    layers, modules = [], []
    for index, layer in enumerate(causal_lm.model.layers):
        found = []
        for path in PROJECTIONS:
            module = layer.get_submodule(path)
            adapter, why = _training_adapter(module, evaluating)
            if why is not None:
                return TrainingAdapters((), (), f"layer {index} {path}: {why}")
            if adapter is not None:
                modules.append(module)
            found.append(adapter)
        layers.append(tuple(found))
    covered = {id(module) for module in modules}
    for module in present:
        adapter, why = (None, None) if id(module) in covered else _training_adapter(module, evaluating)
        if adapter is not None or why is not None:
            name = next(name for name, other in causal_lm.named_modules() if other is module)
            return TrainingAdapters((), (), f"an active LoRA adapter on {name} (the pieces adapt the decoder "
                                            f"layers' projections only)")
    return TrainingAdapters(tuple(layers) if modules else (), tuple(modules))


def lora_layers(model: torch.nn.Module) -> list:
    """The peft LoRA layers of ``model`` ([] without peft)."""
    lora_layer = _lora_layer_class()
    return [] if lora_layer is None else [module for module in model.modules() if isinstance(module, lora_layer)]
