"""``Rollout``: the public engine, a drop-in for DeepSpeed's ``HybridEngineRollout``.

A ``generate`` call runs these stages (each a function wrapped at its call boundary):
expand -> plan (route, prefill buckets) -> mode_switch (eval) -> gather (ZeRO-3) -> lora_fuse ->
cache_acquire -> prefill (per bucket) -> decode x k [-> cache_trim, continuous route] ->
cache_release -> lora_unfuse -> mode_switch (restore) -> mask_build -> postprocess.
"""

from __future__ import annotations

import contextlib
import time

import torch

from instrumentation import collect_stages, stage, stages
from rollout import cb_route, compat, fast_decode, fast_prefill, routes, zero
from rollout.aligned_cache import AlignedKVCache, ScratchArena
from rollout.config import RolloutConfig, SamplingConfig
from rollout.continuous import generate_continuous
from rollout.decode_graphs import FastDecoder, batch_bucket, round_up
from rollout.expand import expand_prompts
from rollout.kv_cache import CachePool, cache_shape
from rollout.lora import LoraFuser
from rollout.planner import CostModel
from rollout.postprocess import assemble, eos_tensor, response_mask
from rollout.profile import build_profile
from rollout.request import RolloutBatch, RolloutRequest
from rollout.runner import generate_ordinary


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
        self.tokenizer = tokenizer
        self.is_zero3 = zero.is_zero3(engine)
        self._pool = CachePool(keep=self.config.keep_cache)
        self._last_profile: dict | None = None
        self._decoder: FastDecoder | None = None
        self._arena: ScratchArena | None = None
        self._cost_model: CostModel | None = None
        if self.config.route != routes.ORDINARY:
            cb_route.check_gather(self.config.route, self.config.gather, self.is_zero3)
        self.last_stats: dict = {}  # counters of the last call (forwards, decode path), kept even with profiling off

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
            batch, counters = self._generate(request, sampling)
        self.last_stats = counters
        self._last_profile = (build_profile(collector.summary(), counters, batch, request, sampling,
                                            time.perf_counter() - start, self._pool.nbytes, self.held_bytes)
                              if collector is not None else None)
        return batch

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the rollout reads the training engine's weights in place. Captured decode
        graphs are keyed by the weights' addresses, so weights that moved are re-captured on the next call."""
        return None

    def shutdown(self) -> None:
        """Release the KV cache, the prefill scratch, the decode buffers and the captured CUDA graphs."""
        self._pool.clear()
        self._decoder = None
        if self._arena is not None:
            self._arena.release()
            self._arena = None

    @property
    def held_bytes(self) -> int:
        """Device memory the rollout keeps between calls (KV cache, prefill scratch, decode buffers, weight
        mirror): what a kept cache adds to the training step's peak. 0 of it is cache with ``keep_cache=False``."""
        held = self._pool.nbytes + (self._arena.nbytes if self._arena is not None else 0)
        return held + (self._decoder.nbytes if self._decoder is not None else 0)

    def get_last_profile(self) -> dict | None:
        """Per-stage timings of the last ``generate`` call, or None when profiling is off."""
        return self._last_profile

    # ---- the call, stage by stage ----------------------------------------------------------------
    def _generate(self, request: RolloutRequest, sampling: SamplingConfig):
        device = self._device()
        prompt_ids, prompt_mask, layout = self._validate(request, sampling, device)
        with stage(stages.EXPAND):
            ids, mask = expand_prompts(prompt_ids, prompt_mask, sampling.n_samples_per_prompt)
        prefill_path = self._prefill_path(device)
        with stage(stages.PLAN):
            choice = routes.choose_route(self.config.route, layout, sampling.n_samples_per_prompt,
                                         sampling.continuous_batch_size, self._costs(),
                                         self.config.max_prefill_tokens, prefill_path)
        with self._inference_mode(), self._generation_weights():
            if choice.route == routes.CONTINUOUS:
                generated, counters = self._run_continuous(prompt_ids, prompt_mask, layout, sampling, device)
            else:
                generated, counters = self._run_ordinary(ids, mask, sampling, device, choice, layout)
        counters.update(route=choice.route, route_reason=choice.reason, dp_skipped=choice.dp_skipped,
                        prefill_path=prefill_path,
                        route_estimates_ms=choice.estimates_ms,
                        prefill_buckets=len(choice.buckets) if choice.buckets else 1)
        with stage(stages.MASK_BUILD):
            responses = response_mask(generated, self.eos_token_ids)
        with stage(stages.POSTPROCESS):
            batch = assemble(ids, mask, generated, responses, self.pad_token_id)
        return batch, counters

    def _run_ordinary(self, ids, mask, sampling, device, choice, layout):
        decoder, reason = self._fast_decoder()
        n = sampling.n_samples_per_prompt
        rows = batch_bucket(ids.shape[0]) if decoder is not None else ids.shape[0]
        capacity = ids.shape[1] + sampling.max_new_tokens
        with stage(stages.CACHE_ACQUIRE):  # storage for the batch bucket; the prefill writes the live rows
            cache = self._pool.acquire(cache_shape(self.model, rows, capacity)).view(
                cache_shape(self.model, ids.shape[0], capacity))
        try:
            state = generate_ordinary(
                self.model, cache, ids, mask, sampling, eos_tensor(self.eos_token_ids, device),
                self.model.config.vocab_size, self.config.eos_check_interval, self._busy, stage,
                decoder=decoder, eos_key=self.eos_token_ids,
                buckets=[list(b) for b in choice.buckets] if choice.buckets else None,
                bucket_lengths=list(choice.bucket_lengths) if choice.bucket_lengths else None,
                fast_prefill=self._fast_prefill_parts(decoder, device), host_rows=_expanded_rows(layout, n))
        finally:
            with stage(stages.CACHE_RELEASE):
                self._pool.release()
                if decoder is not None and not self.config.keep_cache:
                    decoder.release()
        if decoder is not None and state.counters.get("eager_decode_steps") and decoder.fallback_reason:
            reason = decoder.fallback_reason  # graphs were on, but a capture failed
        counters = dict(state.counters, num_steps=state.num_steps, decode_fallback_reason=reason,
                        cache_capacity=capacity)
        return state.generated[:, :state.num_steps], counters

    def _run_continuous(self, prompt_ids, prompt_mask, layout, sampling, device):
        """Continuous batching over an aligned cache whose storage comes from the pool (keep_cache applies)."""
        num_rows = len(layout.spans) * sampling.n_samples_per_prompt
        slots = cb_route.resolve_num_slots(sampling.continuous_batch_size, num_rows, sampling.n_samples_per_prompt)
        capacity = cb_route.checked_capacity(None, layout, sampling.max_new_tokens, slots < num_rows)
        fast, reason = self._continuous_fast_step(device)
        static = fast is not None and self.config.cuda_graphs  # decode from static buffers (graphs on CUDA)
        cache_slots = batch_bucket(slots) if static else slots  # padding slots of the batch buckets
        if static:  # fewer distinct shapes: buffers and graphs are reused across calls
            capacity = round_up(capacity)
        shape = cache_shape(self.model, cache_slots, capacity)
        graph = None
        with stage(stages.CACHE_ACQUIRE):
            base = self._pool.acquire(shape)
            state = None
            if static:
                has_seen = sampling.repetition_penalty != 1.0
                bufs = self._decoder.cb_buffers_for(cache_slots, capacity, num_rows, sampling.max_new_tokens,
                                                    self.model.config.vocab_size, device, has_seen)
                state = (bufs.valid, bufs.write_col)
            cache = AlignedKVCache(shape, storage=(base.key_storage, base.value_storage), state=state)
            if static:
                graph = (self._decoder.cb_stepper(cache, sampling, has_seen), bufs)
            if self._arena is None or not self.config.keep_cache:
                self._arena = ScratchArena.like(shape)
        try:
            result = generate_continuous(
                self.model, prompt_ids, prompt_mask, sampling, eos_tensor(self.eos_token_ids, device),
                cost_model=self._costs(), num_slots=slots, cache=cache, arena=self._arena, layout=layout,
                max_prefill_tokens=self.config.max_prefill_tokens, stage=stage, fast=fast,
                fast_prefill=fast if self.config.fast_prefill else None, graph=graph)
        finally:
            with stage(stages.CACHE_RELEASE):
                self._pool.release()
                if not self.config.keep_cache:
                    self._arena.release()
                    self._arena = None
                    if static:
                        self._decoder.release()
        if fast is None:
            path = "hf"
        elif result.counters.get("graph_decode_steps"):
            path = "graph"
        else:
            path = "fast_eager"
            if static and self._decoder.fallback_reason:
                reason = self._decoder.fallback_reason
        counters = dict(result.counters, num_steps=result.num_steps, decode_fallback_reason=reason, decode_path=path)
        return result.generated, counters

    def _prefill_path(self, device) -> str:
        """How the ordinary route prefills this call (one of ``routes.PREFILL_PATHS``)."""
        if not self.config.fast_prefill or self._fast_decoder()[0] is None:
            return "hf"
        return fast_prefill.attention_path(device, next(self.model.parameters()).dtype)

    def _fast_prefill_parts(self, decoder, device) -> tuple | None:
        """``(spec, weights, step fns)`` for :mod:`rollout.fast_prefill` (None: the HF forward prefills).
        Prefill is not captured in graphs, so it reads the (gathered) parameters directly."""
        if decoder is None or not self.config.fast_prefill:
            return None
        return decoder.step_parts(device, mirrored=False)

    def _continuous_fast_step(self, device) -> tuple[tuple | None, str]:
        """Our step's parts for the continuous route (its eager decode and its prefill), and why decode
        steps run eagerly (None: CUDA graphs)."""
        decoder, reason = self._fast_decoder()
        if decoder is None:
            return None, reason
        parts = decoder.step_parts(device, mirrored=False)
        if not self.config.cuda_graphs:
            return parts, "continuous route: cuda_graphs disabled in RolloutConfig"
        return parts, reason

    def _costs(self) -> CostModel:
        if self._cost_model is None:
            cfg = self.config.cost_model
            if isinstance(cfg, CostModel):
                self._cost_model = cfg
            elif isinstance(cfg, str):
                from rollout.calibration import load_cost_model
                param = next(self.model.parameters())
                self._cost_model = load_cost_model(cfg, self.model, param.device, param.dtype)
            else:
                self._cost_model = CostModel.from_model(self.model)
        return self._cost_model

    def _validate(self, request: RolloutRequest, sampling: SamplingConfig, device: torch.device):
        ids = request.prompt_ids.to(device, non_blocking=True)
        mask = request.prompt_attention_mask.to(device, non_blocking=True)
        # one host sync for all value checks and the layout: [mask min, mask max, id min, id max] + first
        # real column per row + real tokens per row
        layout_rows = cb_route.layout_tensors(mask)  # [2, B]
        checks = torch.cat([torch.stack([mask.min(), mask.max(), ids.min(), ids.max()]).long(),
                            layout_rows.flatten()]).tolist()
        num_rows = ids.shape[0]
        if checks[0] < 0 or checks[1] > 1:
            raise ValueError("prompt_attention_mask: values must be 0 or 1")
        if min(checks[4 + num_rows:]) < 1:
            raise ValueError("prompt_attention_mask: every row needs at least one prompt token (a row is all 0)")
        vocab = self.model.config.vocab_size
        if checks[2] < 0 or checks[3] >= vocab:
            raise ValueError(f"prompt_ids: token ids must be in [0, {vocab}); got [{checks[2]}, {checks[3]}]")
        total = request.prompt_len + sampling.max_new_tokens
        limit = self.config.max_context or compat.context_limit(self.model)
        if limit is not None and total > limit:
            raise ValueError(f"max_new_tokens: prompt length {request.prompt_len} + max_new_tokens "
                             f"{sampling.max_new_tokens} = {total} exceeds the model context {limit}")
        layout = cb_route.layout_from_lists(checks[4:4 + num_rows], checks[4 + num_rows:], request.prompt_len)
        return ids, mask, layout

    @contextlib.contextmanager
    def _inference_mode(self):
        """train -> eval for generation; every submodule's own flag is restored afterwards."""
        with stage(stages.MODE_SWITCH):
            flags = [(m, m.training) for m in self.module.modules()]
            self.module.eval()
        try:
            yield
        finally:
            with stage(stages.MODE_SWITCH):
                for m, was_training in flags:
                    m.training = was_training

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

    def _fast_decoder(self) -> tuple[FastDecoder | None, str | None]:
        """The fast decoder for this call, or None and the reason the HF forward decodes instead."""
        if not self.config.fast_decode:
            return None, "fast_decode disabled in RolloutConfig"
        if self.is_zero3 and self.config.gather == "per_forward":
            return None, "ZeRO-3 per-forward gathering (parameters are not resident)"
        reason = fast_decode.unsupported_reason(self.model)
        if reason is not None:
            return None, reason
        if self._decoder is None:
            self._decoder = FastDecoder(self.model, self.config.cuda_graphs, self.config.compile,
                                        mirror_weights=self.is_zero3)
        device = self._device()
        graph_reason = self._decoder.graph_reason(device)
        return self._decoder, (f"eager fast step: {graph_reason}" if graph_reason else None)

    def _fuser(self):
        if not self.config.fuse_lora or (self.is_zero3 and self.config.gather == "per_forward"):
            return None  # per-forward ZeRO-3 has no full weights to merge into; peft's forward stays exact
        if not hasattr(self, "_lora_fuser"):
            # under ZeRO-3 a kept buffer would hold a full copy of every adapted weight between calls
            self._lora_fuser = LoraFuser.for_model(self.module, keep_buffers=not self.is_zero3)
        return self._lora_fuser

    def _busy(self, local_busy: bool) -> bool:
        """Under ZeRO-3 per-forward gathering every forward is a collective: all ranks must agree."""
        if self.is_zero3 and self.config.gather == "per_forward":
            return zero.any_rank_busy(local_busy, self._device())
        return local_busy

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _expanded_rows(layout, num_samples: int) -> tuple[list[int], list[int]]:
    """Real-token count and first real column of every expanded row (host ints, from the prompt layout)."""
    counts = [c for c in layout.real_counts for _ in range(num_samples)]
    firsts = [layout.padded_len - s for s in layout.spans for _ in range(num_samples)]
    return counts, firsts
