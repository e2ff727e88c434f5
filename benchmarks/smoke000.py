"""Seed 000's smoke matrix, run by ``python -m benchmarks.suites --suite smoke000`` (CPU or GPU).

Cells: batch {1, 4} x samples per prompt {1, 4} x prompt {128, 512} x response {32, 128} x greedy /
sampling x ZeRO stage {0, 3} (64 cells; ``--cells`` picks a shard). Per cell: E2E latency and rollout
tokens/s (mean of ``repeats`` timed calls after a warm-up); from one extra call with
``OPSD_PROFILE=1``: prefill and decode latency, decode step / floor (weights + live KV read once
per step at the measured copy rate: ``instrumentation.roofline.decode_step_floor_s``), post-processing and
cache-management latency, peak allocated memory; and the time of one whole OPSD step (rollout ->
self-distillation on the same model -> backward -> SGD step) on that cell's prompts.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

from benchmarks.harness.models import left_padded, model_geometry, set_single_process_env
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from instrumentation import ProfileConfig, configure
from instrumentation.roofline import Rates, decode_step_floor_s
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.opsd import OPSDConfig, OPSDStep

CELLS = [(zero, batch, n, prompt, response, mode)
         for zero in (0, 3) for batch in (1, 4) for n in (1, 4) for prompt in (128, 512)
         for response in (32, 128) for mode in ("greedy", "sampling")]


def zero3_engine(model, device: str):
    """A single-process DeepSpeed ZeRO-3 engine over ``model`` (gloo on CPU, NCCL on CUDA)."""
    import deepspeed

    set_single_process_env(29512)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip the 60 s JIT build on CPU
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo",
                                   auto_mpi_discovery=False, verbose=False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
              "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _sampling(n: int, response: int, mode: str) -> SamplingConfig:
    greedy = mode == "greedy"
    return SamplingConfig(max_new_tokens=response, temperature=0.0 if greedy else 1.0,
                          top_p=1.0 if greedy else 0.9, n_samples_per_prompt=n, seed=0)


def _profiled(ro: Rollout, ids, mask, sampling) -> dict:
    previous = configure(ProfileConfig(mode="1"))
    try:
        ro.generate(RolloutRequest(ids, mask), sampling)
        return ro.get_last_profile() or {}
    finally:
        configure(previous if previous is not None else ProfileConfig())


def run_cells(model_factory: Callable, tok, device: str, cells: list[int], *, repeats: int,
              rates: Optional[Rates] = None) -> list[dict]:
    """Rows (dicts) for ``cells`` (indices into ``CELLS``); builds one model per ZeRO stage."""
    rows, targets = [], {}
    for index in cells:
        zero, batch, n, prompt, response, mode = CELLS[index]
        if zero not in targets:
            model = model_factory()
            engine = zero3_engine(model, device) if zero == 3 else model
            optimizer = None if zero == 3 else torch.optim.SGD(model.parameters(), lr=1e-6)
            targets[zero] = (engine, optimizer)
        engine, optimizer = targets[zero]
        module = engine.module if zero == 3 else engine
        ro = Rollout(engine, tok, RolloutConfig(gather="once"))
        ids, mask = left_padded([prompt] * batch, module.config.vocab_size, device)
        sampling = _sampling(n, response, mode)
        times = time_rounds({"ours": lambda: ro.generate(RolloutRequest(ids, mask), sampling)}, Rounds(repeats),
                            Timer(device))  # the warm-up call captures the graphs
        e2e = statistics.mean(times["ours"])
        profile = _profiled(ro, ids, mask, sampling)
        steps = max(profile.get("num_decode_forwards", 0), 1)
        step_ms = profile.get("decode_forward_ms", 0.0) / steps
        floor_ms = None if rates is None else 1e3 * decode_step_floor_s(
            model_geometry(module), batch * n * (prompt + response // 2), rates)
        opsd = OPSDStep(engine, module if zero == 0 else engine, tok, OPSDConfig(), optimizer=optimizer,
                        rollout_config=RolloutConfig(gather="once"))
        opsd.step(ids, mask, sampling)  # warm-up
        opsd_ms = opsd.step(ids, mask, sampling).step_ms
        rows.append({
            "cell": f"z{zero} b{batch} n{n} p{prompt} r{response} {mode}",
            "e2e_ms": e2e, "tokens_per_s": batch * n * response / (e2e / 1000.0),
            "prefill_ms": profile.get("prefill_forward_ms"), "decode_ms": profile.get("decode_forward_ms"),
            "decode_step_ms": step_ms, "step_over_floor": step_ms / floor_ms if floor_ms else None,
            "postprocess_ms": profile.get("post_processing_ms"),
            "cache_ms": (profile.get("cache_acquire_ms") or 0.0) + (profile.get("cache_release_ms") or 0.0),
            "peak_mib": profile.get("peak_allocated_mib"),
            "decode.path": profile.get("stats", {}).get("decode", {}).get("path"),
            "opsd_step_ms": opsd_ms,
        })
    return rows
