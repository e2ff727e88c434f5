"""``Rollout``: the public engine, a drop-in for DeepSpeed's ``HybridEngineRollout``.

A ``generate`` call runs these stages (each wrapped at its call boundary):
expand -> plan (route, prefill buckets) -> mode_switch (eval) -> gather (ZeRO-3) -> lora_fuse ->
cache_acquire -> prefill -> decode x k [-> cache_trim, continuous route] -> cache_release ->
lora_unfuse -> mode_switch (restore) -> mask_build -> postprocess.

The engine checks the inputs, chooses the route and the decode path, and hands the call to the route's
executor (:mod:`rollout.executors`), which owns its buffers and graphs; the KV storage is the engine's
one pool, lent to whichever route runs.
"""

from __future__ import annotations

import contextlib
import time

import torch

from instrumentation import collect_stages, stage, stages
from rollout.cache.pool import CachePool, free_device_bytes
from rollout.cache.static import cache_shape
from rollout.config import RolloutConfig, SamplingConfig
from rollout.executors import blas
from rollout.executors.context import CallContext, EosIds
from rollout.executors.continuous.executor import ContinuousExecutor
from rollout.executors.decode import DecodeChoice, FastStep, choose_decode
from rollout.executors.ordinary.executor import OrdinaryExecutor
from rollout.executors.ordinary.loop import PromptBatch
from rollout.executors.ordinary.order import RowOrder
from rollout.executors.prefill_graph import PrefillGraphs
from rollout.model import compat, zero
from rollout.model.costs import cost_model_for
from rollout.model.lora import LoraFuser
from rollout.ops.expand import expand_prompts
from rollout.ops.inputs import checked_layout
from rollout.ops.sampling import sampler_fn
from rollout.ops.postprocess import assemble, finish_reasons, masked_logprobs, response_mask
from rollout.plan import routes
from rollout.plan.layout import PromptLayout, check_gather
from rollout.plan.memory import GIB, Budget, CallMemory, slots_within_budget
from rollout.request import RolloutBatch, RolloutRequest
from rollout.stats import CallShape, CallStats, build_profile


