"""A decode step of our own for Llama-family models (Llama, Qwen2, Mistral), read from the HF modules.

Why: HF's layer code launches dozens of small kernels per layer; even replayed from a CUDA graph a
3B-shaped decode step stays ~6x the memory-bandwidth floor. This step computes exactly what the HF
layers compute (RMSNorm, rotary, grouped-query attention over our static cache, SiLU MLP) with two
fusable pieces per layer (``attention_inputs``, ``attention_output_and_mlp``) that
``compiled_step_fns`` compiles with ``torch.compile`` and :mod:`rollout.executors.graphs` captures in
CUDA graphs. On the CPU it runs eagerly and is checked against HF ``generate`` in the tests.

The weights are the model's own parameter tensors (no copy), so LoRA must be fused (peft's unmerged
forward is not replicated here) and the addresses are part of the graph key.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.ops.decode_attention import sdpa as decode_attention  # the step's default attention piece
from rollout.ops.norm import rms_norm

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


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast step cannot run ``model`` exactly (None when it can)."""
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
    for module in model.modules():  # peft: an unmerged, active LoRA layer adds a path we do not replicate
        if (hasattr(module, "lora_A") and not getattr(module, "merged", False)
                and not getattr(module, "disable_adapters", False) and getattr(module, "active_adapters", None)):
            return "LoRA adapters are not fused (fuse_lora=False, ZeRO-3 per-forward gathering or a LoRA variant)"
    return None


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = getattr(module, "base_layer", module)
    return _plain(base.weight), _plain(base.bias)


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A plain-tensor view (same storage) of a parameter. The compiled step pieces guard on their
    inputs' types: parameters here and the ZeRO-3 weight mirror's plain tensors elsewhere would make
    them recompile for every new prompt shape, instead of once."""
    return None if tensor is None else tensor.detach()


def spec_and_weights(model: torch.nn.Module) -> tuple[DecoderSpec, DecoderWeights]:
    """Read geometry and weight tensors from an HF ``*ForCausalLM`` (no copies: plain-tensor views of the
    parameters, read at each call so that reassigned ``.data`` is followed)."""
    config, inner = model.config, model.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, q_b = _linear(attn.q_proj)
        k, k_b = _linear(attn.k_proj)
        v, v_b = _linear(attn.v_proj)
        o, o_b = _linear(attn.o_proj)
        layers.append(LayerWeights(_plain(layer.input_layernorm.weight), q, q_b, k, k_b, v, v_b, o, o_b,
                                   _plain(layer.post_attention_layernorm.weight), _linear(mlp.gate_proj)[0],
                                   _linear(mlp.up_proj)[0], _linear(mlp.down_proj)[0]))
    lm_head, lm_bias = _linear(model.lm_head)
    spec = DecoderSpec(config.num_hidden_layers, config.num_attention_heads,
                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                       float(getattr(inner.norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6))),
                       float(getattr(inner.rotary_emb, "attention_scaling", 1.0)))
    weights = DecoderWeights(_plain(inner.embed_tokens.weight), layers, _plain(inner.norm.weight), lm_head, lm_bias,
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
    fixed for captured graphs."""

    def __init__(self):
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def _buffer(self, key, parts: list, copy: bool = True) -> torch.Tensor:
        """The kept concatenation of ``parts``; ``copy=False`` skips the copy into a buffer already held (a
        second refresh within one call)."""
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        held = self._buffers.get(key)
        buffer = kept_buffer(self._buffers, key, shape, parts[0])
        if copy or buffer is not held:
            torch.cat(parts, out=buffer)
        return buffer

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
    """Persistent ``[q; k; v]`` weight (and bias) per layer (``RolloutConfig.fuse_qkv``).

    Why: at decode the k and v projections are tiny GEMMs (``2 Hkv D`` outputs) that run at a few percent
    of the GPU's rate; one GEMM over the concatenated weight replaces three launches per layer. The copy is
    ~1/8 of the weights for a 3B Qwen2.5 (377 MB).
    """

    def refresh(self, weights: "DecoderWeights", copy: bool = True) -> "DecoderWeights":
        """``weights`` with each layer's ``qkv`` (and ``qkv_bias``) set to its kept concatenation, and ``q``,
        ``k``, ``v`` (and their biases) set to views of it: the same values at fixed addresses."""
        layers = []
        for i, w in enumerate(weights.layers):
            qkv = self._buffer((i, "w"), [w.q, w.k, w.v], copy)
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
            layers.append(dataclasses.replace(w, qkv=qkv, qkv_bias=bias, q=q, k=k, v=v, **views))
        return dataclasses.replace(weights, layers=layers)


