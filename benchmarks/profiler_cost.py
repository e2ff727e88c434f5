"""What profiling costs a training step, measured in one process (issue 16, items 8 and 9).

Two measurements:

``light``: the always-on light mode (``OPSD_PROFILE=timers`` + ``prof.log_step`` every step) against
profiling off, in one process: ``--pairs`` pairs of adjacent steps, one on and one off, in ABBA order
(pair k is on-off for even k, off-on for odd k) after ``--warmup`` steps. Per pair d = on - off
(wall time of the step, the ``log_step`` call and ``prof.step()``, with a CUDA synchronisation at
both ends). Prints the mean relative cost mean(d) / mean(off) and its one-sided 95% upper confidence
bound (Student t on the paired differences; also a bootstrap bound). Target: upper bound <= 1%.

``linger``: profiling leaves no lasting cost. One process runs ``--steps`` steps in mode ``1`` with a
recorded window early (``--window``, default 24-26 of 60 steps) and a second window at the end; prints the median
step time before the first window, of the recorded steps, and after it (the steps up to the second
window's warm-up), the ratio after / before with a 95% bootstrap interval, the time of the trace
export, and whether CUDA graphs still capture and replay after each window (a graph captured before
any profiling is replayed, and a new one captured and replayed; results checked against eager).
``host``: where the on path's host time goes, per timed step (``OPSD_PROFILE=timers`` + ``prof.log_step``):
the time spent inside each entry point profiling adds to a step (``stage()`` enter and exit, the work records
after the rollout and after training, ``prof.log_step``, ``prof.step()`` with the work sidecar's write inside it),
median over ``--steps`` steps after ``--warmup``. Two arms alternate step by step: ``shipped`` and ``reread``
(each model's geometry and the student's trainable count read again by every record, as before the work
recorder kept them). Host time is what a host-bound step pays in full; on the CPU use
``--student tiny-qwen2-deep`` (the 3B's 36 layers and 434 parameter tensors at tiny width).

``--teardown-cupti 0|1`` sets ``OPSD_PROFILE_TEARDOWN_CUPTI`` (Kineto's ``TEARDOWN_CUPTI=1``; left out: the
default, on where torch's CUDA runtime is >= 12.6).
``--processes K`` runs K child processes alternating ``--teardown-cupti 0`` / ``1`` and prints one
table of all of them.

Workloads: ``--workload opsd`` (default) is ``scripts/train_opsd.py``'s OPSD step (built by :mod:`rollout.job`, the
main job's library), built from the
arguments after ``--`` (the same flags, e.g. ``--student qwen25-3b --teacher qwen25-3b``);
``--workload synthetic`` is a small stand-in (matmuls in stage ranges, a CUDA-graph "decode" on GPU)
for trying the script on a CPU. ``--json-out`` writes every step time and the summary.

    python -m benchmarks.profiler_cost light --pairs 60 -- --student qwen25-3b --teacher qwen25-3b
    python -m benchmarks.profiler_cost linger --processes 4 --fixed-work -- --student qwen25-3b --teacher qwen25-3b
    python -m benchmarks.profiler_cost host --steps 20 --fixed-work -- --student tiny-qwen2-deep \
        --teacher tiny-qwen2-deep --batch-size 4 --samples-per-prompt 4 --max-new-tokens 16 --prompt-len 16
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks import profiler_host
from benchmarks.harness import results
from benchmarks.harness.cli import int_at_least
from benchmarks.harness.meta import run_meta
from benchmarks.harness.rounds import Timer, round_order
from benchmarks.harness.table import markdown_table
from instrumentation import ProfileConfig, configure, opsd_profiler, stage, stages
from instrumentation.config import parse_int_list
from instrumentation.tracing import teardown_cupti


# ---- workloads --------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class OpsdWorkload:
    """``scripts/train_opsd.py``'s OPSD step (its flags), one call per training step."""

    def __init__(self, train_args: list[str], num_steps: int, fixed_work: bool = False):
        from rollout import SamplingConfig
        from rollout.job import StepInputs, build_step, parse_args
        from rollout.opsd.engines import init_distributed

        args = parse_args(train_args + ["--steps", str(num_steps)])
        job = self.job = args.job
        self.rank, _, self.device = init_distributed()
        self.step = build_step(job, args.opsd, self.device)
        self.inputs, self.first = StepInputs(job, self.step, self.rank, self.device), None
        self.sampling = SamplingConfig(max_new_tokens=job.max_new_tokens, temperature=job.sampling_temperature,
                                       n_samples_per_prompt=job.samples_per_prompt)
        self.params = _num_params(getattr(self.step, "student", None)), _num_params(getattr(self.step, "teacher", None))
        self.fixed_work = fixed_work

    def _inputs(self, index: int):
        """The main job's inputs of step ``index`` (drawn in order); with ``fixed_work`` step 0's every time."""
        if self.fixed_work:  # the same prompts and sampling seed every step: same shapes, no recompiles
            self.first = self.first or self.inputs(0)
            return 0, self.first
        return index, self.inputs(index)

    def run(self, index: int) -> dict:
        import dataclasses

        from instrumentation.mfu import mfu, opsd_step_flops, peak_flops
        from rollout.job import step_seed

        index, (_, ids, mask, extra) = self._inputs(index)
        result = self.step.step(ids, mask, dataclasses.replace(self.sampling, seed=step_seed(self.job.seed, self.rank,
                                                                                              index)), **extra)
        prompt_tokens = int(mask.sum()) * self.job.samples_per_prompt
        flops = None
        if None not in self.params:
            flops = opsd_step_flops(self.params[0], self.params[1], prompt_tokens, result.num_response_tokens)
        peak = peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        return {"loss": result.loss, "tokens_per_s": result.rollout_tokens_per_s, "step_ms": result.step_ms,
                "mfu": mfu(flops, result.step_ms / 1e3, peak) if flops is not None else None}


