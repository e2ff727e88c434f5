"""The fast decode step (our own Llama-family step; CUDA graphs on GPU) against the HF forward."""

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.model import step as fast_decode
from rollout.plan.buckets import batch_bucket, length_bucket
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer(pad_token_id=0, eos_token_id=None)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _parts(model, fns=None):
    spec, weights = fast_decode.spec_and_weights(model)
    return fast_decode.StepParts(spec, weights, fns or fast_decode.StepFns())


def _paths(model, ids, mask, sampling, **cfg):
    fast = Rollout(model, TOK, RolloutConfig().with_settings(cfg)).generate(RolloutRequest(ids, mask), sampling)
    slow = Rollout(model, TOK, RolloutConfig(kernels=KernelConfig(fast_decode=False))).generate(
        RolloutRequest(ids, mask), sampling)
    return fast, slow


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=12, temperature=0.0),
    SamplingConfig(max_new_tokens=12, temperature=0.0, repetition_penalty=1.5),
    SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=3, n_samples_per_prompt=2),
])
def test_fast_step_tokens_equal_hf_forward_path(arch, sampling):
    model = tiny_model(arch, seed=2)
    ids, mask = random_prompts(5, 9, min_len=1, seed=41)
    fast, slow = _paths(model, ids, mask, sampling)
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert torch.equal(fast.attention_mask, slow.attention_mask)


def test_fast_step_logits_match_hf_logits():
    from rollout.cache.static import CacheShape, StaticKVCache
    from rollout.model import compat
    from rollout.ops import masks
    model = tiny_model("qwen2", seed=3)
    ids, mask = random_prompts(3, 6, min_len=2, seed=42)
    layers, heads, dim = compat.kv_geometry(model)
    shape = CacheShape(3, 8, layers, heads, dim, torch.float32, torch.device("cpu"))
    hf_cache, fast_cache = StaticKVCache(shape), StaticKVCache(shape)
    next_tok = torch.tensor([7, 8, 9])
    pos = mask.sum(1)
    with torch.no_grad():
        for cache in (hf_cache, fast_cache):  # identical prefill into both caches
            cache.set_window(torch.arange(6), 6)
            compat.forward_last_logits(model, ids, masks.prompt_positions(mask),
                                       masks.prefill_mask(mask), cache)
        valid = masks.key_validity(mask, 8)
        hf_cache.set_window(torch.tensor([6]), 7)
        expected = compat.forward_last_logits(model, next_tok[:, None], pos[:, None],
                                              masks.decode_mask(valid, 7), hf_cache)
        got = fast_decode.decode_logits(_parts(model), fast_cache.key_storage, fast_cache.value_storage, next_tok,
                                        pos, torch.tensor(6), masks.decode_mask(valid, 7))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.key_storage[:, :, :, 6], hf_cache.key_storage[:, :, :, 6])
    # profile_decode_step's --additive-mask experiment: the step given the additive mask torch's cuDNN path
    # builds from the boolean one (0 kept, -65504 masked) computes the same logits (left-padded rows here)
    keep = masks.decode_mask(valid, 7)
    assert not keep.all()  # some columns are masked
    additive = torch.zeros(keep.shape).masked_fill_(~keep, -65504.0)
    fast_cache.key_storage[:, :, :, 6].zero_()  # the step rewrites column 6
    again = fast_decode.decode_logits(_parts(model), fast_cache.key_storage, fast_cache.value_storage, next_tok,
                                      pos, torch.tensor(6), additive)
    torch.testing.assert_close(again, got, rtol=1e-5, atol=1e-5)


def test_weights_are_plain_views_of_the_parameters_like_the_zero3_mirror():
    """The compiled pieces guard on input types: parameters for prefill and the mirror's plain tensors
    for decode (ZeRO-3) made them recompile for every new prompt shape (seen on the H200 as a slow
    second OPSD step). Every weight is a plain tensor sharing the parameter's storage."""
    model = tiny_model("qwen2", seed=9)
    _, weights = fast_decode.spec_and_weights(model)
    mirrored = fast_decode.WeightMirror().refresh(weights)
    for tensor, copy in zip(weights.tensors(), mirrored.tensors()):
        assert type(tensor) is torch.Tensor and type(copy) is torch.Tensor
        assert not tensor.requires_grad
    assert weights.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert weights.layers[0].q.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()


