"""Worker: DeepSpeed 0.19.8's own rollout with and without ``instrument_deepspeed`` (argv[1]: ZeRO stage).

A tiny Qwen2 student in a ``DeepSpeedHybridEngine`` (``hybrid_engine.enabled``). Qwen2 has no
inference container, so upstream's ordinary route is ``HybridEngineRollout.generate`` -> Hugging
Face ``generate`` (the hybrid engine's own generate is never entered). Each route runs three
times: before instrumentation (plain), instrumented under torch.profiler, and after
``uninstrument_deepspeed`` under torch.profiler. Routes:

- ``ordinary``: ``engine.eval()``, a greedy generate, a sampled generate (n=2, fixed seed),
  ``engine.train()``.
- ``container``: the hybrid engine's own ``generate``, entered on CPU by binding
  ``model.generate`` the way ``DeepSpeedHybridEngine.create_inference_module`` does for models that
  have a container (``engine._generate = model.generate; model.generate = engine.generate``), called
  directly (DeepSpeed-Chat style) and through ``HybridEngineRollout.generate``.
- ``direct``: the continuous-batching cache calls (``DeepSpeedStaticCache`` allocation,
  ``compact``, ``trim_left``) on the real class; upstream's continuous batching itself fails on
  transformers 5.x (``DeepSpeedStaticCache`` lacks ``get_query_offset``), so it cannot run end to end.

Emits, per route and run, whether the outputs equal the plain run's bit for bit, and the
``user_annotation`` ranges of each trace as ``[name, tid, start_us, end_us]``.
"""

import os
import sys
import tempfile

import torch
from common import emit, make_engine

import instrumentation
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from traces.chrome import read_chrome_trace
from traces.events import RANGE

STAGE = int(sys.argv[1])
MAX_NEW_TOKENS = 4
SAMPLE_SEED = 1234


def profiled(fn):
    """``(result, ranges)``: ``fn()`` under a CPU torch.profiler, and the trace's user annotations."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        ranges = [[ev[1], ev[3], ev[4], ev[4] + ev[5]] for ev in read_chrome_trace(path) if ev[0] == RANGE]
    return result, ranges


def ordinary_route(engine, rollout, request, up):
    """eval, greedy generate, sampled generate (fixed seed), train; the output tensors."""
    engine.eval()
    greedy = rollout.generate(request, up.SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
    torch.manual_seed(SAMPLE_SEED)
    sampled = rollout.generate(request, up.SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                                                          top_p=0.9, n_samples_per_prompt=2))
    engine.train()
    return [t for batch in (greedy, sampled)
            for t in (batch.input_ids, batch.attention_mask, batch.response_start_idx)]


def container_route(engine, rollout, request, up):
    """The hybrid engine's own generate: called directly, then through HybridEngineRollout."""
    engine.eval()
    direct = engine.module.generate(request.prompt_ids, attention_mask=request.prompt_attention_mask,
                                    max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    batch = rollout.generate(request, up.SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
    engine.train()
    return [direct, batch.input_ids, batch.attention_mask]


def bind_container_generate(engine):
    """What ``create_inference_module`` does when a container exists (looked up now: wrapped or not)."""
    engine._generate = engine._opsd_hf_generate
    engine.module.generate = engine.generate


def direct_cache_calls(config):
    """Allocate a continuous-batching KV cache, fill it, compact rows and trim the left columns."""
    from deepspeed.utils.static_cache import DeepSpeedStaticCache

    torch.manual_seed(0)
    cache = DeepSpeedStaticCache(config, batch_size=3, max_cache_len=8, device="cpu", dtype=torch.float32)
    for layer in cache.layers:
        layer.keys.copy_(torch.randn_like(layer.keys))
        layer.values.copy_(torch.randn_like(layer.values))
    cache.compact(torch.tensor([2, 0]))
    cache.trim_left(3)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def three_runs(run, rebind=None) -> dict:
    """plain -> instrumented (profiled) -> uninstrumented (profiled)."""
    if rebind:
        rebind()
    plain = run()
    wrapped = instrumentation.instrument_deepspeed()
    again = instrumentation.instrument_deepspeed()
    if rebind:
        rebind()
    instrumented, ranges_on = profiled(run)
    restored = instrumentation.uninstrument_deepspeed()
    if rebind:
        rebind()
    after, ranges_off = profiled(run)
    return {"identical": same(plain, instrumented), "identical_after": same(plain, after),
            "ranges_on": ranges_on, "ranges_off": ranges_off, "wrapped": list(wrapped),
            "second_call": list(again), "restored": list(restored)}


def main():
    import deepspeed.runtime.rollout as up

    model = tiny_model("qwen2", seed=0)
    config = model.config
    engine = make_engine(model, STAGE, optimizer=False, config_overrides={
        "hybrid_engine": {"enabled": True, "release_inference_cache": True}})
    rollout = up.HybridEngineRollout(engine, TinyTokenizer(pad_token_id=0, eos_token_id=2))
    ids, mask = random_prompts(2, 6, min_len=3, seed=0)  # ids: [2, 6]
    request = up.RolloutRequest(ids, mask)
    out = {"engine": type(engine).__name__, "num_containers": len(engine._inference_containers),
           # without a container, model.generate stays Hugging Face's (not bound to the engine)
           "module_generate_is_hf": getattr(engine.module.generate, "__self__", None) is engine.module}
    out["ordinary"] = three_runs(lambda: ordinary_route(engine, rollout, request, up))
    engine._opsd_hf_generate = engine.module.generate
    out["container"] = three_runs(lambda: container_route(engine, rollout, request, up),
                                  rebind=lambda: bind_container_generate(engine))
    out["direct"] = three_runs(lambda: direct_cache_calls(config))
    emit(out)


if __name__ == "__main__":
    main()
