"""What the instrumentation costs (micro-benchmarks; not tests), timed by the harness's rounds.

``python -m benchmarks.overhead stage``: the per-call cost of ``stage()`` in each profiling mode. Each case runs
``with stage(stages.DECODE): pass`` ``--calls`` times; the cost per call is the loop time minus an empty loop's,
over ``--calls``. Cases that need no open session are interleaved (rounds alternating) over ``--repeats``; the
in-session cases run in their own block (their session stays open across its repeats). Median and min over
repeats, in ns per call. Cases:

  off                 OPSD_PROFILE unset: the shared do-nothing range
  off @staged         a @staged function call minus a plain function call
  nvtx                NVTX ranges (no tool attached unless run under nsys) + profiler check
  1 outside           mode 1 with nobody recording (what non-recorded steps pay per stage)
  1 + collect_stages  mode 1 inside collect_stages() with no session (timers; CUDA events on GPU)
  1 inside recorded   mode 1 inside a recorded step: timers + record_function under torch.profiler
  timers inside step  mode timers (the always-on light mode) inside a timed step: NVTX + host timer +
                      two CUDA events per call on GPU (no memory reads, no profiler)
  ref record_function torch.profiler.record_function with no profiler running (for comparison)
  ref nvtx.annotate   nvtx.annotate with the opsd domain (for comparison; needs nvtx)

``python -m benchmarks.overhead rollout``: the instrumentation's cost on rollout end to end, median of ``--repeats``
``generate`` calls per candidate, interleaved: ``none`` (the instrumentation calls replaced by a bare
``nullcontext``: what a build without instrumentation would cost), ``unset`` (``OPSD_PROFILE`` unset: the shared
do-nothing range), ``nvtx`` (NVTX ranges; no tool attached), ``1-outside`` (``OPSD_PROFILE=1`` inside a profiler
session, on steps that are not recorded).

  python -m benchmarks.overhead stage --calls 20000 --repeats 15
  python -m benchmarks.overhead rollout                      # tiny model, CPU
  python -m benchmarks.overhead rollout --model 3b           # the Qwen2.5-3B shape, CUDA, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.harness.cli import int_at_least
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import add_model_args, load_model
from benchmarks.harness.rounds import Rounds, Timer, run_rounds
from benchmarks.harness.table import markdown_table
from instrumentation import ProfileConfig, configure, opsd_profiler, stages
from instrumentation.collect import collect_stages
from instrumentation.ranges import stage, staged

NAME = stages.DECODE
_NULL = contextlib.nullcontext()


# ---- stage(): per-call cost --------------------------------------------------------------------------------------
def _empty(n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


def _stage_loop(n: int) -> int:
    open_stage, name = stage, NAME
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with open_stage(name):
            pass
    return time.perf_counter_ns() - t0


def _plain() -> None:
    pass


@staged(NAME)
def _decorated() -> None:
    pass


def _call_loop(fn, n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return time.perf_counter_ns() - t0


def _ctx_loop(make, n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with make():
            pass
    return time.perf_counter_ns() - t0


def _nvtx_annotate():
    try:
        import nvtx
    except ImportError:
        return None
    return lambda: nvtx.annotate("opsd/decode", color=stages.STAGE_COLORS[NAME], domain=stages.NVTX_DOMAIN)


def stage_cases(n: int) -> dict:
    """name -> callable returning the ns per call of one repeat (the mode configured in each call)."""
    def in_mode(mode, body):
        def run():
            configure(ProfileConfig(mode=mode))
            return (body() - _empty(n)) / n
        return run

    def collected():
        with collect_stages():
            return _stage_loop(n)

    cases = {
        "off": in_mode("0", lambda: _stage_loop(n)),
        "off @staged": in_mode("0", lambda: _call_loop(_decorated, n) - _call_loop(_plain, n) + _empty(n)),
        "nvtx": in_mode("nvtx", lambda: _stage_loop(n)),
        "1 outside": in_mode("1", lambda: _stage_loop(n)),
        "1 + collect_stages": in_mode("1", collected),
        "ref record_function": in_mode("0", lambda: _ctx_loop(lambda: torch.profiler.record_function(
            "opsd/decode"), n)),
    }
    annotate = _nvtx_annotate()
    if annotate is not None:
        cases["ref nvtx.annotate"] = in_mode("0", lambda: _ctx_loop(annotate, n))
    return cases


def _in_session(config: ProfileConfig, n: int, repeats: int, step_between: bool) -> list[float]:
    """ns per call over ``repeats`` repeats inside one profiler session; ``step_between``: ``prof.step()`` between
    repeats (outside the measured loop), else every repeat inside the session's first step."""
    out = []
    with opsd_profiler(config, rank=0, world_size=1) as prof:
        for _ in range(repeats):
            out.append((_stage_loop(n) - _empty(n)) / n)
            if step_between:
                prof.step()
    configure(ProfileConfig(mode="0"))
    return out


