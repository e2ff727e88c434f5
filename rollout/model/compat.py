"""The one place that knows how transformers' model-facing interface looks in each tested version.

Tested range: transformers 5.17 - 5.24 (see setup.cfg). What moves between minor versions and is
handled here:

- the cache keyword of ``forward``: ``past_key_values`` (5.17) became ``cache`` (5.24, the old name
  deprecated); detected from the signature once per model class;
- masks: we pass a prebuilt 4-D mask, which transformers' mask preparation returns as-is on both
  ends (a per-layer-type dict works for Qwen2 but not for Llama), so its own mask construction (whose
  cache hooks, e.g. ``get_query_offset``, change between versions) is never involved;
- the cache base classes (``Cache``, ``CacheLayerMixin``) that :mod:`rollout.kv_cache` subclasses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401  (re-exported for the caches)

SUPPORTED_ATTENTION = ("sdpa", "eager")


def unwrap_model(engine_or_model) -> torch.nn.Module:
    """The module to run: ``engine.module`` for a DeepSpeed engine, else the model itself."""
    module = getattr(engine_or_model, "module", None)
    if module is not None and hasattr(engine_or_model, "zero_optimization_stage"):
        return module
    return engine_or_model


def causal_lm(module: torch.nn.Module) -> torch.nn.Module:
    """The HF ``*ForCausalLM`` inside a peft wrapper (its LoRA layers stay in place and active)."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) else module


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ValueError(f"model: {model_cls.__name__}.forward takes neither `cache` nor `past_key_values`")


def attention_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` for models the static-cache loop cannot run exactly."""
    config = model.config
    impl = attention_implementation(model)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"model.config._attn_implementation: {impl!r} is not supported by the rollout core; "
                         f"load the model with attn_implementation in {SUPPORTED_ATTENTION}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"model.config.layer_types: only full-attention models are supported; got "
                         f"{sorted(layer_types)}")
    _cache_kwarg(type(model))


def to_model_mask(keep: torch.Tensor, model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``keep`` mask in the form the model's attention takes (bool for SDPA, additive for eager)."""
    if attention_implementation(model) == "sdpa":
        return keep
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def mask_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``to_model_mask`` needs: bool for SDPA, the parameter dtype (additive mask) for eager."""
    return next(model.parameters()).dtype if attention_implementation(model) == "eager" else torch.bool


def forward_last_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        mask: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run one forward over ``cache`` and return the last position's logits ``[B, V]``."""
    kwargs = {_cache_kwarg(type(model)): cache}
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[:, -1, :]


def kv_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder-only HF model."""
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def context_limit(model: torch.nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def switch_to_eval(module: torch.nn.Module) -> Callable[[], None]:
    """Put ``module`` in eval mode; returns the function restoring every submodule's own ``training`` flag."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()

    def restore() -> None:
        for m, was_training in flags:
            m.training = was_training
    return restore


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the duration; every submodule's own flag is restored afterwards."""
    restore = switch_to_eval(module)
    try:
        yield
    finally:
        restore()
