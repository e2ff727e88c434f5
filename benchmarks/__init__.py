"""Benchmarks of the rollout core, all on one harness (:mod:`benchmarks.harness`: rounds, warm-up, seeds, result
files, tables). Each runs as ``python -m benchmarks.<name> --help``.

| module | measures | was |
|---|---|---|
| ``benchmarks.rl`` | RL-scale cells: routes, Auto's choice, rooflines, GPU busy, peak memory | ``scripts/bench_rl.py`` |
| ``benchmarks.suites`` | decode-step variants, seed 004's workloads, seed 000's smoke matrix (``--suite rl``: ``benchmarks.rl``) | ``scripts/bench_rollout.py`` |
| ``benchmarks.smoke000`` | seed 000's smoke matrix (run by ``benchmarks.suites``) | ``scripts/bench_smoke000.py`` |
| ``benchmarks.decode_step`` | the decode step's pieces: attention, sampler, step variants, GEMMs, skinny kernel, prefill | ``scripts/profile_decode_step.py`` |
| ``benchmarks.sampler`` | the token sampler, before and after the sort-free nucleus, the fused kernels | ``scripts/bench_sampler.py`` |
| ``benchmarks.jsd`` | the fused loss's JSD kernel per chunk: against its PyTorch reference, other trees' kernels, launch parameters | new (issue 32) |
| ``benchmarks.optimizer`` | the optimizer step per DeepSpeed wrapper (ZeRO-0, ZeRO-1, float32 accumulation) | new (issue 32) |
| ``benchmarks.step`` | the whole OPSD step per phase against its roofline: uniform, long-tail and wide cells | new (issue 32) |
| ``benchmarks.postprocess`` | post-processing: reference loop, upstream-style, batched | ``scripts/bench_postprocess.py`` |
| ``benchmarks.planner`` | the prefill planner and the route decision (CPU) | ``scripts/bench_planner.py`` |
| ``benchmarks.keep_cache`` | what ``keep_cache`` adds to a training step's peak memory | ``scripts/bench_keep_cache.py`` |
| ``benchmarks.call_memory`` | what a rollout call leaves allocated (CUDA) | ``scripts/check_call_memory.py`` |
| ``benchmarks.overhead`` | instrumentation cost: ``stage`` (per ``stage()`` call), ``rollout`` (end to end) | ``scripts/bench_overhead.py``, ``scripts/bench_overhead_rollout.py`` |
| ``benchmarks.profiler_cost`` | profiling's cost on a training step: light mode, lingering cost | ``scripts/bench_profiler_cost.py`` |
| ``benchmarks.trace_summary`` | the trace summary against ``json.load`` and HTA | ``scripts/bench_summarize.py`` |
| ``benchmarks.multigpu`` | ZeRO stage x gathering x GPUs x launcher: OPSD step time and memory | ``scripts/bench_multigpu.py`` |
| ``benchmarks.ab`` | one benchmark command in two source trees, alternating | ``scripts/bench_ab.py`` |

Layering (``tests/test_layers.py``): benchmarks import ``rollout``, ``instrumentation`` and ``traces``; no library
imports benchmarks, and benchmarks import nothing of ``scripts/``: the user program two of them drive,
``train_opsd.py``, is launched as a program (its path: ``benchmarks.harness.programs``), and where its flag parser or
its OPSD step is needed in process it comes from the program's library, ``rollout.job``.

Every benchmark times with :mod:`benchmarks.harness.rounds` (a warm-up, then rounds A B C, C B A, ...; round ``r``
draws seed ``base + r % K``), writes ``--json`` as one schema (:mod:`benchmarks.harness.results`: ``{"schema": 1,
"meta": {...}, "rows": [...]}``, readable along with every older file under ``docs/results/``) and prints one
markdown table (:mod:`benchmarks.harness.table`).
"""
