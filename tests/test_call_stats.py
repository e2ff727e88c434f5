"""``CallStats``: every field of ``Rollout.last_stats`` has its value on every route and path.

Three prompts of 6 tokens, 2 samples each (6 rows), 5 new tokens, no EOS (every row runs to the
budget), so every counter follows from the shapes; the expected values are derived in the comments.
Tiny Qwen2: 2 layers, 2 KV heads of 16 channels, fp32 -> one cache column of one row holds
2 (keys, values) x 2 x 2 x 16 x 4 bytes = 512 bytes.
"""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, RoutingConfig
from rollout.stats import CallStats
from rollout.testing import TinyTokenizer, tiny_model

COLUMN_BYTES = 2 * 2 * 2 * 16 * 4
NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
CPU_REASON = "eager fast step: device cpu has no CUDA graphs"

COMMON = dict(dp_skipped=True, route_estimates_ms={}, prefill_buckets=1, graph_decode_steps=0, num_steps=5,
              compactions=0, trims=0, shifts=0, row_moves=0, bytes_moved=0, sampler_fallback_reason=None,
              prefill_graph_passes=0,  # no CUDA graphs on the CPU
              eos_overrun_steps=0,  # no EOS ids: no EOS check
              shared_prefix_steps=0,  # SDPA on the CPU: every row reads its own copy of its prompt
              sampler_path="eager",  # greedy on the CPU: the eager functions
              decode_attention="sdpa",  # no CUDA: the Triton kernel cannot run
              blas_library="")  # no CUDA: no BLAS backend chosen
# ordinary: one pass over the 3 prompts of 6 tokens (each prompt's 2 samples share it), 4 decode steps of 6
# rows; the cache holds the batch bucket of 6 rows (8) x (6 + 5) columns; no EOS ids -> no EOS check, no
# compaction.
ORDINARY = dict(COMMON, route="ordinary", route_reason="route=ordinary", eos_check_interval=1, prefill_forwards=1,
                prefill_attention_groups=1, prefill_rows=3, prefill_tokens=18, decode_forwards=4, decode_rows=24,
                steps=5, host_syncs=0, plans=0, prefill_copy_bytes=0, scratch_bytes=0, scratch_allocations=0)
# continuous, 4 slots: prompts 0 and 1 (4 rows) admitted first, decoded 4 times, retired together at the
# budget; then prompt 2 (2 rows), decoded 4 times: 2 plans, 2 packed passes of one group each, 3 distinct
# prompts (shared prefill) of 6 tokens; 10 scheduler iterations (2 admissions + 8 decodes); the copies
# into the slots: 6 slots x 6 columns; scratch: the first wave's 2 prompts x 6 columns, allocated once.
CONTINUOUS = dict(COMMON, route="continuous", route_reason="route=continuous", eos_check_interval=4,
                  prefill_forwards=2,
                  prefill_attention_groups=2, prefill_rows=3, prefill_tokens=18, decode_forwards=8, decode_rows=24,
                  steps=10, host_syncs=0, plans=2, prefill_copy_bytes=6 * 6 * COLUMN_BYTES,
                  scratch_bytes=2 * 6 * COLUMN_BYTES, scratch_allocations=1)