class FusedGateUp(_ConcatenatedCopies):
    """Persistent ``[gate; up]`` weight per layer (``RolloutConfig.fuse_gate_up``).

    Why: at small decode batches the weight GEMMs are bandwidth-bound and each launch leaves the GPU
    partly idle at its start and end; one GEMM over the concatenated weight reads the same bytes with one
    launch instead of two. The cost is memory: the copy is ~58% of the weights for a 3B Qwen2.5 (3.2 GB).
    """

    def refresh(self, weights: "DecoderWeights", copy: bool = True) -> "DecoderWeights":
        """``weights`` with each layer's ``gate_up`` set to its kept concatenation, ``gate`` and ``up`` to views."""
        layers = []
        for i, w in enumerate(weights.layers):
            gate_up = self._buffer((i, "gate_up"), [w.gate, w.up], copy)
            gate, up = gate_up.split([w.gate.shape[0], w.up.shape[0]])
            layers.append(dataclasses.replace(w, gate_up=gate_up, gate=gate, up=up))
        return dataclasses.replace(weights, layers=layers)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``cos, sin [B, 1, 1, D]`` for one position per row."""
    freqs = positions[:, None].float() * inv_freq.float()  # [B, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * scaling).to(dtype)[:, None, None, :], (emb.sin() * scaling).to(dtype)[:, None, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs(h, norm, wq, bq, wk, bk, wv, bv, *, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int):
    """RMSNorm -> q/k/v projections -> rotary. ``h [B, H]`` -> q ``[B, Hq, 1, D]``, k/v ``[B, Hkv, 1, D]``."""
    batch = h.shape[0]
    x = rms_norm(h, norm, eps)
    q = F.linear(x, wq, bq).view(batch, num_heads, 1, head_dim)
    k = F.linear(x, wk, bk).view(batch, num_kv_heads, 1, head_dim)
    v = F.linear(x, wv, bv).view(batch, num_kv_heads, 1, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs_qkv(h, norm, wqkv, bqkv, *, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                         head_dim: int):
    """:func:`attention_inputs` with one GEMM over the concatenated ``[q; k; v]`` weight."""
    batch = h.shape[0]
    qkv = F.linear(rms_norm(h, norm, eps), wqkv, bqkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(batch, num_heads, 1, head_dim)
    k = k.reshape(batch, num_kv_heads, 1, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(batch, num_kv_heads, 1, head_dim)


# keyword-only, not records: compiled piece; records would add guards
def attention_inputs_qkv_write(h, norm, wqkv, bqkv, *, cos, sin, key_layer, value_layer, cols, eps: float,
                               num_heads: int, num_kv_heads: int, head_dim: int):
    """:func:`attention_inputs_qkv` that also writes the step's k and v into one layer's cache
    (``key_layer``/``value_layer [B, Hkv, capacity, D]``, column ``cols [1]``) and returns q only. Under
    ``torch.compile`` the rotary of q and k and both cache writes become one kernel that writes the cache in
    place (checked on inductor's CPU code: no copy of the cache; one compiled graph serves every layer's
    cache view), where the separate path launches two rotary kernels, two ``index_copy_`` and copies."""
    q, k, v = attention_inputs_qkv(h, norm, wqkv, bqkv, cos=cos, sin=sin, eps=eps, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim)
    key_layer.index_copy_(2, cols, k)
    value_layer.index_copy_(2, cols, v)
    return q


def qkv_projection(h, norm, wqkv, bqkv, eps: float):
    """RMSNorm -> the fused q|k|v projection ``[B, (Hq + 2 Hkv) D]``, before the rotary (for
    :func:`rollout.ops.rotary_write.rotary_write`, which rotates and writes the cache in one kernel)."""
    return F.linear(rms_norm(h, norm, eps), wqkv, bqkv)


def layer_qkv(fns: "StepFns", h, w: LayerWeights, cos, sin, spec: DecoderSpec):
    """q ``[N, Hq, 1, D]``, k/v ``[N, Hkv, 1, D]`` of one layer: one GEMM where ``w.qkv`` is set, else three."""
    if w.qkv is not None:
        return fns.attention_inputs_qkv(h, w.input_norm, w.qkv, w.qkv_bias, cos=cos, sin=sin, **spec.piece_constants)
    return fns.attention_inputs(h, w.input_norm, w.q, w.q_bias, w.k, w.k_bias, w.v, w.v_bias, cos=cos, sin=sin,
                                **spec.piece_constants)


# keyword-only, not records: compiled piece; records would add guards
def attention_output_and_mlp(h, attn, wo, bo, norm, gate, up, down, *, eps: float):
    """o projection + residual, RMSNorm, SiLU MLP + residual. ``attn [B, Hq, 1, D]``."""
    h = h + F.linear(attn.reshape(h.shape[0], -1), wo, bo)
    x = rms_norm(h, norm, eps)
    return h + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# keyword-only, not records: compiled piece; records would add guards
def attention_output_and_gate_up_mlp(h, attn, wo, bo, norm, gate_up, down, *, eps: float):
    """:func:`attention_output_and_mlp` with one GEMM over the concatenated ``[gate; up]`` weight."""
    return gate_up_mlp(h + F.linear(attn.reshape(h.shape[0], -1), wo, bo), norm, gate_up, down, eps)


def gate_up_mlp(h, norm, gate_up, down, eps: float):
    """The second half of :func:`attention_output_and_gate_up_mlp`: the MLP and its residual, for a step whose o
    projection ran apart (``StepFns.skinny_linear``)."""
    gate, up = F.linear(rms_norm(h, norm, eps), gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, down)


def layer_output(fns: "StepFns", h, attn, w: LayerWeights, eps: float):
    """The layer's output from its attention: one gate|up GEMM where ``w.gate_up`` is set, else two."""
    if w.gate_up is not None:
        return fns.attention_output_and_gate_up_mlp(h, attn, w.o, w.o_bias, w.post_norm, w.gate_up, w.down, eps=eps)
    return fns.attention_output_and_mlp(h, attn, w.o, w.o_bias, w.post_norm, w.gate, w.up, w.down, eps=eps)


