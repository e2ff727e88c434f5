"""The decode step's view of an HF Llama-family model: its geometry (:class:`DecoderSpec`) and weight tensors
(:class:`DecoderWeights`, read by :func:`spec_and_weights` as plain views of the parameters, no copies), whether
the step can run it (:func:`unsupported_reason`), and the kept copies that give weights fixed addresses for
captured graphs: the ZeRO-3 :class:`WeightMirror` and the concatenated q|k|v and gate|up weights
(:class:`FusedQKV`, :class:`FusedGateUp`). The step itself: :mod:`rollout.model.step`."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Collection, Optional

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", None)


@dataclass(frozen=True)
class DecoderSpec:
    """Static geometry of the decode step."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    attention_scaling: float
    padding_idx: Optional[int] = None
    """The embedding's ``padding_idx`` (HF's ``config.pad_token_id``): its row gets no gradient in a training pass,
    as in HF's ``nn.Embedding``, even where a real token holds that id."""

    @property
    def piece_constants(self) -> dict:
        """The keyword constants of the q/k/v pieces (``attention_inputs*``): ``eps`` and the head geometry."""
        return dict(eps=self.rms_eps, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim)


@dataclass
class LayerWeights:
    """One decoder layer's tensors (biases may be None)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    qkv: torch.Tensor | None = None
    """q, k and v concatenated ``[(Hq + 2 Hkv) D, H]`` (:class:`FusedQKV`): one GEMM instead of three."""
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    """gate and up concatenated ``[2 I, H]`` (:class:`FusedGateUp`): one GEMM instead of two."""


@dataclass
class DecoderWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_bias: torch.Tensor | None
    inv_freq: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order (biases that are None skipped)."""
        out = [self.embed, self.final_norm, self.lm_head, self.inv_freq]
        if self.lm_head_bias is not None:
            out.append(self.lm_head_bias)
        for layer in self.layers:
            out.extend(t for t in vars(layer).values() if t is not None)
        return out

    def map(self, fn) -> "DecoderWeights":
        """The same structure with every tensor ``t`` replaced by ``fn(t)`` (None stays None)."""
        def f(t):
            return None if t is None else fn(t)
        layers = [LayerWeights(**{k: f(v) for k, v in vars(layer).items()}) for layer in self.layers]
        return DecoderWeights(f(self.embed), layers, f(self.final_norm), f(self.lm_head), f(self.lm_head_bias),
                              f(self.inv_freq))

    def signature(self) -> tuple[int, ...]:
        """Data pointers of every tensor: graphs captured over these weights are valid while it holds."""
        ptrs = [self.embed.data_ptr(), self.final_norm.data_ptr(), self.lm_head.data_ptr()]
        for layer in self.layers:
            ptrs.extend(t.data_ptr() for t in vars(layer).values() if t is not None)
        return tuple(ptrs)


def unsupported_reason(model: torch.nn.Module, fused: Collection[torch.nn.Module] = ()) -> str | None:
    """Why the fast step cannot run ``model`` exactly (None when it can). ``fused``: LoRA layers the call fuses
    before it decodes (:meth:`rollout.model.lora.LoraFuser.fusable_layers`), counted as merged."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} not in {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope type {rope_type!r} is not supported"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias is not supported"
    fused_ids = {id(layer) for layer in fused}
    for module in model.modules():  # peft: an unmerged, active LoRA layer adds a path we do not replicate
        if (hasattr(module, "lora_A") and id(module) not in fused_ids and not getattr(module, "merged", False)
                and not getattr(module, "disable_adapters", False) and getattr(module, "active_adapters", None)):
            return "LoRA adapters are not fused (fuse_lora=False, ZeRO-3 per-forward gathering or a LoRA variant)"
    return None


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A plain-tensor view (same storage) of a parameter. The compiled step pieces guard on their
    inputs' types: parameters here and the ZeRO-3 weight mirror's plain tensors elsewhere would make
    them recompile for every new prompt shape, instead of once."""
    return None if tensor is None else tensor.detach()


