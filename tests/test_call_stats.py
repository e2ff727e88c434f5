"""``CallStats``: every field of ``Rollout.last_stats`` has its value on every route and path.

Three prompts of 6 tokens, 2 samples each (6 rows), 5 new tokens, no EOS (every row runs to the
budget), so every counter follows from the shapes; the expected values are derived in the comments.
Tiny Qwen2: 2 layers, 2 KV heads of 16 channels, fp32 -> one cache column of one row holds
2 (keys, values) x 2 x 2 x 16 x 4 bytes = 512 bytes.
"""

import dataclasses

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, RoutingConfig
from rollout.stats import CallStats
from rollout.testing import TinyTokenizer, tiny_model

COLUMN_BYTES = 2 * 2 * 2 * 16 * 4
NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
CPU_REASON = "eager fast step: device cpu has no CUDA graphs"

COMMON = {"dp_skipped": True, "route_estimates_ms": {}, "prefill.buckets": 1, "decode.graph_steps": 0,
          "decode.num_steps": 5, "cache.compactions": 0, "cache.trims": 0, "cache.shifts": 0, "cache.row_moves": 0,
          "cache.bytes_moved": 0, "sampler.fallback_reason": None,
          "prefill.graph_passes": 0,  # no CUDA graphs on the CPU
          "prefill.nonfinite_logits": False,  # finite weights
          "decode.eos_overrun_steps": 0,  # no EOS ids: no EOS check
          "decode.shared_prefix_steps": 0,  # SDPA on the CPU: every row reads its own copy of its prompt
          "sampler.path": "eager",  # greedy on the CPU: the eager functions
          "decode.attention": "sdpa",  # no CUDA: the Triton kernel cannot run
          "decode.norms_folded": False,  # no CUDA: the norm gains stay in the norms
          "blas_library": "", "blas_tune_ms": 0.0, "blas_untuned": 0}  # no CUDA: no BLAS backend chosen
# ordinary: one pass over the 3 prompts of 6 tokens (each prompt's 2 samples share it), 4 decode steps of 6
# rows; the cache holds the batch bucket of 6 rows (8) x (6 + 5) columns; no EOS ids -> no EOS check, no
# compaction.
ORDINARY = {**COMMON, "route": "ordinary", "route_reason": "route=ordinary", "decode.eos_check_interval": 1,
            "prefill.forwards": 1, "prefill.attention_groups": 1, "prefill.rows": 3, "prefill.tokens": 18,
            "decode.forwards": 4, "decode.rows": 24, "decode.steps": 5, "decode.host_syncs": 0, "plans": 0,
            "cache.prefill_copy_bytes": 0, "cache.scratch_bytes": 0, "cache.scratch_allocations": 0}
# continuous, 4 slots: prompts 0 and 1 (4 rows) admitted first, decoded 4 times, retired together at the
# budget; then prompt 2 (2 rows), decoded 4 times: 2 plans, 2 packed passes of one group each, 3 distinct
# prompts (shared prefill) of 6 tokens; 10 scheduler iterations (2 admissions + 8 decodes); the copies
# into the slots: 6 slots x 6 columns; scratch: the first wave's 2 prompts x 6 columns, allocated once.
CONTINUOUS = {**COMMON, "route": "continuous", "route_reason": "route=continuous", "decode.eos_check_interval": 4,
              "prefill.forwards": 2, "prefill.attention_groups": 2, "prefill.rows": 3, "prefill.tokens": 18,
              "decode.forwards": 8, "decode.rows": 24, "decode.steps": 10, "decode.host_syncs": 0, "plans": 2,
              "cache.prefill_copy_bytes": 6 * 6 * COLUMN_BYTES, "cache.scratch_bytes": 2 * 6 * COLUMN_BYTES,
              "cache.scratch_allocations": 1}
HF_REASON = "kernels.fast_decode disabled in RolloutConfig"

