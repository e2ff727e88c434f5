#!/usr/bin/env python
"""RL-scale rollout benchmark (issue 15, item 1): ``scripts/bench_rollout.py --suite rl``.

Wide batches, long-tailed response lengths, sampling, a KV budget and a long context, on the random
Qwen2.5-3B-shaped model (``--model 3b``, bf16, CUDA) or the tiny model (``--model tiny``, CPU). Uses
only the public API (``rollout.Rollout`` & co., ``rollout.testing``, ``Rollout.last_stats`` read with
``.get``), so the same file runs on commit 80a6322 and on later code; features that old commits lack
(``RolloutConfig.max_cache_gib``) are detected, not assumed.

  python scripts/bench_rollout.py --suite rl --model 3b --cells wide-greedy,wide-sampled --json a.json
  python scripts/bench_rollout.py --suite rl --model 3b --calibrate-only --eos-scales scales.json
  python scripts/bench_rollout.py --suite rl --merge a.json b.json
  python scripts/bench_rl.py --model tiny --scale small            # the whole suite on a CPU, ~2 min

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
  7 capped               longtail-128-1024 under a KV budget allowing 128 slots (``max_cache_gib`` where
                         RolloutConfig has it, else emulated with ``continuous_batch_size=128``)
  8 longctx              8 prompts x n=4 = 32 rows, prompt 8192, 1024 new, T=1, EOS off
  9 longtail-64-1024-top-p  as 3 with top-p 0.9 (3's EOS scale, so its mean length is not calibrated to 100):
                         the nucleus sampler at the few rows of a long tail

EOS on the random model: the tokenizer gets EOS id 2 and the EOS row of the output embedding (tied with the
input embedding on the 3B shape) is multiplied in place by a scale found by a short calibration (a geometric
search over a few rows) so the mean response length hits the target; the scale is restored exactly after the
cell (a saved copy of the row). Found scales (and the peaked cell's norm factor) are cached in
``--eos-scales FILE`` (read if present, written if not) so later runs, old code and new, use identical weights.
``--scale small`` divides prompt lengths, budgets and target means by 16 (rows unchanged).

Candidates, per cell, interleaved (A B C C B A ...) after one warm-up call each: ``auto`` (default
``RolloutConfig`` but ``route="auto"``), ``ordinary``, ``continuous-S`` for S in {rows, rows/2, rows/4}
(duplicates and S < n skipped; ``--candidates`` selects by ``auto``, ``ordinary``, ``continuous``,
``continuous/1|2|4`` or ``continuous-S``) and, with ``--upstream``, DeepSpeed 0.19.8's ``HybridEngineRollout``
without continuous batching (``deepspeed``) on cells whose estimated call time is under ``--upstream-cap-s``
(it ignores EOS while generating, so it always runs to the budget; it runs on the same model object and so
sees the same scaled weights). When the kept KV caches of all candidates would not fit the free GPU memory
(or a call runs out of memory), the cell runs its candidates one after another instead, each released before
the next; the row's note says so.

Columns
-------
- tok/s: sum of realised response lengths (the output attention mask after ``response_start_idx``) / wall.
- wall ms: mean over ``--repeats`` timed calls (min-max too), CUDA synchronised around each call. The calls of a
  sampled cell draw from one seed, so they draw the same tokens; ``--seeds K`` gives timed round ``r`` the seed
  ``SAMPLING_SEED + r % K`` (every candidate of a round the same one), so that means over the rounds average the
  realised lengths out (with K > 1 the lengths columns are over all timed calls).
- roofline ms, x roof: see :func:`call_roofline_s`; each call's own realised lengths; x roof = wall / roofline.
- GPU busy: union of the kernel / memcpy / memset intervals of one extra profiled call (torch.profiler, CUDA
  activity; after every timed call of the cell) / that call's own wall (both under the profiler: against the
  timed wall, traced kernels' longer durations gave up to 125% on the H200). ``n/a (skipped)`` above
  ``--busy-max-events`` events. ``after_profile``: the row's timed calls followed a profiled call of this
  process (CUPTI callbacks may linger; ``--cupti-teardown`` sets ``TEARDOWN_CUPTI=1``, ``--busy off`` skips).
- peak GiB: ``torch.cuda.max_memory_allocated`` over the call (reset before), minus what the other candidates'
  ``Rollout`` objects hold between calls (``held_bytes``), i.e. the peak had this candidate run alone.
- route / decode / prefill: ``last_stats`` of the call (what actually ran).
- lengths: realised response lengths, mean / p50 / p90 / max (nearest rank).
- Auto's choice (the route Auto ran) and Auto / best, best = the fastest of ordinary and the continuous slot
  variants that ran; vs DS = wall / DeepSpeed's wall in the same cell; same tok = identical ``input_ids`` to
  the ordinary candidate's (or the first that ran).

Expected wall time per cell on an H200 (3B, bf16, defaults: warm-up + 2 repeats + 1 profiled call per
candidate, all candidates; estimated from the figures of issue 15, not measured; first cell of a process adds
~1 min of compilation and graph capture):
  wide-greedy ~1.5 min, wide-sampled ~2, wide-sampled-peaked ~2, longtail-64-1024 ~3, longtail-128-1024 ~6,
  longtail-64-2048 ~8.5 (shard: auto,ordinary | continuous), longtail-128-2048 ~15 (shard in 3-4),
  capped ~2.5, longctx ~3.5; EOS calibration (``--calibrate-only``) ~3 min. ``--repeats 1 --busy off``
  halves each. docs/results/README-rl.md has the table and the shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig  # noqa: E402
from rollout.testing import TinyTokenizer  # noqa: E402
from scripts.bench_rollout import build_model, copy_bandwidth_gbps, round_order, upstream_rollout, weight_bytes  # noqa: E402

EOS_ID = 2
PAD_ID = 0
SAMPLING_SEED = 1234
UPSTREAM_WARMUP_TOKENS = 16
"""New tokens of DeepSpeed's warm-up call: it runs every row to the budget (no EOS stop), ~30 ms a step at 256
rows, so a full-length warm-up of a 1,024-token cell alone took minutes; its timed calls keep the full budget."""
SCALE_DIVISORS = {"full": 1, "small": 16}
#: Rows x columns of the calibration probes: the first CALIB_PROMPTS prompts of the long-tail family.
CALIB_PROMPTS = 32
#: DeepSpeed 0.19.8 no-CB, 3B on an H200 (issue 15: 3.82 s for 256 rows x 128 new): seconds per decode step.
UPSTREAM_STEP_S = (0.025, 2e-5)  # fixed + per row
GPU_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Set once a profiled call has run in this process: Kineto may leave CUPTI callbacks installed afterwards
#: (pytorch/pytorch#144455), so later timed calls say so in their row (``after_profile``).
_PROFILED = {"any": False}


# ---- cells and candidates -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CellSpec:
    """One workload of the suite (lengths at full scale; :meth:`scaled` divides them)."""

    name: str
    num_prompts: int
    """Distinct prompts; rows = num_prompts x n."""
    n: int
    """Samples per prompt."""
    prompt_lens: tuple[int, int]
    """Real prompt tokens, drawn uniformly from [lo, hi] (equal ends: every prompt that long)."""
    budget: int
    """``max_new_tokens``."""
    temperature: float
    """0: greedy."""
    top_p: float = 1.0
    mean_target: Optional[int] = None
    """Target mean response length under EOS emulation (None: EOS off, every row runs to the budget)."""
    peaked: bool = False
    """Scale the final norm weight so the median top-p nucleus is <= ``--nucleus-target`` tokens."""
    cap_slots: Optional[int] = None
    """A KV budget that allows this many slots (the capped cell)."""
    family: str = ""
    """Cells of one family share their prompts (same seed)."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.n < 1:
            raise ValueError(f"num_prompts/n: must be >= 1; got {self.num_prompts}/{self.n}")
        if not 1 <= self.prompt_lens[0] <= self.prompt_lens[1]:
            raise ValueError(f"prompt_lens: must be 1 <= lo <= hi; got {self.prompt_lens}")
        if self.budget < 1:
            raise ValueError(f"budget: must be >= 1; got {self.budget}")

    @property
    def rows(self) -> int:
        return self.num_prompts * self.n

    @property
    def eos(self) -> bool:
        return self.mean_target is not None

    def scaled(self, divisor: int) -> "CellSpec":
        if divisor == 1:
            return self
        lo, hi = (max(2, v // divisor) for v in self.prompt_lens)
        mean = None if self.mean_target is None else max(2, round(self.mean_target / divisor))
        return dataclasses.replace(self, prompt_lens=(lo, hi), budget=max(4, self.budget // divisor), mean_target=mean)

    def sampling_label(self) -> str:
        if self.temperature <= 0:
            return "greedy"
        return f"T={self.temperature:g}" + (f" top_p={self.top_p:g}" if self.top_p < 1 else "")


CELLS = (
    CellSpec("wide-greedy", 64, 4, (256, 256), 256, 0.0, family="wide"),
    CellSpec("wide-sampled", 64, 4, (256, 256), 256, 1.0, 0.9, family="wide"),
    CellSpec("wide-sampled-peaked", 64, 4, (256, 256), 256, 1.0, 0.9, peaked=True, family="wide"),
    CellSpec("longtail-64-1024", 64, 4, (128, 1024), 1024, 1.0, mean_target=100, family="longtail"),
    CellSpec("longtail-128-1024", 128, 4, (128, 1024), 1024, 1.0, mean_target=100, family="longtail"),
    CellSpec("longtail-64-2048", 64, 4, (128, 1024), 2048, 1.0, mean_target=300, family="longtail"),
    CellSpec("longtail-128-2048", 128, 4, (128, 1024), 2048, 1.0, mean_target=300, family="longtail"),
    CellSpec("capped", 128, 4, (128, 1024), 1024, 1.0, mean_target=100, cap_slots=128, family="longtail"),
    CellSpec("longctx", 8, 4, (8192, 8192), 1024, 1.0, family="longctx"),
    CellSpec("longtail-64-1024-top-p", 64, 4, (128, 1024), 1024, 1.0, 0.9, mean_target=100, family="longtail"),
)
FAMILY_SEEDS = {"wide": 11, "longtail": 12, "longctx": 13}


@dataclass(frozen=True)
class Candidate:
    """One way to run a cell."""

    name: str
    route: str
    """``RolloutConfig.route``, or ``"deepspeed"``."""
    slots: Optional[int] = None
    """``SamplingConfig.continuous_batch_size``."""
    max_cache_gib: Optional[float] = None
    """Passed to ``RolloutConfig`` (only where the field exists)."""
    note: str = ""
    config: tuple = ()
    """Further ``RolloutConfig`` fields, ``((name, value), ...)`` (``--sampler-ab``: ``fused_sampler=False``)."""


def cap_gib_for_slots(slots: int, longest_prompt: int, budget: int, kv_bytes_per_token: int) -> float:
    """A KV budget (GiB) that allows ``slots`` continuous-batching slots and no more: each slot holds the
    continuous route's capacity with refills, 2 x (longest prompt + budget - 1) columns rounded up to 64 (the
    rule of 80a6322's ``cb_route.default_capacity`` and of the restructured ``plan.layout``), plus half a
    slot of headroom against rounding in the GiB -> bytes conversion."""
    columns = -(-2 * (longest_prompt + budget - 1) // 64) * 64
    return (slots + 0.5) * columns * kv_bytes_per_token / 2 ** 30


def select_cells(spec: Optional[str]) -> list[CellSpec]:
    """Cells by name or index (``"0,2"``, ``"3-6"``, ``"capped,longctx"``); all when empty."""
    if not spec:
        return list(CELLS)
    names = [c.name for c in CELLS]
    chosen: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in names:
            chosen.append(names.index(part))
            continue
        lo, _, hi = part.partition("-")
        if not (lo.isdigit() and (hi == "" or hi.isdigit())):
            raise ValueError(f"--cells: unknown cell {part!r}; names: {', '.join(names)} (or indices 0-{len(names) - 1})")
        for index in range(int(lo), int(hi or lo) + 1):
            if index >= len(CELLS):
                raise ValueError(f"--cells: index {index} out of range 0-{len(CELLS) - 1}")
            chosen.append(index)
    return [CELLS[i] for i in dict.fromkeys(chosen)]


def slot_variants(rows: int, n: int, cap_slots: Optional[int]) -> list[tuple[int, int]]:
    """``(divisor, slots)`` for slots in {rows, rows/2, rows/4}: no duplicates, none below ``n`` (a prompt's
    samples are admitted together), none above ``cap_slots``."""
    out: list[tuple[int, int]] = []
    for divisor in (1, 2, 4):
        slots = rows // divisor
        if slots < n or (cap_slots is not None and slots > cap_slots) or any(s == slots for _, s in out):
            continue
        out.append((divisor, slots))
    return out


def _selected(name: str, divisor: Optional[int], selectors: Optional[set[str]]) -> bool:
    if selectors is None:
        return name != "deepspeed"
    if name in selectors:
        return True
    return divisor is not None and ("continuous" in selectors or f"continuous/{divisor}" in selectors)


def plan_candidates(cell: CellSpec, selectors: Optional[set[str]], has_cap_field: bool,
                    cap_gib: Optional[float], upstream: bool, sampler_ab: bool = False,
                    twins: tuple = ()) -> list[Candidate]:
    """The candidates of a cell, in interleaving order (DeepSpeed last); ``sampler_ab``: on top-p cells, a
    twin of each with ``fused_sampler=False`` (the sampler A/B in one process); ``twins``: one ``((field,
    value), ...)`` per twin, a twin of each candidate with those ``RolloutConfig`` fields set (an A/B of any
    switches)."""
    capped = cell.cap_slots is not None
    cap = cap_gib if capped and has_cap_field else None
    out = []
    if _selected("auto", None, selectors):
        if capped and not has_cap_field:
            out.append(Candidate("auto", "auto", slots=cell.cap_slots,
                                 note=f"cap emulated: continuous_batch_size={cell.cap_slots} (no max_cache_gib)"))
        else:
            out.append(Candidate("auto", "auto", max_cache_gib=cap,
                                 note=f"max_cache_gib={cap:.4g}" if cap is not None else ""))
    if _selected("ordinary", None, selectors) and not capped:
        out.append(Candidate("ordinary", "ordinary"))
    for divisor, slots in slot_variants(cell.rows, cell.n, cell.cap_slots):
        name = f"continuous-{slots}"
        if _selected(name, divisor, selectors):
            out.append(Candidate(name, "continuous", slots=slots, max_cache_gib=cap,
                                 note=f"max_cache_gib={cap:.4g}" if cap is not None else ""))
    base = list(out)
    if sampler_ab and cell.temperature > 0 and cell.top_p < 1:  # each with the compiled search instead
        out += [dataclasses.replace(c, name=f"{c.name} +search", config=(("fused_sampler", False),)) for c in base]
    for fields in twins:
        label = ",".join(f"{name}={value}" for name, value in fields)
        out += [dataclasses.replace(c, name=f"{c.name} {label}", config=tuple(fields)) for c in base]
    if upstream and not capped and (selectors is None or "deepspeed" in selectors):
        out.append(Candidate("deepspeed", "deepspeed"))  # (it has no KV budget: not in the capped cell)
    return out


# ---- pure figures: roofline, lengths, GPU busy ----------------------------------------------------------
@dataclass(frozen=True)
class ModelGeometry:
    """What the roofline needs of a model, as plain ints."""

    weight_bytes: int
    """Bytes of all weights (tied matrices once)."""
    kv_bytes_per_token: int
    """K + V of one token over all layers: 2 * layers * kv_heads * head_dim * element size."""
    nonembedding_params: int
    """Parameters other than the input embedding and the output embedding (lm_head)."""
    lm_head_params: int
    """vocab x hidden."""
    attn_flops_per_key: int
    """4 * layers * q_heads * head_dim: QK^T and PV FLOPs of one query against one key."""


def decode_roofline_s(prompt_lens: list[int], response_lens: list[int], geo: ModelGeometry,
                      bw_bytes_s: float, flops_s: float) -> float:
    """Sum over decode steps t = 1 .. max(L) - 1 of max(bytes_t / BW, flops_t / F).

    Row r (real prompt tokens P_r, realised response length L_r) is live at step t iff L_r > t (the first
    response token comes from the prefill's logits; step t produces token t + 1); its current length is
    P_r + t. bytes_t = weight_bytes + kv_bytes_per_token * sum over live rows of (P_r + t);
    flops_t = sum over live rows of [2 * (nonembedding_params + lm_head_params) + attn_flops_per_key * (P_r + t)].
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens/response_lens: lengths differ ({len(prompt_lens)} vs {len(response_lens)})")
    if not response_lens:
        return 0.0
    order = sorted(range(len(response_lens)), key=lambda i: response_lens[i])
    lens = [response_lens[i] for i in order]
    prompts = [prompt_lens[i] for i in order]
    dense = 2 * (geo.nonembedding_params + geo.lm_head_params)
    live, live_prompt, first = len(lens), sum(prompts), 0
    total = 0.0
    for t in range(1, lens[-1]):
        while first < len(lens) and lens[first] <= t:  # rows that ended before step t leave
            live -= 1
            live_prompt -= prompts[first]
            first += 1
        context = live_prompt + live * t
        step_bytes = geo.weight_bytes + geo.kv_bytes_per_token * context
        step_flops = live * dense + geo.attn_flops_per_key * context
        total += max(step_bytes / bw_bytes_s, step_flops / flops_s)
    return total


def prefill_roofline_s(unique_prompt_lens: list[int], geo: ModelGeometry, bw_bytes_s: float, flops_s: float) -> float:
    """max(weight_bytes / BW, FLOPs / F) over the unique prompts (each prompt once, not once per sample).

    FLOPs = sum over prompts of [2 * nonembedding_params * P + 2 * lm_head_params (one logits row per prompt)
    + attn_flops_per_key * P * (P + 1) / 2 (causal: query i attends i keys)].
    """
    flops = sum(2 * geo.nonembedding_params * p + 2 * geo.lm_head_params + geo.attn_flops_per_key * p * (p + 1) / 2
                for p in unique_prompt_lens)
    return max(geo.weight_bytes / bw_bytes_s, flops / flops_s)


def call_roofline_s(unique_prompt_lens: list[int], n: int, response_lens: list[int], geo: ModelGeometry,
                    bw_bytes_s: float, flops_s: float) -> float:
    """Roofline of one call (issue 15, Definitions): prefill of the unique prompts + every decode step.
    Row i of the output belongs to prompt i // n."""
    expanded = [p for p in unique_prompt_lens for _ in range(n)]
    return (prefill_roofline_s(unique_prompt_lens, geo, bw_bytes_s, flops_s)
            + decode_roofline_s(expanded, response_lens, geo, bw_bytes_s, flops_s))


def length_stats(lengths: list[int]) -> dict:
    """Mean, p50, p90 (nearest rank) and max of realised response lengths."""
    if not lengths:
        return {"mean": None, "p50": None, "p90": None, "max": None}
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"mean": sum(ordered) / len(ordered), "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of ``[start, end]`` intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def busy_percent(intervals: list[tuple[float, float]], wall: float) -> Optional[float]:
    """100 * union of the GPU intervals / wall (same unit)."""
    return None if wall <= 0 else 100.0 * union_length(intervals) / wall


def nucleus_sizes(logits: torch.Tensor, top_p: float) -> list[int]:
    """Tokens kept by top-p filtering per row of ``logits [N, V]``: those whose preceding mass is < top_p."""
    probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
    before = probs.cumsum(dim=-1) - probs
    return (before < top_p).sum(dim=-1).tolist()


def search_scale(probe: Callable[[float], float], target: float, max_probes: int = 12, tolerance: float = 0.1,
                 max_scale: float = 4096.0, lower: Optional[Callable[[float], float]] = None) -> tuple[float, float, list]:
    """Geometric search for s >= 1 with probe(s) ~ target, where probe decreases in s.

    Doubles s from 1 until probe(s) <= target, then bisects geometrically; stops within ``tolerance``
    (relative) or after ``max_probes`` probes. ``lower`` (optional, cheaper, lower(s) <= probe(s), e.g. the
    mean length under a smaller budget) decides the doubling steps where it already exceeds the target; the
    full probe runs only where it does not. Returns (s, probe(s), [(s, value), ...] of the full probes) for
    the full probe closest to the target.
    """
    seen: list[tuple[float, float]] = []
    num_probes = 0

    def run(s: float, fn: Callable[[float], float]) -> float:
        nonlocal num_probes
        num_probes += 1
        value = fn(s)
        if fn is probe:
            seen.append((s, value))
        return value

    def close(value: float) -> bool:
        return abs(value - target) <= tolerance * target

    def above(s: float) -> tuple[bool, float]:
        """Whether probe(s) is clearly above the target (asking ``lower`` first), and the full value if run."""
        if lower is not None and run(s, lower) > target * (1 + tolerance):
            return True, math.nan
        value = run(s, probe)
        return value > target and not close(value), value

    lo, hi = 1.0, None
    is_above, value = above(1.0)
    if is_above:
        s = 2.0
        while num_probes < max_probes and s <= max_scale:
            is_above, value = above(s)
            if not is_above:
                hi = s
                break
            lo, s = s, s * 2
    if hi is not None and not close(value):
        while num_probes < max_probes:
            mid = math.sqrt(lo * hi)
            value = run(mid, probe)
            if close(value):
                break
            lo, hi = (mid, hi) if value > target else (lo, mid)
    if not seen:  # every probe was a lower bound above the target: the largest scale tried is the best known
        seen.append((lo, run(lo, probe)))
    best = min(seen, key=lambda sv: abs(math.log(max(sv[1], 1e-9) / target)))
    return best[0], best[1], seen


def json_safe(value):
    """``value`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ---- rows and tables -----------------------------------------------------------------------------------
@dataclass
class RlRow:
    """One (cell, candidate) result; every column of the table. None: not measured / not applicable."""

    source: str
    cell: str
    candidate: str
    status: str = "ok"
    note: str = ""
    prompts: int = 0
    n: int = 0
    rows: int = 0
    prompt_lens: str = ""
    budget: int = 0
    sampling: str = ""
    slots: Optional[int] = None
    repeats: int = 0
    seeds: int = 1
    """Sampling seeds the timed rounds cycled through (``--seeds``)."""
    response_tokens: Optional[float] = None
    tok_s: Optional[float] = None
    wall_ms: Optional[float] = None
    wall_ms_min: Optional[float] = None
    wall_ms_max: Optional[float] = None
    walls_ms: list = field(default_factory=list)
    """Each timed call's wall ms, in round order."""
    roofline_ms: Optional[float] = None
    prefill_roofline_ms: Optional[float] = None
    x_roofline: Optional[float] = None
    gpu_busy_pct: Optional[float] = None
    gpu_busy_note: str = ""
    peak_gib: Optional[float] = None
    route: Optional[str] = None
    decode_path: Optional[str] = None
    prefill_path: Optional[str] = None
    len_mean: Optional[float] = None
    len_p50: Optional[int] = None
    len_p90: Optional[int] = None
    len_max: Optional[int] = None
    auto_choice: Optional[str] = None
    auto_vs_best: Optional[float] = None
    best_candidate: Optional[str] = None
    auto_vs_best_roofline: Optional[float] = None
    """Auto's roofline ratio over the lowest of the routes' (each from its own realised lengths): sampled tokens
    differ between batch shapes in bf16, so one route may draw a longer row than another, which wall time counts
    against it and the ratio does not."""
    best_roofline_candidate: Optional[str] = None
    vs_deepspeed: Optional[float] = None
    same_tokens: Optional[bool] = None
    after_profile: Optional[bool] = None
    """The timed calls ran after a profiled call of this process (CUPTI callbacks may linger: pass
    ``--cupti-teardown``, or ``--busy off`` for untouched timings)."""
    eos_scale: Optional[float] = None
    norm_factor: Optional[float] = None
    nucleus_median: Optional[float] = None
    stats: dict = field(default_factory=dict)
    """Other ``last_stats`` entries of the last timed call (scalars only)."""


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(RlRow))


def derive(rows: list[RlRow]) -> None:
    """Fill Auto / best (by wall time and by roofline ratio), the best candidates and vs DeepSpeed within each
    (source, cell)."""
    groups: dict[tuple, list[RlRow]] = {}
    for r in rows:
        groups.setdefault((r.source, r.cell), []).append(r)
    for group in groups.values():
        timed = [r for r in group if r.status == "ok" and r.wall_ms is not None]
        routes = [r for r in timed if r.candidate == "ordinary" or r.candidate.startswith("continuous")]
        best = min(routes, key=lambda r: r.wall_ms, default=None)
        ratios = [r for r in routes if r.x_roofline is not None]
        best_ratio = min(ratios, key=lambda r: r.x_roofline, default=None)
        upstream = next((r for r in timed if r.candidate == "deepspeed"), None)
        for r in group:
            r.vs_deepspeed = (r.wall_ms / upstream.wall_ms if upstream is not None and r is not upstream
                              and r.wall_ms is not None else None)
            if r.candidate == "auto":
                r.best_candidate = best.candidate if best is not None else None
                r.auto_vs_best = (r.wall_ms / best.wall_ms if best is not None and r.wall_ms is not None else None)
                r.best_roofline_candidate = best_ratio.candidate if best_ratio is not None else None
                r.auto_vs_best_roofline = (r.x_roofline / best_ratio.x_roofline
                                           if best_ratio is not None and r.x_roofline is not None else None)


def _fmt(value, spec: str = ".0f") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


TABLE_HEADER = ("| source | cell | candidate | tok/s | wall ms (min–max) | roofline ms | x roof | GPU busy | peak GiB "
                "| route / decode / prefill | lengths mean/p50/p90/max | Auto's choice | Auto/best | vs DS "
                "| same tok | note |")


def format_table(rows: list[RlRow]) -> str:
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.source} | {r.cell} | {r.candidate} | " + "— | " * 12
                         + "; ".join(t for t in (r.status, r.note) if t) + " |")
            continue
        busy = _fmt(r.gpu_busy_pct, ".0f") + "%" if r.gpu_busy_pct is not None else (r.gpu_busy_note or "n/a")
        wall = f"{_fmt(r.wall_ms)} ({_fmt(r.wall_ms_min)}–{_fmt(r.wall_ms_max)})"
        lengths = f"{_fmt(r.len_mean, '.1f')}/{_fmt(r.len_p50)}/{_fmt(r.len_p90)}/{_fmt(r.len_max)}"
        path = f"{_fmt(r.route)} / {_fmt(r.decode_path)} / {_fmt(r.prefill_path)}"
        auto = (f"{r.auto_choice}" if r.auto_choice else "")
        auto_best = f"{_fmt(r.auto_vs_best, '.3f')} (best {r.best_candidate})" if r.auto_vs_best is not None else ""
        if r.auto_vs_best_roofline is not None:
            auto_best += f"; by x roof {r.auto_vs_best_roofline:.3f} (best {r.best_roofline_candidate})"
        lines.append(f"| {r.source} | {r.cell} | {r.candidate} | {_fmt(r.tok_s)} | {wall} | {_fmt(r.roofline_ms)} "
                     f"| {_fmt(r.x_roofline, '.2f')} | {busy} | {_fmt(r.peak_gib, '.1f')} | {path} | {lengths} "
                     f"| {auto} | {auto_best} | {_fmt(r.vs_deepspeed, '.3f')} | {_fmt(r.same_tokens)} | {r.note} |")
    return "\n".join(lines)


def load_rows(paths: list[str]) -> list[RlRow]:
    """Rows of several ``--json`` files (shards, or runs of different commits), derived columns recomputed."""
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        source = data.get("meta", {}).get("commit") or os.path.basename(path)
        for r in data["rows"]:
            kept = {k: v for k, v in r.items() if k in ROW_FIELDS}
            kept.setdefault("source", source)
            rows.append(RlRow(**kept))
    derive(rows)
    return sort_rows(rows)


def sort_rows(rows: list[RlRow]) -> list[RlRow]:
    """By cell, then candidate (auto, ordinary, continuous by falling slots, the rest, deepspeed); rows of one
    (cell, candidate) keep their order, so several sources (files) sit side by side."""
    cells = [c.name for c in CELLS]

    def order(r: RlRow):
        cell = cells.index(r.cell) if r.cell in cells else len(cells)
        name = r.candidate
        tail = name.rsplit("-", 1)[-1]
        is_slots = name.startswith("continuous-") and tail.isdigit()
        rank = {"auto": 0, "ordinary": 1, "deepspeed": 4}.get(name, 2 if is_slots else 3)
        return cell, rank, -int(tail) if is_slots else 0, name

    return sorted(rows, key=order)


def write_json(path: str, meta: dict, rows: list[RlRow]) -> None:
    payload = json_safe({"meta": meta, "rows": [asdict(r) for r in rows]})
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, allow_nan=False)
    os.replace(tmp, path)


# ---- device measurements -------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_rates(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, GEMM TFLOP/s): on CUDA the 1 GiB copy of bench_rollout and
    an 8192^3 matmul in ``dtype`` (median of 10 after 3 warm-ups, CUDA events); on a CPU small stand-ins."""
    if device.startswith("cuda"):
        bw = copy_bandwidth_gbps(device)
        a = torch.randn(8192, 8192, device=device, dtype=dtype)
        b = torch.randn(8192, 8192, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        del a, b
        torch.cuda.empty_cache()  # the cells' memory decisions read the free memory
        return bw, 2 * 8192 ** 3 / statistics.median(times) / 1e12
    x = torch.empty(1 << 23, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        copies.append(time.perf_counter() - t0)
    a = torch.randn(512, 512, dtype=dtype)
    a @ a
    gemms = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ a
        gemms.append(time.perf_counter() - t0)
    return 2 * x.numel() * 4 / statistics.median(copies) / 1e9, 2 * 512 ** 3 / statistics.median(gemms) / 1e12


def model_geometry(model) -> ModelGeometry:
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    params = {id(p): p for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    element = next(model.parameters()).element_size()
    total = sum(p.numel() for p in params.values())
    nonembedding = total - embed.numel() - (0 if head is embed else head.numel())
    return ModelGeometry(
        weight_bytes=weight_bytes(model),
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element,
        nonembedding_params=nonembedding, lm_head_params=head.numel(),
        attn_flops_per_key=4 * cfg.num_hidden_layers * heads * head_dim)


def make_prompts(cell: CellSpec, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Distinct random left-padded prompts of the cell's family (token ids avoid pad/bos/eos): ids, mask,
    real lengths. Cells of one family draw from the same seed, so a 64-prompt cell's prompts are the first 64
    of the 128-prompt cell's."""
    gen = torch.Generator().manual_seed(FAMILY_SEEDS.get(cell.family, 0))
    lo, hi = cell.prompt_lens
    lengths = torch.randint(lo, hi + 1, (128,), generator=gen).tolist()
    tokens = torch.randint(3, vocab, (128, hi), generator=gen)
    while len(lengths) < cell.num_prompts:  # families larger than 128 prompts (not in CELLS)
        lengths += torch.randint(lo, hi + 1, (128,), generator=gen).tolist()
        tokens = torch.cat([tokens, torch.randint(3, vocab, (128, hi), generator=gen)])
    lengths = lengths[:cell.num_prompts]
    width = max(lengths)
    ids = torch.full((cell.num_prompts, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = tokens[row, :length]
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device), lengths


def response_lengths(batch) -> list[int]:
    """Realised response lengths of a ``RolloutBatch``: the attention mask after ``response_start_idx``."""
    start = int(batch.response_start_idx[0])
    return batch.attention_mask[:, start:].ne(0).sum(dim=1).tolist()


class scaled_weights:
    """Multiply the EOS row of the output embedding and / or the final norm weight in place for a cell;
    restore the saved originals (exactly) after it."""

    def __init__(self, model, eos_scale: Optional[float], norm_factor: Optional[float]):
        self.targets = []
        if eos_scale is not None and eos_scale != 1.0:
            self.targets.append((model.get_output_embeddings().weight[EOS_ID], eos_scale))
        if norm_factor is not None and norm_factor != 1.0:
            self.targets.append((final_norm(model).weight, norm_factor))
        self.saved = []

    def __enter__(self):
        with torch.no_grad():
            for tensor, factor in self.targets:
                self.saved.append(tensor.detach().clone())
                tensor.mul_(factor)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for (tensor, _), original in zip(self.targets, self.saved):
                tensor.copy_(original)
        self.saved = []
        return False


def final_norm(model):
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError("model: no final norm at model.model.norm (needed by the peaked cell)")
    return norm


def gpu_intervals(prof, max_events: int, trace_path: Optional[str] = None) -> tuple[Optional[list[tuple[float, float]]], str]:
    """Kernel / memcpy / memset intervals (ns) of a finished torch.profiler session, or (None, why).
    ``trace_path``: write the session's Chrome trace there (a session saves its trace once) and read it back."""
    if trace_path:
        prof.export_chrome_trace(trace_path)
        return _chrome_intervals(trace_path, max_events)
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    # torch 2.11's _KinetoEvent has no activity_type() (2.13's has): read the Chrome trace there instead
    if results is not None and hasattr(torch._C._autograd._KinetoEvent, "activity_type"):
        events = results.events()
        if len(events) > max_events:
            return None, f"n/a (skipped: {len(events)} events > {max_events})"
        out = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.activity_type() in GPU_EVENT_KINDS]
        return out, ""
    with tempfile.TemporaryDirectory() as tmp:  # other torch versions: through the Chrome trace
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return _chrome_intervals(path, max_events)


def _chrome_intervals(path: str, max_events: int) -> tuple[Optional[list[tuple[float, float]]], str]:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    if len(events) > max_events:
        return None, f"n/a (skipped: {len(events)} events > {max_events})"
    return [(e["ts"] * 1e3, (e["ts"] + e.get("dur", 0)) * 1e3) for e in events if e.get("cat") in GPU_EVENT_KINDS], ""


# ---- one candidate's calls -----------------------------------------------------------------------------
@dataclass
class CandidateRun:
    """A candidate's callable and what its calls measured."""

    cand: Candidate
    call: Callable
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


def measure(run: CandidateRun, others: list[CandidateRun], device: str, record: bool,
            seed: Optional[int] = None) -> None:
    """One call of ``run`` (wall, peak, lengths, last_stats; ``seed``: passed to the call, which draws with it
    instead of ``SAMPLING_SEED``); errors other than running out of memory are recorded on the candidate, which then
    sits out the remaining rounds."""
    if run.error is not None:
        return
    cuda = device.startswith("cuda")
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        call = run.warm if not record and run.warm is not None else run.call
        batch = call() if seed is None else call(seed)
        sync(device)
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


def scalar_stats(stats) -> dict:
    """The scalar entries of ``Rollout.last_stats``, read with ``.get`` (a dict on 80a6322, a typed record with
    ``keys()`` / ``get()`` later)."""
    if stats is None:
        return {}
    keys = list(stats.keys()) if hasattr(stats, "keys") else []
    values = {k: stats.get(k) for k in keys}
    return {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool)) or v is None}