def spec_and_weights(model: torch.nn.Module, *, trainable: bool = False) -> tuple[DecoderSpec, DecoderWeights]:
    """Read geometry and weight tensors from an HF ``*ForCausalLM`` (no copies: plain-tensor views of the
    parameters, read at each call so that reassigned ``.data`` is followed). ``trainable``: the parameters
    themselves instead, so that a forward through them accumulates their gradients (the student's packed pass)."""
    read = (lambda tensor: tensor) if trainable else _plain

    def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = getattr(module, "base_layer", module)
        return read(base.weight), read(base.bias)

    config, inner = model.config, model.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, q_b = _linear(attn.q_proj)
        k, k_b = _linear(attn.k_proj)
        v, v_b = _linear(attn.v_proj)
        o, o_b = _linear(attn.o_proj)
        layers.append(LayerWeights(read(layer.input_layernorm.weight), q, q_b, k, k_b, v, v_b, o, o_b,
                                   read(layer.post_attention_layernorm.weight), _linear(mlp.gate_proj)[0],
                                   _linear(mlp.up_proj)[0], _linear(mlp.down_proj)[0]))
    lm_head, lm_bias = _linear(model.lm_head)
    spec = DecoderSpec(config.num_hidden_layers, config.num_attention_heads,
                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                       float(getattr(inner.norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6))),
                       float(getattr(inner.rotary_emb, "attention_scaling", 1.0)),
                       getattr(inner.embed_tokens, "padding_idx", None))
    weights = DecoderWeights(read(inner.embed_tokens.weight), layers, read(inner.norm.weight), lm_head, lm_bias,
                             inner.rotary_emb.inv_freq)
    return spec, weights


def kept_buffer(buffers: dict, key, shape, like: torch.Tensor) -> torch.Tensor:
    """``buffers[key]`` if it has ``shape`` and ``like``'s dtype and device, else a new one stored there:
    persistent storage whose address captured graphs can keep reading."""
    buffer = buffers.get(key)
    if buffer is None or buffer.shape != tuple(shape) or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = buffers[key] = torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    return buffer


