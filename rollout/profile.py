"""``Rollout.get_last_profile()``: one flat dict per ``generate`` call, built from the stage timers.

Keys shared with DeepSpeed's ``HybridEngineRollout`` keep its names and meaning; ours are added.
Stage times are device times where the timers have them (CUDA events), else host times.
"""

from __future__ import annotations

from instrumentation import stages


def _stage_ms(summary: dict, name: str) -> float:
    entry = summary.get(name)
    if not entry:
        return 0.0
    device_ms = entry.get("device_ms")
    return float(device_ms if device_ms is not None else entry.get("host_ms", 0.0))


def build_profile(summary: dict, counters: dict, batch, request, sampling, elapsed_s: float,
                  cache_bytes: int, held_bytes: int = 0) -> dict:
    """The profile of one call. ``summary``: ``{stage: {count, host_ms, device_ms, peak_allocated_mib}}``."""
    prompt_len = request.prompt_len
    num_rows = batch.batch_size
    response_len = batch.seq_len - prompt_len
    total_ms = _stage_ms(summary, stages.ROLLOUT) or elapsed_s * 1000.0
    num_generated = num_rows * response_len
    num_useful = int(batch.attention_mask[:, prompt_len:].sum())
    peaks = [e.get("peak_allocated_mib") for e in summary.values() if e.get("peak_allocated_mib") is not None]
    profile = {
        # DeepSpeed HybridEngineRollout keys
        "prompt_expansion_ms": _stage_ms(summary, stages.EXPAND),
        "prefill_forward_ms": _stage_ms(summary, stages.PREFILL),
        "decode_forward_ms": _stage_ms(summary, stages.DECODE),
        "num_decode_forwards": counters.get("decode_forwards", 0),
        "post_processing_ms": _stage_ms(summary, stages.POSTPROCESS),
        "total_ms": total_ms,
        "num_generated_tokens": num_generated,
        "tokens_per_second": num_generated / (total_ms / 1000.0) if total_ms > 0 else 0.0,
        "batch_size": request.batch_size,
        "num_samples_per_prompt": sampling.n_samples_per_prompt,
        "prompt_length": prompt_len,
        "response_length": response_len,
        # ours
        "route": counters.get("route", "ordinary"),
        "route_reason": counters.get("route_reason"),
        "num_prefill_buckets": counters.get("prefill_buckets", 1),
        "planner_dp_skipped": counters.get("dp_skipped"),
        "num_cache_trims": counters.get("trims", 0),
        "cache_bytes_moved": counters.get("bytes_moved", 0),
        "cache_capacity": counters.get("capacity", counters.get("cache_capacity")),
        "plan_ms": _stage_ms(summary, stages.PLAN),
        "cache_trim_ms": _stage_ms(summary, stages.CACHE_TRIM),
        "decode_path": counters.get("decode_path") or ("graph" if counters.get("graph_decode_steps") else
                        "fast_eager" if counters.get("eager_decode_steps") else "hf"),
        "decode_fallback_reason": counters.get("decode_fallback_reason"),
        "num_prefill_forwards": counters.get("prefill_forwards", 0),
        "num_useful_tokens": num_useful,
        "useful_tokens_per_second": num_useful / (total_ms / 1000.0) if total_ms > 0 else 0.0,
        "mode_switch_ms": _stage_ms(summary, stages.MODE_SWITCH),
        "mask_build_ms": _stage_ms(summary, stages.MASK_BUILD),
        "gather_ms": _stage_ms(summary, stages.GATHER),
        "lora_fuse_ms": _stage_ms(summary, stages.LORA_FUSE),
        "lora_unfuse_ms": _stage_ms(summary, stages.LORA_UNFUSE),
        "cache_acquire_ms": _stage_ms(summary, stages.CACHE_ACQUIRE),
        "cache_release_ms": _stage_ms(summary, stages.CACHE_RELEASE),
        "cache_bytes": cache_bytes,
        "held_bytes_after_call": held_bytes,
        "peak_allocated_mib": max(peaks) if peaks else None,
        "stages": summary,
    }
    return profile
