"""``OrdinaryExecutor``: the ordinary route's owner of its static decode buffers and CUDA graphs."""

from __future__ import annotations

from typing import Optional

from instrumentation import stages
from rollout.cache.pool import CachePool, ScratchArena
from rollout.cache.static import cache_shape
from rollout.executors.context import CallContext, Generation, RouteCall, settle_stats
from rollout.executors.decode import DecodeChoice, FastStep, prompt_sharing, shares_prefix
from rollout.executors.graphs import EAGER, GraphSet, sampling_key
from rollout.executors.ordinary.buffers import DecodeBuffers, decode_step
from rollout.executors.ordinary.loop import PromptBatch, StaticDecode, generate_ordinary
from rollout.executors.ordinary.order import RowOrder
from rollout.model.step import StepParts
from rollout.ops import decode_attention
from rollout.plan.buckets import batch_bucket, length_bucket, length_round


class OrdinaryExecutor:
    """Runs the ordinary route: one batch over the pool's static cache, decode from static buffers."""

    def __init__(self, pool: CachePool, fast_step: Optional[FastStep]):
        self.pool = pool
        self.fast_step = fast_step
        self.buffers: Optional[DecodeBuffers] = None
        self.graphs = GraphSet("ordinary")
        self.scratch: Optional[ScratchArena] = None
        """Where prompts with several samples are prefilled once before their copies (kept like the cache)."""
        self.eos_tensors: dict = {}
        """The EOS-id tensor each set of ids was captured with, kept as long as the graphs: a replay reads
        the tensor at its captured address, so a later call must not bring a new one (the first call's
        would be freed and its memory reused; rows then never finish in graph replays)."""

    def run(self, call: RouteCall) -> Generation:
        """The call's ``N = B * n`` rows, in request order: prompts ordered and grouped by the plan's buckets."""
        ctx, choice, prompts = call.ctx, call.decode, call.prompts
        order = RowOrder.plan(prompts.layout, ctx.sampling.n_samples_per_prompt, call.plan.buckets,
                              call.plan.bucket_lengths)
        batch = PromptBatch(prompts.ids, prompts.mask, prompts.expanded_ids, prompts.expanded_mask)
        # a prompt's samples read its columns once (in a pass of their own, or each from its run's first row, the
        # prompts then padded to end at a tile edge where the Triton attention runs, so that every prompt tile is
        # shared; the KV budget counts the same columns: Runner._slots_within_budget)
        parts = self.fast_step.parts(ctx.device, mirrored=True) if choice.is_fast else None
        sharing, first_row, align = prompt_sharing(self.fast_step.kernels if parts else None, batch.ids.shape[1],
                                                   order.num_samples)
        if align and parts.fns.shared_prefix_rows > 0:
            batch = batch.left_padded(decode_attention.BLOCK_L)
        num_rows = batch.ids.shape[0]
        rows = batch_bucket(num_rows) if choice.is_fast else num_rows
        capacity = batch.ids.shape[1] + ctx.sampling.max_new_tokens
        with ctx.stage(stages.CACHE_ACQUIRE):  # storage for the batch bucket; the prefill writes the live rows
            cache = self.pool.acquire(cache_shape(ctx.model, rows, capacity)).view(
                cache_shape(ctx.model, num_rows, capacity))
            if order.num_samples > 1 and self.scratch is None:
                self.scratch = ScratchArena.like(cache.shape)
        try:
            static = self.static_decode(ctx, choice, cache, parts, num_rows, sharing, first_row) if parts else None
            state = generate_ordinary(ctx, cache, batch, order, static, self.scratch)
        finally:
            with ctx.stage(stages.CACHE_RELEASE):
                self.pool.release()
                if not self.pool.keep:
                    self.release()
        stats = state.stats
        stats.decode.settle_path(choice.path, choice.reason, self.graphs.fallback_reason, choice.attention,
                                 choice.norms_folded)
        stats.decode.num_steps = stats.decode.steps = state.num_steps
        stats.cache.num_slots, stats.cache.capacity, stats.cache.nbytes = rows, capacity, cache.nbytes
        settle_stats(call, stats)
        logprobs = None if state.logprobs is None else state.logprobs[:, :state.num_steps]
        return Generation(state.generated[:, :state.num_steps], logprobs, stats)

    def static_decode(self, ctx: CallContext, choice: DecodeChoice, cache, parts: StepParts, num_rows: int,
                      samples: int = 1, first_row: bool = False) -> StaticDecode:
        """Buffers for this call (reused while they fit) and its step function (graphs keyed per call) over ``parts``;
        ``samples``: rows per prompt whose prompt's columns may be read once for all of them (1: every row
        reads its own copy); ``first_row``: read by each row from its run's first row, not in a pass of their own."""
        sampling, device = ctx.sampling, ctx.device
        bucket = batch_bucket(num_rows)
        if self.buffers is None or not self.buffers.fits(bucket, cache.shape.capacity, sampling.max_new_tokens,
                                                         ctx.vocab_size, device):
            self.graphs.clear()
            self.eos_tensors.clear()
            self.buffers = None
            self.buffers = DecodeBuffers(bucket, length_round(cache.shape.capacity),
                                         length_round(sampling.max_new_tokens), ctx.vocab_size, device)
        bufs, has_seen = self.buffers, sampling.repetition_penalty != 1.0
        use_graphs = choice.path == "graph"
        budgets = ctx.row_budgets is not None
        key = (sampling_key(sampling), ctx.eos.ids, has_seen, cache.key_storage.data_ptr(),
               tuple(cache.key_storage.shape), parts.weights.signature(), samples, first_row, budgets)
        eos = self.eos_tensors.setdefault(ctx.eos.ids, ctx.eos.tensor) if use_graphs else ctx.eos.tensor

        def step(live_len: int, rows: int) -> str:
            shape = (rows, length_bucket(live_len, cache.shape.capacity))

            def work():
                decode_step(parts, cache, bufs, shape, ctx.sampler, eos, has_seen=has_seen,
                            with_logprobs=ctx.with_logprobs, samples=samples, first_row=first_row, budgets=budgets)

            if not use_graphs:
                work()
                return EAGER
            return self.graphs.replay((shape, key), work, bufs.mutable())

        return StaticDecode(bufs, step, lambda rows: shares_prefix(parts, rows, samples, first_row))

    def release(self) -> None:
        """Drop the static buffers, the prefill scratch and the captured graphs (``keep_cache=False``)."""
        self.graphs.clear()
        self.eos_tensors.clear()
        self.buffers = None
        if self.scratch is not None:
            self.scratch.release()
            self.scratch = None

    @property
    def nbytes(self) -> int:
        """Bytes held between calls: the static buffers and the prefill scratch (graph pools not counted)."""
        held = self.buffers.nbytes if self.buffers is not None else 0
        return held + (self.scratch.nbytes if self.scratch is not None else 0)
