"""``Runner``: what a ``Rollout`` holds on the device and does around a route.

It owns the KV pool, our fused step (``FastStep``), the captured prefill passes and one executor per route, and
for each call it checks the memory budget before anything is allocated, then brings the weights in (train ->
eval, ZeRO-3 gather, LoRA fuse, the BLAS backend), builds the one ``RouteCall`` every route takes and hands it
to the route's executor. The engine (``rollout.engine``) decides nothing here: it checks the inputs, plans the
route and post-processes.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation import stage, stages
from rollout.cache.pool import CachePool, free_device_bytes
from rollout.cache.static import cache_shape
from rollout.config import RolloutConfig, SamplingConfig
from rollout.executors import blas
from rollout.executors.context import CallContext, EosIds, Executor, Generation, Prompts, RouteCall, RowBudgets
from rollout.executors.continuous.executor import ContinuousExecutor
from rollout.executors.decode import DecodeChoice, FastStep, choose_decode, prompt_sharing
from rollout.executors.ordinary.executor import OrdinaryExecutor
from rollout.executors.prefill_graph import PrefillGraphs
from rollout.model import compat, zero
from rollout.model.costs import cost_model_for
from rollout.model.lora import LoraFuser
from rollout.ops import decode_attention
from rollout.ops.expand import expand_prompts
from rollout.ops.sampling import sampler_fn
from rollout.plan import routes
from rollout.plan.calibration import check_readable
from rollout.plan.layout import PromptLayout, check_gather, check_prefill_limit, resolve_num_slots
from rollout.plan.memory import GIB, Budget, CallMemory, SlotPlan, slots_within_budget
from rollout.plan.routes import RouteChoice


@dataclass(frozen=True)
class Prepared:
    """A call's decode path and KV budget, settled before anything is allocated."""

    decode: DecodeChoice
    fit: Optional[SlotPlan]
    """The continuous route's slots and capacity within the budget (None: as planned)."""
    prompts: Prompts
    """The prompts on the device, once per prompt and once per row."""
    sampling: SamplingConfig
    eos_ids: tuple[int, ...]
    """The tokenizer's end-of-sequence ids (empty: rows run to the budget)."""
    device: torch.device
    row_budgets: Optional[RowBudgets] = None
    """Each output row's own budget (``RolloutRequest.row_max_new_tokens``, checked), None: the sampling's."""

    @property
    def slots(self) -> Optional[int]:
        """Slots the route planner may count on (the budget's, else ``continuous_batch_size``)."""
        return self.fit.slots if self.fit else self.sampling.continuous_batch_size


