"""What one ``generate`` call hands a route executor (frozen, typed), and what it gets back.

Every route is an :class:`Executor`: ``run(call) -> Generation`` with the same :class:`RouteCall`, from which
it prepares its own inputs and fills its own ``CallStats`` (:func:`settle_stats` records the decisions made
before the route ran)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Optional, Protocol

import torch

from instrumentation import NOOP_RANGE
from rollout.config import SamplingConfig
from rollout.model.step import StepParts
from rollout.ops.postprocess import eos_tensor
from rollout.ops.sampling import Sampler, sampler_fn
from rollout.plan.layout import PromptLayout
from rollout.plan.memory import SlotPlan
from rollout.plan.planner import DEFAULT_MAX_TOKENS, CostModel
from rollout.plan.routes import RouteChoice

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


class LogitCheck:
    """Whether any prefill pass of a call produced a non-finite last-token logit (NaN weights or inputs: the
    sampler would then emit token 0 for every row, silently). One reduction on the device per prefill pass, no
    sync; :meth:`found` reads it once, at the end of the call. Decode steps are not checked (their captured
    graphs stay as they are): NaN weights already show in the prefill."""

    __slots__ = ("_bad",)

    def __init__(self) -> None:
        self._bad: Optional[torch.Tensor] = None

    def note(self, logits: torch.Tensor) -> None:
        bad = torch.isfinite(logits).logical_not_().any()
        self._bad = bad if self._bad is None else self._bad.logical_or_(bad)

    def found(self) -> bool:
        """Whether a non-finite logit was noted (a host read of one flag)."""
        return self._bad is not None and bool(self._bad)


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
class RowBudgets:
    """Each output row's own token budget (``RolloutRequest.row_max_new_tokens``), by sample id."""

    values: tuple[int, ...]
    """``[B*n]`` on the host (the continuous route's scheduler retires on them)."""
    tensor: torch.Tensor
    """The same, int64 on the model's device (the ordinary route's finished flags)."""

    @classmethod
    def on(cls, values, device) -> Optional["RowBudgets"]:
        if values is None:
            return None
        values = tuple(int(v) for v in values)
        return cls(values, torch.tensor(values, dtype=torch.long, device=torch.device(device)))


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
    _: KW_ONLY
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
    """Ordinary route, static buffers: a check reads the previous check's count
    (``RolloutConfig.routing.late_eos_count``)."""
    row_budgets: Optional[RowBudgets] = None
    """Each row's own budget (``RolloutRequest.row_max_new_tokens``); None: ``sampling.max_new_tokens`` for all."""
    logit_check: LogitCheck = field(default_factory=LogitCheck)
    """The prefill passes' non-finite logits, noted by the routes and read by the runner after the call."""

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
    def has_stops(self) -> bool:
        """Whether a row can end before the budget (EOS ids or rows' own budgets): the routes check for it."""
        return self.eos.tensor is not None or self.row_budgets is not None

    @property
    def with_logprobs(self) -> bool:
        return self.sampling.return_logprobs

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class Prompts:
    """The call's prompts on the model's device, once per prompt and once per row."""

    ids: torch.Tensor
    """``[B, T_p]`` left-padded prompt ids."""
    mask: torch.Tensor
    """``[B, T_p]`` their attention mask."""
    expanded_ids: torch.Tensor
    """``[B*n, T_p]``: each prompt's ``n`` adjacent copies (request order)."""
    expanded_mask: torch.Tensor
    """``[B*n, T_p]``."""
    layout: PromptLayout
    """Each prompt's real tokens and span (``rollout.ops.inputs.checked_layout``)."""


@dataclass(frozen=True)
class RouteCall:
    """Everything a route executor needs for one call: the same record for every route."""

    ctx: CallContext
    """The model, sampling, EOS ids, the step's parts and the call's stage and busy functions."""
    decode: "object"
    """How the call decodes and prefills (``rollout.executors.decode.DecodeChoice``)."""
    plan: RouteChoice
    """The route and, on the ordinary route, its prefill buckets (``rollout.plan.routes.choose_route``)."""
    prompts: Prompts
    fit: Optional[SlotPlan] = None
    """The KV budget's slots and capacity (None: the call runs as planned, ``rollout.plan.memory``)."""
    blas_library: str = ""
    """The BLAS backend the call's matrix products run on (``CallStats.blas_library``)."""
    graph_passes_before: int = 0
    """``ctx.prefill_graphs.replays`` when the call started (the call's captured prefill passes are counted
    from it)."""


class Executor(Protocol):
    """A route: it owns its buffers and graphs between calls and runs one call at a time."""

    def run(self, call: RouteCall) -> Generation:
        """The call's raw tokens in request order, with its ``CallStats`` filled."""

    def release(self) -> None:
        """Drop what it holds between calls (buffers, graphs, scratch)."""

    @property
    def nbytes(self) -> int:
        """Device bytes it holds between calls."""


def settle_stats(call: RouteCall, stats) -> None:
    """The decisions made before the route ran, and the call-wide pieces' counts, into its ``CallStats``."""
    plan, ctx = call.plan, call.ctx
    stats.route, stats.route_reason, stats.dp_skipped = plan.route, plan.reason, plan.dp_skipped
    stats.route_estimates_ms, stats.blas_library = plan.estimates_ms, call.blas_library
    stats.plans += 0 if plan.dp_skipped else 1  # Auto's bucket DP ran for this call
    stats.prefill.path = call.decode.prefill_path
    stats.prefill.buckets = len(plan.buckets) if plan.buckets else 1
    if ctx.prefill_graphs is not None:
        stats.prefill.graph_passes = ctx.prefill_graphs.replays - call.graph_passes_before
    stats.decode.eos_check_interval = ctx.eos_check_interval
    stats.sampler.fallback_reason, stats.sampler.path = ctx.sampler.fallback_reason, ctx.sampler.last_path
