import dataclasses
import re

import pytest

from rollout import KernelConfig, RolloutConfig, RoutingConfig, SamplerConfig, SamplingConfig
from rollout.config import MOVED, REMOVED, SECTIONS, setting_names


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, top_p=1.5), "top_p"),
    (dict(max_new_tokens=4, top_k=2.5), "top_k"),
    (dict(max_new_tokens=4, n_samples_per_prompt=0), "n_samples_per_prompt"),
    (dict(max_new_tokens=4, continuous_batch_size=0), "continuous_batch_size"),
    (dict(max_new_tokens=4, repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_new_tokens=4, repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(max_new_tokens=4, seed="7"), "seed"),
])
def test_sampling_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_sampling_config_keeps_upstream_defaults():
    cfg = SamplingConfig(max_new_tokens=8)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.n_samples_per_prompt, cfg.continuous_batch_size) == \
        (1.0, 1.0, -1, 1, None)
    assert (cfg.repetition_penalty, cfg.seed) == (1.0, None)
    assert SamplingConfig(max_new_tokens=1, temperature=0.0).is_greedy
    assert SamplingConfig(max_new_tokens=1, temperature=-1.0).is_greedy
    assert not cfg.is_greedy


@pytest.mark.parametrize("settings, field", [
    ({"route": "fastest"}, "route"),
    ({"gather": "sometimes"}, "gather"),
    ({"keep_cache": "yes"}, "keep_cache"),
    ({"fuse_lora": 1}, "fuse_lora"),
    ({"max_context": 0}, "max_context"),
    ({"max_cache_gib": float("inf")}, "max_cache_gib"),
    ({"kernels.fuse_qkv": "no"}, "kernels.fuse_qkv"),
    ({"sampler.fused": 0}, "sampler.fused"),
    ({"sampler.chunk_tokens": -1}, "sampler.chunk_tokens"),
    ({"sampler.chunk_tokens": 8192.0}, "sampler.chunk_tokens"),
    ({"sampler.chunk_tokens": True}, "sampler.chunk_tokens"),
    ({"routing.eos_check_interval": 0}, "routing.eos_check_interval"),
    ({"routing.eos_check_interval": 2.0}, "routing.eos_check_interval"),
    ({"routing.late_eos_count": 1}, "routing.late_eos_count"),
    ({"routing.max_prefill_tokens": 0}, "routing.max_prefill_tokens"),
    ({"routing.cost_model": 3}, "routing.cost_model"),
    ({"kernels.compile_mode": "reduce-overhead"}, "kernels.compile_mode"),  # inductor CUDA graphs inside ours
    ({"kernels.compile_mode": "max-autotune"}, "kernels.compile_mode"),
    ({"kernels.compile_mode": 1}, "kernels.compile_mode"),
    ({"kernels.decode_attention": "flash"}, "kernels.decode_attention"),
    ({"kernels.decode_attention": None}, "kernels.decode_attention"),
    ({"kernels.blas_library": "cutlass"}, "kernels.blas_library"),
    ({"kernels.blas_library": "cuBLASLt"}, "kernels.blas_library"),
    ({"kernels.blas_library": 1}, "kernels.blas_library"),
    ({"kernels.fused_kv_write": 1}, "kernels.fused_kv_write"),
    ({"kernels.fuse_gate_up": "yes"}, "kernels.fuse_gate_up"),
    ({"kernels.rotary_kernel": 1}, "kernels.rotary_kernel"),
    ({"kernels.prefill_graph_tokens": -1}, "kernels.prefill_graph_tokens"),
    ({"kernels.prefill_graph_tokens": True}, "kernels.prefill_graph_tokens"),
    ({"kernels.prefill_graph_tokens": 512.0}, "kernels.prefill_graph_tokens"),
    ({"kernels.skinny_rows": -1}, "kernels.skinny_rows"),
    ({"kernels.skinny_rows": True}, "kernels.skinny_rows"),
    ({"kernels.skinny_rows": 8.0}, "kernels.skinny_rows"),
    ({"kernels.shared_prefix_rows": -1}, "kernels.shared_prefix_rows"),
    ({"kernels.shared_prefix_rows": 2.5}, "kernels.shared_prefix_rows"),
    ({"kernels.shared_prefix_columns": 0}, "kernels.shared_prefix_columns"),
    ({"kernels.shared_prefix_columns": True}, "kernels.shared_prefix_columns"),
    ({"kernels.shared_prefix_first_row_rows": -1}, "kernels.shared_prefix_first_row_rows"),
    ({"kernels.shared_prefix_first_row_rows": True}, "kernels.shared_prefix_first_row_rows"),
])
def test_rollout_config_rejects_bad_values(settings, field):
    """Each bad value is refused with the setting's dotted name, whether set through ``with_settings`` or by
    building the section itself."""
    with pytest.raises(ValueError, match=re.escape(field)):
        RolloutConfig().with_settings(settings)
    (name, value), = settings.items()
    section, _, key = name.rpartition(".")
    if section:
        with pytest.raises(ValueError, match=re.escape(field)):
            SECTIONS[section](**{key: value})