def test_unsupported_models_fall_back_with_a_reason():
    model = tiny_model("qwen2", seed=4)
    model.config.hidden_act = "gelu"
    assert "hidden_act" in fast_decode.unsupported_reason(model)
    model.config.hidden_act = "silu"
    assert fast_decode.unsupported_reason(model) is None


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_failed_graph_capture_falls_back_to_eager_with_the_reason(route, monkeypatch):
    """A capture that fails (after its warm-up runs, as a real one can) leaves the step running
    eagerly, the tokens unchanged, no second attempt for the same key, and the reason in the stats.
    Run on the CPU by pretending it has graphs and making every capture fail."""
    from rollout.executors import decode, graphs
    attempts = []

    def failing_capture(step, mutable, pool):
        attempts.append(pool)
        saved = [t.clone() for t in mutable]
        step()  # a warm-up run writes the buffers; the real capture_graph restores them, so must this
        for dst, src in zip(mutable, saved):
            dst.copy_(src)
        raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_model("qwen2", seed=7)
    ids, mask = random_prompts(5, 9, min_len=1, seed=44)
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5, n_samples_per_prompt=2,
                              continuous_batch_size=3 if route == "continuous" else None)
    want = Rollout(model, TOK, RolloutConfig(route=route, kernels=KernelConfig(cuda_graphs=False))).generate(
        RolloutRequest(ids, mask), sampling)
    real_choose = decode.choose_decode

    def pretend_cuda(config, model, is_zero3, device, fused=()):  # graphs chosen as on a GPU
        choice = real_choose(config, model, is_zero3, device, fused)
        return decode.DecodeChoice("graph", None, choice.prefill_path)
    from rollout.executors import runner as engine
    monkeypatch.setattr(engine, "choose_decode", pretend_cuda)
    monkeypatch.setattr(graphs, "capture_graph", failing_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", route))
    ro = Rollout(model, TOK, RolloutConfig(route=route))
    got = ro.generate(RolloutRequest(ids, mask), sampling)
    assert torch.equal(got.input_ids, want.input_ids)
    stats = ro.last_stats
    assert f"{route} route: CUDA graph capture failed" in stats.decode.fallback_reason
    assert "stream is capturing" in stats.decode.fallback_reason
    assert stats.decode.eager_steps == stats.decode.forwards and not stats.decode.graph_steps
    graph_set = ro.runner.executors[route].graphs
    assert len(attempts) == len(graph_set._graphs) > 0  # one attempt per graph key, not one per step
    assert graph_set.num_captures == 0


def test_buckets():
    assert [batch_bucket(n) for n in (1, 3, 5, 17, 33, 300)] == [1, 4, 8, 24, 48, 384]
    assert length_bucket(1, 1000) == 256 and length_bucket(257, 1000) == 512 and length_bucket(900, 1000) == 1000


@cuda
@pytest.mark.parametrize("compile_step", [False, True])
def test_cuda_graph_replay_equals_eager_fp32(compile_step):
    model = tiny_model("qwen2", seed=5, device="cuda")
    ids, mask = random_prompts(6, 10, min_len=2, seed=43, device="cuda")
    for sampling in (SamplingConfig(max_new_tokens=300, temperature=0.0),
                     SamplingConfig(max_new_tokens=20, temperature=1.0, top_p=0.8, seed=1, repetition_penalty=1.2)):
        ro = Rollout(model, TOK, RolloutConfig(kernels=KernelConfig(compile=compile_step)))
        graph = ro.generate(RolloutRequest(ids, mask), sampling)
        eager = Rollout(model, TOK, RolloutConfig(kernels=KernelConfig(cuda_graphs=False, compile=False))).generate(
            RolloutRequest(ids, mask), sampling)
        hf = Rollout(model, TOK, RolloutConfig(kernels=KernelConfig(fast_decode=False))).generate(
            RolloutRequest(ids, mask), sampling)
        assert torch.equal(graph.input_ids, eager.input_ids)
        assert torch.equal(graph.input_ids, hf.input_ids)
        captures = ro.runner.executors["ordinary"].graphs.num_captures
        ro.generate(RolloutRequest(ids, mask), sampling)
        assert ro.runner.executors["ordinary"].graphs.num_captures == captures  # graphs are reused across calls


@cuda
def test_graph_decode_calls_leave_no_memory_behind():
    """Every capture's warm-up used a new side stream, and the GEMM libraries keep a workspace per
    stream for the life of the process: each keep_cache=False call left ~66 MiB allocated on the H200.
    With one warm-up stream per device, repeated calls (new captures each time) hold steady."""
    import gc
    model = tiny_model("qwen2", seed=8, device="cuda")
    ids, mask = random_prompts(4, 10, min_len=2, seed=45, device="cuda")
    ro = Rollout(model, TOK, RolloutConfig(keep_cache=False))
    sampling = SamplingConfig(max_new_tokens=300, temperature=0.0)  # two length buckets: two captures a call
    after = []
    for _ in range(4):
        ro.generate(RolloutRequest(ids, mask), sampling)
        assert ro.last_stats.decode.graph_steps > 0
        torch.cuda.synchronize()
        gc.collect()
        after.append(torch.cuda.memory_allocated())
    assert after[1] == after[2] == after[3], after


@cuda
def test_graph_decode_makes_no_host_sync_per_step():
    model = tiny_model("qwen2", seed=6, device="cuda")
    ids, mask = random_prompts(4, 8, seed=44, device="cuda")
    ro = Rollout(model, TOK)
    sampling = SamplingConfig(max_new_tokens=32, temperature=0.0)
    ro.generate(RolloutRequest(ids, mask), sampling)  # capture outside the checked region
    from rollout.executors.context import CallContext, EosIds
    from rollout.executors.decode import choose_decode
    from rollout.plan.planner import CostModel
    ctx = CallContext(model, sampling, EosIds.on((), "cuda"), CostModel.from_model(model))
    choice = choose_decode(ro.config, model, False, torch.device("cuda"))
    executor = ro.runner.executors["ordinary"]
    static = executor.static_decode(ctx, choice, ro.runner.pool._cache,
                                    executor.fast_step.parts(torch.device("cuda"), mirrored=True), 4)
    bufs, step = static.buffers, static.step
    bufs.step.fill_(1)  # rewind to the first decode step (fill_ with a Python number: no sync)
    bufs.col.fill_(8)
    torch.cuda.set_sync_debug_mode("error")
    try:
        modes = [step(8 + 1 + k, 4) for k in range(8)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert modes == ["graph"] * 8


@cuda
def test_fast_step_logits_match_hf_in_bf16_on_gpu():
    """The compiled step's logits stay within bf16 tolerance of the HF layers' (same cache contents)."""
    from rollout.cache.static import CacheShape, StaticKVCache
    from rollout.model import compat
    from rollout.model.step import compiled_step_fns
    from rollout.ops import masks
    model = tiny_model("qwen2", seed=8, device="cuda", dtype=torch.bfloat16)
    ids, mask = random_prompts(4, 12, min_len=3, seed=45, device="cuda")
    layers, heads, dim = compat.kv_geometry(model)
    shape = CacheShape(4, 16, layers, heads, dim, torch.bfloat16, torch.device("cuda"))
    hf_cache, fast_cache = StaticKVCache(shape), StaticKVCache(shape)
    next_tok, pos = torch.tensor([7, 8, 9, 10], device="cuda"), mask.sum(1)
    with torch.no_grad():
        for cache in (hf_cache, fast_cache):
            cache.set_window(torch.arange(12, device="cuda"), 12)
            compat.forward_last_logits(model, ids, masks.prompt_positions(mask), masks.prefill_mask(mask), cache)
        valid = masks.key_validity(mask, 16)
        hf_cache.set_window(torch.tensor([12], device="cuda"), 13)
        expected = compat.forward_last_logits(model, next_tok[:, None], pos[:, None], masks.decode_mask(valid, 13),
                                              hf_cache)
        got = fast_decode.decode_logits(_parts(model, compiled_step_fns()), fast_cache.key_storage,
                                        fast_cache.value_storage, next_tok, pos, torch.tensor(12, device="cuda"),
                                        masks.decode_mask(valid, 13))
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_decode_attention_equals_sdpa(heads, kv_heads, additive):
    """The batched-GEMM decode attention (profile_decode_step's experiment) computes SDPA's result with
    enable_gqa, for boolean and additive masks, rows with masked columns included."""
    from rollout.model.step import decode_attention, grouped_decode_attention
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(3, heads, 1, 16, generator=gen)
    k = torch.randn(3, kv_heads, 9, 16, generator=gen)
    v = torch.randn(3, kv_heads, 9, 16, generator=gen)
    keep = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding
    keep[2, ..., 7] = False  # a hole
    mask = torch.zeros(keep.shape).masked_fill_(~keep, -65504.0) if additive else keep
    expected = decode_attention(q, k, v, mask, 0.25, heads != kv_heads)
    got = grouped_decode_attention(q, k, v, mask, 0.25, heads != kv_heads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_step_with_grouped_attention_equals_hf_generate():
    """Our step with the batched-GEMM attention piece gives HF generate's greedy tokens (fp32)."""
    import dataclasses

    from rollout.model.step import StepFns, grouped_decode_attention
    from tests.conftest import hf_greedy, response_of
    model = tiny_model("qwen2", seed=5)
    ids, mask = random_prompts(3, 7, min_len=2, seed=9)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary"))
    grouped = dataclasses.replace(StepFns(), attention=grouped_decode_attention)
    original = ro.runner.fast_step.parts

    def parts(device, mirrored):
        return dataclasses.replace(original(device, mirrored), fns=grouped)

    ro.runner.fast_step.parts = parts
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert ro.last_stats.decode.path == "fast_eager"
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


def _kv_write_fns(compiled: bool):
    import dataclasses

    from rollout.model.step import StepFns, attention_inputs_qkv_write, compile_piece
    piece = compile_piece(attention_inputs_qkv_write) if compiled else attention_inputs_qkv_write
    return dataclasses.replace(StepFns(), attention_inputs_qkv_write=piece)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    __import__("shutil").which("g++") is None, reason="torch.compile on the CPU needs a C++ compiler"))])