def final_logits(h, norm, lm_head, lm_bias, eps: float):
    return F.linear(rms_norm(h, norm, eps), lm_head, lm_bias)


def grouped_decode_attention(q, k, v, keep, scale: float, gqa: bool, *, last=None, shared=None):
    """:func:`decode_attention` as two batched GEMMs per KV head over its group of query heads (q heads
    ``h * G .. h * G + G - 1`` share KV head ``h``, as in SDPA's ``enable_gqa``): each key and value is read
    once per KV head, and under ``torch.compile`` the mask and softmax fuse into one kernel. Scores are
    computed in the inputs' dtype and the softmax in fp32, as HF's eager attention does. An experiment
    (``scripts/profile_decode_step.py --grouped-attention``), not used by the routes: on an H200 it made the
    compiled 3B step slower (4.08 vs 3.79 ms at 32 rows, 12.8 vs 5.79 at 256)."""
    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group, dim), k.transpose(-1, -2)).float() * scale
    keep = keep.reshape(batch, 1, 1, length)
    scores = scores.masked_fill(~keep, float("-inf")) if keep.dtype == torch.bool else scores + keep.float()
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, Hkv, G, L]
    return torch.matmul(probs, v).reshape(batch, heads, 1, dim)


@dataclass(frozen=True)
class StepFns:
    """The fusable pieces (eager functions, or their ``torch.compile``d versions). They take tensors and
    constants only, so one compiled graph serves every layer: the layer's input and weights positionally, the
    rest keyword-only (not records, which would add guards)."""

    attention_inputs: object = attention_inputs
    attention_inputs_qkv: object = attention_inputs_qkv
    attention_output_and_mlp: object = attention_output_and_mlp
    final_logits: object = final_logits
    attention: object = decode_attention
    """Decode attention, left eager: :func:`decode_attention` (SDPA), or on CUDA with
    ``RolloutConfig.decode_attention="triton"`` the kernel of :mod:`rollout.ops.decode_attention`."""
    attention_inputs_qkv_write: object = None
    """When set (and q|k|v are fused), decode steps write k and v into the cache inside this piece
    (:func:`attention_inputs_qkv_write`) instead of with two ``index_copy_`` after it
    (``RolloutConfig.fused_kv_write``, compiled pieces only)."""
    attention_output_and_gate_up_mlp: object = attention_output_and_gate_up_mlp
    qkv_projection: object = qkv_projection
    gate_up_mlp: object = gate_up_mlp
    skinny_linear: object = None
    """When set (with ``rotary_write`` and fused gate|up), decode steps of at most ``skinny_rows`` rows compute each
    layer's o projection and its residual add with this kernel (``RolloutConfig.skinny_rows``:
    :func:`rollout.ops.skinny_linear.skinny_linear`), then ``gate_up_mlp``; the other projections stay cuBLAS
    GEMMs in the compiled pieces, which were faster there on an H200."""
    skinny_rows: int = 0
    shared_prefix_rows: int = 0
    """Ordinary-route decode steps of at least this many rows, whose prompts have several samples, hand the
    attention piece a ``SharedPrefix`` (``RolloutConfig.shared_prefix_rows``; 0: never)."""
    rotary_write: object = None
    """When set (and q|k|v are fused), decode steps compute ``qkv_projection`` and hand it to this function,
    which rotates q and k and writes k and v into the cache (``RolloutConfig.rotary_kernel``: the one Triton
    kernel of :mod:`rollout.ops.rotary_write`); it takes precedence over ``attention_inputs_qkv_write``."""