CASES = {
    # static buffers, eager on the CPU: every decode step is an eager step of our fused step
    "ordinary-fast": ({"route": "ordinary"}, None, {
        **ORDINARY, "prefill.path": "packed", "decode.path": "fast_eager", "decode.fallback_reason": CPU_REASON,
        "decode.eager_steps": 4, "cache.num_slots": 8, "cache.capacity": 11, "cache.nbytes": 8 * 11 * COLUMN_BYTES}),
    "ordinary-hf": ({"route": "ordinary", "kernels.fast_decode": False}, None, {
        **ORDINARY, "prefill.path": "hf", "decode.path": "hf", "decode.fallback_reason": HF_REASON,
        "decode.attention": "hf",
        "decode.eager_steps": 0, "cache.num_slots": 6, "cache.capacity": 11, "cache.nbytes": 6 * 11 * COLUMN_BYTES}),
    "ordinary-hf-prefill": ({"route": "ordinary", "kernels.fast_prefill": False}, None, {
        **ORDINARY, "prefill.path": "hf", "decode.path": "fast_eager", "decode.fallback_reason": CPU_REASON,
        "decode.eager_steps": 4, "cache.num_slots": 8, "cache.capacity": 11, "cache.nbytes": 8 * 11 * COLUMN_BYTES}),
    # static buffers: capacity 2 x (6 + 5 - 1) = 20 (refills) -> 64 -> the 256-column length bucket
    "continuous-static": ({"route": "continuous"}, 4, {
        **CONTINUOUS, "prefill.path": "packed", "decode.path": "fast_eager", "decode.fallback_reason": CPU_REASON,
        "decode.eager_steps": 8, "cache.num_slots": 4, "cache.capacity": 256, "cache.nbytes": 4 * 256 * COLUMN_BYTES}),
    # per-call tensors (cuda_graphs off): capacity 64, no static-buffer steps
    "continuous-per-call": ({"route": "continuous", "kernels.cuda_graphs": False}, 4, {
        **CONTINUOUS, "prefill.path": "packed", "decode.path": "fast_eager",
        "decode.fallback_reason": "eager fast step: kernels.cuda_graphs disabled in RolloutConfig",
        "decode.eager_steps": 0, "cache.num_slots": 4, "cache.capacity": 64, "cache.nbytes": 4 * 64 * COLUMN_BYTES}),
    "continuous-hf": ({"route": "continuous", "kernels.fast_decode": False}, 4, {
        **CONTINUOUS, "prefill.path": "hf", "decode.path": "hf", "decode.fallback_reason": HF_REASON,
        "decode.attention": "hf",
        "decode.eager_steps": 0, "cache.num_slots": 4, "cache.capacity": 64, "cache.nbytes": 4 * 64 * COLUMN_BYTES}),
}


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (3, 6), generator=gen)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("name", list(CASES))
def test_every_field_has_its_value(name, prompts):
    config, slots, expected = CASES[name]
    ro = Rollout(tiny_model("qwen2", seed=0), NO_EOS, RolloutConfig().with_settings(config))
    ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0, n_samples_per_prompt=2,
                                                         continuous_batch_size=slots))
    stats = ro.last_stats
    assert isinstance(stats, CallStats)
    assert stats.flat() == expected  # the table covers every field of every record


def test_auto_with_every_row_in_one_batch_runs_the_ordinary_route(prompts):
    ro = Rollout(tiny_model("qwen2", seed=0), NO_EOS, RolloutConfig(route="auto"))
    ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0, n_samples_per_prompt=2))
    stats = ro.last_stats
    assert (stats.route, stats.route_reason, stats.dp_skipped) == ("ordinary", "all prompts span alike", True)
    assert set(stats.route_estimates_ms) == {"single"} and stats.route_estimates_ms["single"] > 0
    assert (stats.decode.path, stats.decode.forwards, stats.decode.eager_steps) == ("fast_eager", 4, 4)


@pytest.mark.parametrize("route, slots, interval, checks, syncs", [
    ("ordinary", None, None, 1, 4), ("ordinary", None, 2, 2, 2), ("continuous", 4, 1, 1, 10),
    ("continuous", 4, None, 4, 2)])
def test_eos_checks_are_counted_as_host_syncs(route, slots, interval, checks, syncs, prompts):
    """An EOS id that never comes: the ordinary route checks before each of its 4 decode steps (by
    default; every 2nd: 2); the continuous route reads the flags once per scheduler iteration with k = 1
    (10, as above) and, by default (k = 4), after iterations 4 and 8."""
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=1)
    ro = Rollout(tiny_model("qwen2", seed=0), tok, RolloutConfig(route=route,
                                                                 routing=RoutingConfig(eos_check_interval=interval)))
    batch = ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                                 n_samples_per_prompt=2, continuous_batch_size=slots))
    assert not (batch.input_ids[:, 6:] == 1).any()  # precondition: the EOS id is never generated
    assert (ro.last_stats.decode.eos_check_interval, ro.last_stats.decode.host_syncs) == (checks, syncs)


def test_one_record_per_part_and_one_name_per_counter(prompts):
    """``CallStats`` nests a record per part of the call; the continuous route's cache counters are the
    ``AlignedKVCache``'s own record (not a copy under other names), and the profile carries the same names."""
    import rollout.stats as stats_module
    from rollout.cache.stats import CacheStats

    ro = Rollout(tiny_model("qwen2", seed=0), NO_EOS, RolloutConfig(route="continuous"))
    ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0, n_samples_per_prompt=2,
                                                         continuous_batch_size=4))
    stats = ro.last_stats
    assert type(stats.cache) is CacheStats and stats.cache.prefill_copy_bytes > 0
    assert set(stats.to_dict()) == {f.name for f in dataclasses.fields(CallStats)}
    assert stats.to_dict()["cache"]["prefill_copy_bytes"] == stats.flat()["cache.prefill_copy_bytes"]
    assert not hasattr(stats, "__getitem__") and not hasattr(stats, "get")  # no dict facade, no aliases
    profile = stats_module.build_profile({}, stats, stats_module.CallShape(3, 2, 6, 5, 6, 30), 0.5, 0)
    assert profile["stats"] == stats.to_dict() and profile["num_decode_forwards"] == stats.decode.forwards


def test_every_old_name_maps_to_a_field():
    """``RENAMED`` (for rows written before 0.2) maps every old flat name to a dotted name that exists."""
    from rollout.stats import RENAMED, renamed

    names = set(CallStats().flat())
    assert set(RENAMED.values()) <= names
    assert renamed({"decode_path": "graph", "trims": 2, "route": "auto"}) == \
        {"decode.path": "graph", "cache.trims": 2, "route": "auto"}
