"""One cell of the RL suite: its prompts and scales, its candidates interleaved (or one at a time when their kept
caches would not fit), a row per candidate."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Optional

import torch

from benchmarks.rl.cells import SAMPLING_SEED, Candidate, CellSpec, cap_gib_for_slots, make_prompts, \
    plan_candidates, upstream_estimate_s
from benchmarks.rl.figures import length_stats
from benchmarks.rl.rows import RlRow, derive
from benchmarks.rl.running import Bench, CandidateRun, kept_bytes_estimate, make_runs, release, rollout_for, \
    run_interleaved, run_sequential, sampling_for, to_cpu
from benchmarks.rl.scales import eos_scale_for, norm_factor_for, scaled_weights
from instrumentation.roofline import call_roofline_s, prefill_roofline_s
from rollout import RolloutRequest


def run_cell(bench: Bench, spec: CellSpec) -> tuple[list[RlRow], dict]:
    """The cell's rows, and the last timed batch of each candidate (on the CPU)."""
    cell = bench.cell(spec)
    args = bench.args
    ids, mask, prompt_lens = make_prompts(cell, bench.model.config.vocab_size, bench.device)
    eos = eos_scale_for(bench, cell) if cell.eos else None
    peaked = norm_factor_for(bench, cell) if cell.peaked else None
    cap_gib = None
    if cell.cap_slots is not None:
        cap_gib = args.cap_gib or cap_gib_for_slots(cell.cap_slots, max(prompt_lens), cell.budget,
                                                    bench.geometry.kv_bytes_per_token)
    cands = plan_candidates(cell, args.candidate_set, cap_gib=cap_gib, upstream=args.upstream,
                            sampler_ab=args.sampler_ab, twins=args.twins)
    seeds = bench.rounds(cell).seeds
    common = dict(source=bench.source, cell=spec.name, prompts=cell.num_prompts, n=cell.n, rows=cell.rows,
                  prompt_lens=cell.prompt_label(), budget=cell.budget, sampling=cell.sampling_label(),
                  eos_scale=eos["scale"] if eos else None, norm_factor=peaked["factor"] if peaked else None,
                  nucleus_median=peaked["nucleus_median"] if peaked else None, repeats=args.repeats, seeds=seeds)
    rows: list[RlRow] = []
    if cell.cap_slots is not None and args.upstream:
        rows.append(RlRow(candidate="deepspeed", status="not run: no KV budget upstream", **common))
    if any(c.route == "deepspeed" for c in cands):
        estimate = upstream_estimate_s(cell, prompt_lens, bench.geometry)
        if estimate > args.upstream_cap_s:
            cands = [c for c in cands if c.route != "deepspeed"]
            rows.append(RlRow(candidate="deepspeed", status="not run: cap", **common,
                              note=f"estimated {estimate:.0f} s a call > --upstream-cap-s {args.upstream_cap_s:g}"))
    if cell.cap_slots is not None and (args.candidate_set is None or "ordinary" in args.candidate_set):
        rows.append(probe_over_cap(bench, cell, (ids, mask), cap_gib, eos["scale"] if eos else None, common))
    print(f"## {spec.name}: {cell.num_prompts} prompts x n={cell.n}, prompts {common['prompt_lens']}, budget "
          f"{cell.budget}, {cell.sampling_label()}"
          + (f" (seeds {SAMPLING_SEED}..{SAMPLING_SEED + seeds - 1})" if seeds > 1 else "")
          + f", EOS {'scale %.4g' % eos['scale'] if eos else 'off'}"
          + (f", norm x{peaked['factor']:.4g} (median nucleus {peaked['nucleus_median']:g})" if peaked else "")
          + f"; candidates {', '.join(c.name for c in cands)}", flush=True)
    t0 = time.perf_counter()
    with scaled_weights(bench.model, eos["scale"] if eos else None, peaked["factor"] if peaked else None):
        runs, mode = run_candidates(bench, cell, cands, (ids, mask))
    reference = next((r for r in runs if r.cand.name == "ordinary" and r.last_batch is not None),
                     next((r for r in runs if r.last_batch is not None), None))
    batches = {}
    for run in runs:
        rows.append(candidate_row(bench, cell, run, prompt_lens, reference, mode, common))
        if run.last_batch is not None:
            batches[run.cand.name] = to_cpu(run.last_batch)
    release(runs, bench.device)
    derive(rows)
    print(f"## {spec.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows, batches


def probe_over_cap(bench: Bench, cell: CellSpec, prompts: tuple, cap_gib: float, eos_scale: Optional[float],
                   common: dict) -> RlRow:
    """The ordinary route (every row at once) under ``max_cache_gib``: it should be refused, with the figures,
    before anything is allocated. One untimed call; the row records what happened."""
    cand = Candidate("ordinary (over cap)", "ordinary", max_cache_gib=cap_gib)
    ro = None
    start = time.perf_counter()
    try:
        ro = rollout_for(bench, cand, bench.tokenizer(cell.eos))
        with scaled_weights(bench.model, eos_scale, None):
            ro.generate(RolloutRequest(*prompts), sampling_for(cell, None))
        status = f"not refused: ran in {time.perf_counter() - start:.1f} s"
    except Exception as exc:  # the expected outcome
        status = f"refused: {type(exc).__name__}: {exc}"[:300]
    finally:
        if ro is not None:
            ro.shutdown()
        del ro
        gc.collect()
    print(f"  ordinary over the cap ({cap_gib:.4g} GiB): {status}", flush=True)
    return RlRow(candidate=cand.name, status=status, note=f"max_cache_gib={cap_gib:.4g}", **common)


def run_candidates(bench: Bench, cell: CellSpec, cands, prompts: tuple) -> tuple[list[CandidateRun], str]:
    """The candidates interleaved, or (``--sequential``, kept caches over 80% of the free memory, or out of memory
    while interleaved) one at a time; and which of the two ran."""
    device, args = bench.device, bench.args
    sequential = args.sequential
    if device.startswith("cuda") and not sequential:
        free, _ = torch.cuda.mem_get_info()
        need = kept_bytes_estimate(bench, cell, cands, prompts[0].shape[1])
        if need > 0.8 * free:
            print(f"  kept KV caches ~{need / 2 ** 30:.1f} GiB > 80% of free {free / 2 ** 30:.1f} GiB: one candidate "
                  "at a time", flush=True)
            sequential = True
    if not sequential:
        runs = make_runs(bench, cell, cands, prompts, shared=True)
        try:
            run_interleaved(runs, device, bench.rounds(cell), bench.busy, cell.name)
            return runs, "interleaved"
        except torch.cuda.OutOfMemoryError:
            print("  out of memory while interleaved: one candidate at a time", flush=True)
            release(runs, device)
            del runs
    return run_sequential(bench, cell, cands, prompts), "sequential (memory)"


def candidate_row(bench: Bench, cell: CellSpec, run: CandidateRun, prompt_lens: list[int], reference, mode: str,
                  common: dict) -> RlRow:
    """The row of one candidate's timed calls (an error row when none ran)."""
    notes = [n for n in (run.cand.note, mode if mode != "interleaved" else "",
                         "peak includes other candidates' caches (no held_bytes)" if run.peak_includes_others else "")
             if n]
    if run.error is not None or not run.walls_ms:
        return RlRow(candidate=run.cand.name, slots=run.cand.slots, status=f"error: {run.error or 'no timed call'}",
                     note="; ".join(notes), **common)
    walls = run.walls_ms
    tokens = [sum(lengths) for lengths in run.lengths]
    rooflines = [call_roofline_s(prompt_lens, cell.n, lengths, bench.geometry, bench.rates) for lengths in run.lengths]
    once_ms = 1000.0 * statistics.mean(call_roofline_s(prompt_lens, cell.n, lengths, bench.geometry, bench.rates, True)
                                       for lengths in run.lengths)
    prefill = prefill_roofline_s(prompt_lens, bench.geometry, bench.rates)
    drawn = common.get("seeds", 1) > 1  # the calls drew different tokens: lengths over all of them
    stats = length_stats([n for lengths in run.lengths for n in lengths] if drawn else run.lengths[-1])
    print(f"  {run.cand.name}: lengths mean {stats['mean']:.1f} p50 {stats['p50']} p90 {stats['p90']} "
          f"max {stats['max']}; {statistics.mean(walls):.0f} ms; roofline {statistics.mean(rooflines) * 1e3:.0f} ms, "
          f"{once_ms:.0f} ms with each prompt read once a step", flush=True)
    wall = statistics.mean(walls)
    roofline_ms = statistics.mean(rooflines) * 1000.0
    same = None
    if reference is not None and reference is not run:
        a, b = run.last_batch.input_ids, reference.last_batch.input_ids
        same = a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    elif reference is run:
        same = True
    call_stats = dict(run.stats)
    route = call_stats.pop("route", None)
    row = RlRow(candidate=run.cand.name, slots=run.cand.slots, note="; ".join(notes),
                response_tokens=statistics.mean(tokens), tok_s=statistics.mean(tokens) / (wall / 1000.0),
                wall_ms=wall, wall_ms_min=min(walls), wall_ms_max=max(walls), walls_ms=[round(w, 2) for w in walls],
                roofline_ms=roofline_ms, prefill_roofline_ms=prefill * 1000.0,
                x_roofline=wall / roofline_ms if roofline_ms > 0 else None, roofline_prompt_once_ms=once_ms,
                x_roofline_prompt_once=wall / once_ms if once_ms > 0 else None,
                gpu_busy_pct=run.busy[0], gpu_busy_note=run.busy[1],
                peak_gib=max(run.peaks_bytes) / 2 ** 30 if run.peaks_bytes else None,
                route=route if run.cand.route != "deepspeed" else "deepspeed-no-cb",
                len_mean=stats["mean"], len_p50=stats["p50"], len_p90=stats["p90"], len_max=stats["max"],
                same_tokens=same, after_profile=run.after_profile, stats=call_stats, **common)
    if run.cand.name == "auto":
        slots = call_stats.get("cache.num_slots")
        row.auto_choice = f"{route}" + (f" ({slots} slots)" if slots is not None and route == "continuous" else "")
    return row