CASES = {
    # static buffers, eager on the CPU: every decode step is an eager step of our fused step
    "ordinary-fast": (dict(route="ordinary"), None, dict(
        ORDINARY, prefill_path="packed", decode_path="fast_eager", decode_fallback_reason=CPU_REASON,
        eager_decode_steps=4, num_slots=8, capacity=11, cache_bytes=8 * 11 * COLUMN_BYTES)),
    "ordinary-hf": ({"route": "ordinary", "kernels.fast_decode": False}, None, dict(
        ORDINARY, prefill_path="hf", decode_path="hf", decode_fallback_reason="kernels.fast_decode disabled in RolloutConfig",
        decode_attention="hf",
        eager_decode_steps=0, num_slots=6, capacity=11, cache_bytes=6 * 11 * COLUMN_BYTES)),
    "ordinary-hf-prefill": ({"route": "ordinary", "kernels.fast_prefill": False}, None, dict(
        ORDINARY, prefill_path="hf", decode_path="fast_eager", decode_fallback_reason=CPU_REASON,
        eager_decode_steps=4, num_slots=8, capacity=11, cache_bytes=8 * 11 * COLUMN_BYTES)),
    # static buffers: capacity 2 x (6 + 5 - 1) = 20 (refills) -> 64 -> the 256-column length bucket
    "continuous-static": (dict(route="continuous"), 4, dict(
        CONTINUOUS, prefill_path="packed", decode_path="fast_eager", decode_fallback_reason=CPU_REASON,
        eager_decode_steps=8, num_slots=4, capacity=256, cache_bytes=4 * 256 * COLUMN_BYTES)),
    # per-call tensors (cuda_graphs off): capacity 64, no static-buffer steps
    "continuous-per-call": ({"route": "continuous", "kernels.cuda_graphs": False}, 4, dict(
        CONTINUOUS, prefill_path="packed", decode_path="fast_eager",
        decode_fallback_reason="eager fast step: kernels.cuda_graphs disabled in RolloutConfig",
        eager_decode_steps=0, num_slots=4, capacity=64, cache_bytes=4 * 64 * COLUMN_BYTES)),
    "continuous-hf": ({"route": "continuous", "kernels.fast_decode": False}, 4, dict(
        CONTINUOUS, prefill_path="hf", decode_path="hf", decode_fallback_reason="kernels.fast_decode disabled in RolloutConfig",
        decode_attention="hf",
        eager_decode_steps=0, num_slots=4, capacity=64, cache_bytes=4 * 64 * COLUMN_BYTES)),
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
    assert set(expected) == set(CallStats.__dataclass_fields__)  # the table covers every field
    assert {k: getattr(stats, k) for k in expected} == expected


def test_auto_with_every_row_in_one_batch_runs_the_ordinary_route(prompts):
    ro = Rollout(tiny_model("qwen2", seed=0), NO_EOS, RolloutConfig(route="auto"))
    ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0, n_samples_per_prompt=2))
    stats = ro.last_stats
    assert (stats.route, stats.route_reason, stats.dp_skipped) == ("ordinary", "all prompts span alike", True)
    assert set(stats.route_estimates_ms) == {"single"} and stats.route_estimates_ms["single"] > 0
    assert (stats.decode_path, stats.decode_forwards, stats.eager_decode_steps) == ("fast_eager", 4, 4)


@pytest.mark.parametrize("route, slots, interval, checks, syncs", [
    ("ordinary", None, None, 1, 4), ("ordinary", None, 2, 2, 2), ("continuous", 4, 1, 1, 10),
    ("continuous", 4, None, 4, 2)])
def test_eos_checks_are_counted_as_host_syncs(route, slots, interval, checks, syncs, prompts):
    """An EOS id that never comes: the ordinary route checks before each of its 4 decode steps (by
    default; every 2nd: 2); the continuous route reads the flags once per scheduler iteration with k = 1
    (10, as above) and, by default (k = 4), after iterations 4 and 8."""
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=1)
    ro = Rollout(tiny_model("qwen2", seed=0), tok, RolloutConfig(route=route, routing=RoutingConfig(eos_check_interval=interval)))
    batch = ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                                 n_samples_per_prompt=2, continuous_batch_size=slots))
    assert not (batch.input_ids[:, 6:] == 1).any()  # precondition: the EOS id is never generated
    assert (ro.last_stats.eos_check_interval, ro.last_stats.host_syncs) == (checks, syncs)


def test_mapping_access_keeps_old_callers_working(prompts):
    ro = Rollout(tiny_model("qwen2", seed=0), NO_EOS)
    ro.generate(RolloutRequest(*prompts), SamplingConfig(max_new_tokens=5, temperature=0.0))
    stats = ro.last_stats
    assert stats["decode_path"] == stats.get("decode_path") == stats.decode_path
    assert stats["cache_capacity"] == stats["capacity"] == 11  # the old ordinary-route name
    assert stats.get("no_such_field", "default") == "default" and "no_such_field" not in stats
    with pytest.raises(KeyError):
        stats["no_such_field"]
    assert stats.to_dict()["cache_capacity"] == 11 and "decode_path" in stats.keys()