def run_stage(args) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    cases = stage_cases(args.calls)
    run_rounds(list(cases), Rounds(args.repeats),
               lambda name, seed, timed: samples.setdefault(name, []).append(cases[name]()) if timed else cases[name]())
    with tempfile.TemporaryDirectory() as tmp:
        recorded = ProfileConfig(mode="1", output_dir=tmp, steps=(0,), profile_memory=False)
        samples["1 inside recorded"] = _in_session(recorded, args.inside_calls, args.repeats, step_between=False)
        samples["timers inside step"] = _in_session(ProfileConfig(mode="timers", output_dir=tmp), args.inside_calls,
                                                    args.repeats, step_between=True)
    print(f"stage() per call: {args.repeats} repeats x {args.calls} calls; in-session {args.inside_calls}")
    print(markdown_table(["case", "median ns/call", "min ns/call"],
                         [[name, f"{statistics.median(v):,.0f}", f"{min(v):,.0f}"] for name, v in samples.items()]))
    return samples


# ---- rollout end to end ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _no_collect():
    yield None


@contextlib.contextmanager
def rollout_candidate(name: str, trace_dir: str):
    """One candidate's instrumentation around a call."""
    import rollout.engine as engine_module

    if name == "none":
        real = engine_module.stage, engine_module.collect_stages
        engine_module.stage, engine_module.collect_stages = (lambda _name: _NULL), _no_collect
        configure(ProfileConfig(mode="0"))
        try:
            yield
        finally:
            engine_module.stage, engine_module.collect_stages = real
        return
    if name == "1-outside":
        config = ProfileConfig(mode="1", output_dir=trace_dir, steps=(10**9,))
        with opsd_profiler(config):  # a session whose recorded step never comes
            yield
        return
    configure(ProfileConfig(mode={"unset": "0", "nvtx": "nvtx"}[name]))
    yield


def run_rollout(args) -> dict[str, list[float]]:
    from rollout import Rollout, RolloutRequest, SamplingConfig
    from rollout.testing import TinyTokenizer, random_prompts

    loaded = load_model(args)
    ro = Rollout(loaded.model, TinyTokenizer(pad_token_id=0, eos_token_id=None))
    ids, mask = random_prompts(args.batch_size, args.prompt_len, min_len=args.prompt_len,
                               vocab_size=loaded.model.config.vocab_size, device=args.device)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.9,
                              n_samples_per_prompt=args.samples, seed=0)
    timer = Timer(args.device)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as trace_dir:
        def call(name, seed, timed):  # the candidate's set-up outside the timed call
            with rollout_candidate(name, trace_dir):
                ms, _ = timer(lambda: ro.generate(RolloutRequest(ids, mask), sampling))
            if timed:
                times.setdefault(name, []).append(ms)

        run_rounds(["none", "unset", "nvtx", "1-outside"], Rounds(args.repeats), call)
    base = statistics.median(times["none"])
    print(f"rollout E2E, {loaded.name} on {args.device}: B={args.batch_size} n={args.samples} prompt={args.prompt_len} "
          f"new={args.max_new_tokens}, median of {args.repeats}")
    print(markdown_table(["candidate", "median E2E ms", "vs none"],
                         [[n, f"{statistics.median(v):.3f}", f"{100.0 * (statistics.median(v) - base) / base:+.2f} %"]
                          for n, v in times.items()]))
    return times


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="measure", required=True)
    p = sub.add_parser("stage", help="the per-call cost of stage() in each mode")
    p.add_argument("--calls", type=int_at_least(1), default=20_000, help="stage() calls per repeat")
    p.add_argument("--repeats", type=int_at_least(1), default=15)
    p.add_argument("--inside-calls", type=int_at_least(1), default=2_000,
                   help="calls per repeat inside the recorded step (each one is a trace event)")
    p = sub.add_parser("rollout", help="the instrumentation's cost on rollout end to end")
    add_model_args(p, dtype=False)
    p.add_argument("--repeats", type=int_at_least(1), default=30)
    p.add_argument("--batch-size", type=int_at_least(1), default=4)
    p.add_argument("--samples", type=int_at_least(1), default=4)
    p.add_argument("--prompt-len", type=int_at_least(1), default=128)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    args = parser.parse_args(argv)
    print(header(run_meta("overhead", argv, getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu"))))
    return run_stage(args) if args.measure == "stage" else run_rollout(args)


if __name__ == "__main__":
    main()