def _num_params(model):
    from instrumentation.mfu import matmul_params

    try:
        return matmul_params(model)
    except Exception:
        return None


class SyntheticWorkload:
    """Matmuls in stage ranges: eager prefill (many launches), a CUDA-graph decode on GPU, a sync."""

    def __init__(self, size: int = 256, decode_steps: int = 16):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.w = torch.randn(size, size, device=self.device) / size ** 0.5  # w: [H, H]
        self.x = torch.randn(64, size, device=self.device)  # x: [B, H]
        self.decode_steps, self.graph = decode_steps, None
        if self.device.type == "cuda":
            self.graph, self.static_out = capture_graph(lambda: torch.tanh(self.x @ self.w))

    def run(self, index: int) -> dict:
        t0 = time.perf_counter()
        with stage(stages.STEP):
            with stage(stages.ROLLOUT):
                with stage(stages.PREFILL):
                    h = self.x
                    for _ in range(32):
                        h = torch.tanh(h @ self.w)
                for _ in range(self.decode_steps):
                    with stage(stages.DECODE):
                        if self.graph is not None:
                            self.graph.replay()
                        else:
                            h = torch.tanh(h @ self.w)
            with stage(stages.LOSS):
                loss = float(h.square().mean())
        return {"loss": loss, "tokens_per_s": None, "step_ms": (time.perf_counter() - t0) * 1e3, "mfu": None}


def capture_graph(fn):
    """(graph, output) of ``fn`` captured on a side stream after a warm-up (CUDA only)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def make_workload(args, num_steps: int):
    if args.workload == "synthetic":
        return SyntheticWorkload()
    return OpsdWorkload(args.train_args, num_steps, fixed_work=args.fixed_work)


# ---- statistics -------------------------------------------------------------------------------------
def t_quantile_95(df: int) -> float:
    """One-sided 95% quantile of Student's t (Cornish-Fisher expansion; within 0.05% for df >= 5)."""
    z = 1.6448536269514722
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_cost(on: list[float], off: list[float], seed: int = 0) -> dict:
    """Relative cost of ``on`` over ``off`` (paired), with its one-sided 95% upper bounds."""
    d = np.array(on) - np.array(off)
    base = float(np.mean(off))
    n = len(d)
    sd = float(np.std(d, ddof=1)) if n > 1 else float("nan")
    ucb = (float(d.mean()) + t_quantile_95(n - 1) * sd / math.sqrt(n)) / base if n > 1 else None
    rng = np.random.default_rng(seed)
    boot = [rng.choice(d, n).mean() / base for _ in range(4000)]
    return {"pairs": n, "off_mean_ms": base, "diff_sd_ms": sd, "on_mean_ms": float(np.mean(on)), "diff_mean_ms": float(d.mean()),
            "relative": float(d.mean()) / base, "ucb95_t": ucb, "ucb95_bootstrap": float(np.quantile(boot, 0.95))}


