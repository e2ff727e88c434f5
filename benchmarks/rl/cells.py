"""The RL suite's workloads (cells) and the ways to run each (candidates): plain data, no device work."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation.roofline import ModelGeometry

EOS_ID = 2
PAD_ID = 0
SAMPLING_SEED = 1234
SCALE_DIVISORS = {"full": 1, "small": 16}
#: Cells of one family share their prompts (drawn from the family's seed).
FAMILY_SEEDS = {"wide": 11, "longtail": 12, "longctx": 13, "opsd": 14}
#: DeepSpeed 0.19.8 no-CB, 3B on an H200 (issue 15: 3.82 s for 256 rows x 128 new): seconds per decode step.
UPSTREAM_STEP_S = (0.025, 2e-5)  # fixed + per row


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
    row_mean: Optional[int] = None
    """Each row ends at a budget of its own (``RolloutRequest.row_max_new_tokens``): long-tailed lengths with this mean,
    drawn as ``benchmarks.step``'s long-tail cell draws its first timed round's (:func:`row_budgets`)."""

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
        row_mean = None if self.row_mean is None else max(2, round(self.row_mean / divisor))
        return dataclasses.replace(self, prompt_lens=(lo, hi), budget=max(4, self.budget // divisor), mean_target=mean,
                                   row_mean=row_mean)

    def sampling_label(self) -> str:
        if self.temperature <= 0:
            return "greedy"
        return f"T={self.temperature:g}" + (f" top_p={self.top_p:g}" if self.top_p < 1 else "")

    def prompt_label(self) -> str:
        lo, hi = self.prompt_lens
        return f"{lo}..{hi}" if lo != hi else str(lo)


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
    # the rollout of the OPSD step's uniform cell (benchmarks.step): prompts of 128..256 real tokens, T = 1, EOS off
    CellSpec("opsd-uniform", 64, 4, (128, 256), 1024, 1.0, family="opsd"),
    # the rollout of its long-tail cell: the same prompts, each row ending at its own budget (mean ~200 of 1,024)
    CellSpec("opsd-longtail", 64, 4, (128, 256), 1024, 1.0, family="opsd", row_mean=200),
)


def row_budgets(cell: CellSpec) -> Optional[torch.Tensor]:
    """The cell's per-row budgets (None: every row runs to ``budget`` or EOS): ``benchmarks.step``'s long-tail
    lengths for ``cell.rows`` rows, seed 1 (that cell's first timed round at ``--seed 0``)."""
    from benchmarks.step import longtail_lengths

    if cell.row_mean is None:
        return None
    return longtail_lengths(cell.rows, cell.budget, cell.row_mean, 1)


@dataclass(frozen=True)
class Candidate:
    """One way to run a cell."""

    name: str
    route: str
    """``RolloutConfig.route``, or ``"deepspeed"``."""
    slots: Optional[int] = None
    """``SamplingConfig.continuous_batch_size``."""
    max_cache_gib: Optional[float] = None
    note: str = ""
    config: tuple = ()
    """Further settings by dotted name, ``((name, value), ...)`` for ``RolloutConfig.with_settings`` (``--sampler-ab``:
    ``sampler.fused=False``; ``--twin``)."""


def cap_gib_for_slots(slots: int, longest_prompt: int, budget: int, kv_bytes_per_token: int) -> float:
    """A KV budget (GiB) that allows ``slots`` continuous-batching slots and no more: each slot holds the
    continuous route's capacity with refills, 2 x (longest prompt + budget - 1) columns rounded up to 64 (the
    rule of ``rollout.plan.layout``), plus half a slot of headroom against rounding in the GiB -> bytes
    conversion."""
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


def plan_candidates(cell: CellSpec, selectors: Optional[set[str]], *, cap_gib: Optional[float] = None,
                    upstream: bool = False, sampler_ab: bool = False, twins: tuple = ()) -> list[Candidate]:
    """The candidates of a cell, in interleaving order (DeepSpeed last). ``cap_gib``: the capped cell's
    ``max_cache_gib``; ``sampler_ab``: on top-p cells, a twin of each with ``sampler.fused=False`` (the sampler A/B in
    one process); ``twins``: one ``((setting, value), ...)`` per twin, a twin of each candidate with those settings
    (an A/B of any switches)."""
    capped = cell.cap_slots is not None
    cap = cap_gib if capped else None
    note = f"max_cache_gib={cap:.4g}" if cap is not None else ""
    out = []
    if _selected("auto", None, selectors):
        out.append(Candidate("auto", "auto", max_cache_gib=cap, note=note))
    if _selected("ordinary", None, selectors) and not capped:
        out.append(Candidate("ordinary", "ordinary"))
    for divisor, slots in slot_variants(cell.rows, cell.n, cell.cap_slots):
        name = f"continuous-{slots}"
        if _selected(name, divisor, selectors):
            out.append(Candidate(name, "continuous", slots=slots, max_cache_gib=cap, note=note))
    base = list(out)
    if sampler_ab and cell.temperature > 0 and cell.top_p < 1:  # each with the compiled search instead
        out += [dataclasses.replace(c, name=f"{c.name} +search", config=(("sampler.fused", False),)) for c in base]
    for fields in twins:
        label = ",".join(f"{name}={value}" for name, value in fields)
        out += [dataclasses.replace(c, name=f"{c.name} {label}", config=tuple(fields)) for c in base]
    if upstream and not capped and (selectors is None or "deepspeed" in selectors):
        out.append(Candidate("deepspeed", "deepspeed"))  # (it has no KV budget: not in the capped cell)
    return out


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
    ids = torch.full((cell.num_prompts, width), PAD_ID, dtype=torch.long)  # ids: [num_prompts, T_p]
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = tokens[row, :length]
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device), lengths


def upstream_estimate_s(cell: CellSpec, prompt_lens: list[int], geo: ModelGeometry) -> float:
    """Estimated seconds of one DeepSpeed no-CB call: it runs every row to the budget (EOS is applied after
    generation), ~25 ms + 0.02 ms per row per step on the 3B shape (issue 15), plus the prefill of every
    expanded row at 300 TFLOP/s."""
    step = UPSTREAM_STEP_S[0] + UPSTREAM_STEP_S[1] * cell.rows
    prefill = 2 * (geo.nonembedding_params + geo.lm_head_params) * sum(prompt_lens) * cell.n / 3e14
    return cell.budget * step + prefill