def token_ids(tokenizer) -> tuple[tuple[int, ...], int]:
    """``(eos_token_ids, pad_token_id)`` from anything with ``eos_token_id`` / ``pad_token_id``.

    ``eos_token_id`` may be an int, a list of ints or None (no EOS: rows run to the budget). Without a
    pad id the first EOS id pads, as in HF ``generate``.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = (eos,)
    elif isinstance(eos, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
        eos_ids = tuple(eos)
    else:
        raise ValueError(f"tokenizer.eos_token_id: must be an int, a list of ints or None; got {eos!r}")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        if not eos_ids:
            raise ValueError("tokenizer.pad_token_id: is None and there is no eos_token_id to pad with")
        pad = eos_ids[0]
    elif not isinstance(pad, int) or isinstance(pad, bool):
        raise ValueError(f"tokenizer.pad_token_id: must be an int or None; got {pad!r}")
    return eos_ids, pad


def _check_in_vocab(eos_ids: tuple[int, ...], pad_id: int, vocab_size: int) -> None:
    """Pad and EOS ids the model cannot emit or embed would fail far away, or never end a row."""
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"tokenizer.pad_token_id: {pad_id} is outside the model's vocabulary [0, {vocab_size})")
    outside = [t for t in eos_ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"tokenizer.eos_token_id: {outside} outside the model's vocabulary [0, {vocab_size}): "
                         "such an EOS would never end a row")


class Rollout:
    """Generates student rollouts for on-policy distillation.

    ``engine`` is a DeepSpeed engine (ZeRO-0..3, optionally a peft LoRA model inside) or a plain HF
    causal LM (optionally peft-wrapped). Sampling behaviour comes from ``SamplingConfig`` alone: the
    model's ``generation_config`` is ignored. Outputs live on the model's device.
    """

    name = "opsd_rollout"

    def __init__(self, engine, tokenizer, config: RolloutConfig | None = None):
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise ValueError(f"config: must be a RolloutConfig; got {type(self.config).__name__}")
        self.engine = engine
        self.module = compat.unwrap_model(engine)
        self.model = compat.causal_lm(self.module)
        compat.check_supported(self.model)
        self.eos_token_ids, self.pad_token_id = token_ids(tokenizer)
        _check_in_vocab(self.eos_token_ids, self.pad_token_id, self.model.config.vocab_size)
        self.tokenizer = tokenizer
        self.is_zero3 = zero.is_zero3(engine)
        if self.config.route != routes.ORDINARY:
            check_gather(self.config.route, self.config.gather, self.is_zero3)
        self._pool = CachePool(keep=self.config.keep_cache)
        self._fast_step = self._new_fast_step()
        self._ordinary = OrdinaryExecutor(self._pool, self._fast_step)
        self._continuous = ContinuousExecutor(self._pool, self._fast_step)
        tokens = self.config.kernels.prefill_graph_tokens
        self._prefill_graphs = PrefillGraphs(tokens) if tokens else None
        self._cost_model = None
        self._lora_fuser = None
        self._last_profile: dict | None = None
        self.last_stats: CallStats = CallStats()
        """What the last call did (kept even with profiling off); also readable as a dict."""

    # ---- public interface (DeepSpeed's RolloutEngine) -------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Run one rollout. See :mod:`rollout.request` for the output semantics."""
        if not isinstance(request, RolloutRequest):
            raise ValueError(f"request: must be a RolloutRequest; got {type(request).__name__}")
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling: must be a SamplingConfig; got {type(sampling).__name__}")
        start = time.perf_counter()
        with collect_stages() as collector, stage(stages.ROLLOUT):
            try:
                batch, stats = self._generate(request, sampling)
            finally:
                if not self.config.keep_cache:  # nothing of the call stays but the ZeRO-3 weight mirror
                    self._fast_step.release_copies()
                    if self._prefill_graphs is not None:
                        self._prefill_graphs.clear()
        self.last_stats = stats
        if collector is not None:
            shape = CallShape(request.batch_size, sampling.n_samples_per_prompt, request.prompt_len,
                              batch.seq_len - request.prompt_len, batch.batch_size,
                              int(batch.attention_mask[:, request.prompt_len:].sum()))
            self._last_profile = build_profile(collector.summary(), stats, shape, time.perf_counter() - start,
                                               self._pool.nbytes, self.held_bytes)
        else:
            self._last_profile = None
        return batch

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the rollout reads the training engine's weights in place. Captured decode
        graphs are keyed by the weights' addresses, so weights that moved are re-captured on the next call."""
        return None

    def shutdown(self) -> None:
        """Release the KV cache, the prefill scratch, the decode buffers and the captured CUDA graphs."""
        self._pool.clear()
        self._ordinary.release()
        self._continuous.release()
        if self._prefill_graphs is not None:
            self._prefill_graphs.clear()
        self._fast_step = self._new_fast_step()
        self._ordinary.fast_step = self._continuous.fast_step = self._fast_step

    def _new_fast_step(self) -> FastStep:
        """Our step for this model as the config asks (nothing held yet: no weight copies, no mirror)."""
        return FastStep(self.model, self.config.kernels, mirror_weights=self.is_zero3)

    @property
    def held_bytes(self) -> int:
        """Device memory the rollout keeps between calls (KV cache, prefill scratch, decode buffers, weight
        mirror): what a kept cache adds to the training step's peak. 0 of it is cache with ``keep_cache=False``."""
        graphs = self._prefill_graphs.nbytes if self._prefill_graphs is not None else 0
        return self._pool.nbytes + self._ordinary.nbytes + self._continuous.nbytes + self._fast_step.nbytes + graphs

    def get_last_profile(self) -> dict | None:
        """Per-stage timings of the last ``generate`` call, or None when profiling is off."""
        return self._last_profile

    # ---- the call, stage by stage ----------------------------------------------------------------
    def _generate(self, request: RolloutRequest, sampling: SamplingConfig) -> tuple[RolloutBatch, CallStats]:
        device = next(self.model.parameters()).device
        ids = request.prompt_ids.to(device, non_blocking=True)
        mask = request.prompt_attention_mask.to(device, non_blocking=True)
        layout = checked_layout(ids, mask, self.model.config.vocab_size, sampling.max_new_tokens,
                                self.config.max_context or compat.context_limit(self.model))
        decode = choose_decode(self.config, self.model, self.is_zero3, device)
        fit = self._slots_within_budget(layout, sampling, decode, device)  # refuses before any allocation
        with stage(stages.EXPAND):
            expanded_ids, expanded_mask = expand_prompts(ids, mask, sampling.n_samples_per_prompt)
        with stage(stages.PLAN):
            route = routes.choose_route(self.config.route, layout, sampling.n_samples_per_prompt,
                                        fit.slots if fit else sampling.continuous_batch_size, self._costs(),
                                        self.config.routing.max_prefill_tokens, decode.prefill_path)
        with self._inference_mode(), self._generation_weights(), self._fast_step.one_call(), \
                blas.blas_library(self.config.kernels.blas_library, device) as blas_in_effect:
            ctx = self._context(sampling, decode, device, route.route)  # after the gather: ZeRO-3 weights are resident
            graph_passes = ctx.prefill_graphs.replays if ctx.prefill_graphs is not None else 0
            if route.route == routes.CONTINUOUS:
                result = self._continuous.run(ctx, decode, ids, mask, layout, fit)
            else:
                order = RowOrder.plan(layout, sampling.n_samples_per_prompt, route.buckets, route.bucket_lengths)
                batch = PromptBatch(ids, mask, expanded_ids, expanded_mask)
                result = self._ordinary.run(ctx, decode, batch, order)
        generated, stats = result.tokens, result.stats
        if ctx.prefill_graphs is not None:
            stats.prefill_graph_passes = ctx.prefill_graphs.replays - graph_passes
        stats.sampler_fallback_reason, stats.sampler_path = ctx.sampler.fallback_reason, ctx.sampler.last_path
        stats.route, stats.route_reason, stats.dp_skipped = route.route, route.reason, route.dp_skipped
        stats.eos_check_interval, stats.blas_library = ctx.eos_check_interval, blas_in_effect
        stats.route_estimates_ms, stats.prefill_path = route.estimates_ms, decode.prefill_path
        stats.prefill_buckets = len(route.buckets) if route.buckets else 1
        stats.plans += 0 if route.dp_skipped else 1  # Auto's bucket DP ran for this call
        with stage(stages.MASK_BUILD):
            responses = response_mask(generated, self.eos_token_ids)
        with stage(stages.POSTPROCESS):
            extras = {}
            if sampling.return_finish_reasons:
                extras["finish_reasons"] = finish_reasons(generated, self.eos_token_ids)
            if result.logprobs is not None:
                extras["logprobs"] = masked_logprobs(result.logprobs, responses)
            output = assemble(expanded_ids, expanded_mask, generated, responses, self.pad_token_id, extras)
        return output, stats

    def _context(self, sampling: SamplingConfig, decode: DecodeChoice, device: torch.device,
                 route: str) -> CallContext:
        """What the executors need of this call (inside the gather). An eager prefill reads the (gathered)
        parameters directly, as eager decode steps do; a captured one (``prefill_graph_tokens``, with graph
        decode and the variable-length prefill) reads them through the weight mirror, whose addresses hold
        across calls under ZeRO-3."""
        parts = self._fast_step.parts(device, mirrored=False) if decode.is_fast else None
        graphs = self._prefill_graphs_for(decode)
        prefill_parts = self._fast_step.parts(device, mirrored=True) if graphs is not None else parts
        sampler = sampler_fn(sampling, compiled=self.config.kernels.compile and device.type == "cuda",
                             fused=self.config.sampler.fused, chunk_tokens=self.config.sampler.chunk_tokens)
        return CallContext(self.model, sampling, EosIds.on(self.eos_token_ids, device), self._costs(),
                           self.config.routing.max_prefill_tokens,
                           routes.eos_check_interval(self.config.routing.eos_check_interval, route), stage, self._busy,
                           fast=parts, fast_prefill=prefill_parts if decode.prefill_path != "hf" else None,
                           sampler=sampler, prefill_graphs=graphs, late_eos_count=self.config.routing.late_eos_count)

    def _prefill_graphs_for(self, decode: DecodeChoice):
        """The captured prefill passes where this call can run them (``prefill_graph_tokens`` set, the
        variable-length prefill, graph decode unless they run eagerly for the CPU tests), else None."""
        graphs = self._prefill_graphs
        if graphs is None or decode.prefill_path != "varlen" or (graphs.use_graphs and decode.path != "graph"):
            return None
        return graphs

    def _slots_within_budget(self, layout: PromptLayout, sampling: SamplingConfig, decode: DecodeChoice,
                             device: torch.device):
        """Continuous-batching slots (and capacity) the KV budget allows (None: the call runs as planned);
        refuses a call that cannot fit (``plan.memory``). The kept cache counts as free: a call reuses or
        replaces it."""
        cap = self.config.max_cache_gib
        free = free_device_bytes(device)
        if free is not None:  # the kept cache is reused or replaced; weight copies not yet held are allocated
            free += self._pool.nbytes - (self._fast_step.new_copy_bytes() if decode.is_fast else 0)
            if self._prefill_graphs_for(decode) is not None:
                free -= self._prefill_graphs.new_bytes(self.model)
        budget = Budget(None if cap is None else int(cap * GIB), free)
        call = CallMemory(layout, sampling.n_samples_per_prompt, sampling.max_new_tokens, self.model.config.vocab_size,
                          cache_shape(self.model, 1, 1).column_bytes, decode.is_fast,
                          decode.is_fast and decode.cuda_graphs)
        return slots_within_budget(call, self.config.route, sampling.continuous_batch_size, budget)

    def _costs(self):
        if self._cost_model is None:
            self._cost_model = cost_model_for(self.config.routing.cost_model, self.model)
        return self._cost_model

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
            return zero.any_rank_busy(local_busy, next(self.model.parameters()).device)
        return local_busy
