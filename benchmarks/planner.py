"""CPU timings of the prefill planner and the route decision (a benchmark, not a test).

    python -m benchmarks.planner [--repeats 400] [--seed 0] [--e2e-repeats 15] [--json out.json]

For 32 / 128 / 256 requests it times ``plan_prefill_buckets`` (O(n log n) monotone queue) next to
``reference_plan_prefill_buckets`` (the plain O(n^2) DP the tests use as an oracle) on random lengths 1..2048
and on the seed PR's regime of prompts at the 65,536-token limit, with the default token limit and with none;
then the engine's Auto decision (``rollout.plan.routes.choose_route``) on 128 short requests (the seed reviewer's
case where planning made Auto 1.82x slower) and on 128 mixed ones. Median and p90 over ``--repeats`` timed calls
after warm-up, with the garbage collector off, default ``CostModel``. Last, end to end: the reviewer's case through
``Rollout`` (route ordinary against auto, tiny model, interleaved rounds).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least, int_in, out_path
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.rounds import Rounds, Timer, time_rounds
from benchmarks.harness.table import markdown_table
from rollout.plan.layout import PromptLayout
from rollout.plan.planner import DEFAULT_MAX_TOKENS, CostModel, plan_prefill_buckets, reference_plan_prefill_buckets
from rollout.plan.routes import choose_route


@dataclass
class PlannerRow:
    case: str
    n: int
    max_tokens: Optional[int]
    median_ms: float
    p90_ms: float
    reference_median_ms: Optional[float] = None
    """The O(n^2) reference DP's median (None: not timed)."""
    reference_p90_ms: Optional[float] = None
    buckets: int = 1
    note: str = ""


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 5) -> tuple[float, float]:
    """(median, p90) milliseconds of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed ones, with the
    garbage collector off."""
    gc.disable()
    try:
        samples = sorted(time_rounds({"fn": fn}, Rounds(repeats, warmup=warmup), Timer())["fn"])
    finally:
        gc.enable()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.9 * len(samples)))]


def workloads(seed: int):
    rng = random.Random(seed)
    for n in (32, 128, 256):
        yield "random 1..2048", [rng.randint(1, 2048) for _ in range(n)]
    for n in (32, 128, 256):
        yield "all 65536", [65536] * n


def plan_rows(args, cm: CostModel) -> list[PlannerRow]:
    rows = []
    for name, lengths in workloads(args.seed):
        for max_tokens in (DEFAULT_MAX_TOKENS, None):
            plan = plan_prefill_buckets(lengths, cm, max_tokens)
            reference = reference_plan_prefill_buckets(lengths, cm, max_tokens)
            assert abs(plan.cost_ms - reference.cost_ms) <= 1e-9 * reference.cost_ms, (name, max_tokens)
            med, p90 = time_ms(lambda: plan_prefill_buckets(lengths, cm, max_tokens), args.repeats)
            ref_med, ref_p90 = time_ms(lambda: reference_plan_prefill_buckets(lengths, cm, max_tokens),
                                       args.reference_repeats, warmup=2)
            rows.append(PlannerRow(f"plan {name}", len(lengths), max_tokens, med, p90, ref_med, ref_p90,
                                   len(plan.buckets)))
    return rows


def route_cases(seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed + 1)
    return [("route 128 short 13..20", [rng.randint(13, 20) for _ in range(128)]),
            ("route 128 mixed 1..2048", [rng.randint(1, 2048) for _ in range(128)]),
            ("route 1x512+31x16", [512] + [16] * 31)]


def route_rows(args, cm: CostModel) -> list[PlannerRow]:
    rows = []
    for name, lengths in route_cases(args.seed):  # the engine's route="auto" decision
        layout = PromptLayout(tuple(lengths), tuple(lengths), max(lengths))
        decide = lambda: choose_route("auto", layout, 1, None, cm, DEFAULT_MAX_TOKENS)  # noqa: E731
        decision = decide()
        med, p90 = time_ms(decide, args.repeats)
        rows.append(PlannerRow(name, len(lengths), DEFAULT_MAX_TOKENS, med, p90,
                               buckets=len(decision.buckets) if decision.buckets else 1,
                               note=f"{decision.reason}, dp_skipped={decision.dp_skipped}"))
    return rows


def end_to_end_short(lengths: list[int], repeats: int) -> list[PlannerRow]:
    """The reviewer's case: 128 short requests x 16 new tokens, ``Rollout`` with route ordinary vs auto (planning
    included), tiny model on this machine; interleaved rounds, median of ``repeats``."""
    import torch

    from benchmarks.harness.models import left_padded
    from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
    from rollout.testing import TinyTokenizer, tiny_model

    model = tiny_model("qwen2", seed=0)
    ids, mask = left_padded(lengths, 512, "cpu")
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    engines = {route: Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route=route))
               for route in ("ordinary", "auto")}
    times = time_rounds({route: (lambda ro=ro: ro.generate(RolloutRequest(ids, mask), sampling))
                         for route, ro in engines.items()}, Rounds(repeats), Timer())
    med = {route: statistics.median(v) for route, v in times.items()}
    stats = engines["auto"].last_stats
    note = (f"{torch.get_num_threads()} threads; auto / ordinary {med['auto'] / med['ordinary']:.3f} (auto ran "
            f"{stats.route}, {stats.prefill.buckets} prefill bucket(s), dp_skipped={stats.dp_skipped})")
    return [PlannerRow(f"e2e 128 short x 16 new, {route}", len(lengths), None, med[route],
                       sorted(times[route])[min(repeats - 1, int(0.9 * repeats))], note=note if route == "auto" else "")
            for route in engines]


def main(argv=None) -> list[PlannerRow]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int_at_least(1), default=400, help="timed calls per planner cell")
    parser.add_argument("--reference-repeats", type=int_at_least(1), default=40,
                        help="timed calls per reference-DP cell")
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    parser.add_argument("--e2e-repeats", type=int_at_least(0), default=15,
                        help="Rollout ordinary vs auto on 128 short requests (0: skip)")
    parser.add_argument("--json", type=out_path, help="also write the result file here")
    args = parser.parse_args(argv)
    cm = CostModel()
    rows = plan_rows(args, cm) + route_rows(args, cm)
    if args.e2e_repeats:
        rows += end_to_end_short(route_cases(args.seed)[0][1], args.e2e_repeats)
    meta = run_meta("planner", argv, repeats=args.repeats, seed=args.seed)
    print(header(meta))
    print(markdown_table(["case", "n", "max_tokens", "median ms", "p90 ms", "O(n^2) median", "O(n^2) p90", "buckets",
                          "note"],
                         [[r.case, r.n, r.max_tokens, f"{r.median_ms:.4f}", f"{r.p90_ms:.4f}",
                           None if r.reference_median_ms is None else f"{r.reference_median_ms:.4f}",
                           None if r.reference_p90_ms is None else f"{r.reference_p90_ms:.4f}", r.buckets, r.note]
                          for r in rows]))
    if args.json:
        results.write(args.json, meta, rows)
    return rows


if __name__ == "__main__":
    main()
