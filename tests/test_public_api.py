"""The public API, pinned: a change to any name here must change this test and ``CHANGELOG.md``.

What users write against: the package exports, the fields of the config records (in order: they are also
positional), ``Rollout``'s public members, the ``CallStats`` names (``flat()``), the profile's keys and the OPSD
exports. The CHANGELOG names every field of the pinned records.
"""

import dataclasses
import inspect
import pathlib
import re

import instrumentation
import rollout
import rollout.opsd as opsd
from rollout.config import MOVED, REMOVED
from rollout.stats import RENAMED, CallShape, CallStats, build_profile

CHANGELOG = (pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()

EXPORTS = ["Rollout", "RolloutConfig", "RoutingConfig", "KernelConfig", "SamplerConfig", "SamplingConfig",
           "RolloutRequest", "RolloutBatch"]

FIELDS = {
    "SamplingConfig": ["max_new_tokens", "temperature", "top_p", "top_k", "n_samples_per_prompt",
                       "continuous_batch_size", "repetition_penalty", "seed", "return_logprobs",
                       "return_finish_reasons"],
    "RolloutConfig": ["route", "max_cache_gib", "keep_cache", "max_context", "gather", "fuse_lora", "routing",
                      "kernels", "sampler"],
    "RoutingConfig": ["cost_model", "max_prefill_tokens", "eos_check_interval", "late_eos_count"],
    "KernelConfig": ["fast_decode", "fast_prefill", "cuda_graphs", "prefill_graph_tokens", "compile", "compile_mode",
                     "decode_attention", "fused_kv_write", "blas_library", "fuse_qkv", "fuse_gate_up",
                     "rotary_kernel", "skinny_rows", "shared_prefix_rows", "shared_prefix_columns",
                     "shared_prefix_first_row_rows", "shared_prefix_align", "residual_in_place", "fold_norms",
                     "rotary_in_attention_rows"],
    "SamplerConfig": ["fused", "chunk_tokens"],
    "RolloutRequest": ["prompt_ids", "prompt_attention_mask", "row_max_new_tokens"],  # ours after DeepSpeed's
    "RolloutBatch": ["input_ids", "attention_mask", "response_start_idx", "finish_reasons", "logprobs"],
}

STATS = ["route", "route_reason", "dp_skipped", "route_estimates_ms", "plans", "blas_library", "blas_tune_ms",
         "blas_untuned",
         "prefill.path", "prefill.buckets", "prefill.forwards", "prefill.graph_passes", "prefill.attention_groups",
         "prefill.rows", "prefill.tokens", "prefill.nonfinite_logits",
         "decode.path", "decode.fallback_reason", "decode.attention", "decode.norms_folded", "decode.forwards",
         "decode.rows",
         "decode.graph_steps", "decode.eager_steps", "decode.num_steps", "decode.steps", "decode.host_syncs",
         "decode.eos_check_interval", "decode.shared_prefix_steps", "decode.eos_overrun_steps",
         "sampler.path", "sampler.fallback_reason",
         "cache.num_slots", "cache.capacity", "cache.nbytes", "cache.compactions", "cache.trims", "cache.shifts",
         "cache.row_moves", "cache.bytes_moved", "cache.prefill_copy_bytes", "cache.scratch_bytes",
         "cache.scratch_allocations"]

#: DeepSpeed's keys (same names and meaning as ``deepspeed.runtime.rollout``), then ours.
PROFILE = {"prompt_expansion_ms", "prefill_forward_ms", "decode_forward_ms", "post_processing_ms",
           "num_decode_forwards", "total_ms", "num_generated_tokens", "tokens_per_second", "batch_size",
           "num_samples_per_prompt", "prompt_length", "response_length",
           "plan_ms", "cache_trim_ms", "mode_switch_ms", "mask_build_ms", "gather_ms", "lora_fuse_ms",
           "lora_unfuse_ms", "cache_acquire_ms", "cache_release_ms", "stats", "num_useful_tokens",
           "useful_tokens_per_second", "pool_bytes", "held_bytes_after_call", "peak_allocated_mib", "stages"}


def test_package_exports():
    assert rollout.__all__ == EXPORTS
    for name in EXPORTS:
        assert getattr(rollout, name).__name__ == name
    assert opsd.__all__ == ["OPSDConfig", "OPSDStep", "PhaseTimes", "StepBreakdown", "StepResult",
                            "generalized_jsd_loss"]
    assert {"stage", "stages", "collect_stages", "opsd_profiler", "configure"} <= set(instrumentation.__all__)


def test_record_fields_in_order():
    for name, fields in FIELDS.items():
        assert [f.name for f in dataclasses.fields(getattr(rollout, name))] == fields, name


def test_rollout_members():
    members = {n for n, _ in inspect.getmembers(rollout.Rollout) if not n.startswith("_")}
    assert members == {"generate", "get_last_profile", "held_bytes", "name", "shutdown", "sync_weights"}
    assert list(inspect.signature(rollout.Rollout.__init__).parameters) == ["self", "engine", "tokenizer", "config"]
    assert list(inspect.signature(rollout.Rollout.generate).parameters) == ["self", "request", "sampling"]


def test_call_stats_names_and_profile_keys():
    assert list(CallStats().flat()) == STATS
    profile = build_profile({}, CallStats(), CallShape(1, 1, 1, 1, 1, 1), 0.1, 0)
    assert set(profile) == PROFILE
    assert profile["stats"] == CallStats().to_dict()


def test_the_changelog_names_every_renamed_and_removed_name():
    """Each old name and its new place appear in CHANGELOG.md (as written in its tables)."""
    words = set(re.findall(r"`([^`]+)`", CHANGELOG))
    names = {w for text in words for w in re.split(r"[\s,()=.]+", text)} | words
    for old, new in {**MOVED, **RENAMED}.items():
        assert old in names, f"CHANGELOG.md does not name {old!r}"
        assert new in words or new.split(".")[-1] in names, f"CHANGELOG.md does not name {new!r}"
    for old in REMOVED:
        assert old in names, f"CHANGELOG.md does not name the removed {old!r}"