class WeightMirror:
    """Persistent copies of the decode weights, refreshed in place at every call.

    Under ZeRO-3 the gathered parameters get new addresses at every gather, which would invalidate
    captured graphs each call; the mirror gives them fixed addresses (one full copy of the model's
    weights on the device: the memory cost of graphs under ZeRO-3; ``gather="per_forward"`` stays the
    low-memory option). Refreshing is one device copy per tensor, so new weights (a training step,
    ``sync_weights``, fused LoRA) are always what the graphs read.
    """

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}

    def refresh(self, weights: "DecoderWeights", copy: bool = True, stable: tuple = ()) -> "DecoderWeights":
        """``weights`` through the mirror; ``copy=False`` skips the copies into buffers already held (the
        caller knows they hold these values: a second refresh within one call). Tensors viewing one of the
        ``stable`` tensors (kept buffers of fixed address, e.g. the fused q|k|v and gate|up copies) pass as
        they are, and a tensor seen twice (tied embedding and output weights) gets one buffer."""
        keys = itertools.count()  # a tensor's key: its position in the fixed order of ``map``
        kept = {t.untyped_storage().data_ptr() for t in stable}
        seen: dict = {}

        def mirrored(tensor: torch.Tensor) -> torch.Tensor:
            key = next(keys)
            if tensor.untyped_storage().data_ptr() in kept:
                self._buffers.pop(key, None)
                return tensor
            same = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            if same in seen:
                self._buffers.pop(key, None)
                return seen[same]
            held = self._buffers.get(key)
            buffer = kept_buffer(self._buffers, key, tensor.shape, tensor)
            seen[same] = buffer.copy_(tensor) if copy or buffer is not held else buffer
            return seen[same]
        return weights.map(mirrored)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class _ConcatenatedCopies:
    """Persistent concatenations of weight tensors, refreshed in place at every call (one ``torch.cat`` into
    a kept buffer per tensor group): new weights are always what the step reads, and the addresses stay
    fixed for captured graphs.

    A refresh with ``fold`` (``RolloutConfig.kernels.fold_norms``) multiplies the RMSNorm gain before these projections
    into the copy (each input column by its gain) and gives the record a gain of ones: ``rms_norm(h, ones) @ copy.T``
    is what ``rms_norm(h, gain) @ weight.T`` was, so every reader of the record stays right, and a decode step may
    scale the product of the raw residual by each row's RMS instead (:mod:`rollout.ops.rms_scaled`)."""

    def __init__(self):
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._folded: bool | None = None
        """``fold`` of the refresh that last wrote the buffers (another value makes the next refresh copy)."""

    def _buffer(self, key, parts: list, copy: bool = True, gain: torch.Tensor | None = None) -> torch.Tensor:
        """The kept concatenation of ``parts`` (times ``gain`` along the input dimension when given); ``copy=False``
        skips the copy into a buffer already held (a second refresh within one call)."""
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        held = self._buffers.get(key)
        buffer = kept_buffer(self._buffers, key, shape, parts[0])
        if copy or buffer is not held:
            torch.cat(parts, out=buffer)
            if gain is not None:
                buffer.mul_(gain.to(buffer.dtype))
        return buffer

    def _copies(self, copy: bool, fold: bool) -> bool:
        """Whether this refresh writes the buffers: ``copy``, or ``fold`` differs from the refresh that wrote them."""
        copy = copy or self._folded != fold
        self._folded = fold
        return copy

    def _norm(self, gain: torch.Tensor, fold: bool) -> torch.Tensor:
        """The gain the refreshed record carries: ``gain`` itself, or with ``fold`` a kept vector of ones (one for
        every layer, at a fixed address for captured graphs)."""
        if not fold:
            return gain
        held = self._buffers.get((-1, "ones"))
        ones = kept_buffer(self._buffers, (-1, "ones"), gain.shape, gain)
        return ones if ones is held else ones.fill_(1)

    def clear(self) -> None:
        self._buffers = {}

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The kept concatenations (what :meth:`WeightMirror.refresh` passes through as ``stable``)."""
        return tuple(self._buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class FusedQKV(_ConcatenatedCopies):
    """Persistent ``[q; k; v]`` weight (and bias) per layer (``RolloutConfig.kernels.fuse_qkv``).

    Why: at decode the k and v projections are tiny GEMMs (``2 Hkv D`` outputs) that run at a few percent
    of the GPU's rate; one GEMM over the concatenated weight replaces three launches per layer. The copy is
    ~1/8 of the weights for a 3B Qwen2.5 (377 MB).
    """

    def refresh(self, weights: "DecoderWeights", copy: bool = True, fold: bool = False) -> "DecoderWeights":
        """``weights`` with each layer's ``qkv`` (and ``qkv_bias``) set to its kept concatenation, and ``q``,
        ``k``, ``v`` (and their biases) set to views of it: the same values at fixed addresses. ``fold``: the input
        norm's gain multiplied into the copy (:class:`_ConcatenatedCopies`)."""
        layers, copy = [], self._copies(copy, fold)
        for i, w in enumerate(weights.layers):
            qkv = self._buffer((i, "w"), [w.q, w.k, w.v], copy, w.input_norm if fold else None)
            biases = (w.q_bias, w.k_bias, w.v_bias)
            bias = None
            outs = [w.q.shape[0], w.k.shape[0], w.v.shape[0]]
            if any(b is not None for b in biases):
                zeros = [torch.zeros(n, dtype=w.q.dtype, device=w.q.device) for n in outs]
                bias = self._buffer((i, "b"), [b if b is not None else z for b, z in zip(biases, zeros)], copy)
            q, k, v = qkv.split(outs)
            views = {}
            if bias is not None:
                q_bias, k_bias, v_bias = bias.split(outs)
                views = {name: view for name, view, b in (("q_bias", q_bias, w.q_bias), ("k_bias", k_bias, w.k_bias),
                                                           ("v_bias", v_bias, w.v_bias)) if b is not None}
            layers.append(dataclasses.replace(w, qkv=qkv, qkv_bias=bias, q=q, k=k, v=v,
                                              input_norm=self._norm(w.input_norm, fold), **views))
        return dataclasses.replace(weights, layers=layers)


class FusedGateUp(_ConcatenatedCopies):
    """Persistent ``[gate; up]`` weight per layer (``RolloutConfig.kernels.fuse_gate_up``).

    Why: at small decode batches the weight GEMMs are bandwidth-bound and each launch leaves the GPU
    partly idle at its start and end; one GEMM over the concatenated weight reads the same bytes with one
    launch instead of two. The cost is memory: the copy is ~58% of the weights for a 3B Qwen2.5 (3.2 GB).
    """

    def refresh(self, weights: "DecoderWeights", copy: bool = True, fold: bool = False) -> "DecoderWeights":
        """``weights`` with each layer's ``gate_up`` set to its kept concatenation, ``gate`` and ``up`` to views.
        ``fold``: the post-attention norm's gain multiplied into the copy (:class:`_ConcatenatedCopies`)."""
        layers, copy = [], self._copies(copy, fold)
        for i, w in enumerate(weights.layers):
            gate_up = self._buffer((i, "gate_up"), [w.gate, w.up], copy, w.post_norm if fold else None)
            gate, up = gate_up.split([w.gate.shape[0], w.up.shape[0]])
            layers.append(dataclasses.replace(w, gate_up=gate_up, gate=gate, up=up,
                                              post_norm=self._norm(w.post_norm, fold)))
        return dataclasses.replace(weights, layers=layers)