class Runner:
    """The device side of one ``Rollout``: pool, step, graphs and the route executors."""

    def __init__(self, engine, config: RolloutConfig):
        self.engine = engine
        self.config = config
        self.module = compat.unwrap_model(engine)
        self.model = compat.causal_lm(self.module)
        if getattr(self.model, "config", None) is None:
            raise ValueError(f"engine: the model ({type(self.model).__name__}) has no HF `config`; the rollout needs "
                             "a transformers causal LM (or a DeepSpeed engine / peft model around one)")
        compat.check_supported(self.model)
        positions = compat.context_limit(self.model)
        if config.max_context and positions and config.max_context > positions:  # was taken silently
            warnings.warn(f"max_context: {config.max_context} is above the model's max_position_embeddings "
                          f"{positions}; positions past it were never trained", stacklevel=3)
        self.is_zero3 = zero.is_zero3(engine)
        if config.route != routes.ORDINARY:
            check_gather(config.route, config.gather, self.is_zero3)
        self.pool = CachePool(keep=config.keep_cache)
        self.fast_step = self._new_fast_step()
        self.executors: dict[str, Executor] = {routes.ORDINARY: OrdinaryExecutor(self.pool, self.fast_step),
                                               routes.CONTINUOUS: ContinuousExecutor(self.pool, self.fast_step)}
        tokens = config.kernels.prefill_graph_tokens
        self.prefill_graphs = PrefillGraphs(tokens) if tokens else None
        self._cost_model = None
        if isinstance(config.routing.cost_model, str):  # read now; its metadata is checked against the first call's
            check_readable(config.routing.cost_model)
        self._lora_fuser = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_limit(self) -> int:
        """Most prompt + new tokens a call may ask for (``RolloutConfig.max_context``, else the model's)."""
        return self.config.max_context or compat.context_limit(self.model)

    @property
    def context_source(self) -> str:
        """Where :attr:`context_limit` is read, for the error that cites it."""
        return "RolloutConfig.max_context" if self.config.max_context else "the model's max_position_embeddings"

    @property
    def cost_model(self):
        """The prefill cost model (``RolloutConfig.routing.cost_model`` resolved once, with this model's geometry)."""
        if self._cost_model is None:
            self._cost_model = cost_model_for(self.config.routing.cost_model, self.model)
        return self._cost_model

    # ---- one call ---------------------------------------------------------------------------------
    def prepare(self, ids: torch.Tensor, mask: torch.Tensor, layout: PromptLayout, sampling: SamplingConfig,
                eos_ids: tuple[int, ...], row_budgets: Optional[RowBudgets] = None) -> Prepared:
        """The call's decode path and KV budget (a call that cannot fit is refused before any allocation), then its
        prompts expanded to one row per sample (``ids``/``mask``: ``[B, T_p]`` on the device, checked)."""
        if self.config.route != routes.ORDINARY:  # a prompt's samples share slots; no chunked prefill
            resolve_num_slots(sampling.continuous_batch_size, layout.num_prompts * sampling.n_samples_per_prompt,
                              sampling.n_samples_per_prompt)
            check_prefill_limit(layout, self.config.routing.max_prefill_tokens)
        device = self.device
        fuser = self._fuser()  # what run() fuses before decoding: its layers count as merged
        decode = choose_decode(self.config, self.model, self.is_zero3, device,
                               fuser.fusable_layers() if fuser is not None else ())
        fit = self._slots_within_budget(layout, sampling, decode, device)
        with stage(stages.EXPAND):
            expanded_ids, expanded_mask = expand_prompts(ids, mask, sampling.n_samples_per_prompt)
        prompts = Prompts(ids, mask, expanded_ids, expanded_mask, layout)
        return Prepared(decode, fit, prompts, sampling, eos_ids, device, row_budgets)

    def run(self, prepared: Prepared, plan: RouteChoice) -> Generation:
        """The planned route over the prepared prompts, with the weights ready for generation around it."""
        device, decode = prepared.device, prepared.decode
        tuner = blas.tuner_of(self.config.kernels.blas_library, device)
        tuned_before = (tuner.tune_s, tuner.untuned_in_capture) if tuner is not None else (0.0, 0)
        with self._inference_mode(), self._generation_weights(), self.fast_step.one_call(), \
                blas.blas_library(self.config.kernels.blas_library, device) as blas_in_effect:
            ctx = self._context(prepared, plan.route)  # after the gather: ZeRO-3 weights are resident
            graphs = ctx.prefill_graphs
            call = RouteCall(ctx, decode, plan, prepared.prompts, prepared.fit, blas_in_effect,
                             graph_passes_before=graphs.replays if graphs is not None else 0)
            result = self.executors[plan.route].run(call)
        if tuner is not None:  # what this call spent choosing algorithms for shapes new to the process
            result.stats.blas_tune_ms = (tuner.tune_s - tuned_before[0]) * 1e3
            result.stats.blas_untuned = tuner.untuned_in_capture - tuned_before[1]
        if ctx.logit_check.found():  # one flag read at the end of the call (no sync per pass)
            result.stats.prefill.nonfinite_logits = True
            warnings.warn("Rollout.generate: the prefill produced NaN or infinite logits: the model's weights or "
                          "activations hold non-finite values, so the sampled tokens are meaningless (argmax of "
                          "NaN is token 0); check the weights (torch.isfinite) and the last update",
                          RuntimeWarning, stacklevel=5)
        return result

    def after_call(self) -> None:
        """Nothing of the call stays but the ZeRO-3 weight mirror (``keep_cache=False``)."""
        if not self.config.keep_cache:
            self.fast_step.release_copies()
            if self.prefill_graphs is not None:
                self.prefill_graphs.clear()

    def shutdown(self) -> None:
        """Release the KV cache, the prefill scratch, the decode buffers, the graphs and the weight copies."""
        self.pool.clear()
        for executor in self.executors.values():
            executor.release()
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()
        self.fast_step = self._new_fast_step()
        for executor in self.executors.values():
            executor.fast_step = self.fast_step

    @property
    def held_bytes(self) -> int:
        """Device memory kept between calls (KV cache, prefill scratch, decode buffers, graphs' staging, weight
        copies and mirror)."""
        graphs = self.prefill_graphs.nbytes if self.prefill_graphs is not None else 0
        return (self.pool.nbytes + sum(e.nbytes for e in self.executors.values()) + self.fast_step.nbytes
                + graphs)

    # ---- pieces of a call -------------------------------------------------------------------------
    def _new_fast_step(self) -> FastStep:
        """Our step for this model as ``config.kernels`` asks (nothing held yet: no weight copies, no mirror)."""
        return FastStep(self.model, self.config.kernels, mirror_weights=self.is_zero3)

    def _context(self, prepared: Prepared, route: str) -> CallContext:
        """What the executors need of this call (inside the gather). An eager prefill reads the (gathered)
        parameters directly, as eager decode steps do; a captured one (``kernels.prefill_graph_tokens``, with graph
        decode and the variable-length prefill) reads them through the weight mirror, whose addresses hold across
        calls under ZeRO-3."""
        config, sampling, decode, device = self.config, prepared.sampling, prepared.decode, prepared.device
        parts = self.fast_step.parts(device, mirrored=False) if decode.is_fast else None
        graphs = self._prefill_graphs_for(decode)
        prefill_parts = self.fast_step.parts(device, mirrored=True) if graphs is not None else parts
        sampler = sampler_fn(sampling, compiled=config.kernels.compile and device.type == "cuda",
                             fused=config.sampler.fused, chunk_tokens=config.sampler.chunk_tokens)
        return CallContext(self.model, sampling, EosIds.on(prepared.eos_ids, device), self.cost_model,
                           max_prefill_tokens=config.routing.max_prefill_tokens,
                           eos_check_interval=routes.eos_check_interval(config.routing.eos_check_interval, route),
                           stage=stage, busy=self._busy, fast=parts,
                           fast_prefill=prefill_parts if decode.prefill_path != "hf" else None,
                           sampler=sampler, prefill_graphs=graphs, late_eos_count=config.routing.late_eos_count,
                           row_budgets=prepared.row_budgets)

    def _prefill_graphs_for(self, decode: DecodeChoice) -> Optional[PrefillGraphs]:
        """The captured prefill passes where this call can run them (``kernels.prefill_graph_tokens`` set, the
        variable-length prefill, graph decode unless they run eagerly for the CPU tests), else None."""
        graphs = self.prefill_graphs
        if graphs is None or decode.prefill_path != "varlen" or (graphs.use_graphs and decode.path != "graph"):
            return None
        return graphs

    def _slots_within_budget(self, layout: PromptLayout, sampling: SamplingConfig, decode: DecodeChoice,
                             device: torch.device) -> Optional[SlotPlan]:
        """Continuous-batching slots (and capacity) the KV budget allows (None: the call runs as planned);
        refuses a call that cannot fit (``plan.memory``). The kept cache counts as free: a call reuses or
        replaces it."""
        cap = self.config.max_cache_gib
        free = free_device_bytes(device)
        if free is not None:  # the kept cache is reused or replaced; weight copies not yet held are allocated
            free += self.pool.nbytes - (self.fast_step.new_copy_bytes(device) if decode.is_fast else 0)
            if self._prefill_graphs_for(decode) is not None:
                free -= self.prefill_graphs.new_bytes(self.model)
        budget = Budget(None if cap is None else int(cap * GIB), free)
        align = decode.attention == "triton" and prompt_sharing(self.config.kernels, layout.padded_len,
                                                                sampling.n_samples_per_prompt)[2]
        shape = cache_shape(self.model, 1, 1)
        call = CallMemory(layout, sampling.n_samples_per_prompt, sampling.max_new_tokens, self.model.config.vocab_size,
                          shape.column_bytes, decode.is_fast, decode.is_fast and decode.cuda_graphs,
                          decode_attention.BLOCK_L if align else 1, shape.padded_head_bytes)
        return slots_within_budget(call, self.config.route, sampling.continuous_batch_size, budget)

    @contextlib.contextmanager
    def _inference_mode(self):
        """train -> eval for generation; every submodule's own flag is restored afterwards."""
        with stage(stages.MODE_SWITCH):
            restore = compat.switch_to_eval(self.module)
        try:
            yield
        finally:
            with stage(stages.MODE_SWITCH):
                restore()

    @contextlib.contextmanager
    def _generation_weights(self):
        """ZeRO-3 gather (per ``config.gather``), then LoRA fuse; unfuse before the gather closes."""
        mode = self.config.gather if self.is_zero3 else "per_forward"
        with contextlib.ExitStack() as exits:
            with stage(stages.GATHER):
                exits.enter_context(zero.gathered(self.engine, mode))
            fuser = self._fuser()
            if fuser is not None:
                with stage(stages.LORA_FUSE):
                    fuser.fuse()
                exits.callback(self._unfuse, fuser)
            yield

    @staticmethod
    def _unfuse(fuser) -> None:
        with stage(stages.LORA_UNFUSE):
            fuser.unfuse()

    def _fuser(self):
        if not self.config.fuse_lora or (self.is_zero3 and self.config.gather == "per_forward"):
            return None  # per-forward ZeRO-3 has no full weights to merge into; peft's forward stays exact
        if self._lora_fuser is None:
            # under ZeRO-3 a kept buffer would hold a full copy of every adapted weight between calls
            self._lora_fuser = LoraFuser.for_model(self.module, keep_buffers=not self.is_zero3) or False
        return self._lora_fuser or None

    def _busy(self, local_busy: bool) -> bool:
        """Under ZeRO-3 per-forward gathering every forward is a collective: all ranks must agree."""
        if self.is_zero3 and self.config.gather == "per_forward":
            return zero.any_rank_busy(local_busy, self.device)
        return local_busy