def profile_busy(run: CandidateRun, device: str, max_events: int, teardown: bool = False,
                 trace_path: Optional[str] = None) -> None:
    """GPU-busy % of one extra profiled call: its GPU activity over its own wall. ``trace_path``: also record
    the host (with our stage ranges when ``OPSD_PROFILE`` is on) and write the call's Chrome trace there."""
    if run.error is not None or not run.walls_ms:
        return
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.startswith("cuda") else ProfilerActivity.CPU  # CPU: no GPU events
    sync(device)
    try:
        _PROFILED["any"] = True
        activities = [activity] + ([ProfilerActivity.CPU] if trace_path and activity != ProfilerActivity.CPU else [])
        prof = profile(activities=activities)
        if teardown:  # before start and stop: torch resets it where it thinks graphs and teardown clash
            os.environ["TEARDOWN_CUPTI"] = "1"
        with prof:
            start = time.perf_counter_ns()
            run.call()
            sync(device)
            wall_ns = time.perf_counter_ns() - start
            if teardown:
                os.environ["TEARDOWN_CUPTI"] = "1"
        intervals, why = gpu_intervals(prof, max_events, trace_path)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # the busy column is lost, not the row
        run.busy = (None, f"n/a (profiler: {type(exc).__name__}: {exc})"[:200])
        return
    if intervals is None:
        run.busy = (None, why)
    elif not intervals:
        run.busy = (None, "n/a (no GPU events recorded)")
    else:
        run.busy = (busy_percent(intervals, wall_ns), f"{len(intervals)} events, profiled call {wall_ns / 1e6:.0f} ms")


