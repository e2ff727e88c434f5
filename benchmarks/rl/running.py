"""Running a cell's candidates: a callable per candidate, its timed calls through the harness's rounds, what each
call measured (wall, peak memory, realised lengths, ``CallStats``), one profiled call for the GPU-busy column."""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from benchmarks.harness.device import release_memory
from benchmarks.harness.models import upstream_rollout
from benchmarks.harness.rounds import Rounds, run_rounds
from benchmarks.rl import busy
from benchmarks.rl.cells import EOS_ID, PAD_ID, SAMPLING_SEED, SCALE_DIVISORS, Candidate, CellSpec, row_budgets
from benchmarks.rl.figures import response_lengths
from instrumentation.roofline import ModelGeometry, Rates
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer

UPSTREAM_WARMUP_TOKENS = 16
"""New tokens of DeepSpeed's warm-up call: it runs every row to the budget (no EOS stop), ~30 ms a step at 256
rows, so a full-length warm-up of a 1,024-token cell alone took minutes; its timed calls keep the full budget."""


@dataclass
class Bench:
    """Everything a cell needs: the model, its figures, the options."""

    model: object
    model_name: str
    device: str
    dtype: torch.dtype
    geometry: ModelGeometry
    rates: Rates
    args: argparse.Namespace
    source: str
    scales: dict = field(default_factory=dict)
    upstream: dict = field(default_factory=dict)
    busy: Optional[busy.BusyOptions] = None
    """One profiled call per candidate for the GPU-busy column (CUDA and ``--busy on``), or None."""

    def cell(self, spec: CellSpec) -> CellSpec:
        cell = spec.scaled(SCALE_DIVISORS[self.args.scale])
        if self.args.max_prompts and cell.num_prompts > self.args.max_prompts:
            cell = dataclasses.replace(cell, num_prompts=self.args.max_prompts)
        return cell

    def tokenizer(self, eos: bool) -> TinyTokenizer:
        return TinyTokenizer(pad_token_id=PAD_ID, eos_token_id=EOS_ID if eos else None,
                             vocab_size=self.model.config.vocab_size)

    def rounds(self, cell: CellSpec) -> Rounds:
        """``--repeats`` rounds; on sampled cells round ``r`` draws seed ``SAMPLING_SEED + r % --seeds``."""
        seeds = self.args.seeds if cell.temperature > 0 else 1
        return Rounds(self.args.repeats, seeds=seeds, base_seed=SAMPLING_SEED)


@dataclass
class CandidateRun:
    """A candidate's callable and what its calls measured."""

    cand: Candidate
    call: Optional[Callable]
    """``call(seed)`` -> a ``RolloutBatch``."""
    rollout: Optional[object]
    warm: Optional[Callable] = None
    """The warm-up call, where it is not ``call`` (DeepSpeed: a short one, see :func:`_upstream_call`)."""
    walls_ms: list = field(default_factory=list)
    peaks_bytes: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    last_batch: Optional[object] = None
    stats: dict = field(default_factory=dict)
    error: Optional[str] = None
    busy: tuple = (None, "n/a")
    after_profile: bool = False
    peak_includes_others: bool = False


def _held(rollout) -> int:
    held = getattr(rollout, "held_bytes", 0) if rollout is not None else 0
    return held if isinstance(held, int) else 0


def scalar_stats(stats) -> dict:
    """The scalar fields of ``Rollout.last_stats`` by dotted name (``CallStats.flat()``)."""
    if stats is None:
        return {}
    return {k: v for k, v in stats.flat().items() if isinstance(v, (int, float, str, bool)) or v is None}


def measure(run: CandidateRun, others: list[CandidateRun], device: str, record: bool, seed: int) -> None:
    """One call of ``run`` drawing with ``seed`` (wall, peak, lengths, last_stats when ``record``); errors other
    than running out of memory are recorded on the candidate, which then sits out the remaining rounds."""
    if run.error is not None:
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        batch = (run.warm if not record and run.warm is not None else run.call)(seed)
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1000.0
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # recorded, not hidden
        run.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if not record:
        return
    run.walls_ms.append(wall_ms)
    if cuda:  # minus what the other candidates' Rollout objects keep (the continuous variants share one)
        kept = [o.rollout for o in others if o.rollout is not None and o.rollout is not run.rollout]
        run.peak_includes_others = run.peak_includes_others or any(not hasattr(r, "held_bytes") for r in kept)
        held = {id(r): _held(r) for r in kept}
        run.peaks_bytes.append(torch.cuda.max_memory_allocated() - sum(held.values()))
    run.lengths.append(response_lengths(batch))
    run.last_batch = batch
    if run.rollout is not None:
        run.stats = scalar_stats(getattr(run.rollout, "last_stats", None))


def run_interleaved(runs: list[CandidateRun], device: str, rounds: Rounds, profiling: Optional[busy.BusyOptions] = None,
                    cell: str = "") -> None:
    """The harness's rounds over ``runs``: the warm-up (every seed of the rounds once per candidate: a seed's rows
    end at other steps, so its calls compact into batch buckets, and compile or capture pieces, that another seed's
    did not; timed first, that work went to the first candidate of a sequential cell: 4,039 against 3,888 ms for
    the same tokens), then the timed rounds (A B C, C B A, ...), then with ``profiling`` one profiled call each,
    after every timed call."""
    for run in runs:
        run.after_profile = busy.PROFILED["any"]
    run_rounds(runs, rounds, lambda run, seed, timed: measure(run, [o for o in runs if o is not run], device,
                                                                  record=timed, seed=seed))
    if profiling is None:
        return
    for run in runs:
        if run.error is None and run.walls_ms:
            path = busy.trace_file(profiling.trace_dir, cell, run.cand.name)
            run.busy = busy.profile_busy(lambda: run.call(rounds.seed(0)), device, profiling, path)


