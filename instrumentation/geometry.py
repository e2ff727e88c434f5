"""A model's :class:`instrumentation.roofline.ModelGeometry`, read from an HF decoder (no torch import).

Shared by the benchmarks (``benchmarks.harness.models`` re-exports it) and the OPSD step's work records
(:mod:`instrumentation.worklog`), so that both count the same work.
"""

from __future__ import annotations

from instrumentation.mfu import matmul_params
from instrumentation.roofline import ModelGeometry
from instrumentation.work import Head


def weight_bytes(model) -> int:
    """Bytes of the full weights (under ZeRO-3 a parameter's local tensor is a partition: ``ds_numel`` is its full
    size), tied weights counted once."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())


def trainable_params(model) -> int:
    """Parameters that take gradients (full size under ZeRO-3), tied ones counted once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in unique if p.requires_grad)


def trained_share(model) -> float:
    """Share of the matmul weights (every parameter but an untied input embedding; full sizes under ZeRO-3) that take
    gradients: 1.0 when every weight trains, a LoRA student's adapters alone a fraction of a percent
    (:func:`instrumentation.roofline.backward_flops`)."""
    total = matmul_params(model)
    embed, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    lookup = int(getattr(embed, "ds_numel", 0) or embed.numel()) if embed is not out and embed.requires_grad else 0
    return (trainable_params(model) - lookup) / total if total else 0.0  # a trained lookup table is no matmul


def model_geometry(model) -> ModelGeometry:
    """The roofline's figures of an HF decoder (:class:`instrumentation.roofline.ModelGeometry`)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    element = next(model.parameters()).element_size()
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    nonembedding = total - embed.numel() - (0 if head is embed else head.numel())
    return ModelGeometry(
        weight_bytes=weight_bytes(model),
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element,
        nonembedding_params=nonembedding, lm_head_params=head.numel(),
        attn_flops_per_key=4 * cfg.num_hidden_layers * heads * head_dim)


def head(model) -> Head:
    """The output head of an HF decoder (:class:`instrumentation.work.Head`): ``[V, H]``, its element bytes, whether
    it trains."""
    weight = model.get_output_embeddings().weight
    vocab, hidden = (int(x) for x in getattr(weight, "ds_shape", weight.shape))
    return Head(vocab, hidden, weight.element_size(), bool(weight.requires_grad))