def release(runs: list[CandidateRun], device: str) -> None:
    """Shut the candidates' ``Rollout`` objects down (KV caches, graphs) and drop their callables."""
    for run in runs:
        if run.rollout is not None and hasattr(run.rollout, "shutdown"):
            run.rollout.shutdown()
        run.rollout = None
        run.call = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---- the suite -----------------------------------------------------------------------------------------
@dataclass
class Bench:
    """Everything a cell needs: the model, its figures, the options."""

    model: object
    model_name: str
    device: str
    dtype: torch.dtype
    geometry: ModelGeometry
    bw_bytes_s: float
    flops_s: float
    args: argparse.Namespace
    source: str
    has_cap_field: bool
    scales: dict = field(default_factory=dict)
    upstream: dict = field(default_factory=dict)
    busy_enabled: bool = False
    """One profiled call per candidate for the GPU-busy column (CUDA and ``--busy on``)."""

    def cell(self, spec: CellSpec) -> CellSpec:
        cell = spec.scaled(SCALE_DIVISORS[self.args.scale])
        if self.args.max_prompts and cell.num_prompts > self.args.max_prompts:
            cell = dataclasses.replace(cell, num_prompts=self.args.max_prompts)
        return cell

    def tokenizer(self, eos: bool) -> TinyTokenizer:
        return TinyTokenizer(pad_token_id=PAD_ID, eos_token_id=EOS_ID if eos else None,
                             vocab_size=self.model.config.vocab_size)

    @property
    def key_prefix(self) -> str:
        return scale_key_prefix(self.model_name, self.dtype, self.args.scale)

    def save_scales(self) -> None:
        path = self.args.eos_scales
        if path:
            with open(path, "w") as f:
                json.dump(json_safe(self.scales), f, indent=1, allow_nan=False, sort_keys=True)