def test_rollout_config_rejects_unknown_fields_and_is_frozen():
    with pytest.raises(TypeError):
        RolloutConfig(routes="ordinary")
    with pytest.raises(ValueError, match="routes: not a RolloutConfig setting"):
        RolloutConfig().with_settings({"routes": "ordinary"})
    with pytest.raises(ValueError, match="kernels.compiled: not a RolloutConfig setting"):
        RolloutConfig().with_settings({"kernels.compiled": False})
    with pytest.raises(ValueError, match="kernels: must be a KernelConfig; got dict"):
        RolloutConfig(kernels={"compile": False})
    cfg = RolloutConfig()
    with pytest.raises(Exception):
        cfg.route = "continuous"
    with pytest.raises(Exception):
        cfg.kernels.compile = False


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_flat_keyword_of_the_old_api_names_its_new_place(old, new):
    """Every flat keyword before 0.2 fails with the dotted name it moved to (in the constructor, in
    ``dataclasses.replace`` and in ``with_settings``), and the new place exists."""
    assert new in setting_names()
    for build in (lambda: RolloutConfig(**{old: None}), lambda: dataclasses.replace(RolloutConfig(), **{old: None}),
                  lambda: RolloutConfig().with_settings({old: None})):
        with pytest.raises(ValueError, match=re.escape(repr(new))):
            build()


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_a_removed_setting_says_why(old):
    with pytest.raises(ValueError, match=f"{old}.*removed in 0.2"):
        RolloutConfig(**{old: 0})


def test_the_replaced_first_row_bool_names_its_row_count():
    """``kernels.shared_prefix_first_row`` (a bool until 604431e) names the row count that replaced it."""
    with pytest.raises(ValueError, match=r"shared_prefix_first_row: not a RolloutConfig setting.*"
                                         r"now kernels\.shared_prefix_first_row_rows"):
        RolloutConfig().with_settings({"kernels.shared_prefix_first_row": True})
    off = RolloutConfig().with_settings({"kernels.shared_prefix_first_row_rows": 0})
    assert off.kernels.shared_prefix_first_row_rows == 0


def test_common_settings_stay_flat_and_sections_round_trip():
    cfg = RolloutConfig(route="auto", max_cache_gib=40)
    assert (cfg.route, cfg.max_cache_gib) == ("auto", 40)
    assert cfg.kernels == KernelConfig() and cfg.routing == RoutingConfig() and cfg.sampler == SamplerConfig()
    changed = cfg.with_settings({"kernels.compile": False, "sampler.chunk_tokens": 0, "keep_cache": False})
    assert (changed.kernels.compile, changed.sampler.chunk_tokens, changed.keep_cache) == (False, 0, False)
    assert changed.kernels == KernelConfig(compile=False) and changed.route == "auto"
    assert cfg.kernels.compile  # the original is unchanged
    settings = changed.settings()
    assert tuple(settings) == setting_names() and settings["kernels.compile"] is False
    assert RolloutConfig().with_settings(settings) == changed