def release(runs: list[CandidateRun], device: str) -> None:
    """Shut the candidates' ``Rollout`` objects down (KV caches, graphs) and drop their callables."""
    for run in runs:
        if run.rollout is not None:
            run.rollout.shutdown()
        run.rollout = None
        run.call = None
    release_memory(device)


def rollout_for(bench: Bench, cand: Candidate, tok) -> Rollout:
    settings = {"route": cand.route, **dict(cand.config)}
    if cand.max_cache_gib is not None:
        settings["max_cache_gib"] = cand.max_cache_gib
    return Rollout(bench.model, tok, RolloutConfig().with_settings(settings))


def sampling_for(cell: CellSpec, slots: Optional[int], seed: int = SAMPLING_SEED) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=cell.budget, temperature=cell.temperature, top_p=cell.top_p,
                          n_samples_per_prompt=cell.n, continuous_batch_size=slots,
                          seed=seed if cell.temperature > 0 else None)


def make_runs(bench: Bench, cell: CellSpec, cands: list[Candidate], prompts: tuple, shared: bool) -> list[CandidateRun]:
    """A callable per candidate over ``prompts`` (``(ids, mask)``); ``shared``: the continuous slot variants share
    one ``Rollout``."""
    tok = bench.tokenizer(cell.eos)
    budgets = row_budgets(cell)
    request = RolloutRequest(*prompts, row_max_new_tokens=None if budgets is None else budgets.to(prompts[0].device))
    cache: dict = {}
    runs = []
    for cand in cands:
        if cand.route == "deepspeed":
            try:
                runs.append(CandidateRun(cand, _upstream_call(bench, cell, prompts), None,
                                         warm=_upstream_call(bench, cell, prompts, UPSTREAM_WARMUP_TOKENS)))
            except Exception as exc:  # e.g. deepspeed not installed: the row says so, the cell goes on
                runs.append(CandidateRun(cand, None, None, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        key = (cand.route, cand.max_cache_gib, cand.config) if shared else cand.name
        if key not in cache:
            cache[key] = rollout_for(bench, cand, tok)
        ro = cache[key]
        runs.append(CandidateRun(cand, (lambda seed, ro=ro, slots=cand.slots:
                                        ro.generate(request, sampling_for(cell, slots, seed))), ro))
    return runs


def _upstream_call(bench: Bench, cell: CellSpec, prompts: tuple, budget: Optional[int] = None) -> Callable:
    """A DeepSpeed no-CB call of the cell (``budget``: fewer new tokens, for its warm-up)."""
    from deepspeed.runtime.rollout import RolloutRequest as UpRequest
    from deepspeed.runtime.rollout import SamplingConfig as UpSampling

    if cell.eos not in bench.upstream:
        bench.upstream[cell.eos] = upstream_rollout(bench.model, bench.tokenizer(cell.eos))
    up = bench.upstream[cell.eos]
    sampling = UpSampling(max_new_tokens=min(budget or cell.budget, cell.budget), temperature=cell.temperature,
                          top_p=cell.top_p, n_samples_per_prompt=cell.n)

    def call(seed):
        torch.manual_seed(seed)  # no seed field upstream: the global RNG
        return up.generate(UpRequest(*prompts), sampling)

    return call


def kept_bytes_estimate(bench: Bench, cell: CellSpec, cands: list[Candidate], width: int) -> int:
    """What the candidates' ``Rollout`` objects keep between calls (KV caches): the ordinary route rows x (T_p +
    budget), the continuous route (one object for all slot counts) its largest slots x capacity, doubled when
    slots < rows (room for refills)."""
    kv, cols = bench.geometry.kv_bytes_per_token, width + cell.budget
    per_route: dict = {}
    for cand in cands:
        if cand.route == "deepspeed":
            continue
        slots = min(cand.slots or cell.rows, cell.rows)
        need = slots * cols * (2 if slots < cell.rows else 1) * kv
        key = ("continuous", cand.config) if cand.route == "continuous" else cand.name
        per_route[key] = max(per_route.get(key, 0), need)
    return sum(per_route.values())


def to_cpu(batch):
    return type(batch)(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.response_start_idx.cpu())


def run_sequential(bench: Bench, cell: CellSpec, cands: list[Candidate], prompts: tuple) -> list[CandidateRun]:
    """Each candidate alone (warm-up, rounds, profiled call), released before the next."""
    done = []
    for cand in cands:
        (run,) = make_runs(bench, cell, [cand], prompts, shared=False)
        try:
            run_interleaved([run], bench.device, bench.rounds(cell), bench.busy, cell.name)
        except torch.cuda.OutOfMemoryError as exc:
            run.error = f"OutOfMemoryError: {exc}"[:300]
        if run.last_batch is not None:
            run.last_batch = to_cpu(run.last_batch)
        release([run], bench.device)
        done.append(run)
    return done
