"""``CallStats``: the one typed record of what a ``generate`` call did, and the profile built from it.

``CallStats`` is made of records, one per part of the call, each filled where its counts happen: ``prefill``,
``decode``, ``sampler`` and ``cache`` (the KV cache's own ``rollout.cache.stats.CacheStats``, which the cache
counts into directly), beside the call's decisions (route, reason, BLAS backend). A record keeps the name of
each counter from where it is counted to the profile and the docs (``decode.path``, ``cache.trims``);
:meth:`CallStats.flat` lists them by these dotted names. Every route fills every record (a field that does not
apply keeps its neutral value). ``Rollout.last_stats`` is this record. ``build_profile`` turns it and the stage
timers into ``Rollout.get_last_profile()``: DeepSpeed's keys with their names and meaning, then ``stats``
(this record as a nested dict) and the call's shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from instrumentation import stages
from rollout.cache.stats import CacheStats


@dataclass
class PrefillStats:
    """The call's prefill passes."""

    path: str = "hf"
    """``"hf"``, ``"packed"`` or ``"varlen"`` (``routes.PREFILL_PATHS``)."""
    buckets: int = 1
    """Prefill buckets of the plan (ordinary route; 1 when unplanned)."""
    forwards: int = 0
    """Prefill passes over the weights (a packed pass counts once whatever its groups)."""
    graph_passes: int = 0
    """Of those, passes run from a CUDA graph (``RolloutConfig.kernels.prefill_graph_tokens``)."""
    attention_groups: int = 0
    """Attention groups over all prefill passes."""
    rows: int = 0
    """Distinct prompts prefilled (shared prefill: a prompt with n samples counts once)."""
    tokens: int = 0
    """Padded prompt tokens (rows x length) over all prefill buckets."""
    nonfinite_logits: bool = False
    """A prefill pass produced a NaN or infinite last-token logit (the model's weights or activations hold
    non-finite values; the sampled tokens are then meaningless): a ``RuntimeWarning`` says so."""


@dataclass
class DecodeStats:
    """The call's decode steps and what they ran."""

    path: str = "hf"
    """``"graph"``, ``"fast_eager"`` or ``"hf"``: what the decode steps actually ran."""
    fallback_reason: Optional[str] = None
    """Why decode steps did not all run from CUDA graphs (None when they did)."""
    attention: str = "hf"
    """The decode step's attention: ``"triton"`` (``rollout.ops.decode_attention``), ``"sdpa"``, or ``"hf"`` when
    the HF layers decode (``RolloutConfig.kernels.decode_attention``; SDPA where the kernel cannot run)."""
    norms_folded: bool = False
    """The decode steps ran on fused weight copies that carry the norm gains, scaling by each row's 1/RMS in their
    kernels (``RolloutConfig.kernels.fold_norms``: CUDA with triton): bf16 tokens round otherwise than the unfolded
    step's."""
    forwards: int = 0
    """Decode steps (one forward over the live batch each)."""
    rows: int = 0
    """Rows computed over all decode steps (the batch bucket's padding rows excluded)."""
    graph_steps: int = 0
    """Decode steps replayed from CUDA graphs."""
    eager_steps: int = 0
    """Decode steps of our fused step run eagerly over static buffers."""
    num_steps: int = 0
    """Tokens of the longest row (the first comes from prefill)."""
    steps: int = 0
    """Scheduler iterations (continuous route; = ``num_steps`` on the ordinary route)."""
    host_syncs: int = 0
    """Host syncs the route made for EOS checks and the layout (the input checks' one sync not counted). The
    ordinary route's EOS checks on static buffers wait on an event of the previous check
    (``RolloutConfig.routing.late_eos_count``), not on the step just launched."""
    eos_check_interval: int = 1
    """Decode steps between EOS checks in this call: ``RolloutConfig.routing.eos_check_interval``, or the route's
    default when that is None (``rollout.plan.routes.EOS_CHECK_INTERVAL``)."""
    shared_prefix_steps: int = 0
    """Ordinary route, Triton attention: decode steps whose attention read each prompt's keys and values once for
    all of its samples (``RolloutConfig.kernels.shared_prefix_rows``), in a pass of their own or from the first row
    of each prompt's run (``shared_prefix_first_row_rows``)."""
    eos_overrun_steps: int = 0
    """Ordinary route, static buffers: decode steps run after every row had ended (the EOS check reads the
    finished count one check late); their tokens are cut from the output."""

    def count(self, mode: str, num_rows: int) -> None:
        """One decode step ran (``mode``: ``"graph"``, ``"eager"`` or ``"hf"``) over ``num_rows`` live rows."""
        self.forwards += 1
        self.rows += num_rows
        if mode == "graph":
            self.graph_steps += 1
        elif mode == "eager":
            self.eager_steps += 1

    def settle_path(self, intended: str, reason: Optional[str], capture_failure: Optional[str],
                    attention: str, norms_folded: bool = False) -> None:
        """``path`` and its reason from what the steps did: ``"graph"`` only when every step replayed a graph;
        ``reason`` (why the call was not meant to use graphs) unless a failed capture explains eager steps of a
        call meant for graphs. ``attention``: the step's attention piece (``"hf"`` on the HF path);
        ``norms_folded``: the step's weight copies carry the norm gains."""
        self.fallback_reason = reason
        self.attention = attention
        self.norms_folded = norms_folded and intended != "hf"
        if intended == "hf" or not self.forwards:
            self.path = intended  # no step ran: the path the call would have taken
        elif self.graph_steps and not self.eager_steps:
            self.path = "graph"
        else:
            self.path = "fast_eager"
            if intended == "graph" and capture_failure:
                self.fallback_reason = capture_failure