def rollout_for(bench: Bench, cand: Candidate, tok) -> Rollout:
    kwargs = {"route": cand.route, **dict(cand.config)}
    if cand.max_cache_gib is not None:
        kwargs["max_cache_gib"] = cand.max_cache_gib
    return Rollout(bench.model, tok, RolloutConfig(**kwargs))


def sampling_for(cell: CellSpec, slots: Optional[int], seed: int = SAMPLING_SEED) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=cell.budget, temperature=cell.temperature, top_p=cell.top_p,
                          n_samples_per_prompt=cell.n, continuous_batch_size=slots,
                          seed=seed if cell.temperature > 0 else None)


def round_seed(round_index: int, seeds: int) -> Optional[int]:
    """The seed of timed round ``round_index`` with ``--seeds seeds`` (None: the calls' own, ``SAMPLING_SEED``)."""
    return None if seeds <= 1 else SAMPLING_SEED + round_index % seeds


def upstream_for(bench: Bench, eos: bool):
    if eos not in bench.upstream:
        bench.upstream[eos] = upstream_rollout(bench.model, bench.tokenizer(eos), bench.device, continuous=False)
    return bench.upstream[eos]


def upstream_estimate_s(cell: CellSpec, prompt_lens: list[int], geo: ModelGeometry) -> float:
    """Estimated seconds of one DeepSpeed no-CB call: it runs every row to the budget (EOS is applied after
    generation), ~25 ms + 0.02 ms per row per step on the 3B shape (issue 15), plus the prefill of every
    expanded row at 300 TFLOP/s."""
    step = UPSTREAM_STEP_S[0] + UPSTREAM_STEP_S[1] * cell.rows
    prefill = 2 * (geo.nonembedding_params + geo.lm_head_params) * sum(prompt_lens) * cell.n / 3e14
    return cell.budget * step + prefill


