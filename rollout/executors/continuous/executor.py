"""``ContinuousExecutor``: the continuous route's owner of its static buffers, CUDA graphs and scratch."""

from __future__ import annotations

from typing import Optional

from instrumentation import stages
from rollout.cache.aligned import AlignedKVCache
from rollout.cache.pool import CachePool, ScratchArena
from rollout.cache.static import cache_shape
from rollout.executors.context import CallContext, Generation, RouteCall, settle_stats
from rollout.executors.continuous.buffers import CBBuffers, cb_decode_step
from rollout.executors.continuous.loop import SlotSpec, generate_continuous
from rollout.executors.continuous.state import GraphDecode
from rollout.executors.decode import DecodeChoice, FastStep
from rollout.executors.graphs import EAGER, GraphSet, sampling_key
from rollout.plan.buckets import batch_bucket, length_round, read_window
from rollout.plan.layout import continuous_cache_shape, resolve_num_slots


class ContinuousExecutor:
    """Runs the continuous route over storage from the engine's pool (``keep_cache`` applies)."""

    def __init__(self, pool: CachePool, fast_step: Optional[FastStep]):
        self.pool = pool
        self.fast_step = fast_step
        self.buffers: Optional[CBBuffers] = None
        self.graphs = GraphSet("continuous")
        self.arena: Optional[ScratchArena] = None

    def run(self, call: RouteCall) -> Generation:
        """The call's rows ``[B*n, S]`` in request order from the unexpanded prompts ``[B, T_p]``; the KV budget's
        slots and capacity (``call.fit``) override ``sampling.continuous_batch_size`` and the default capacity."""
        ctx, choice, fit = call.ctx, call.decode, call.fit
        sampling, layout = ctx.sampling, call.prompts.layout
        num_rows = layout.num_prompts * sampling.n_samples_per_prompt
        slots = resolve_num_slots(fit.slots if fit else sampling.continuous_batch_size, num_rows,
                                  sampling.n_samples_per_prompt)
        static = choice.is_fast and choice.cuda_graphs  # graph-ready static buffers (eager steps without CUDA)
        cache_slots, capacity = continuous_cache_shape(layout, sampling.max_new_tokens, slots, num_rows, static,
                                                       fit.capacity if fit else None)
        with ctx.stage(stages.CACHE_ACQUIRE):
            cache, graph = self._cache(ctx, choice, cache_slots, capacity, num_rows, static)
            if self.arena is None or not self.pool.keep:
                self.arena = ScratchArena.like(cache.shape)
        try:
            result = generate_continuous(ctx, call.prompts.ids, call.prompts.mask, layout,
                                         SlotSpec(num_slots=slots, cache=cache, arena=self.arena), graph)
        finally:
            with ctx.stage(stages.CACHE_RELEASE):
                self.pool.release()
                if not self.pool.keep:
                    self.release()
        result.stats.decode.settle_path(choice.path, choice.reason, self.graphs.fallback_reason, choice.attention,
                                        choice.norms_folded)
        settle_stats(call, result.stats)
        return Generation(result.generated, result.logprobs, result.stats)

    def _cache(self, ctx: CallContext, choice: DecodeChoice, slots: int, capacity: int, num_rows: int,
               static: bool) -> tuple[AlignedKVCache, Optional[GraphDecode]]:
        shape = cache_shape(ctx.model, slots, capacity)
        base = self.pool.acquire(shape)
        storage = (base.key_storage, base.value_storage)
        if not static:
            return AlignedKVCache(shape, storage=storage), None
        has_seen = ctx.sampling.repetition_penalty != 1.0
        bufs = self._buffers(ctx, slots, capacity, num_rows, has_seen)
        cache = AlignedKVCache(shape, storage=storage, state=(bufs.valid, bufs.write_col))
        parts = self.fast_step.parts(ctx.device, mirrored=True)
        return cache, GraphDecode(bufs, self._stepper(ctx, choice, parts, cache, bufs, has_seen))

    def _buffers(self, ctx: CallContext, slots: int, capacity: int, rows: int, has_seen: bool) -> CBBuffers:
        """Static buffers for ``slots`` (a batch bucket) x ``capacity``; reused while they fit (the graphs
        captured over them too), reallocated (graphs dropped) otherwise."""
        sampling, device = ctx.sampling, ctx.device
        if self.buffers is None or not self.buffers.fits(slots, capacity, rows, sampling.max_new_tokens,
                                                         ctx.vocab_size, device, has_seen):
            self.graphs.clear()
            self.buffers = None
            self.buffers = CBBuffers(slots, capacity, rows, length_round(sampling.max_new_tokens), ctx.vocab_size,
                                     device, has_seen)
        return self.buffers

    def _stepper(self, ctx: CallContext, choice: DecodeChoice, parts, cache: AlignedKVCache, bufs: CBBuffers,
                 has_seen: bool):
        """``step(num_rows, front, read_start) -> "graph" | "eager"``: one decode step of live rows
        ``[0, num_rows)`` writing column ``front`` and reading from ``read_start`` on (``parts``: the call's
        mirrored step parts)."""
        sampling = ctx.sampling
        use_graphs = choice.path == "graph"
        key = (sampling_key(sampling), has_seen, cache.key_storage.data_ptr(), tuple(cache.key_storage.shape),
               cache.valid.data_ptr(), parts.weights.signature())

        def step(num_rows: int, front: int, read_start: int) -> str:
            bucket = batch_bucket(num_rows)
            window = read_window(read_start, front, cache.capacity)

            def work():
                cb_decode_step(parts, cache, bufs, bucket, window, ctx.sampler, has_seen, ctx.with_logprobs)

            if not use_graphs:
                work()
                return EAGER
            return self.graphs.replay((bucket, window, key), work, bufs.mutable())

        return step

    def release(self) -> None:
        """Drop the static buffers, the captured graphs and the scratch arena."""
        self.graphs.clear()
        self.buffers = None
        if self.arena is not None:
            self.arena.release()
            self.arena = None

    @property
    def nbytes(self) -> int:
        """Bytes held between calls: static buffers and the prefill scratch (graph pools not counted)."""
        held = self.buffers.nbytes if self.buffers is not None else 0
        return held + (self.arena.nbytes if self.arena is not None else 0)