@dataclass
class SamplerStats:
    """How the call chose its tokens."""

    path: str = "eager"
    """What the call's last token selection ran: ``"fused"`` (the Triton nucleus kernels), ``"compiled"`` or
    ``"eager"`` (``rollout.ops.sampling.Sampler.last_path``)."""
    fallback_reason: Optional[str] = None
    """Why token selection runs its eager functions (or not the fused kernels) although asked (None otherwise)."""


@dataclass
class CallStats:
    """Counters and decisions of one ``generate`` call (filled by the route that ran it)."""

    route: str = "ordinary"
    """What ran: ``"ordinary"`` or ``"continuous"``."""
    route_reason: str = ""
    """Why (``route=...`` as configured, or the cost model's reason under ``route="auto"``)."""
    dp_skipped: bool = True
    """Auto only: whether the bucket planner's DP was skipped by a lower bound (True on manual routes)."""
    route_estimates_ms: dict = field(default_factory=dict)
    """The cost model's estimates behind an Auto decision."""
    plans: int = 0
    """Prefill plans made for the call: Auto's bucket DP when it ran (ordinary route), one per admission wave
    (continuous route)."""
    blas_library: str = ""
    """The BLAS backend the call's matrix products ran on (``"cublaslt"``, ``"cublas"``; ``""`` off CUDA;
    ``RolloutConfig.kernels.blas_library``, or the process's setting when that is None)."""
    blas_tune_ms: float = 0.0
    """``"cublaslt-tuned"``: wall ms the call spent timing cuBLASLt algorithms for product shapes new to the process
    (``rollout.ops.tuned_gemm``; once per shape and process, so mostly the first calls)."""
    blas_untuned: int = 0
    """``"cublaslt-tuned"``: products the call left to PyTorch because their shape first came inside a CUDA graph
    capture (0 where the routes warm up eagerly first, as they do)."""
    prefill: PrefillStats = field(default_factory=PrefillStats)
    decode: DecodeStats = field(default_factory=DecodeStats)
    sampler: SamplerStats = field(default_factory=SamplerStats)
    cache: CacheStats = field(default_factory=CacheStats)

    def to_dict(self) -> dict:
        """The record as nested dicts (what the profile and JSON rows record)."""
        return asdict(self)

    def flat(self) -> dict:
        """Every field by its dotted name (``"decode.path"``, ``"cache.trims"``): one row of a table."""
        out = {}
        for name, value in self.to_dict().items():
            if isinstance(value, dict) and name in RECORDS:
                out.update({f"{name}.{key}": inner for key, inner in value.items()})
            else:
                out[name] = value
        return out


#: The records inside ``CallStats``.
RECORDS = ("prefill", "decode", "sampler", "cache")

