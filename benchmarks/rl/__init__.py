"""RL-scale rollout benchmark (issue 15, item 1): ``python -m benchmarks.rl`` (``python -m benchmarks.suites
--suite rl`` passes its other flags here).

Wide batches, long-tailed response lengths, sampling, a KV budget and a long context, on the random
Qwen2.5-3B-shaped model (``--model 3b``, bf16, CUDA) or the tiny model (``--model tiny``, CPU), through the
public API (``rollout.Rollout`` & co., ``rollout.testing``, ``Rollout.last_stats.flat()``). Runs of commits
before the 0.2 API (sectioned ``RolloutConfig``, nested ``CallStats``) use that commit's own
``scripts/bench_rl.py`` (``python -m benchmarks.ab`` runs each tree's own copy); their result files merge with
today's (``--merge``), their ``CallStats`` names mapped to today's.

  python -m benchmarks.rl --model 3b --cells wide-greedy,wide-sampled --json a.json
  python -m benchmarks.rl --model 3b --calibrate-only --eos-scales scales.json
  python -m benchmarks.rl --merge a.json b.json
  python -m benchmarks.rl --model tiny --scale small            # the whole suite on a CPU, ~2 min
  python -m benchmarks.rl --cells capped --candidates auto --twin "kernels.fuse_gate_up=False" --seeds 4 --repeats 4

Cells (``--cells`` takes names or indices, comma-separated; ``3-6`` ranges too)
------------------------------------------------------------------------------
  0 wide-greedy          64 prompts x n=4, prompt 256 (distinct random), 256 new, greedy, EOS off
  1 wide-sampled         same, T=1, top-p 0.9, fixed seed
  2 wide-sampled-peaked  same as 1 on logits scaled so the median top-p nucleus is <= 1k tokens: the final
                         norm weight is multiplied in place by a factor for the cell and restored after
  3 longtail-64-1024     64 prompts x n=4, prompt lengths uniform in 128..1024, T=1, budget 1024, mean ~100
  4 longtail-128-1024    128 prompts x n=4, same
  5 longtail-64-2048     64 prompts x n=4, budget 2048, mean ~300
  6 longtail-128-2048    128 prompts x n=4, budget 2048, mean ~300
  7 capped               longtail-128-1024 under a KV budget allowing 128 slots (``max_cache_gib``)
  8 longctx              8 prompts x n=4 = 32 rows, prompt 8192, 1024 new, T=1, EOS off
  9 longtail-64-1024-top-p  as 3 with top-p 0.9 (3's EOS scale, so its mean length is not calibrated to 100):
                         the nucleus sampler at the few rows of a long tail
 10 opsd-uniform         64 prompts x n=4, prompt lengths uniform in 128..256, 1024 new, T=1, EOS off: the
                         rollout of benchmarks.step's uniform cell (issue 32's RL command)
 11 opsd-longtail        the same prompts, each row ending at a budget of its own (row_max_new_tokens: log-normal,
                         mean ~200 of 1024, as benchmarks.step's long-tail cell's first timed round): its rollout

EOS on the random model: the tokenizer gets EOS id 2 and the EOS row of the output embedding (tied with the
input embedding on the 3B shape) is multiplied in place by a scale found by a short calibration (a geometric
search over a few rows) so the mean response length hits the target; the scale is restored exactly after the
cell (a saved copy of the row). Found scales (and the peaked cell's norm factor) are cached in
``--eos-scales FILE`` (read if present, written if not) so later runs, old code and new, use identical weights.
``--scale small`` divides prompt lengths, budgets and target means by 16 (rows unchanged).

Candidates, per cell, timed by the harness (``benchmarks.harness.rounds``: a warm-up call per seed, then rounds
A B C, C B A, ...): ``auto`` (default ``RolloutConfig`` but ``route="auto"``), ``ordinary``, ``continuous-S`` for
S in {rows, rows/2, rows/4} (duplicates and S < n skipped; ``--candidates`` selects by ``auto``, ``ordinary``,
``continuous``, ``continuous/1|2|4`` or ``continuous-S``); ``--sampler-ab`` and ``--twin SETTINGS`` add a twin of
each with those ``RolloutConfig`` settings (dotted names: ``--twin "kernels.fuse_gate_up=False"``; an old flat name
fails naming its new one); with ``--upstream``, DeepSpeed 0.19.8's ``HybridEngineRollout`` without continuous
batching (``deepspeed``) on cells whose estimated call time is under ``--upstream-cap-s`` (it ignores EOS while
generating, so it always runs to the budget; it runs on the same model object and so sees the same scaled
weights). When the kept KV caches of all candidates would not fit the free GPU memory (or a call runs out of
memory), the cell runs its candidates one after another instead, each released before the next; the row's note
says so.

Columns
-------
- tok/s: sum of realised response lengths (the output attention mask after ``response_start_idx``) / wall.
- wall ms: mean over ``--repeats`` timed calls (min-max too), CUDA synchronised around each call. The calls of a
  sampled cell draw from one seed, so they draw the same tokens; ``--seeds K`` gives timed round ``r`` the seed
  ``SAMPLING_SEED + r % K`` (every candidate of a round the same one), so that means over the rounds average the
  realised lengths out (with K > 1 the lengths columns are over all timed calls).
- roofline ms, x roof: ``instrumentation.roofline.call_roofline_s`` at the measured copy and GEMM rates; each
  call's own realised lengths; x roof = wall / roofline.
- GPU busy: union of the kernel / memcpy / memset intervals of one extra profiled call (torch.profiler, CUDA
  activity; after every timed call of the cell) / that call's own wall. ``n/a (skipped)`` above
  ``--busy-max-events`` events. ``after_profile``: the row's timed calls followed a profiled call of this
  process (CUPTI callbacks may linger; ``--cupti-teardown`` sets ``TEARDOWN_CUPTI=1``, ``--busy off`` skips).
- peak GiB: ``torch.cuda.max_memory_allocated`` over the call (reset before), minus what the other candidates'
  ``Rollout`` objects hold between calls (``held_bytes``), i.e. the peak had this candidate run alone.
- route / decode / prefill: ``last_stats`` of the call (``route``, ``decode.path``, ``prefill.path``); every other
  scalar of ``last_stats.flat()`` is in the row's ``stats``.
- lengths: realised response lengths, mean / p50 / p90 / max (nearest rank).
- Auto's choice (the route Auto ran) and Auto / best, best = the fastest of ordinary and the continuous slot
  variants that ran; vs DS = wall / DeepSpeed's wall in the same cell; same tok = identical ``input_ids`` to
  the ordinary candidate's (or the first that ran).

Expected wall time per cell on an H200 (3B, bf16, defaults: warm-up + 2 repeats + 1 profiled call per
candidate, all candidates; first cell of a process adds ~1 min of compilation and graph capture):
  wide-greedy ~1.5 min, wide-sampled ~2, wide-sampled-peaked ~2, longtail-64-1024 ~3, longtail-128-1024 ~6,
  longtail-64-2048 ~8.5 (shard: auto,ordinary | continuous), longtail-128-2048 ~15 (shard in 3-4),
  capped ~2.5, longctx ~3.5; EOS calibration (``--calibrate-only``) ~3 min. ``--repeats 1 --busy off``
  halves each. docs/results/README-rl.md has the table and the shards.

Modules: ``cells`` (workloads, candidates), ``figures`` (lengths, busy unions, the scale search), ``scales``
(EOS emulation, the peaked cell), ``running`` (a candidate's calls), ``busy`` (the profiled call), ``cell`` (one
cell's rows), ``rows`` (the row, derived columns, table, merge), ``cli``.
"""