def make_runs(bench: Bench, cell: CellSpec, cands: list[Candidate], ids, mask, shared: bool) -> list[CandidateRun]:
    """A callable per candidate; ``shared``: the continuous slot variants share one ``Rollout``."""
    tok = bench.tokenizer(cell.eos)
    request = RolloutRequest(ids, mask)
    cache: dict = {}
    runs = []
    for cand in cands:
        if cand.route == "deepspeed":
            try:
                runs.append(CandidateRun(cand, _upstream_call(bench, cell, ids, mask), None,
                                         warm=_upstream_call(bench, cell, ids, mask, UPSTREAM_WARMUP_TOKENS)))
            except Exception as exc:  # e.g. deepspeed not installed: the row says so, the cell goes on
                runs.append(CandidateRun(cand, None, None, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        key = (cand.route, cand.max_cache_gib, cand.config) if shared else cand.name
        if key not in cache:
            cache[key] = rollout_for(bench, cand, tok)
        ro = cache[key]
        runs.append(CandidateRun(cand, (lambda seed=SAMPLING_SEED, ro=ro, slots=cand.slots:
                                        ro.generate(request, sampling_for(cell, slots, seed))), ro))
    return runs


def _upstream_call(bench: Bench, cell: CellSpec, ids, mask, budget: Optional[int] = None) -> Callable:
    """A DeepSpeed no-CB call of the cell (``budget``: fewer new tokens, for its warm-up)."""
    from deepspeed.runtime.rollout import RolloutRequest as UpRequest
    from deepspeed.runtime.rollout import SamplingConfig as UpSampling

    up = upstream_for(bench, cell.eos)
    sampling = UpSampling(max_new_tokens=min(budget or cell.budget, cell.budget), temperature=cell.temperature,
                          top_p=cell.top_p, n_samples_per_prompt=cell.n)

    def call(seed=SAMPLING_SEED):
        torch.manual_seed(seed)  # no seed field upstream: the global RNG
        return up.generate(UpRequest(ids, mask), sampling)

    return call


def kept_bytes_estimate(bench: Bench, cell: CellSpec, cands: list[Candidate], width: int) -> int:
    """What the candidates' ``Rollout`` objects keep between calls (KV caches, 80a6322's shapes): the ordinary
    route rows x (T_p + budget), the continuous route (one object for all slot counts) its largest slots x
    capacity, doubled when slots < rows (room for refills)."""
    kv, cols = bench.geometry.kv_bytes_per_token, width + cell.budget
    per_route: dict[str, int] = {}
    for cand in cands:
        if cand.route == "deepspeed":
            continue
        slots = min(cand.slots or cell.rows, cell.rows)
        need = slots * cols * (2 if slots < cell.rows else 1) * kv
        key = ("continuous", cand.config) if cand.route == "continuous" else cand.name
        per_route[key] = max(per_route.get(key, 0), need)
    return sum(per_route.values())


def run_interleaved(runs: list[CandidateRun], device: str, repeats: int, busy: bool, max_events: int,
                    teardown: bool = False, trace_dir: Optional[str] = None, cell: str = "", seeds: int = 1) -> None:
    """Warm-up (with ``seeds`` > 1 one call per seed: a seed's rows end at other steps, so its calls compact into
    batch buckets, and compile or capture pieces, that another seed's did not; timed first, that work went to the
    first candidate of a sequential cell: 4,039 against 3,888 ms for the same tokens), ``repeats`` rounds
    (A B C, C B A, ...: ``bench_rollout.round_order``; round ``r`` draws with :func:`round_seed`), then
    (``busy``) one profiled call each, after every timed call;
    ``trace_dir``: each profiled call's Chrome trace as ``<cell>--<candidate>.json`` there."""
    for run in runs:
        run.after_profile = _PROFILED["any"]
    for run in runs:  # warm-up: each seed of the rounds once, so no timed call meets a batch shape first
        for w in range(seeds):
            measure(run, [o for o in runs if o is not run], device, record=False, seed=round_seed(w, seeds))
    for r in range(repeats):
        for run in round_order(runs, r):
            measure(run, [o for o in runs if o is not run], device, record=True, seed=round_seed(r, seeds))
    if busy:
        for run in runs:
            profile_busy(run, device, max_events, teardown, trace_file(trace_dir, cell, run.cand.name))


def trace_file(trace_dir: Optional[str], cell: str, candidate: str) -> Optional[str]:
    """``<trace_dir>/<cell>--<candidate>.json``, the candidate's name made a file name; None without a folder."""
    if not trace_dir:
        return None
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", candidate)
    return os.path.join(trace_dir, f"{cell}--{safe}.json")


def run_sequential(bench: Bench, cell: CellSpec, cands: list[Candidate], ids, mask) -> list[CandidateRun]:
    """Each candidate alone (warm-up, repeats, profiled call), released before the next."""
    done = []
    for cand in cands:
        (run,) = make_runs(bench, cell, [cand], ids, mask, shared=False)
        try:
            run_interleaved([run], bench.device, bench.args.repeats, bench.busy_enabled, bench.args.busy_max_events,
                            bench.args.cupti_teardown, bench.args.trace_dir, cell.name, bench.args.seeds)
        except torch.cuda.OutOfMemoryError as exc:
            run.error = f"OutOfMemoryError: {exc}"[:300]
        if run.last_batch is not None:
            run.last_batch = _to_cpu(run.last_batch)
        release([run], bench.device)
        done.append(run)
    return done


def _to_cpu(batch):
    return type(batch)(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.response_start_idx.cpu())


# ---- scales: EOS emulation and the peaked cell ------------------------------------------------------------
def scale_key_prefix(model_name: str, dtype: torch.dtype, scale: str) -> str:
    return f"{model_name}|{str(dtype).replace('torch.', '')}|{scale}"


def eos_key(prefix: str, cell: CellSpec) -> str:
    """Key of a cell's EOS scale in ``--eos-scales``: cells of one budget, target and prompt range share it."""
    return f"{prefix}|eos|budget={cell.budget}|mean={cell.mean_target}|prompts={cell.prompt_lens[0]}..{cell.prompt_lens[1]}"


def norm_key(prefix: str, cell: CellSpec, target: int) -> str:
    return f"{prefix}|norm|top_p={cell.top_p}|target={target}|prompts={cell.prompt_lens[0]}..{cell.prompt_lens[1]}"


def eos_scale_for(bench: Bench, cell: CellSpec) -> dict:
    """The cached (or freshly calibrated) EOS-row scale for the cell's (budget, target mean)."""
    key = eos_key(bench.key_prefix, cell)
    if key in bench.scales:
        return bench.scales[key]
    family = dataclasses.replace(cell, num_prompts=CALIB_PROMPTS, cap_slots=None)
    ids, mask, _ = make_prompts(family, bench.model.config.vocab_size, bench.device)
    ro = Rollout(bench.model, bench.tokenizer(True), RolloutConfig(route="ordinary"))
    short = min(cell.budget, 4 * cell.mean_target)

    def mean_length(scale: float, budget: int) -> float:
        sampling = sampling_for(dataclasses.replace(family, budget=budget), None)
        with scaled_weights(bench.model, scale, None):
            lengths = response_lengths(ro.generate(RolloutRequest(ids, mask), sampling))
        mean = sum(lengths) / len(lengths)
        print(f"  calibrate {cell.name}: eos scale {scale:.4g}, budget {budget} -> mean length {mean:.1f} "
              f"(target {cell.mean_target})", flush=True)
        return mean

    t0 = time.perf_counter()
    scale, mean, seen = search_scale(lambda s: mean_length(s, cell.budget), float(cell.mean_target),
                                     lower=(lambda s: mean_length(s, short)) if short < cell.budget else None)
    ro.shutdown()
    del ro
    gc.collect()
    entry = {"scale": scale, "calibration_mean": mean, "probes": seen, "rows": family.rows,
             "seconds": time.perf_counter() - t0}
    bench.scales[key] = entry
    bench.save_scales()
    return entry


def norm_factor_for(bench: Bench, cell: CellSpec) -> dict:
    """Smallest factor 2^(j/8) of the final norm weight (= of the logits) whose median top-p nucleus over the
    prefill logits of 8 of the cell's prompts is <= the target; the median measured at it with real weights."""
    target = bench.args.nucleus_target or min(1000, bench.model.config.vocab_size // 8)
    key = norm_key(bench.key_prefix, cell, target)
    if key in bench.scales:
        return bench.scales[key]
    ids, mask, _ = make_prompts(dataclasses.replace(cell, num_prompts=8), bench.model.config.vocab_size, bench.device)

    def last_logits():
        with torch.no_grad():
            return bench.model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()

    base = last_logits()
    factor = 1.0
    for j in range(0, 8 * 10 + 1):
        factor = 2.0 ** (j / 8)
        if statistics.median(nucleus_sizes(base * factor, cell.top_p)) <= target:
            break
    with scaled_weights(bench.model, None, factor):
        measured = statistics.median(nucleus_sizes(last_logits(), cell.top_p))
    entry = {"factor": factor, "nucleus_median": measured, "nucleus_target": target,
             "nucleus_median_unscaled": statistics.median(nucleus_sizes(base, cell.top_p))}
    bench.scales[key] = entry
    bench.save_scales()
    return entry


# ---- one cell ------------------------------------------------------------------------------------------
def run_cell(bench: Bench, spec: CellSpec) -> tuple[list[RlRow], dict]:
    cell = bench.cell(spec)
    args = bench.args
    vocab = bench.model.config.vocab_size
    ids, mask, prompt_lens = make_prompts(cell, vocab, bench.device)
    eos = eos_scale_for(bench, cell) if cell.eos else None
    peaked = norm_factor_for(bench, cell) if cell.peaked else None
    cap_gib = None
    if cell.cap_slots is not None:
        cap_gib = args.cap_gib or cap_gib_for_slots(cell.cap_slots, max(prompt_lens), cell.budget,
                                                    bench.geometry.kv_bytes_per_token)
    cands = plan_candidates(cell, args.candidate_set, bench.has_cap_field, cap_gib, args.upstream,
                            getattr(args, "sampler_ab", False), getattr(args, "twins", ()))
    rows: list[RlRow] = []
    common = dict(source=bench.source, cell=spec.name, prompts=cell.num_prompts, n=cell.n, rows=cell.rows,
                  prompt_lens=f"{cell.prompt_lens[0]}..{cell.prompt_lens[1]}" if cell.prompt_lens[0] != cell.prompt_lens[1]
                  else str(cell.prompt_lens[0]), budget=cell.budget, sampling=cell.sampling_label(),
                  eos_scale=eos["scale"] if eos else None, norm_factor=peaked["factor"] if peaked else None,
                  nucleus_median=peaked["nucleus_median"] if peaked else None, repeats=args.repeats,
                  seeds=args.seeds if spec.temperature > 0 else 1)
    if cell.cap_slots is not None and args.upstream:
        rows.append(RlRow(candidate="deepspeed", status="not run: no KV budget upstream", **common))
    if any(c.route == "deepspeed" for c in cands):
        estimate = upstream_estimate_s(cell, prompt_lens, bench.geometry)
        if estimate > args.upstream_cap_s:
            cands = [c for c in cands if c.route != "deepspeed"]
            rows.append(RlRow(candidate="deepspeed", status="not run: cap",
                              note=f"estimated {estimate:.0f} s a call > --upstream-cap-s {args.upstream_cap_s:g}",
                              **common))
    if cell.cap_slots is not None and bench.has_cap_field and (args.candidate_set is None
                                                               or "ordinary" in args.candidate_set):
        rows.append(probe_over_cap(bench, cell, ids, mask, cap_gib, eos["scale"] if eos else None, common))
    print(f"## {spec.name}: {cell.num_prompts} prompts x n={cell.n}, prompts {common['prompt_lens']}, budget "
          f"{cell.budget}, {cell.sampling_label()}"
          + (f" (seeds {SAMPLING_SEED}..{SAMPLING_SEED + common['seeds'] - 1})" if common["seeds"] > 1 else "")
          + f", EOS {'scale %.4g' % eos['scale'] if eos else 'off'}"
          + (f", norm x{peaked['factor']:.4g} (median nucleus {peaked['nucleus_median']:g})" if peaked else "")
          + f"; candidates {', '.join(c.name for c in cands)}", flush=True)
    t0 = time.perf_counter()
    with scaled_weights(bench.model, eos["scale"] if eos else None, peaked["factor"] if peaked else None):
        runs, mode = _run_candidates(bench, cell, cands, ids, mask)
    reference = next((r for r in runs if r.cand.name == "ordinary" and r.last_batch is not None),
                     next((r for r in runs if r.last_batch is not None), None))
    batches = {}
    for run in runs:
        rows.append(_row(bench, cell, run, prompt_lens, reference, mode, common))
        if run.last_batch is not None:
            batches[run.cand.name] = _to_cpu(run.last_batch)
    release(runs, bench.device)
    derive(rows)
    print(f"## {spec.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows, batches


def probe_over_cap(bench: Bench, cell: CellSpec, ids, mask, cap_gib: float, eos_scale: Optional[float],
                   common: dict) -> RlRow:
    """The ordinary route (every row at once) under ``max_cache_gib``: it should be refused, with the figures,
    before anything is allocated. One untimed call; the row records what happened."""
    cand = Candidate("ordinary (over cap)", "ordinary", max_cache_gib=cap_gib)
    ro = None
    start = time.perf_counter()
    try:
        ro = rollout_for(bench, cand, bench.tokenizer(cell.eos))
        with scaled_weights(bench.model, eos_scale, None):
            ro.generate(RolloutRequest(ids, mask), sampling_for(cell, None))
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


def _run_candidates(bench: Bench, cell: CellSpec, cands, ids, mask) -> tuple[list[CandidateRun], str]:
    device, args = bench.device, bench.args
    sequential = args.sequential
    if device.startswith("cuda") and not sequential:
        free, _ = torch.cuda.mem_get_info()
        need = kept_bytes_estimate(bench, cell, cands, ids.shape[1])
        if need > 0.8 * free:
            print(f"  kept KV caches ~{need / 2 ** 30:.1f} GiB > 80% of free {free / 2 ** 30:.1f} GiB: one candidate "
                  "at a time", flush=True)
            sequential = True
    if not sequential:
        runs = make_runs(bench, cell, cands, ids, mask, shared=True)
        try:
            run_interleaved(runs, device, args.repeats, bench.busy_enabled, args.busy_max_events, args.cupti_teardown,
                            args.trace_dir, cell.name, args.seeds)
            return runs, "interleaved"
        except torch.cuda.OutOfMemoryError:
            print("  out of memory while interleaved: one candidate at a time", flush=True)
            release(runs, device)
            del runs
    return run_sequential(bench, cell, cands, ids, mask), "sequential (memory)"


def _row(bench: Bench, cell: CellSpec, run: CandidateRun, prompt_lens: list[int], reference, mode: str,
         common: dict) -> RlRow:
    notes = [n for n in (run.cand.note, mode if mode != "interleaved" else "",
                         "peak includes other candidates' caches (no held_bytes)" if run.peak_includes_others else "")
             if n]
    if run.error is not None or not run.walls_ms:
        return RlRow(candidate=run.cand.name, slots=run.cand.slots, status=f"error: {run.error or 'no timed call'}",
                     note="; ".join(notes), **common)
    walls = run.walls_ms
    tokens = [sum(lengths) for lengths in run.lengths]
    rooflines = [call_roofline_s(prompt_lens, cell.n, lengths, bench.geometry, bench.bw_bytes_s, bench.flops_s)
                 for lengths in run.lengths]
    prefill = prefill_roofline_s(prompt_lens, bench.geometry, bench.bw_bytes_s, bench.flops_s)
    drawn = common.get("seeds", 1) > 1  # the calls drew different tokens: lengths over all of them
    stats = length_stats([n for lengths in run.lengths for n in lengths] if drawn else run.lengths[-1])
    print(f"  {run.cand.name}: lengths mean {stats['mean']:.1f} p50 {stats['p50']} p90 {stats['p90']} "
          f"max {stats['max']}; {statistics.mean(walls):.0f} ms", flush=True)
    wall = statistics.mean(walls)
    roofline_ms = statistics.mean(rooflines) * 1000.0
    same = None
    if reference is not None and reference is not run:
        a, b = run.last_batch.input_ids, reference.last_batch.input_ids
        same = a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    elif reference is run:
        same = True
    stats_kept = dict(run.stats)
    route = stats_kept.pop("route", None)
    row = RlRow(candidate=run.cand.name, slots=run.cand.slots, note="; ".join(notes),
                response_tokens=statistics.mean(tokens), tok_s=statistics.mean(tokens) / (wall / 1000.0),
                wall_ms=wall, wall_ms_min=min(walls), wall_ms_max=max(walls), walls_ms=[round(w, 2) for w in walls],
                roofline_ms=roofline_ms,
                prefill_roofline_ms=prefill * 1000.0, x_roofline=wall / roofline_ms if roofline_ms > 0 else None,
                gpu_busy_pct=run.busy[0], gpu_busy_note=run.busy[1],
                peak_gib=max(run.peaks_bytes) / 2 ** 30 if run.peaks_bytes else None,
                route=route if run.cand.route != "deepspeed" else "deepspeed-no-cb",
                decode_path=_decode_path(stats_kept) if run.rollout is not None or run.stats else None, prefill_path=stats_kept.pop("prefill_path", None),
                len_mean=stats["mean"], len_p50=stats["p50"], len_p90=stats["p90"], len_max=stats["max"],
                same_tokens=same, after_profile=run.after_profile, stats=stats_kept, **common)
    if run.cand.name == "auto":
        slots = next((stats_kept.get(k) for k in ("num_slots", "slots", "continuous_batch_size") if k in stats_kept), None)
        row.auto_choice = f"{route}" + (f" ({slots} slots)" if slots is not None and route == "continuous" else "")
    return row


def _decode_path(stats: dict) -> Optional[str]:
    """``last_stats["decode_path"]``, or (80a6322's ordinary route has none) what its step counters say, by the
    rule of ``rollout/profile.py``."""
    if not stats:
        return None
    path = stats.pop("decode_path", None)
    if path:
        return path
    return "graph" if stats.get("graph_decode_steps") else "fast_eager" if stats.get("eager_decode_steps") else "hf"


# ---- entry point ---------------------------------------------------------------------------------------
def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "3b"], default=None, help="3b on CUDA, tiny elsewhere")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--scale", choices=sorted(SCALE_DIVISORS), default="full",
                        help="small: prompt lengths, budgets and target means / 16")
    parser.add_argument("--cells", help="names or indices, comma-separated (default all)")
    parser.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts per cell "
                        "(smoke tests; the rows and slot counts shrink with it)")
    parser.add_argument("--candidates", help="auto, ordinary, continuous, continuous/1|2|4, continuous-S, deepspeed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=1, help="sampled cells: timed round r draws with seed "
                        f"{SAMPLING_SEED} + r %% SEEDS (every candidate of a round the same), so the means average "
                        "the realised lengths out; 1: every call the same seed, the same tokens")
    parser.add_argument("--upstream", action="store_true", help="also DeepSpeed 0.19.8 no-CB, where under the cap")
    parser.add_argument("--upstream-cap-s", type=float, default=30.0, help="estimated seconds a call, above: not run")
    parser.add_argument("--busy", choices=["on", "off"], default="on", help="one profiled call per candidate (CUDA)")
    parser.add_argument("--busy-max-events", type=int, default=3_000_000)
    parser.add_argument("--trace-dir", help="write each candidate's profiled call as a Chrome trace here, host "
                        "included (set OPSD_PROFILE=1 for our stage ranges; then scripts/summarize_trace.py)")
    parser.add_argument("--cupti-teardown", action="store_true", help="set TEARDOWN_CUPTI=1 around each profiled "
                        "call so no CUPTI callbacks linger into later timed calls (torch warns that CUDA graphs and "
                        "CUPTI re-init have crashed on older CUDA)")
    parser.add_argument("--sampler-ab", action="store_true", help="on top-p cells, also each candidate with "
                        "fused_sampler=False (the compiled search instead of the one-kernel nucleus), interleaved")
    parser.add_argument("--twin", action="append", default=[], metavar="FIELD=VALUE[;FIELD=VALUE]",
                        help="also each candidate with these RolloutConfig fields set, e.g. fuse_qkv=False or "
                        "\"decode_attention='sdpa';fused_kv_write=False\" (repeatable: one twin each)")
    parser.add_argument("--sequential", action="store_true", help="one candidate at a time, released in between")
    parser.add_argument("--cap-gib", type=float, default=None, help="the capped cell's max_cache_gib (default: what "
                        "128 continuous slots with refills need, see cap_gib_for_slots)")
    parser.add_argument("--nucleus-target", type=int, default=None, help="peaked cell: median nucleus at most this "
                        "(default min(1000, vocab/8))")
    parser.add_argument("--eos-scales", help="JSON of calibrated scales: read if present, written if not "
                        "(default: rl-scales.json next to --json)")
    parser.add_argument("--calibrate-only", action="store_true", help="find the selected cells' scales, then exit")
    parser.add_argument("--commit-label", help="recorded as the commit when git rev-parse fails")
    parser.add_argument("--json", help="write {meta, rows} here (rewritten after every cell)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from several --json files")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if args.seeds < 1 or args.seeds > args.repeats:
        parser.error(f"--seeds: must be in 1..--repeats ({args.repeats}); got {args.seeds}")
    args.cell_specs = select_cells(args.cells)
    args.candidate_set = _parse_candidates(parser, args.candidates)
    args.twins = tuple(_parse_twin(parser, spec) for spec in args.twin)
    if args.eos_scales is None and args.json:
        args.eos_scales = os.path.join(os.path.dirname(os.path.abspath(args.json)), "rl-scales.json")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    for name in ("json", "eos_scales"):  # output folders exist before any work starts
        path = getattr(args, name)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for path in args.merge or ():
        if not os.path.isfile(path):
            parser.error(f"--merge: no such file {path!r}")
    return args


