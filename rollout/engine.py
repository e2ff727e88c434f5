"""``Rollout``: the public engine, a drop-in for DeepSpeed's ``HybridEngineRollout``.

A ``generate`` call runs these stages (each wrapped at its call boundary):
expand -> plan (route, prefill buckets) -> mode_switch (eval) -> gather (ZeRO-3) -> lora_fuse ->
cache_acquire -> prefill -> decode x k [-> cache_trim, continuous route] -> cache_release ->
lora_unfuse -> mode_switch (restore) -> mask_build -> postprocess.

The engine checks the inputs, plans the route and post-processes; everything on the device (the KV pool, our
step, the graphs, the prompts' expansion, the weights' gather and LoRA fuse, one executor per route) belongs to its
:class:`rollout.executors.runner.Runner`, which hands every route the same ``RouteCall``.
"""

from __future__ import annotations

import threading
import time

import torch

from instrumentation import collect_stages, stage, stages
from rollout.config import RolloutConfig, SamplingConfig, is_int  # rollout.checks' (the engine's import cap)
from rollout.executors.context import RowBudgets
from rollout.executors.runner import Runner
from rollout.ops.inputs import checked_layout
from rollout.ops.postprocess import assemble, finish_reasons, masked_logprobs, response_mask
from rollout.plan import routes
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
    elif is_int(eos):
        eos_ids = (int(eos),)
    elif isinstance(eos, (list, tuple)) and all(is_int(t) for t in eos):
        eos_ids = tuple(int(t) for t in eos)
    else:
        raise ValueError(f"tokenizer.eos_token_id: must be an int, a list of ints or None; got {eos!r}")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        if not eos_ids:
            raise ValueError("tokenizer.pad_token_id: is None and there is no eos_token_id to pad with")
        pad = eos_ids[0]
    elif not is_int(pad):
        raise ValueError(f"tokenizer.pad_token_id: must be an int or None; got {pad!r}")
    return eos_ids, int(pad)


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
    model's ``generation_config`` is ignored. Outputs live on the model's device. A ``Rollout`` runs one call
    at a time (its buffers and graphs are shared by its calls): a ``generate`` call made while another runs on the
    same ``Rollout`` (another thread) raises ``RuntimeError`` at once; use one ``Rollout`` per thread.
    """

    name = "opsd_rollout"

    def __init__(self, engine, tokenizer, config: RolloutConfig | None = None):
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise ValueError(f"config: must be a RolloutConfig; got {type(self.config).__name__}")
        self.engine = engine
        self.eos_token_ids, self.pad_token_id = token_ids(tokenizer)
        self.runner = Runner(engine, self.config)
        """The device side (pool, step, graphs, route executors): internals, for tests and benchmarks."""
        self.module, self.model = self.runner.module, self.runner.model
        _check_in_vocab(self.eos_token_ids, self.pad_token_id, self.model.config.vocab_size)
        self.tokenizer = tokenizer
        self._call_lock = threading.Lock()  # taken without blocking: a second concurrent call is refused
        self.is_zero3 = self.runner.is_zero3
        self._last_profile: dict | None = None
        self.last_stats: CallStats = CallStats()
        """What the last call did (kept even with profiling off)."""

    # ---- public interface (DeepSpeed's RolloutEngine) -------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Run one rollout. See :mod:`rollout.request` for the output semantics."""
        if not isinstance(request, RolloutRequest):
            raise ValueError(f"request: must be a RolloutRequest; got {type(request).__name__}")
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling: must be a SamplingConfig; got {type(sampling).__name__}")
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError("Rollout.generate: another call is running on this Rollout (its cache and buffers "
                               "serve one call at a time); use one Rollout per thread")
        try:
            return self._timed_generate(request, sampling)
        finally:
            self._call_lock.release()

    def _timed_generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        start = time.perf_counter()
        with collect_stages() as collector, stage(stages.ROLLOUT):
            try:
                batch, stats = self._generate(request, sampling)
            finally:
                self.runner.after_call()
        self.last_stats = stats
        if collector is not None:
            shape = CallShape(request.batch_size, sampling.n_samples_per_prompt, request.prompt_len,
                              batch.seq_len - request.prompt_len, batch.batch_size,
                              int(batch.attention_mask[:, request.prompt_len:].sum()))
            self._last_profile = build_profile(collector.summary(), stats, shape, time.perf_counter() - start,
                                               self.runner.pool.nbytes, self.held_bytes)
        else:
            self._last_profile = None
        return batch

    def sync_weights(self, step: int) -> None:
        """Nothing to push: the rollout reads the training engine's weights in place. Captured decode
        graphs are keyed by the weights' addresses, so weights that moved are re-captured on the next call."""
        return None

    def shutdown(self) -> None:
        """Release the KV cache, the prefill scratch, the decode buffers and the captured CUDA graphs."""
        self.runner.shutdown()

    @property
    def held_bytes(self) -> int:
        """Device memory the rollout keeps between calls (KV cache, prefill scratch, decode buffers, weight
        mirror): what a kept cache adds to the training step's peak. 0 of it is cache with ``keep_cache=False``."""
        return self.runner.held_bytes

    def get_last_profile(self) -> dict | None:
        """Per-stage timings of the last ``generate`` call, or None when profiling is off."""
        return self._last_profile

    # ---- the call, stage by stage ----------------------------------------------------------------
    def _generate(self, request: RolloutRequest, sampling: SamplingConfig) -> tuple[RolloutBatch, CallStats]:
        device = self.runner.device
        budgets = RowBudgets.on(request.row_budgets(sampling.n_samples_per_prompt, sampling.max_new_tokens),
                                device)  # checked first
        ids = request.prompt_ids.to(device, non_blocking=True)
        mask = request.prompt_attention_mask.to(device, non_blocking=True)
        layout = checked_layout(ids, mask, self.model.config.vocab_size, sampling.max_new_tokens,
                                self.runner.context_limit, self.runner.context_source)
        prepared = self.runner.prepare(ids, mask, layout, sampling, self.eos_token_ids,
                                       budgets)  # refuses what cannot fit
        with stage(stages.PLAN):
            plan = routes.choose_route(self.config.route, layout, sampling.n_samples_per_prompt, prepared.slots,
                                       self.runner.cost_model, self.config.routing.max_prefill_tokens,
                                       prepared.decode.prefill_path)
        result = self.runner.run(prepared, plan)
        generated = result.tokens
        cap = None if budgets is None else budgets.tensor
        with stage(stages.MASK_BUILD):
            responses = response_mask(generated, self.eos_token_ids, cap)
        with stage(stages.POSTPROCESS):
            extras = {}
            if sampling.return_finish_reasons:
                extras["finish_reasons"] = finish_reasons(generated, self.eos_token_ids, cap)
            if result.logprobs is not None:
                extras["logprobs"] = masked_logprobs(result.logprobs, responses)
            prompts = prepared.prompts
            output = assemble(prompts.expanded_ids, prompts.expanded_mask, generated, responses, self.pad_token_id,
                              extras)
        return output, result.stats
