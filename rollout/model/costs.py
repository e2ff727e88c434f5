"""The planner's cost model for a given model: defaults from its geometry, or a calibration file checked
against what this run is (device, dtype, attention backend, library versions, geometry, sources)."""

from __future__ import annotations

import platform
from typing import Sequence

import torch

from rollout.model import compat
from rollout.plan.calibration import check_metadata, read_calibration, source_fingerprint
from rollout.plan.planner import CostModel


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'unknown'}"


def calibration_metadata(model, device, dtype) -> dict:
    """What the coefficients depend on: device, dtype, attention backend, library versions, geometry, sources."""
    import transformers

    config = model.config
    geometry = CostModel.from_model(model, dtype=dtype)
    return {
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "attention_implementation": compat.attention_implementation(model),
        "prefill_path": default_prefill_path(model, device, dtype),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "geometry": {"model_type": getattr(config, "model_type", None), "hidden_size": config.hidden_size,
                     "intermediate_size": getattr(config, "intermediate_size", None),
                     "vocab_size": config.vocab_size,
                     **{k: getattr(geometry, k) for k in ("num_layers", "num_query_heads", "num_kv_heads",
                                                          "head_dim", "element_bytes")}},
        "source_sha256": source_fingerprint(),
    }


def default_prefill_path(model, device, dtype) -> str:
    """The prefill the engine runs for this model by default (one of ``routes.PREFILL_PATHS``)."""
    from rollout.model import prefill, step

    if step.unsupported_reason(model) is not None:
        return "hf"
    return prefill.attention_path(device, dtype)


def load_cost_model(path, model, device, dtype, ignore: Sequence[str] = ()) -> CostModel:
    """The saved ``CostModel``, after checking its metadata against ``(model, device, dtype)``.

    ``ignore``: metadata keys not to compare (e.g. ``("source_sha256",)`` while developing).
    """
    record = read_calibration(path)
    check_metadata(record["metadata"], calibration_metadata(model, device, dtype), ignore)
    return CostModel.from_dict(record["cost_model"])


def cost_model_for(setting, model) -> CostModel:
    """``RolloutConfig.routing.cost_model`` resolved: a ``CostModel`` as given, a calibration file checked against
    ``model``, or the seed PR's default coefficients with this model's geometry (None)."""
    if isinstance(setting, CostModel):
        return setting
    if isinstance(setting, str):
        param = next(model.parameters())
        return load_cost_model(setting, model, param.device, param.dtype)
    return CostModel.from_model(model)