#: |drift| above which the steps before a window are called not steady (``before_drift``).
DRIFT_WARN = 0.05


def before_drift(before: list[float]) -> float | None:
    """median(second half) / median(first half) - 1 of the steps before a window: a workload that is still
    speeding up or slowing down (clocks, caches, the model changing) makes after / before meaningless."""
    if len(before) < 4:
        return None
    half = len(before) // 2
    return statistics.median(before[half:]) / statistics.median(before[:half]) - 1.0


def ratio_of_medians(after: list[float], before: list[float], seed: int = 0) -> dict:
    """median(after) / median(before) with a 95% bootstrap interval (steps resampled)."""
    rng = np.random.default_rng(seed)
    a, b = np.array(after), np.array(before)
    boot = [np.median(rng.choice(a, len(a))) / np.median(rng.choice(b, len(b))) for _ in range(4000)]
    return {"ratio": float(np.median(a) / np.median(b)), "low": float(np.quantile(boot, 0.025)),
            "high": float(np.quantile(boot, 0.975))}


# ---- light mode -------------------------------------------------------------------------------------
#: Wall ms of a step, the device synchronised before and after it.
_timed = Timer("cuda" if torch.cuda.is_available() else "cpu")


def measure_light(args) -> dict:
    total = args.warmup + 2 * args.pairs
    workload = make_workload(args, total)
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="opsd_light_")
    on_cfg = ProfileConfig.from_env({}, mode="timers", output_dir=out_dir, run_name=f"light-{os.getpid()}")
    off_cfg = ProfileConfig(mode="0")
    on_ms, off_ms, order = [], [], []
    with opsd_profiler(on_cfg) as prof:
        for index in range(total):
            if index == args.warmup and args.gc_freeze:  # both arms alike: no long gen-2 collections in pairs
                gc.collect()
                gc.freeze()
            pair, first = divmod(index - args.warmup, 2)  # the harness's order: on off, off on, ...
            on = index < args.warmup or round_order(("on", "off"), pair)[first] == "on"
            configure(on_cfg if on else off_cfg)

            def one_step():
                figures = workload.run(index)
                if on:
                    prof.log_step(index, **figures)
                prof.step()

            ms, _ = _timed(one_step)
            if index >= args.warmup:
                (on_ms if on else off_ms).append(ms)
                order.append("on" if on else "off")
    configure(off_cfg)
    result = {"measure": "light", "workload": args.workload, "fixed_work": args.fixed_work,
              "gc_freeze": args.gc_freeze, "device": _device(),
              **paired_cost(on_ms, off_ms),
              "on_ms": on_ms, "off_ms": off_ms, "order": order, "scalars_dir": prof.scalars_dir}
    print_light(result)
    return result


def print_light(r: dict) -> None:
    work = (", fixed work" if r.get("fixed_work") else "") + (", gc frozen" if r.get("gc_freeze") else "")
    print(f"light mode (OPSD_PROFILE=timers + log_step) vs off, {r['workload']}{work} on {r['device']}, "
          f"{r['pairs']} ABBA pairs")
    ucb = r["ucb95_t"]
    print(markdown_table(["off mean ms", "on mean ms", "mean diff ms", "cost", "95% upper bound (t)", "(bootstrap)",
                          "<= 1%"],
                         [[f"{r['off_mean_ms']:.2f}", f"{r['on_mean_ms']:.2f}", f"{r['diff_mean_ms']:+.3f}",
                           f"{100 * r['relative']:+.3f}%", f"{100 * ucb:+.3f}%", f"{100 * r['ucb95_bootstrap']:+.3f}%",
                           "yes" if ucb <= 0.01 else "NO"]]))
    print(f"scalars: {r['scalars_dir']}")


