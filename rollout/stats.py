"""``CallStats``: the one typed record of what a ``generate`` call did, and the profile built from it.

Every route fills every field (a field that does not apply keeps its neutral value: 0, or the value
that describes the route, e.g. ``num_slots`` = rows on the ordinary route). ``Rollout.last_stats`` is
this record; it also answers ``stats["name"]`` and ``stats.get("name")`` for callers that treat it as a
dict. ``build_profile`` turns it and the stage timers into ``Rollout.get_last_profile()``: DeepSpeed's
keys with their names and meaning, then ours.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from instrumentation import stages

#: Old names kept readable on the record (``last_stats`` only gains fields).
_ALIASES = {"cache_capacity": "capacity"}


@dataclass
class CallStats:
    """Counters and decisions of one ``generate`` call (filled by the engine and the route executor)."""

    route: str = "ordinary"
    """What ran: ``"ordinary"`` or ``"continuous"``."""
    route_reason: str = ""
    """Why (``route=...`` as configured, or the cost model's reason under ``route="auto"``)."""
    dp_skipped: bool = True
    """Auto only: whether the bucket planner's DP was skipped by a lower bound (True on manual routes)."""
    route_estimates_ms: dict = field(default_factory=dict)
    """The cost model's estimates behind an Auto decision."""
    prefill_path: str = "hf"
    """``"hf"``, ``"packed"`` or ``"varlen"`` (``routes.PREFILL_PATHS``)."""
    decode_path: str = "hf"
    """``"graph"``, ``"fast_eager"`` or ``"hf"``: what the decode steps actually ran."""
    decode_fallback_reason: Optional[str] = None
    """Why decode steps did not all run from CUDA graphs (None when they did)."""
    decode_attention: str = "hf"
    """The decode step's attention: ``"triton"`` (:mod:`rollout.ops.decode_attention`), ``"sdpa"``, or
    ``"hf"`` when the HF layers decode (``RolloutConfig.kernels.decode_attention``; SDPA where the kernel cannot run)."""
    blas_library: str = ""
    """The BLAS backend the call's matrix products ran on (``"cublaslt"``, ``"cublas"``; ``""`` off CUDA;
    ``RolloutConfig.kernels.blas_library``, or the process's setting when that is None)."""
    sampler_fallback_reason: Optional[str] = None
    """Why token selection runs its eager functions (or not the fused kernel) although asked (None otherwise)."""
    sampler_path: str = "eager"
    """What the call's last token selection ran: ``"fused"`` (the one-kernel nucleus), ``"compiled"`` or
    ``"eager"`` (``rollout.ops.sampling.Sampler.last_path``)."""
    eos_check_interval: int = 1
    """Decode steps between EOS checks in this call: ``RolloutConfig.routing.eos_check_interval``, or the route's
    default when that is None (``rollout.plan.routes.EOS_CHECK_INTERVAL``)."""
    prefill_buckets: int = 1
    """Prefill buckets of the plan (ordinary route; 1 when unplanned)."""
    prefill_forwards: int = 0
    """Prefill passes over the weights (a packed pass counts once whatever its groups)."""
    prefill_graph_passes: int = 0
    """Of those, passes run from a CUDA graph (``RolloutConfig.kernels.prefill_graph_tokens``)."""
    prefill_attention_groups: int = 0
    """Attention groups over all prefill passes."""
    prefill_rows: int = 0
    """Distinct prompts prefilled (shared prefill: a prompt with n samples counts once)."""
    prefill_tokens: int = 0
    """Padded prompt tokens (rows x length) over all prefill buckets."""
    decode_forwards: int = 0
    """Decode steps (one forward over the live batch each)."""
    decode_rows: int = 0
    """Rows computed over all decode steps (the batch bucket's padding rows excluded)."""
    graph_decode_steps: int = 0
    """Decode steps replayed from CUDA graphs."""
    eager_decode_steps: int = 0
    """Decode steps of our fused step run eagerly over static buffers."""
    num_steps: int = 0
    """Tokens of the longest row (the first comes from prefill)."""
    steps: int = 0
    """Scheduler iterations (continuous route; = num_steps on the ordinary route)."""
    host_syncs: int = 0
    """Host syncs the route made for EOS checks and the layout (the input checks' one sync not counted). The
    ordinary route's EOS checks on static buffers wait on an event of the previous check
    (``RolloutConfig.routing.late_eos_count``), not on the step just launched."""
    shared_prefix_steps: int = 0
    """Triton attention: decode steps whose attention read each prompt's keys and values once for all of its
    samples (ordinary route, ``RolloutConfig.kernels.shared_prefix_rows``)."""
    eos_overrun_steps: int = 0
    """Ordinary route, static buffers: decode steps run after every row had ended. Its EOS check reads the
    finished count one check late, so the host never waits for the step it has just launched; these
    steps' tokens are cut from the output."""
    plans: int = 0
    """Prefill plans made for the call: Auto's bucket DP when it ran (ordinary route), one per admission
    wave (continuous route)."""
    num_slots: int = 0
    """Rows of the KV cache the call used (a batch bucket when decoding from static buffers)."""
    capacity: int = 0
    """Columns of the KV cache the call used."""
    cache_bytes: int = 0
    """Bytes of that KV cache (keys + values, all layers)."""
    compactions: int = 0
    """Ordinary route: times the unfinished rows were moved into a smaller batch bucket."""
    trims: int = 0
    """Continuous route: left realigns (the dead prefix dropped at the capacity)."""
    shifts: int = 0
    """Continuous route: right realigns (room for a longer admitted prompt)."""
    row_moves: int = 0
    """Rows copied by compaction (both routes)."""
    bytes_moved: int = 0
    """Bytes written into the cache by compaction and (continuous route) realigns."""
    prefill_copy_bytes: int = 0
    """Continuous route: bytes of prefilled keys/values copied from the scratch into the slots."""
    scratch_bytes: int = 0
    """Continuous route: bytes of the prefill scratch arena."""
    scratch_allocations: int = 0
    """Continuous route: allocations of the scratch arena during the call."""

    def count_decode(self, mode: str, num_rows: int) -> None:
        """One decode step ran (``mode``: ``"graph"``, ``"eager"`` or ``"hf"``) over ``num_rows`` live rows."""
        self.decode_forwards += 1
        self.decode_rows += num_rows
        if mode == "graph":
            self.graph_decode_steps += 1
        elif mode == "eager":
            self.eager_decode_steps += 1

    def settle_decode_path(self, intended: str, reason: Optional[str], capture_failure: Optional[str],
                           attention: str) -> None:
        """``decode_path`` and its reason from what the steps did: ``"graph"`` only when every step replayed
        a graph; ``reason`` (why the call was not meant to use graphs) unless a failed capture explains
        eager steps of a call meant for graphs. ``attention``: the step's attention piece (``DecodeChoice.attention``,
        ``"hf"`` on the HF path)."""
        self.decode_fallback_reason = reason
        self.decode_attention = attention
        if intended == "hf" or not self.decode_forwards:
            self.decode_path = intended  # no step ran: the path the call would have taken
        elif self.graph_decode_steps and not self.eager_decode_steps:
            self.decode_path = "graph"
        else:
            self.decode_path = "fast_eager"
            if intended == "graph" and capture_failure:
                self.decode_fallback_reason = capture_failure

    # ---- mapping access (``last_stats`` was a dict) ---------------------------------------------
    def __getitem__(self, key: str):
        name = _ALIASES.get(key, key)
        if name not in _FIELD_NAMES:
            raise KeyError(key)
        return getattr(self, name)

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in _FIELD_NAMES or key in _ALIASES

    def keys(self) -> list[str]:
        return [*_FIELD_NAMES, *_ALIASES]

    def to_dict(self) -> dict:
        """Every field and alias: what JSON rows record."""
        out = asdict(self)
        out.update({alias: out[name] for alias, name in _ALIASES.items()})
        return out


_FIELD_NAMES = tuple(f.name for f in fields(CallStats))


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


def build_profile(summary: dict, stats: CallStats, shape: CallShape, elapsed_s: float, cache_bytes: int,
                  held_bytes: int = 0) -> dict:
    """The profile of one call. ``summary``: ``{stage: {count, host_ms, device_ms, peak_allocated_mib}}``."""
    total_ms = _stage_ms(summary, stages.ROLLOUT) or elapsed_s * 1000.0
    num_generated = shape.num_rows * shape.response_len
    per_s = (lambda n: n / (total_ms / 1000.0)) if total_ms > 0 else (lambda n: 0.0)
    peaks = [e.get("peak_allocated_mib") for e in summary.values() if e.get("peak_allocated_mib") is not None]
    profile = {key: _stage_ms(summary, name) for key, name in _STAGE_KEYS.items()}
    profile.update({
        "num_decode_forwards": stats.decode_forwards, "total_ms": total_ms, "num_generated_tokens": num_generated,
        "tokens_per_second": per_s(num_generated), "batch_size": shape.batch_size,
        "num_samples_per_prompt": shape.num_samples, "prompt_length": shape.prompt_len,
        "response_length": shape.response_len,
        # ours
        "route": stats.route, "route_reason": stats.route_reason, "num_prefill_buckets": stats.prefill_buckets,
        "planner_dp_skipped": stats.dp_skipped, "num_cache_trims": stats.trims,
        "cache_bytes_moved": stats.bytes_moved, "cache_capacity": stats.capacity,
        "decode_path": stats.decode_path, "decode_fallback_reason": stats.decode_fallback_reason,
        "decode_attention": stats.decode_attention, "blas_library": stats.blas_library,
        "num_prefill_forwards": stats.prefill_forwards, "num_useful_tokens": shape.num_useful_tokens,
        "useful_tokens_per_second": per_s(shape.num_useful_tokens), "cache_bytes": cache_bytes,
        "held_bytes_after_call": held_bytes, "peak_allocated_mib": max(peaks) if peaks else None,
        "stages": summary,
    })
    return profile