def test_kv_write_in_the_piece_equals_the_separate_writes(compiled):
    """profile_decode_step's --kv-write-in-piece experiment: the step that writes k and v inside the (fused
    q|k|v) piece gives the same logits and the same cache as the step with two index_copy_ after it, eagerly
    and compiled (inductor on the CPU: one compiled graph serves every layer's cache view)."""
    from rollout.cache.static import CacheShape, StaticKVCache
    from rollout.model import compat
    from rollout.model.step import FusedQKV, StepParts, spec_and_weights
    from rollout.ops import masks
    model = tiny_model("qwen2", seed=4)
    ids, mask = random_prompts(3, 6, min_len=2, seed=7)
    layers, heads, dim = compat.kv_geometry(model)
    shape = CacheShape(3, 12, layers, heads, dim, torch.float32, torch.device("cpu"))
    caches = [StaticKVCache(shape), StaticKVCache(shape)]
    with torch.no_grad():
        for cache in caches:
            cache.set_window(torch.arange(6), 6)
            compat.forward_last_logits(model, ids, masks.prompt_positions(mask), masks.prefill_mask(mask), cache)
        spec, weights = spec_and_weights(model)
        weights = FusedQKV().refresh(weights)
        valid = masks.key_validity(mask, 12)
        tokens, pos = torch.tensor([7, 8, 9]), mask.sum(1)
        plain = StepParts(spec, weights, fast_decode.StepFns())
        fused = StepParts(spec, weights, _kv_write_fns(compiled))
        for step in range(3):  # three steps: columns 6, 7, 8
            keep = masks.decode_mask(valid, 7 + step)
            valid[:, 6 + step] = True
            want = fast_decode.decode_logits(plain, caches[0].key_storage, caches[0].value_storage, tokens,
                                             pos + step, torch.tensor(6 + step), keep)
            got = fast_decode.decode_logits(fused, caches[1].key_storage, caches[1].value_storage, tokens,
                                            pos + step, torch.tensor(6 + step), keep)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens = want.argmax(-1)
    torch.testing.assert_close(caches[1].key_storage, caches[0].key_storage, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].value_storage, caches[0].value_storage, rtol=1e-5, atol=1e-5)