def compile_piece(fn, mode: str | None = None):
    """``fn`` compiled as every piece of the step is: one graph, shapes dynamic after a second size, no
    inductor CUDA graphs (ours wrap the whole step). ``mode``: ``RolloutConfig.compile_mode``."""
    return torch.compile(fn, dynamic=None, fullgraph=True, mode=mode)


@functools.lru_cache(maxsize=None)
def compiled_step_fns(mode: str | None = None, kv_write: bool = False) -> StepFns:
    """``torch.compile``d pieces (inductor fuses norms, rotary, SiLU and residual adds). One compiled graph
    serves every layer. ``mode``: the ``torch.compile`` mode (``RolloutConfig.compile_mode``; None: torch's
    default); ``kv_write``: the fused q|k|v piece also writes k and v into the cache
    (``RolloutConfig.fused_kv_write``)."""
    fns = StepFns(*(compile_piece(fn, mode) for fn in (attention_inputs, attention_inputs_qkv,
                                                        attention_output_and_mlp, final_logits)),
                  attention_output_and_gate_up_mlp=compile_piece(attention_output_and_gate_up_mlp, mode),
                  qkv_projection=compile_piece(qkv_projection, mode), gate_up_mlp=compile_piece(gate_up_mlp, mode))
    if kv_write:
        fns = dataclasses.replace(fns, attention_inputs_qkv_write=compile_piece(attention_inputs_qkv_write, mode))
    return fns


@dataclass(frozen=True)
class StepParts:
    """Everything our step functions read besides the cache and the tokens: geometry, weights, pieces."""

    spec: DecoderSpec
    weights: DecoderWeights
    """The model's own tensors (plain views) or, under ZeRO-3 with graphs, the weight mirror's copies."""
    fns: StepFns
    """Eager or ``torch.compile``d pieces (``compiled_step_fns``)."""


def decode_logits(parts: StepParts, key_cache: torch.Tensor, value_cache: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, col: torch.Tensor, keep: torch.Tensor, *, start: int = 0,
                  last: torch.Tensor | None = None, shared=None) -> torch.Tensor:
    """One decode step: ``logits [B, V]`` for ``tokens [B]`` at ``positions [B]``, written at cache column ``col``.

    ``key_cache``/``value_cache``: ``[layers, B, Hkv, capacity, D]`` views; ``keep [B, 1, 1, L]`` bool
    selects the keys each row may attend among columns ``[start, start + L)`` (``L`` = the length
    bucket; ``start`` > 0 for the aligned cache of the continuous route, whose dead prefix is skipped).
    ``last`` (a scalar tensor, a column of the window: no row attends past it) and ``shared``
    (``decode_attention.SharedPrefix``: rows that hold one prompt's columns) go to the attention piece, which
    may read less with them (the Triton kernel) or ignore them (SDPA).
    """
    window = {key: value for key, value in (("last", last), ("shared", shared)) if value is not None}
    spec, weights, fns = parts.spec, parts.weights, parts.fns
    live = keep.shape[-1]
    stop = start + live
    h = F.embedding(tokens, weights.embed)  # [B, H]
    cos, sin = rotary(positions, weights.inv_freq, spec.attention_scaling, h.dtype)
    cols = col.view(1)
    eps = spec.rms_eps
    skinny = (fns.skinny_linear is not None and fns.rotary_write is not None and tokens.shape[0] <= fns.skinny_rows)
    for i, w in enumerate(weights.layers):
        if fns.rotary_write is not None and w.qkv is not None:
            qkv = fns.qkv_projection(h, w.input_norm, w.qkv, w.qkv_bias, eps)
            q = fns.rotary_write(qkv, cos, sin, key_cache[i], value_cache[i], cols, heads=spec.num_heads,
                                 kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        elif fns.attention_inputs_qkv_write is not None and w.qkv is not None:
            q = fns.attention_inputs_qkv_write(h, w.input_norm, w.qkv, w.qkv_bias, cos=cos, sin=sin,
                                               key_layer=key_cache[i], value_layer=value_cache[i], cols=cols,
                                               **spec.piece_constants)
        else:
            q, k, v = layer_qkv(fns, h, w, cos, sin, spec)
            key_cache[i].index_copy_(2, cols, k)
            value_cache[i].index_copy_(2, cols, v)
        attn = fns.attention(q, key_cache[i, :, :, start:stop], value_cache[i, :, :, start:stop], keep,
                             spec.head_dim ** -0.5, spec.num_heads != spec.num_kv_heads, **window)
        if skinny and w.gate_up is not None:  # o + residual in one kernel, then the compiled MLP
            h = fns.skinny_linear(attn.reshape(h.shape[0], -1), w.o, w.o_bias, residual=h)
            h = fns.gate_up_mlp(h, w.post_norm, w.gate_up, w.down, eps)
        else:
            h = layer_output(fns, h, attn, w, eps)
    return fns.final_logits(h, weights.final_norm, weights.lm_head, weights.lm_head_bias, eps)
