"""Configuration dataclasses: what to sample (``SamplingConfig``) and how to run (``RolloutConfig``).

``SamplingConfig`` keeps the field names and defaults of DeepSpeed's ``deepspeed.runtime.rollout``
so users can switch; it is the only source of sampling behaviour (a model's ``generation_config``,
e.g. an Instruct model's default temperature, is ignored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rollout.checks import is_int, require

ROUTES = ("ordinary", "continuous", "auto")
#: Seeds key the sampling noise through 32-bit hashes: larger ones would alias smaller ones.
MAX_SEED = 2**32
GATHER_MODES = ("once", "per_forward")
#: ``RolloutConfig.compile_mode`` values: torch.compile modes without inductor CUDA graphs.
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
#: ``RolloutConfig.decode_attention`` values.
DECODE_ATTENTIONS = ("triton", "sdpa")
#: ``RolloutConfig.blas_library`` values besides None (``rollout.executors.blas`` sets them).
BLAS_LIBRARIES = ("cublas", "cublaslt")


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling knobs passed to ``Rollout.generate`` each step."""

    max_new_tokens: int
    """Response budget per row (> 0). Prompt + budget must fit the model's context."""
    temperature: float = 1.0
    """Softmax temperature; ``<= 0`` means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus filtering in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; ``<= 0`` disables it."""
    n_samples_per_prompt: int = 1
    """Responses per prompt (>= 1); output row i belongs to prompt ``i // n``."""
    continuous_batch_size: Optional[int] = None
    """Slots for continuous batching (ignored by the ordinary route)."""
    repetition_penalty: float = 1.0
    """HF semantics (> 0; 1 disables): applied in fp32 over the padded history (prompt incl. padding + response)."""
    seed: Optional[int] = None
    """Same inputs + same seed -> same samples, in ``[0, 2**32)``. None uses torch's global RNG."""
    return_logprobs: bool = False
    """Also return ``RolloutBatch.logprobs``: each sampled token's log-probability under the distribution
    it was drawn from (after repetition penalty, temperature, top-k, top-p). Greedy: the log-softmax of
    the penalised logits at temperature 1, without filtering."""
    return_finish_reasons: bool = False
    """Also return ``RolloutBatch.finish_reasons``: per row, EOS or budget."""

    def __post_init__(self) -> None:
        require(is_int(self.max_new_tokens) and self.max_new_tokens > 0, "max_new_tokens",
                 f"must be a positive int; got {self.max_new_tokens!r}")
        require(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature),
                 "temperature", f"must be a finite number; got {self.temperature!r}")
        require(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, "top_p",
                 f"must be in (0, 1]; got {self.top_p!r}")
        require(is_int(self.top_k), "top_k", f"must be an int (<= 0 disables); got {self.top_k!r}")
        require(is_int(self.n_samples_per_prompt) and self.n_samples_per_prompt >= 1,
                 "n_samples_per_prompt", f"must be an int >= 1; got {self.n_samples_per_prompt!r}")
        require(self.continuous_batch_size is None
                 or (is_int(self.continuous_batch_size) and self.continuous_batch_size >= 1),
                 "continuous_batch_size", f"must be None or an int >= 1; got {self.continuous_batch_size!r}")
        require(isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                 and self.repetition_penalty > 0, "repetition_penalty",
                 f"must be a finite number > 0; got {self.repetition_penalty!r}")
        require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
                f"must be None or an int in [0, 2**32); got {self.seed!r}")
        for name in ("return_logprobs", "return_finish_reasons"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool; got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout runs (our own; DeepSpeed's ``HybridEngineRolloutConfig`` has no equivalent)."""

    route: str = "ordinary"
    """``"ordinary"`` (one padded batch over a static KV cache), ``"continuous"`` (aligned-cache continuous
    batching with ``SamplingConfig.continuous_batch_size`` slots) or ``"auto"`` (chosen per call by the
    cost model; see :mod:`rollout.routes`)."""
    gather: str = "once"
    """ZeRO-3 only: ``"once"`` gathers all parameters once per ``generate`` call (fast, needs memory for the
    full model); ``"per_forward"`` keeps ZeRO-3's own per-forward gathering (low memory, slow)."""
    keep_cache: bool = True
    """Keep the KV cache allocated between compatible calls (no re-allocation) or release it after each call."""
    fuse_lora: bool = True
    """Merge peft LoRA adapters into the base weights for generation (restored bit-exactly afterwards)."""
    eos_check_interval: Optional[int] = None
    """Decode steps between the checks whether rows have finished (each check is one host sync): the
    ordinary route stops when all have; the continuous route retires them then, so a row that ended in
    between decodes up to ``k - 1`` more tokens (masked in the output) while the host, not waiting, runs
    ahead of the GPU. Outputs are the same for every ``k``. None: the route's default
    (``rollout.plan.routes.EOS_CHECK_INTERVAL``: 1 for the ordinary route, 4 for continuous batching,
    chosen by measurement on the H200)."""
    late_eos_count: bool = True
    """The ordinary route's EOS checks (static buffers) read the count of unfinished rows one check late: the
    host then waits for a step that a later one already follows, so the GPU never idles while the host
    launches the next step (with the count read at once it did, at every check). Rows that have ended stay
    ended, so the late count only delays a compaction by one check; the steps run after the last row ended
    (up to one check's worth, ``CallStats.eos_overrun_steps``) are cut from the output, which is the same
    either way. On an H200 (3B, long-tailed sampled lengths; docs/BENCHMARKS.md, 2026-12-02) Auto went from 1.99x
    to 1.97x its roofline at 64 x 4 rows and from 2.03x to 1.98x at 128 x 4. False reads the count at once."""
    max_context: Optional[int] = None
    """Upper bound on prompt + new tokens; None reads ``max_position_embeddings`` from the model config."""
    fast_decode: bool = True
    """Run decode steps through our own fused step (Llama-family models); other models, unfused LoRA and
    ZeRO-3 per-forward gathering use the HF forward, with the reason in the profile."""
    fast_prefill: bool = True
    """Prefill through our own pass (:mod:`rollout.fast_prefill`: linear layers over the packed real tokens,
    attention per planner bucket) wherever the fast decode step runs; False keeps the HF forward."""
    cuda_graphs: bool = True
    """On CUDA, capture the fast decode step in CUDA graphs (per batch and length bucket) and replay them."""
    prefill_graph_tokens: int = 2048
    """With ``cuda_graphs`` and the variable-length prefill (CUDA, bf16/fp16), prefill passes of at most this many
    real tokens replay a CUDA graph captured per token, row and length bucket
    (:mod:`rollout.executors.prefill_graph`) instead of launching each layer's pieces from Python (~22-28 ms of
    host time per pass for the 3B shape on an H200). It keeps a staging buffer of the largest bucket's keys and
    values (36 x 256 x 4 bytes a token for the 3B shape: 75 MB at 2,048) between calls. 0: off.
    Measured on the H200 (3B, bf16; ``docs/BENCHMARKS.md``, "2026-12-01 (23:20 UTC session)"): one pass of 8 x 64
    tokens 41.9 -> 7.7 ms, 8 x 256 28.7 -> 21.2, 32 x 64 25.6 -> 20.8, 32 x 256 (8,192) 85.2 -> 85.3; the seed-004
    short calls 16-37% faster, its 16..512 workload 3.5-4.5% slower in two runs though its one pass ran eagerly
    (unexplained; with the benchmark's rounds alternating it stayed, 157.0 against 149.3 ms: not the position),
    the RL capped cell 3.9% faster. Token buckets are powers of two, so a pass of just over 2,048 real tokens would pay
    the GEMMs of 4,096 where the GPU, not the host, is the limit: hence 2,048."""
    compile: bool = True
    """On CUDA, ``torch.compile`` the fast step's fusable pieces (norms, rotary, MLP activation)."""
    compile_mode: Optional[str] = None
    """``torch.compile`` mode of those pieces: None (torch's default: cuBLAS GEMMs, inductor's fusions) or
    ``"max-autotune-no-cudagraphs"`` (inductor benchmarks Triton GEMM templates against cuBLAS per shape and
    batch bucket, at a compile time of minutes; aimed at small-batch decode, where the weight GEMMs run at
    ~58% of the copy rate on an H200). Modes that add inductor's own CUDA graphs are refused: ours capture
    the whole step. On an H200 it made the 3B step 15-19% slower (docs/BENCHMARKS.md): not the default."""
    decode_attention: str = "triton"
    """Attention of our decode step: ``"triton"`` (:mod:`rollout.ops.decode_attention`: the query heads of a
    KV head as one tile, no mask conversion, a row's left padding not read; where it cannot run — no CUDA,
    no triton — SDPA runs and ``CallStats.decode_attention`` says so) or ``"sdpa"`` (PyTorch's SDPA with a
    boolean mask). Chosen by measurement on the H200 (docs/BENCHMARKS.md)."""
    fused_kv_write: bool = True
    """With ``compile`` and ``fuse_qkv`` on CUDA, the compiled q|k|v piece also writes k and v into the cache
    (one kernel with the rotary) instead of two ``index_copy_`` per layer after it."""
    blas_library: Optional[str] = "cublaslt"
    """On CUDA, the BLAS backend of the call's matrix products (PyTorch's process-wide
    ``torch.backends.cuda.preferred_blas_library``, set for the call and restored after it, so the caller's
    own GEMMs keep theirs; ``rollout.executors.blas``): ``"cublaslt"``, ``"cublas"``, or None to leave the
    process's setting. ``CallStats.blas_library`` says what ran. On an H200 (3B shape, bf16, the routes' default
    decode step captured in a CUDA graph, ``profile_decode_step.py --blas``, A B A B) cuBLASLt took the step at
    256 rows from 5.225/5.204 to 5.029/5.045 ms (-3.4%) and moved it by at most 0.6% at 8, 32, 128 and 512 rows;
    the wide RL cells took 2.3% (greedy) and 1.7% (sampled) less time, the long-tail and capped cells' roofline
    ratios stayed within their spread (docs/BENCHMARKS.md, "2026-12-02 (06:50 UTC session)")."""
    fuse_qkv: bool = True
    """Our step computes q, k and v with one GEMM over a concatenated copy of their weights (refreshed at
    every call; ~1/8 of the weights for Qwen2.5-3B) instead of three; False reads the model's own tensors."""
    fuse_gate_up: bool = True
    """Our step (decode and the fast prefill) computes the MLP's gate and up projections with one GEMM over a
    concatenated copy of their weights (refreshed at every call) instead of two. On an H200 (3B shape) it
    made the decode step 4-5% faster at 8, 32 and 256 rows and every RL cell 1.4-3% faster
    (docs/BENCHMARKS.md). It costs memory: ~58% of the weights for Qwen2.5-3B (3.2 GB), held between calls
    like the fused q|k|v copy and counted by the memory budget before a call allocates it; False reads the
    model's own tensors."""
    rotary_kernel: bool = True
    """On CUDA with triton (and ``fuse_qkv``), the rotary of a decode step's q and k and the cache writes of k
    and v run as one Triton kernel per layer (:mod:`rollout.ops.rotary_write`) instead of inductor's three
    (``fused_kv_write``) or the eager path's rotaries and two ``index_copy_``. On an H200 (3B shape) the step
    took 3.0% less time at 8 rows, 3.8% at 32 and 1.2% at 256 (docs/BENCHMARKS.md)."""
    skinny_rows: int = 32
    """On CUDA with ``rotary_kernel`` and ``fuse_gate_up``: decode steps whose batch bucket has at most this many
    rows (up to 64) compute each layer's o projection and residual add as one Triton kernel
    (:mod:`rollout.ops.skinny_linear`) instead of a cuBLAS GEMM and a copy. On an H200 (3B shape) that part of
    the step took 0.206 ms instead of 0.270 at 8 rows and 0.236 instead of 0.305 at 32 (docs/BENCHMARKS.md);
    64 rows were not timed. 0: off."""
    split_k_rows: int = 0
    """With ``fuse_gate_up``: decode steps whose batch bucket has at least this many rows compute the o and down
    projections (and, with ``rotary_kernel``, the fused q|k|v) as ``rollout.model.step.SPLIT_K`` partial products
    summed in fp32 (one batched GEMM each, :func:`rollout.model.step.split_k_linear`) instead of one GEMM. On an
    H200 (3B shape, ``profile_decode_step.py --split-k``, A B A B) the whole step took 3.888/3.887 -> 3.745/3.747
    ms at 128 rows (-3.7%) and 5.059/5.068 -> 5.035/5.049 at 256 (-0.4%) (docs/BENCHMARKS.md, "2026-12-01
    (23:20 UTC session)"); in the RL cells against its twin wide-greedy -1.3% and longtail-64-1024's roofline ratio
    +1% ("2026-12-02"), within their spread; not timed at 512 rows; so off. 0: off."""
    shared_prefix_rows: int = 32
    """With the Triton decode attention (``decode_attention="triton"``, CUDA), ordinary-route decode steps whose
    batch bucket has at least this many rows, in calls with several samples per prompt, read each prompt's
    keys and values once for all of its samples (one tile of ``n x`` the query heads per KV head,
    ``rollout.ops.decode_attention.SharedPrefix``) and then each row's own columns after the prompt, instead
    of every row reading its copy of the prompt; only for prompts (the batch's padded prompt length) of at least
    ``rollout.ops.decode_attention.MIN_SHARED_PROMPT`` = 512 columns, where it paid on the H200: the attention
    alone (3B shape, 4 samples) took 27% less time at 256 rows and 30% at 128 with a 768-column prompt, 16% more
    at 256 rows with a 256-column one; the long-tail RL cells' roofline ratios 1.97x/1.98x against their
    twins' 1.99x/2.01x (docs/BENCHMARKS.md, "2026-12-02 (02:31 UTC session)"). The 32-row threshold was not
    varied. 0: off."""
    continuous_stop_at_front: bool = False
    """Continuous route, static buffers (``cuda_graphs``): the captured step's attention is told the front (the
    column the step writes) as the last column any row attends, so the Triton kernel does not read the up to 255
    columns past it that the read window's rounding adds (masked for every row). The ordinary route always does
    this (its ``last``, -3.5% on the wide cell). Off: in its one H200 A/B (capped, one call each, other tokens)
    the route took 2.24x its roofline against 1.99x without it, unexplained, and not yet measured over several
    seeds in one process (``--twin continuous_stop_at_front=True``); the tokens do not depend on it beyond bf16
    rounding (fp32: HF ``generate``'s, tested)."""
    continuous_shared_prefix: bool = False
    """Continuous route, static buffers, the Triton attention: decode steps whose batch bucket has at least
    ``shared_prefix_rows`` rows read each prompt's keys and values once for all of its samples held in adjacent
    slots (admitted together, so adjacent until a compaction separates them), as the ordinary route does; each
    row's prompt ends at its own column (rows were admitted at different fronts). Only in calls whose padded
    prompts have at least ``rollout.ops.decode_attention.MIN_SHARED_PROMPT`` columns. Off: CPU-tested (the
    interpreted kernel; HF ``generate``'s tokens), not yet timed on a GPU (``--twin continuous_shared_prefix=True``
    on the RL suite's capped cell, whose attention took ~30% of its decode GPU time in an H200 trace)."""
    fused_sampler: bool = True
    """On CUDA (with ``compile``), temperature + top-p sampling without top-k or a repetition penalty runs
    the Triton nucleus kernels (:mod:`rollout.ops.fused_nucleus`); False keeps the compiled sort-free search.
    Both draw the same tokens except where a cumulative mass lies within rounding of ``1 - top_p``."""
    sampler_chunk_tokens: Optional[int] = None
    """Tokens of a row each program of the nucleus kernels reads (``fused_sampler``): None, the kernels' default
    (``rollout.ops.fused_nucleus.CHUNK_TOKENS`` = 8192: a program per chunk, 5.4x faster than one program per row
    at 8 rows, 3% at 256 on the H200; the RL suite's top-p long-tail cell 6.4% faster, same tokens); 0, one program
    per row. Fixed per call, never from the rows, so a row's
    token does not depend on its batch; other values sum masses in another order, so tokens may differ where a
    cumulative mass lies within rounding of ``1 - top_p``."""
    cost_model: Optional[object] = None
    """Prefill cost model for planning: a ``planner.CostModel``, the path of a calibration JSON
    (``scripts/calibrate_prefill.py``), or None for the seed PR's default coefficients with this model's
    geometry. The defaults are starting estimates: calibrate for your model, GPU and dtype."""
    max_prefill_tokens: Optional[int] = 65536
    """Padded tokens (rows x length) per planned prefill forward; None removes the limit."""
    max_cache_gib: Optional[float] = None
    """Cap on the KV cache of a call (GiB). The continuous route's slots and Auto's choice follow it; a call
    whose smallest feasible cache does not fit is refused with the figures before anything is allocated.
    None: the memory the device has free (a call that could not fit there is refused the same way)."""

    def __post_init__(self) -> None:
        require(self.route in ROUTES, "route", f"must be one of {ROUTES}; got {self.route!r}")
        require(self.gather in GATHER_MODES, "gather", f"must be one of {GATHER_MODES}; got {self.gather!r}")
        require(isinstance(self.keep_cache, bool), "keep_cache", f"must be a bool; got {self.keep_cache!r}")
        for name in ("fuse_lora", "fast_decode", "fast_prefill", "cuda_graphs", "compile", "fuse_qkv", "fuse_gate_up",
                     "rotary_kernel", "fused_sampler", "fused_kv_write", "late_eos_count", "continuous_stop_at_front",
                     "continuous_shared_prefix"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool; got {getattr(self, name)!r}")
        require(is_int(self.prefill_graph_tokens) and self.prefill_graph_tokens >= 0, "prefill_graph_tokens",
                f"must be an int >= 0 (0: off); got {self.prefill_graph_tokens!r}")
        require(is_int(self.split_k_rows) and self.split_k_rows >= 0, "split_k_rows",
                f"must be an int >= 0 (0: off); got {self.split_k_rows!r}")
        require(is_int(self.shared_prefix_rows) and self.shared_prefix_rows >= 0, "shared_prefix_rows",
                f"must be an int >= 0 (0: off); got {self.shared_prefix_rows!r}")
        require(self.sampler_chunk_tokens is None or (is_int(self.sampler_chunk_tokens)
                                                      and self.sampler_chunk_tokens >= 0),
                "sampler_chunk_tokens", f"must be None or an int >= 0 (0: a program per row); "
                f"got {self.sampler_chunk_tokens!r}")
        require(is_int(self.skinny_rows) and self.skinny_rows >= 0, "skinny_rows",
                f"must be an int >= 0 (0: off); got {self.skinny_rows!r}")
        require(self.blas_library is None or self.blas_library in BLAS_LIBRARIES, "blas_library",
                f"must be None or one of {BLAS_LIBRARIES}; got {self.blas_library!r}")
        require(self.decode_attention in DECODE_ATTENTIONS, "decode_attention",
                 f"must be one of {DECODE_ATTENTIONS}; got {self.decode_attention!r}")
        require(self.compile_mode in COMPILE_MODES, "compile_mode",
                 f"must be one of {COMPILE_MODES} (modes with inductor CUDA graphs clash with ours); "
                 f"got {self.compile_mode!r}")
        require(self.eos_check_interval is None or (is_int(self.eos_check_interval) and self.eos_check_interval >= 1),
                 "eos_check_interval", f"must be None or an int >= 1; got {self.eos_check_interval!r}")
        require(self.max_prefill_tokens is None or (is_int(self.max_prefill_tokens) and self.max_prefill_tokens > 0),
                 "max_prefill_tokens", f"must be None or a positive int; got {self.max_prefill_tokens!r}")
        from rollout.plan.planner import CostModel  # light, pure Python
        require(self.cost_model is None or isinstance(self.cost_model, (CostModel, str)), "cost_model",
                 f"must be a CostModel, a calibration file path or None; got {type(self.cost_model).__name__}")
        require(self.max_cache_gib is None or (isinstance(self.max_cache_gib, (int, float))
                                                and not isinstance(self.max_cache_gib, bool)
                                                and math.isfinite(self.max_cache_gib) and self.max_cache_gib > 0),
                "max_cache_gib", f"must be None or a finite number > 0; got {self.max_cache_gib!r}")
        require(self.max_context is None or (is_int(self.max_context) and self.max_context > 0),
                 "max_context", f"must be None or a positive int; got {self.max_context!r}")