# ---- lingering cost ---------------------------------------------------------------------------------
def graph_check(graph_before, label: str) -> dict:
    """Replay the graph captured before profiling, capture and replay a new one; compare with eager."""
    if not torch.cuda.is_available():
        return {"label": label, "status": "skipped (no CUDA)"}
    try:
        graph, out, x, w = graph_before
        x.normal_()
        graph.replay()
        _sync()
        replay_err = float((out - torch.tanh(x @ w)).abs().max())
        new_graph, new_out = capture_graph(lambda: torch.tanh(x @ w + 1))
        x.normal_()
        new_graph.replay()
        _sync()
        capture_err = float((new_out - torch.tanh(x @ w + 1)).abs().max())
        ok = replay_err < 1e-3 and capture_err < 1e-3
        return {"label": label, "status": "ok" if ok else "WRONG RESULT", "replay_max_err": replay_err,
                "capture_max_err": capture_err}
    except Exception as exc:  # what we are looking for: report it, do not hide it
        return {"label": label, "status": f"FAILED: {type(exc).__name__}: {exc}"}


def _graph_before_profiling():
    if not torch.cuda.is_available():
        return None
    x = torch.randn(256, 256, device="cuda")  # x: [256, 256]
    w = torch.randn(256, 256, device="cuda") / 16
    graph, out = capture_graph(lambda: torch.tanh(x @ w))
    return graph, out, x, w


def measure_linger(args) -> dict:
    first = parse_int_list(args.window, "--window")  # checked by parse_args
    a, b = first[0], first[-1]
    if args.teardown_cupti is not None:
        os.environ["OPSD_PROFILE_TEARDOWN_CUPTI"] = str(args.teardown_cupti)
    second = (args.steps, args.steps + 1)
    total = args.steps + 4
    workload = make_workload(args, total)
    graph = _graph_before_profiling()
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="opsd_linger_")
    cfg = ProfileConfig.from_env(os.environ, mode="1", output_dir=out_dir, steps=tuple(first) + second,
                                 run_name=f"linger-teardown{args.teardown_cupti}-{os.getpid()}")
    step_ms, prof_ms, checks = [], [], []
    with opsd_profiler(cfg) as prof:
        for index in range(total):
            if index == b + 2:
                checks.append(graph_check(graph, f"after window {a}-{b}"))
            ms, _ = _timed(lambda: workload.run(index))
            step_ms.append(ms)
            p_ms, _ = _timed(prof.step)
            prof_ms.append(p_ms)
    checks.append(graph_check(graph, f"after window {second[0]}-{second[1]}"))
    before, recorded = step_ms[1:a - 1], step_ms[a:b + 1]
    after = step_ms[b + 1:second[0] - 1]
    result = {"measure": "linger", "workload": args.workload, "device": _device(),
              "teardown_cupti": teardown_cupti(cfg), "torch": torch.__version__, "cuda": torch.version.cuda,
              "window": [a, b], "second_window": list(second), "median_before_ms": statistics.median(before),
              "median_recorded_ms": statistics.median(recorded), "median_after_ms": statistics.median(after),
              "after_over_before": ratio_of_medians(after, before),
              "recorded_over_before": statistics.median(recorded) / statistics.median(before),
              "before_drift": before_drift(before),
              "export_ms": prof_ms[b], "graph_checks": checks, "step_ms": step_ms, "prof_step_ms": prof_ms,
              "traces": prof.trace_paths()}
    print_linger(result)
    return result


def print_linger(r: dict) -> None:
    a, b = r["window"]
    q = r["after_over_before"]
    print(f"lingering cost: {r['workload']} on {r['device']}, torch {r['torch']} CUDA {r['cuda']}, "
          f"TEARDOWN_CUPTI {'1' if r['teardown_cupti'] else 'unset'}, window {a}-{b}")
    print(f"median step ms: before {r['median_before_ms']:.1f} (steps 1-{a - 2}), recorded "
          f"{r['median_recorded_ms']:.1f} ({a}-{b}, x{r['recorded_over_before']:.3f}), after "
          f"{r['median_after_ms']:.1f} ({b + 1}-{r['second_window'][0] - 2})")
    print(f"after / before: {q['ratio']:.4f} (95% bootstrap {q['low']:.4f}-{q['high']:.4f}); "
          f"trace export in prof.step(): {r['export_ms']:.0f} ms")
    drift = r.get("before_drift")
    if drift is not None and abs(drift) > DRIFT_WARN:
        print(f"WARNING: the steps before the window drifted by {100 * drift:+.1f}% (second half vs first half): "
              "the workload was not steady, so after / before mixes that drift with any lingering cost; "
              "start the window later (--window, --steps)")
    for c in r["graph_checks"]:
        print(f"cuda graphs {c['label']}: {c['status']}")


