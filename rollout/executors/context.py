"""What one ``generate`` call hands a route executor (frozen, typed), and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from instrumentation import NOOP_RANGE
from rollout.config import SamplingConfig
from rollout.model.step import StepParts
from rollout.ops.postprocess import eos_tensor
from rollout.ops.sampling import Sampler, sampler_fn
from rollout.plan.planner import DEFAULT_MAX_TOKENS, CostModel

#: ``stage(name)`` -> a context manager wrapping one stage call (``instrumentation.stage`` in the engine).
StageFn = Callable[[str], object]
#: Decides whether another decode step runs (all ranks must agree under ZeRO-3 per-forward gathering).
BusyFn = Callable[[bool], bool]


def no_stage(name: str):
    """A stage function that records nothing (tests and direct callers)."""
    return NOOP_RANGE


def local_busy(busy: bool) -> bool:
    """The busy function of a single rank: its own flag."""
    return busy


@dataclass(frozen=True)
class EosIds:
    """The end-of-sequence ids of a call, as the host key of captured graphs and as a device tensor."""

    ids: tuple[int, ...]
    """Empty: no EOS, every row runs to the budget."""
    tensor: Optional[torch.Tensor]
    """``[len(ids)]`` int64 on the model's device, or None when ``ids`` is empty."""

    @classmethod
    def on(cls, ids: tuple[int, ...], device) -> "EosIds":
        return cls(tuple(ids), eos_tensor(tuple(ids), torch.device(device)))


@dataclass(frozen=True)
class Generation:
    """What a route executor returns: raw tokens and what came with them."""

    tokens: torch.Tensor
    """``[B*n, S]`` raw tokens of every step, request order (post-processing cuts at the first EOS)."""
    logprobs: Optional[torch.Tensor]
    """``[B*n, S]`` float32 log-probabilities of those tokens (``SamplingConfig.return_logprobs``), else None."""
    stats: "object"
    """The call's ``rollout.stats.CallStats``."""


@dataclass(frozen=True)
class CallContext:
    """One generation as a route executor sees it."""

    model: torch.nn.Module
    """The HF ``*ForCausalLM`` (LoRA fused, ZeRO-3 parameters gathered where asked)."""
    sampling: SamplingConfig
    eos: EosIds
    cost_model: CostModel
    """What prefill buckets are planned on (``rollout.model.costs.cost_model_for``)."""
    max_prefill_tokens: Optional[int] = DEFAULT_MAX_TOKENS
    """Padded tokens per planned prefill forward (``RolloutConfig.routing.max_prefill_tokens``)."""
    eos_check_interval: int = 1
    """Ordinary route: decode steps between the "anyone still running?" checks (one host sync each)."""
    stage: StageFn = no_stage
    busy: BusyFn = local_busy
    fast: Optional[StepParts] = None
    """Our step's parts for eager decode steps (None: the HF layers decode)."""
    fast_prefill: Optional[StepParts] = None
    """Our step's parts for the packed prefill (None: the HF layers prefill)."""
    sampler: Optional[Sampler] = None
    """Token selection (``rollout.ops.sampling.sampler_fn``; compiled on CUDA); None: the eager one."""
    prefill_graphs: Optional[object] = None
    """Captured prefill passes (``rollout.executors.prefill_graph.PrefillGraphs``) where
    ``RolloutConfig.kernels.prefill_graph_tokens`` asks for them, else None."""
    late_eos_count: bool = True
    """Ordinary route, static buffers: a check reads the previous check's count (``RolloutConfig.routing.late_eos_count``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling: must be a SamplingConfig; got {type(self.sampling).__name__}")
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model: must be a planner.CostModel; got {type(self.cost_model).__name__}")
        if not isinstance(self.eos, EosIds):
            raise ValueError(f"eos: must be an EosIds; got {type(self.eos).__name__}")
        if self.sampler is None:
            object.__setattr__(self, "sampler", sampler_fn(self.sampling, compiled=False))

    @property
    def with_logprobs(self) -> bool:
        return self.sampling.return_logprobs

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
