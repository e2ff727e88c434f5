"""CPU timings of the prefill planner and the route decision (a benchmark, not a test).

    python scripts/bench_planner.py [--repeats 400] [--seed 0]

For 32 / 128 / 256 requests it times ``plan_prefill_buckets`` (O(n log n) monotone queue) next to
``reference_plan_prefill_buckets`` (the plain O(n^2) DP the tests use as an oracle) on random
lengths 1..2048 and on the seed PR's regime of prompts at the 65,536-token limit, with the default
token limit and with none; then the engine's Auto decision (``rollout.routes.choose_route``) on 128
short requests (the seed reviewer's case
where planning made Auto 1.82x slower) and on 128 mixed ones. Median and p90 over ``--repeats``
timed calls after warm-up, with the garbage collector off, default ``CostModel``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Callable

from rollout.plan.layout import PromptLayout
from rollout.plan.routes import choose_route
from rollout.plan.planner import (
    DEFAULT_MAX_TOKENS, CostModel, plan_prefill_buckets, reference_plan_prefill_buckets,
)


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 5) -> tuple[float, float]:
    """(median, p90) milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - start) / 1e6)
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.9 * len(samples)))]


def workloads(seed: int):
    rng = random.Random(seed)
    for n in (32, 128, 256):
        yield "random 1..2048", [rng.randint(1, 2048) for _ in range(n)]
    for n in (32, 128, 256):
        yield "all 65536", [65536] * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=400, help="timed calls per planner cell")
    parser.add_argument("--reference-repeats", type=int, default=40, help="timed calls per reference-DP cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e-repeats", type=int, default=15,
                        help="Rollout ordinary vs auto on 128 short requests (0: skip)")
    args = parser.parse_args()
    cm = CostModel()

    header = (f"{'case':<26} {'n':>4} {'max_tokens':>10} {'median ms':>10} {'p90 ms':>8} "
              f"{'O(n^2) med':>10} {'O(n^2) p90':>10} {'buckets':>7}  note")
    print(header)
    print("-" * len(header))
    for name, lengths in workloads(args.seed):
        for max_tokens in (DEFAULT_MAX_TOKENS, None):
            plan = plan_prefill_buckets(lengths, cm, max_tokens)
            reference = reference_plan_prefill_buckets(lengths, cm, max_tokens)
            assert abs(plan.cost_ms - reference.cost_ms) <= 1e-9 * reference.cost_ms, (name, max_tokens)
            med, p90 = time_ms(lambda: plan_prefill_buckets(lengths, cm, max_tokens), args.repeats)
            ref_med, ref_p90 = time_ms(lambda: reference_plan_prefill_buckets(lengths, cm, max_tokens),
                                       args.reference_repeats, warmup=2)
            print(f"{'plan ' + name:<26} {len(lengths):>4} {str(max_tokens):>10} {med:>10.4f} {p90:>8.4f} "
                  f"{ref_med:>10.4f} {ref_p90:>10.4f} {len(plan.buckets):>7}")

    rng = random.Random(args.seed + 1)
    route_cases = [("route 128 short 13..20", [rng.randint(13, 20) for _ in range(128)]),
                   ("route 128 mixed 1..2048", [rng.randint(1, 2048) for _ in range(128)]),
                   ("route 1x512+31x16", [512] + [16] * 31)]
    for name, lengths in route_cases:  # the engine's route="auto" decision (rollout/routes.py)
        layout = PromptLayout(tuple(lengths), tuple(lengths), max(lengths))
        decide = lambda: choose_route("auto", layout, 1, None, cm, DEFAULT_MAX_TOKENS)  # noqa: E731
        decision = decide()
        med, p90 = time_ms(decide, args.repeats)
        buckets = len(decision.buckets) if decision.buckets else 1
        note = f"{decision.reason}, dp_skipped={decision.dp_skipped}"
        print(f"{name:<26} {len(lengths):>4} {DEFAULT_MAX_TOKENS:>10} {med:>10.4f} {p90:>8.4f} "
              f"{'-':>10} {'-':>10} {buckets:>7}  {note}")
    if args.e2e_repeats:
        end_to_end_short(route_cases[0][1], args.e2e_repeats)


def end_to_end_short(lengths: list[int], repeats: int) -> None:
    """The reviewer's case: 128 short requests x 16 new tokens, ``Rollout`` with route ordinary vs auto
    (planning included), tiny model on this machine; interleaved, median of ``repeats``."""
    import statistics
    import time

    import torch

    from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
    from rollout.testing import TinyTokenizer, tiny_model

    model = tiny_model("qwen2", seed=0)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 512, (length,))
        mask[row, width - length:] = 1
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    engines = {route: Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route=route))
               for route in ("ordinary", "auto")}
    times = {route: [] for route in engines}
    for ro in engines.values():
        ro.generate(RolloutRequest(ids, mask), sampling)
    for _ in range(repeats):
        for route, ro in engines.items():
            start = time.perf_counter()
            ro.generate(RolloutRequest(ids, mask), sampling)
            times[route].append((time.perf_counter() - start) * 1000.0)
    med = {route: statistics.median(v) for route, v in times.items()}
    stats = engines["auto"].last_stats
    print(f"\nend to end, 128 short requests x 16 new tokens, tiny model, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {repeats}:")
    print(f"  ordinary {med['ordinary']:.2f} ms   auto {med['auto']:.2f} ms   auto / ordinary "
          f"{med['auto'] / med['ordinary']:.3f}   (auto ran {stats['route']}, "
          f"{stats['prefill_buckets']} prefill forward(s), dp_skipped={stats['dp_skipped']})")


if __name__ == "__main__":
    main()