def test_the_zero3_mirror_copies_only_what_the_fused_copies_do_not_hold():
    """Under ZeRO-3 the weight mirror gives captured steps fixed addresses. With fused q|k|v and gate|up, the
    step reads q, k, v, gate and up through those kept copies, so the mirror holds only the rest (o, down,
    norms, embedding, output head: tied ones once) and copies only that at each call. Parameters that move
    between calls (as gathered ZeRO-3 parameters do) keep the parts' addresses; new values are followed."""
    from rollout.executors.decode import FastStep

    model = tiny_model("qwen2", seed=9, tie_word_embeddings=True)
    step = FastStep(model, KernelConfig(compile=False, fuse_qkv=True, fuse_gate_up=True), mirror_weights=True)
    cpu = torch.device("cpu")
    with step.one_call():
        first = step.parts(cpu, mirrored=True)
    rest = model.model.embed_tokens.weight.nbytes + model.model.norm.weight.nbytes
    for layer in model.model.layers:
        rest += sum(t.nbytes for t in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight,
                                        layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
    inv_freq = first.weights.inv_freq.nbytes
    assert step.mirror.nbytes == rest + inv_freq  # no q/k/v/gate/up, the tied head once
    assert first.weights.lm_head.data_ptr() == first.weights.embed.data_ptr()
    signature = first.weights.signature()
    with torch.no_grad():  # parameters move (new storage) and change
        for p in model.parameters():
            p.data = p.data.clone() * 1.5
    with step.one_call():
        again = step.parts(cpu, mirrored=True)
    assert again.weights.signature() == signature
    layer, w = model.model.layers[1], again.weights.layers[1]
    torch.testing.assert_close(w.o, layer.self_attn.o_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(w.k, layer.self_attn.k_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(w.up, layer.mlp.up_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(w.v_bias, layer.self_attn.v_proj.bias, rtol=0, atol=0)
    assert w.k.untyped_storage().data_ptr() == w.qkv.untyped_storage().data_ptr()