#: ``CallStats`` fields before 0.2 (a flat record) and profile keys -> their dotted names now (``CHANGELOG.md``);
#: readers of older JSON rows map them with :func:`renamed`.
RENAMED = {
    **{f"prefill_{name}": f"prefill.{name}" for name in ("path", "buckets", "forwards", "graph_passes",
                                                           "attention_groups", "rows", "tokens")},
    "decode_path": "decode.path", "decode_fallback_reason": "decode.fallback_reason",
    "decode_attention": "decode.attention", "decode_forwards": "decode.forwards", "decode_rows": "decode.rows",
    "graph_decode_steps": "decode.graph_steps", "eager_decode_steps": "decode.eager_steps",
    **{name: f"decode.{name}" for name in ("num_steps", "steps", "host_syncs", "eos_check_interval",
                                           "shared_prefix_steps", "eos_overrun_steps")},
    "sampler_path": "sampler.path", "sampler_fallback_reason": "sampler.fallback_reason",
    # CallStats.cache_bytes (the profile's "cache_bytes", the pool's storage, is now "pool_bytes")
    "cache_bytes": "cache.nbytes", "cache_capacity": "cache.capacity",
    **{name: f"cache.{name}" for name in ("num_slots", "capacity", "compactions", "trims", "shifts", "row_moves",
                                          "bytes_moved", "prefill_copy_bytes", "scratch_bytes",
                                          "scratch_allocations")},
    # the profile's names before 0.2
    "num_prefill_buckets": "prefill.buckets", "planner_dp_skipped": "dp_skipped", "num_cache_trims": "cache.trims",
    "cache_bytes_moved": "cache.bytes_moved", "num_prefill_forwards": "prefill.forwards",
}


def renamed(row: dict) -> dict:
    """A flat row of ``CallStats`` fields (or profile keys) of any version with today's dotted names."""
    return {RENAMED.get(name, name): value for name, value in row.items()}


def _stage_ms(summary: dict, name: str) -> float:
    entry = summary.get(name)
    if not entry:
        return 0.0
    device_ms = entry.get("device_ms")
    return float(device_ms if device_ms is not None else entry.get("host_ms", 0.0))


#: Profile key -> stage whose time it reports (DeepSpeed's keys first, then ours).
_STAGE_KEYS = {
    "prompt_expansion_ms": stages.EXPAND, "prefill_forward_ms": stages.PREFILL, "decode_forward_ms": stages.DECODE,
    "post_processing_ms": stages.POSTPROCESS, "plan_ms": stages.PLAN, "cache_trim_ms": stages.CACHE_TRIM,
    "mode_switch_ms": stages.MODE_SWITCH, "mask_build_ms": stages.MASK_BUILD, "gather_ms": stages.GATHER,
    "lora_fuse_ms": stages.LORA_FUSE, "lora_unfuse_ms": stages.LORA_UNFUSE,
    "cache_acquire_ms": stages.CACHE_ACQUIRE, "cache_release_ms": stages.CACHE_RELEASE,
}


@dataclass(frozen=True)
class CallShape:
    """The shape of a call's input and output, for the profile."""

    batch_size: int
    num_samples: int
    prompt_len: int
    response_len: int
    num_rows: int
    num_useful_tokens: int
    """Response tokens with mask 1 (padding after EOS excluded)."""


def build_profile(summary: dict, stats: CallStats, shape: CallShape, elapsed_s: float, pool_bytes: int,
                  held_bytes: int = 0) -> dict:
    """The profile of one call. ``summary``: ``{stage: {count, host_ms, device_ms, peak_allocated_mib}}``;
    ``pool_bytes``: the KV pool's storage after the call (0 with ``keep_cache=False``)."""
    total_ms = _stage_ms(summary, stages.ROLLOUT) or elapsed_s * 1000.0
    num_generated = shape.num_rows * shape.response_len
    per_s = (lambda n: n / (total_ms / 1000.0)) if total_ms > 0 else (lambda n: 0.0)
    peaks = [e.get("peak_allocated_mib") for e in summary.values() if e.get("peak_allocated_mib") is not None]
    profile = {key: _stage_ms(summary, name) for key, name in _STAGE_KEYS.items()}
    profile.update({
        "num_decode_forwards": stats.decode.forwards, "total_ms": total_ms, "num_generated_tokens": num_generated,
        "tokens_per_second": per_s(num_generated), "batch_size": shape.batch_size,
        "num_samples_per_prompt": shape.num_samples, "prompt_length": shape.prompt_len,
        "response_length": shape.response_len,
        # ours: the call's CallStats by its own names, then what only the engine knows
        "stats": stats.to_dict(), "num_useful_tokens": shape.num_useful_tokens,
        "useful_tokens_per_second": per_s(shape.num_useful_tokens), "pool_bytes": pool_bytes,
        "held_bytes_after_call": held_bytes, "peak_allocated_mib": max(peaks) if peaks else None,
        "stages": summary,
    })
    return profile