def _parse_twin(parser, spec: str) -> tuple:
    """``"fuse_qkv=False;compile=False"`` -> ``(("fuse_qkv", False), ("compile", False))``; each field must be a
    ``RolloutConfig`` field, each value a Python literal."""
    import ast

    fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    out = []
    for part in spec.split(";"):
        name, sep, text = part.strip().partition("=")
        if not sep or name not in fields:
            parser.error(f"--twin: {part!r} is not FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parser.error(f"--twin: {part!r}: the value must be a Python literal (True, 0.5, 'ordinary')")
        out.append((name, value))
    return tuple(out)


def _parse_candidates(parser, spec: Optional[str]) -> Optional[set[str]]:
    if not spec:
        return None
    names = {p.strip() for p in spec.split(",") if p.strip()}
    fixed = {"auto", "ordinary", "continuous", "continuous/1", "continuous/2", "continuous/4", "deepspeed"}
    bad = [n for n in names if n not in fixed and not (n.startswith("continuous-") and n[11:].isdigit())]
    if bad:
        parser.error(f"--candidates: unknown {bad}; use {sorted(fixed)} or continuous-S")
    return names


@dataclass
class SuiteResult:
    """What :func:`main` returns: the rows, the last timed batch per (cell, candidate) on the CPU, the meta."""

    rows: list
    batches: dict
    meta: dict


def main(argv=None) -> SuiteResult:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge:
        rows = load_rows(args.merge)
        print(format_table(rows))
        return SuiteResult(rows, {}, {})
    model_name = args.model or ("3b" if args.device.startswith("cuda") else "tiny")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    model = build_model(model_name, dtype, args.device)
    bw_gbps, gemm_tflops = measure_rates(args.device, dtype)
    commit = git_commit() or args.commit_label or "unknown"
    import transformers
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else (platform.processor() or "cpu"),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit,
            "commit_label": args.commit_label, "bw_gbps": bw_gbps, "gemm_tflops": gemm_tflops,
            "command": " ".join(["scripts/bench_rl.py", *argv]), "rollout_package": os.path.dirname(
                sys.modules[Rollout.__module__].__file__), "model": model_name, "dtype": str(dtype),
            "scale": args.scale, "repeats": args.repeats, "seeds": args.seeds,
            "features": {"max_cache_gib": "max_cache_gib" in {f.name for f in dataclasses.fields(RolloutConfig)}}}
    scales = {}
    if args.eos_scales and os.path.exists(args.eos_scales):
        with open(args.eos_scales) as f:
            scales = json.load(f)
    bench = Bench(model, model_name, args.device, dtype, model_geometry(model), bw_gbps * 1e9, gemm_tflops * 1e12,
                  args, args.commit_label or commit[:10], meta["features"]["max_cache_gib"], scales,
                  busy_enabled=args.busy == "on" and args.device.startswith("cuda"))
    print(f"# {meta['date']} {meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}; commit "
          f"{commit}; model {model_name} {dtype}; scale {args.scale}; copy {bw_gbps:.0f} GB/s, GEMM "
          f"{gemm_tflops:.3g} TFLOP/s; max_cache_gib {'present' if bench.has_cap_field else 'absent'}", flush=True)
    if args.calibrate_only:
        for spec in args.cell_specs:
            cell = bench.cell(spec)
            if cell.eos:
                print(f"{spec.name}: eos {eos_scale_for(bench, cell)}", flush=True)
            if cell.peaked:
                print(f"{spec.name}: norm {norm_factor_for(bench, cell)}", flush=True)
        meta["scales"] = bench.scales
        return SuiteResult([], {}, meta)
    rows: list[RlRow] = []
    batches = {}
    for spec in args.cell_specs:
        try:
            cell_rows, cell_batches = run_cell(bench, spec)
        except Exception as exc:  # one broken cell does not cost the others of the command
            import traceback
            traceback.print_exc()
            cell_rows, cell_batches = [RlRow(source=bench.source, cell=spec.name, candidate="*",
                                             status=f"error: {type(exc).__name__}: {exc}"[:300])], {}
        rows += cell_rows
        batches.update({(spec.name, name): b for name, b in cell_batches.items()})
        meta["scales"] = {k: v for k, v in bench.scales.items()}
        if args.json:
            write_json(args.json, meta, rows)
    print(format_table(sort_rows(rows)))
    return SuiteResult(rows, batches, meta)


if __name__ == "__main__":
    main()