def run_processes(args, passthrough: list[str]) -> list[dict]:
    """``--processes K`` children alternating ``--teardown-cupti 0/1``; one table at the end."""
    out = []
    for k in range(args.processes):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, "-m", "benchmarks.profiler_cost", "linger", "--teardown-cupti", str(k % 2),
               "--json-out", path, *passthrough]
        proc = subprocess.run(cmd, text=True)
        if proc.returncode != 0:
            out.append({"teardown_cupti": bool(k % 2), "failed": proc.returncode})
            continue
        out.append(results.read(path).rows[0])
    print(markdown_table(["process", "TEARDOWN_CUPTI", "before ms", "drift before", "recorded ms", "after ms",
                          "after/before (95%)", "graphs"], [_process_cells(k, r) for k, r in enumerate(out)]))
    return out


def _process_cells(k: int, r: dict) -> list:
    if "failed" in r:
        return [k, int(r["teardown_cupti"]), f"process failed (exit {r['failed']})", "", "", "", "", ""]
    q = r["after_over_before"]
    drift = r.get("before_drift")
    return [k, int(r["teardown_cupti"]), f"{r['median_before_ms']:.1f}",
            f"{100 * drift:+.1f}%" if drift is not None else "n/a", f"{r['median_recorded_ms']:.1f}",
            f"{r['median_after_ms']:.1f}", f"{q['ratio']:.4f} ({q['low']:.4f}-{q['high']:.4f})",
            ", ".join(c["status"] for c in r["graph_checks"])]


# ---- main -------------------------------------------------------------------------------------------
def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiler_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measure", choices=("light", "linger", "host"))
    p.add_argument("--workload", choices=("opsd", "synthetic"), default="opsd")
    p.add_argument("--pairs", type=int_at_least(2), default=60, help="light: on/off pairs (>= 50 for the report)")
    p.add_argument("--warmup", type=int_at_least(0), default=6, help="light: steps before the pairs (on)")
    p.add_argument("--steps", type=int_at_least(2), default=60,
                   help="linger: steps before the second window; host: timed steps (both arms)")
    p.add_argument("--window", default="24-26",
                   help="linger: the early recorded window, 'A-B' (late enough for the steps before it to be "
                        "steady: on the H200 a 3B OPSD step drifted up ~25%% within its first ten steps)")
    p.add_argument("--teardown-cupti", type=int, choices=(0, 1), default=None)
    p.add_argument("--processes", type=int_at_least(0), default=0,
                   help="linger: K child processes, teardown 0/1 alternating")
    p.add_argument("--fixed-work", action="store_true",
                   help="opsd: every step reuses step 0's prompts and sampling seed (fixed shapes and lengths, "
                        "so the step's own variation does not swamp a small cost)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="light, host: gc.collect() + gc.freeze() after the warm-up (the model's objects leave the "
                        "collector's generations, as training loops that freeze after setup do)")
    p.add_argument("--output-dir", default=None, help="where traces and scalars go (default: a temp dir)")
    p.add_argument("--json-out", default=None, help="write the result file here (one row: the measurement)")
    args, rest = p.parse_known_args(argv)
    args.train_args = [x for x in rest if x != "--"]
    if args.measure == "linger":
        try:
            window = parse_int_list(args.window, "--window")
        except ValueError as exc:
            p.error(str(exc))
        if not (3 <= window[0] and window[-1] + 4 <= args.steps):  # step 0 warms up, a-1 is the profiler's warm-up
            p.error(f"--window {args.window} must start at step >= 3 and end at least 4 steps before --steps "
                    f"({args.steps})")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.measure == "linger" and args.processes:
        passthrough = [x for x in argv if x not in ("linger",)]
        skip = {"--processes", "--teardown-cupti", "--json-out"}
        cleaned, i = [], 0
        while i < len(passthrough):
            if passthrough[i] in skip:
                i += 2
                continue
            cleaned.append(passthrough[i])
            i += 1
        result = {"processes": run_processes(args, cleaned)}
    else:
        if args.measure == "host":
            result = profiler_host.measure_host(args, make_workload(args, args.warmup + args.steps), _device())
        else:
            result = measure_light(args) if args.measure == "light" else measure_linger(args)
    if args.json_out:
        results.write(args.json_out, run_meta("profiler_cost", argv, "cuda" if torch.cuda.is_available() else "cpu",
                                              workload=args.workload), [result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
