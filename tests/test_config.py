import pytest

from rollout import RolloutConfig, SamplingConfig


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


@pytest.mark.parametrize("kwargs, field", [
    (dict(route="fastest"), "route"),
    (dict(gather="sometimes"), "gather"),
    (dict(keep_cache="yes"), "keep_cache"),
    (dict(fuse_lora=1), "fuse_lora"),
    (dict(fuse_qkv="no"), "fuse_qkv"),
    (dict(fused_sampler=0), "fused_sampler"),
    (dict(sampler_chunk_tokens=-1), "sampler_chunk_tokens"),
    (dict(sampler_chunk_tokens=8192.0), "sampler_chunk_tokens"),
    (dict(sampler_chunk_tokens=True), "sampler_chunk_tokens"),
    (dict(eos_check_interval=0), "eos_check_interval"),
    (dict(eos_check_interval=2.0), "eos_check_interval"),
    (dict(compile_mode="reduce-overhead"), "compile_mode"),  # inductor CUDA graphs inside ours
    (dict(compile_mode="max-autotune"), "compile_mode"),
    (dict(compile_mode=1), "compile_mode"),
    (dict(decode_attention="flash"), "decode_attention"),
    (dict(decode_attention=None), "decode_attention"),
    (dict(blas_library="cutlass"), "blas_library"),
    (dict(blas_library="cuBLASLt"), "blas_library"),
    (dict(blas_library=1), "blas_library"),
    (dict(continuous_stop_at_front=1), "continuous_stop_at_front"),
    (dict(continuous_shared_prefix="yes"), "continuous_shared_prefix"),
    (dict(fused_kv_write=1), "fused_kv_write"),
    (dict(fuse_gate_up="yes"), "fuse_gate_up"),
    (dict(rotary_kernel=1), "rotary_kernel"),
    (dict(prefill_graph_tokens=-1), "prefill_graph_tokens"),
    (dict(prefill_graph_tokens=True), "prefill_graph_tokens"),
    (dict(prefill_graph_tokens=512.0), "prefill_graph_tokens"),
    (dict(split_k_rows=-1), "split_k_rows"),
    (dict(split_k_rows=True), "split_k_rows"),
    (dict(skinny_rows=-1), "skinny_rows"),
    (dict(skinny_rows=True), "skinny_rows"),
    (dict(skinny_rows=8.0), "skinny_rows"),
    (dict(shared_prefix_rows=-1), "shared_prefix_rows"),
    (dict(shared_prefix_rows=2.5), "shared_prefix_rows"),
    (dict(max_context=0), "max_context"),
])
def test_rollout_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kwargs)


def test_rollout_config_rejects_unknown_fields_and_is_frozen():
    with pytest.raises(TypeError):
        RolloutConfig(routes="ordinary")
    cfg = RolloutConfig()
    with pytest.raises(Exception):
        cfg.route = "continuous"
