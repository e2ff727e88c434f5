"""What :func:`instrumentation.instrument_deepspeed` wraps: one :class:`Target` per upstream method.

No DeepSpeed import here: a target names its module, class and method, the stage its calls become
and the kind of wrapper (see :mod:`instrumentation.upstream` for what each kind does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from instrumentation import stages as S

#: Kinds of wrapper: a plain stage range, a generate call (``rollout`` + forward hooks), or a
#: region whose model forwards are prefills.
KIND_STAGE, KIND_GENERATE, KIND_PREFILL_REGION = "stage", "generate", "prefill_region"
KINDS = (KIND_STAGE, KIND_GENERATE, KIND_PREFILL_REGION)


@dataclass(frozen=True)
class Target:
    """One upstream method to wrap."""

    module: str
    """Import path of the module that defines the class."""
    owner: str
    """Class name in that module."""
    method: str
    """Method (attribute) name on the class."""
    stage: str
    """Stage name (a constant of :mod:`instrumentation.stages`)."""
    kind: str = KIND_STAGE
    """:data:`KIND_STAGE`, :data:`KIND_GENERATE` or :data:`KIND_PREFILL_REGION`."""
    forward_module: Optional[str] = None
    """For :data:`KIND_GENERATE`: dotted attribute path from ``self`` to the model whose forwards
    are prefill/decode (e.g. ``"engine.module"``)."""

    def __post_init__(self) -> None:
        for name in ("module", "owner", "method"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string; got {getattr(self, name)!r}")
        S.range_name(self.stage)  # ValueError naming the accepted stages
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if (self.kind == KIND_GENERATE) != (self.forward_module is not None):
            raise ValueError("forward_module must be set exactly for kind 'generate'; "
                             f"got kind={self.kind!r}, forward_module={self.forward_module!r}")

    @property
    def qualname(self) -> str:
        """``Class.method``, as named in warnings and return values."""
        return f"{self.owner}.{self.method}"


_RO = "deepspeed.runtime.rollout.hybrid_engine_rollout"
_HE = "deepspeed.runtime.hybrid_engine"
_ENGINE = "deepspeed.runtime.engine"
_PARAMS = "deepspeed.runtime.zero.partition_parameters"
_COORD = "deepspeed.runtime.zero.partitioned_param_coordinator"
_WORKSPACE = "deepspeed.ops.transformer.inference.op_binding.workspace"
_CACHE = "deepspeed.utils.static_cache"

#: What :func:`instrument_deepspeed` wraps (DeepSpeed 0.19.8 names).
TARGETS: tuple[Target, ...] = (
    Target(_RO, "HybridEngineRollout", "generate", S.ROLLOUT, KIND_GENERATE, "engine.module"),
    Target(_RO, "HybridEngineRollout", "_continuous_prefill_cache", S.PREFILL, KIND_PREFILL_REGION),
    Target(_HE, "DeepSpeedHybridEngine", "generate", S.ROLLOUT, KIND_GENERATE, "module"),
    Target(_HE, "DeepSpeedHybridEngine", "fuse_lora_weight", S.LORA_FUSE),
    Target(_HE, "DeepSpeedHybridEngine", "_fuse_lora_layer", S.LORA_FUSE),
    Target(_HE, "DeepSpeedHybridEngine", "unfuse_lora_weight", S.LORA_UNFUSE),
    Target(_HE, "DeepSpeedHybridEngine", "unfuse_lora_weight_non_pinned", S.LORA_UNFUSE),
    Target(_HE, "DeepSpeedHybridEngine", "_unfuse_lora_layer", S.LORA_UNFUSE),
    Target(_HE, "DeepSpeedHybridEngine", "retake_inference_cache", S.CACHE_ACQUIRE),
    Target(_HE, "DeepSpeedHybridEngine", "eval", S.MODE_SWITCH),
    Target(_HE, "DeepSpeedHybridEngine", "train", S.MODE_SWITCH),
    Target(_ENGINE, "DeepSpeedEngine", "eval", S.MODE_SWITCH),
    Target(_ENGINE, "DeepSpeedEngine", "train", S.MODE_SWITCH),
    Target(_PARAMS, "GatheredParameters", "__enter__", S.GATHER),
    Target(_COORD, "PartitionedParameterCoordinator", "fetch_sub_module", S.GATHER),
    Target(_WORKSPACE, "WorkspaceOp", "release_workspace", S.CACHE_RELEASE),
    Target(_CACHE, "DeepSpeedStaticCache", "__init__", S.CACHE_ACQUIRE),
    Target(_CACHE, "DeepSpeedStaticCache", "compact", S.CACHE_TRIM),
    Target(_CACHE, "DeepSpeedStaticCache", "trim_left", S.CACHE_TRIM),
)
