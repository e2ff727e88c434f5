"""ZeRO stage x rollout gathering x GPU count x launcher: OPSD step time and peak memory per rank.

Runs ``scripts/train_opsd.py --json-out`` once per variant, each under a launcher (``torchrun
--standalone`` or the ``deepspeed`` launcher) in its own process group with a time limit, collects
the JSON reports and prints one markdown table: variant, launcher, GPUs, ZeRO stage, gather,
median seconds per OPSD step (first step excluded as warm-up; the slowest rank's median), rollout
tokens/s (all ranks together), peak memory per rank (CUDA max allocated during the steps; peak RSS
on the CPU), the last step's loss (mean over ranks). A variant that fails or runs out of time
becomes a row with the tail of its log; the others still run. ``--out`` holds every row (and each
run's full report) and is rewritten after every variant, so a run cut short keeps what finished.

    # issue 8: random Qwen2.5-3B-shaped student and teacher, 1 and 2 GPUs, six variants
    python -m benchmarks.multigpu --student qwen25-3b --teacher qwen25-3b --batch-size 2 \\
        --samples-per-prompt 4 --max-new-tokens 128 --prompt-len 256 --steps 4 --nproc 1 2 --out bench8.json
    # the same under the deepspeed launcher, with per-rank traces and their summary per variant
    python -m benchmarks.multigpu ... --launcher deepspeed --profile traces8
    python -m benchmarks.multigpu --merge bench8.json bench8-ds.json    # one table from several runs

Variants (``--variants``): ``zeroS`` (S = 0, 1, 2, 3) or ``zero3-once`` / ``zero3-per_forward``
(``RolloutConfig.gather``), each optionally with ``/Ngpu`` to pin its GPU count; a variant without
it runs once per ``--nproc`` value. Every flag this script does not know is passed to
``train_opsd.py`` (checked by its own parser before anything runs: :func:`rollout.job.parse_args`);
``--zero-stage``, ``--gather`` and ``--json-out`` come from the variant. ``--profile DIR`` runs every variant with ``OPSD_PROFILE=1
OPSD_PROFILE_RANKS=all OPSD_PROFILE_DIR=DIR/<launcher>-<variant>-<N>gpu`` and afterwards prints
``scripts/summarize_trace.py --by-rank`` of the run's trace directory (the profiled steps carry the
profiler's overhead: take step times from runs without ``--profile``). The other ``OPSD_PROFILE_*``
variables of the environment are kept (``OPSD_PROFILE_STEPS=1`` records one step after the warm-up
and keeps traces small); the summaries are also stored in ``--out``. Without ``--profile`` every run
gets ``OPSD_PROFILE=0``. Launchers run through this interpreter (``python -m torch.distributed.run``,
``python -m deepspeed.launcher.runner``), so neither needs to be on PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.harness import results
from benchmarks.harness.cli import finite_number
from benchmarks.harness.meta import run_meta
from benchmarks.harness.programs import REPO, SUMMARIZE_SCRIPT, TRAIN_SCRIPT
from benchmarks.harness.table import markdown_table

LAUNCHERS = ("torchrun", "deepspeed")
DEFAULT_VARIANTS = ("zero0", "zero3-once", "zero3-per_forward")
DEFAULT_NPROC = (1, 2)
#: Flags of train_opsd.py that each variant sets itself.
RESERVED_FLAGS = ("--zero-stage", "--gather", "--json-out", "--local_rank", "--local-rank")
#: Characters of a failed variant's log kept in its row.
ERROR_TAIL_CHARS = 3000
#: Seconds between SIGTERM and SIGKILL of a variant's process group on timeout.
KILL_GRACE_S = 10
SUMMARY_TIMEOUT_S = 300
_VARIANT_RE = re.compile(r"^zero(?P<stage>[0-3])(?:-(?P<gather>once|per_forward))?(?:/(?P<gpus>[1-9]\d*)gpu)?$")


# ---- variants -----------------------------------------------------------------------------------
def parse_variant(text: str) -> dict:
    """``"zero3-once/2gpu"`` -> ``{"variant": "zero3-once", "zero_stage": 3, "gather": "once", "gpus": 2}``.

    ``gpus`` is None when the name carries no ``/Ngpu``; ``gather`` is None for stages 0-2 (it only
    matters under ZeRO-3, where it defaults to ``once``).
    """
    match = _VARIANT_RE.match(text.strip())
    if match is None:
        raise ValueError(f"--variants: {text!r} is not a variant; use zeroS (S in 0-3), zero3-once or "
                         "zero3-per_forward, optionally followed by /Ngpu (e.g. zero3-once/2gpu)")
    stage, gather = int(match["stage"]), match["gather"]
    if gather is not None and stage != 3:
        raise ValueError(f"--variants: {text!r}: the gather mode only applies to ZeRO-3 (zero3-{gather})")
    if stage == 3 and gather is None:
        gather = "once"
    name = f"zero{stage}" if stage != 3 else f"zero3-{gather}"
    return {"variant": name, "zero_stage": stage, "gather": gather,
            "gpus": int(match["gpus"]) if match["gpus"] else None}


def expand_runs(variants: list[str], nprocs: list[int], launchers: list[str]) -> list[dict]:
    """Every (launcher, GPU count, variant) to run, without duplicates: per launcher, by GPU count,
    then in the order of ``variants``. A variant with ``/Ngpu`` runs at N GPUs only."""
    parsed = [parse_variant(v) for v in variants]
    keyed = {}
    for li, launcher in enumerate(launchers):
        for vi, spec in enumerate(parsed):
            for gpus in ([spec["gpus"]] if spec["gpus"] is not None else nprocs):
                key = (launcher, gpus, spec["variant"])
                keyed.setdefault(key, ((li, gpus, vi), {**spec, "gpus": gpus, "launcher": launcher,
                                                        "id": f"{launcher}-{spec['variant']}-{gpus}gpu"}))
    return [run for _, run in sorted(keyed.values(), key=lambda item: item[0])]


# ---- one run ------------------------------------------------------------------------------------
def train_args(run: dict, job_args: list[str], json_path: Path) -> list[str]:
    """train_opsd.py's arguments for ``run``."""
    args = [*job_args, "--zero-stage", str(run["zero_stage"])]
    if run["gather"] is not None:
        args += ["--gather", run["gather"]]
    return args + ["--json-out", str(json_path)]


def launch_command(run: dict, job_args: list[str], json_path: Path) -> list[str]:
    """The launcher command line (through this interpreter, so no launcher has to be on PATH)."""
    from rollout.opsd.engines import free_port  # torch: imported when a run is launched

    args = train_args(run, job_args, json_path)
    if run["launcher"] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(run["gpus"]), str(TRAIN_SCRIPT), *args]
    # The deepspeed launcher appends --local_rank=N to the script's arguments (train_opsd accepts it).
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(run["gpus"]),
            "--master_port", str(free_port()), str(TRAIN_SCRIPT), *args]


def run_env(run: dict, profile_dir: Optional[Path]) -> dict:
    """The variant's environment: this one, with the repository importable and profiling set."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OPSD_PROFILE_RUN_NAME"):  # each run: its own
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    # Same host threads per rank under both launchers (torchrun alone would default to 1).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // run["gpus"])))
    if profile_dir is None:
        env["OPSD_PROFILE"] = "0"
    else:
        env.update({"OPSD_PROFILE": "1", "OPSD_PROFILE_RANKS": "all",
                    "OPSD_PROFILE_DIR": str(profile_dir / run["id"])})
    return env


def run_bounded(argv: list[str], env: dict, log_path: Path, timeout_s: float) -> tuple[Optional[int], float]:
    """Run ``argv`` in its own process group, output to ``log_path``; ``(exit status or None on
    timeout, wall seconds)``. On timeout (or Ctrl-C) the whole group is ended."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            code = None
        except BaseException:
            _end_group(proc)
            raise
    return code, time.monotonic() - started


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


_NOISE_RE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING)\]|Warning: |^\s+return func\(|warnings\.warn\(")
#: Where a launcher starts reporting a failed rank (what follows is the launcher's own traceback).
_LAUNCHER_FAILURE_RE = re.compile(r"failed \(exitcode: -?\d+\)|exits with return code|ChildFailedError")
_EXCEPTION_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?P<line>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?.*)$")


def error_tail(log_path: Path, chars: int = ERROR_TAIL_CHARS) -> str:
    """The cause (the first exception line of a rank) and the end of the ranks' output, without
    DeepSpeed's info lines, Python warnings and the launcher's own traceback."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    lines = [line for line in text.splitlines()[1:] if not _NOISE_RE.search(line)]  # [0]: the command
    for index, line in enumerate(lines):
        if _LAUNCHER_FAILURE_RE.search(line):
            lines = lines[:index] or lines
            break
    causes = [m["line"] for m in map(_EXCEPTION_RE.match, lines) if m and "ChildFailedError" not in m["line"]]
    tail = "\n".join(lines)[-chars:]
    return f"cause: {causes[0]}\n{tail}" if causes else tail


@dataclass
class VariantRow:
    """One variant's run: what ran, how it ended, and (``status`` ok) the figures of its report."""

    id: str
    variant: str
    launcher: str
    gpus: int
    zero_stage: int
    gather: Optional[str] = None
    command: list = field(default_factory=list)
    log: str = ""
    profiled: bool = False
    wall_s: Optional[float] = None
    exit_status: Optional[int] = None
    """None: timed out."""
    status: str = ""
    """``ok``, ``failed`` or ``timeout``."""
    error: Optional[str] = None
    median_step_s: Optional[float] = None
    last_step_s: Optional[float] = None
    rollout_tokens_per_s: Optional[float] = None
    peak_memory: Optional[str] = None
    """What ``peak_gib_per_rank`` measures: ``cuda_max_allocated`` or ``cpu_peak_rss``."""
    peak_gib_per_rank: list = field(default_factory=list)
    peak_gib_max: Optional[float] = None
    last_loss: Optional[float] = None
    last_losses: list = field(default_factory=list)
    device_name: Optional[str] = None
    reported_launcher: Optional[str] = None
    report: Optional[dict] = None
    """train_opsd.py's ``--json-out`` report (every rank)."""
    trace_dirs: list = field(default_factory=list)
    trace_summary_status: Optional[int] = None
    trace_summary: Optional[str] = None


def row_from_report(run: dict, report: dict) -> dict:
    """The table figures of a successful run."""
    peaks = report.get("peak_gib_per_rank") or []
    last_steps = [r["step_ms"][-1] / 1000.0 for r in report.get("ranks", []) if r.get("step_ms")]
    return {"median_step_s": report.get("median_step_s"), "last_step_s": max(last_steps) if last_steps else None,
            "rollout_tokens_per_s": report.get("rollout_tokens_per_s"),
            "peak_memory": report.get("peak_memory"), "peak_gib_per_rank": peaks,
            "peak_gib_max": max(peaks) if peaks else None, "last_loss": report.get("last_loss"),
            "last_losses": [r["losses"][-1] for r in report.get("ranks", []) if r.get("losses")],
            "device_name": report.get("device_name"), "reported_launcher": report.get("launcher"),
            "zero_stage": report.get("zero_stage", run["zero_stage"])}


def new_run_dirs(variant_dir: Path, before: set) -> list[Path]:
    if not variant_dir.is_dir():
        return []
    return sorted(p for p in variant_dir.glob("run-*") if p.is_dir() and p not in before)


def summarize_traces(run_dirs: list[Path], env: dict) -> tuple[Optional[int], str]:
    """``summarize_trace.py --by-rank`` over ``run_dirs``: ``(exit status, output)``."""
    argv = [sys.executable, str(SUMMARIZE_SCRIPT), *map(str, run_dirs), "--by-rank"]
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SUMMARY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"summarize_trace.py timed out after {SUMMARY_TIMEOUT_S} s"
    return proc.returncode, proc.stdout + (("\n" + proc.stderr) if proc.stderr.strip() else "")


def run_variant(run: dict, job_args: list[str], work_dir: Path, timeout_s: float,
                profile_dir: Optional[Path]) -> VariantRow:
    """Run one variant; a row (``status`` ok / failed / timeout), never an exception for its failure."""
    json_path = work_dir / f"{run['id']}.json"
    log_path = work_dir / f"{run['id']}.log"
    json_path.unlink(missing_ok=True)
    argv = launch_command(run, job_args, json_path)
    env = run_env(run, profile_dir)
    variant_dir = None if profile_dir is None else profile_dir / run["id"]
    before = set(variant_dir.glob("run-*")) if variant_dir is not None and variant_dir.is_dir() else set()
    row = VariantRow(**{key: run[key] for key in ("id", "variant", "launcher", "gpus", "zero_stage", "gather")},
                     command=argv, log=str(log_path), profiled=profile_dir is not None)
    code, row.wall_s = run_bounded(argv, env, log_path, timeout_s)
    row.exit_status = code
    report = None
    if json_path.is_file():
        try:
            report = json.loads(json_path.read_text())
        except ValueError as exc:
            row.error = f"unreadable report {json_path}: {exc}"
    if code is None:
        row.status, row.error = "timeout", f"timed out after {timeout_s:.0f} s\n{error_tail(log_path)}"
    elif code != 0:
        row.status, row.error = "failed", f"exit status {code}\n{error_tail(log_path)}"
    elif report is None:
        row.status, row.error = "failed", row.error or f"no report at {json_path}\n{error_tail(log_path)}"
    elif report.get("world_size") != run["gpus"] or len(report.get("ranks", [])) != run["gpus"]:
        row.status, row.error = "failed", (f"report has world size {report.get('world_size')} and "
                                           f"{len(report.get('ranks', []))} ranks; expected {run['gpus']}")
    else:
        row = dataclasses.replace(row, status="ok", error=None, **row_from_report(run, report))
    row.report = report
    if variant_dir is not None:
        run_dirs = new_run_dirs(variant_dir, before)
        row.trace_dirs = [str(p) for p in run_dirs]
        if run_dirs:
            row.trace_summary_status, row.trace_summary = summarize_traces(run_dirs, env)
        else:
            row.trace_summary = f"no trace directory under {variant_dir}"
    return row


# ---- output -------------------------------------------------------------------------------------
def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _first_error_line(error: Optional[str]) -> str:
    """The error's cause line (see :func:`error_tail`), else its last meaningful line, for the table."""
    if not error:
        return ""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if lines and lines[0].startswith("timed out"):
        return lines[0]
    cause = next((line[len("cause: "):] for line in lines if line.startswith("cause: ")), None)
    text = cause or (lines[-1] if lines else "")
    if cause is None and len(lines) > 1 and lines[0].startswith(("timed out", "exit status", "no report")):
        text = f"{lines[0]}; {text}"
    return text[:200].replace("|", "/")


HEADER = ("variant", "launcher", "GPUs", "ZeRO", "gather", "median s/step", "last step s", "rollout tok/s",
          "peak GiB max", "peak GiB per rank", "last loss", "status")


def _cells(row: VariantRow) -> list:
    ok = row.status == "ok"
    status = "ok" + (" (profiled)" if row.profiled else "") if ok else f"{row.status}: {_first_error_line(row.error)}"
    figures = [_num(row.median_step_s, ".3f"), _num(row.last_step_s, ".3f"), _num(row.rollout_tokens_per_s, ".0f"),
               _num(row.peak_gib_max, ".2f"), ", ".join(format(p, ".2f") for p in row.peak_gib_per_rank) or "-",
               _num(row.last_loss, ".5f")]
    return [row.variant, row.launcher, row.gpus, row.zero_stage, row.gather or "-",
            *(figures if ok else ["-"] * len(figures)), status]


def format_table(rows: list[VariantRow]) -> str:
    """One markdown table of the rows (failed ones with their error's cause), and what the columns mean."""
    kinds = {row.peak_memory for row in rows if row.status == "ok"}
    notes = {"cuda_max_allocated": "peak GiB: torch.cuda.max_memory_allocated per rank during the training steps",
             "cpu_peak_rss": "peak GiB: peak resident set size of each rank's process (CPU run)"}
    devices = sorted({row.device_name for row in rows if row.device_name})
    footer = [notes[k] for k in sorted(k for k in kinds if k in notes)]
    footer.append("median s/step: median over the steps after the first (warm-up), slowest rank; last step s: the "
                  "last step, slowest rank (the steady state when warm-up outlasts step 1); rollout tok/s: sum over "
                  "ranks of each rank's median")
    if devices:
        footer.append("device: " + ", ".join(devices))
    return markdown_table(HEADER, [_cells(row) for row in rows]) + "\n\n" + "\n".join(footer)


def progress_line(index: int, total: int, row: VariantRow) -> str:
    head = f"[{index}/{total}] {row.variant} {row.gpus}gpu ({row.launcher}): {row.status}"
    if row.status == "ok":
        return (f"{head}, {row.median_step_s:.3f} s/step, {_num(row.rollout_tokens_per_s, '.0f')} tok/s, "
                f"peak {_num(row.peak_gib_max, '.2f')} GiB, wall {row.wall_s:.0f} s")
    return f"{head} after {row.wall_s:.0f} s (log: {row.log})\n{row.error}"


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multigpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # every unknown flag goes to train_opsd.py whole
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="V",
                        help="zeroS, zero3-once, zero3-per_forward, optionally /Ngpu "
                             f"(default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--nproc", nargs="+", type=int, default=list(DEFAULT_NPROC), metavar="N",
                        help="processes (GPUs) per run, each variant once per value (default: 1 2)")
    parser.add_argument("--launcher", nargs="+", choices=LAUNCHERS, default=["torchrun"],
                        help="torchrun (--standalone) and/or the deepspeed launcher (default: torchrun)")
    parser.add_argument("--timeout", type=finite_number(0.0, above=True), default=480.0, help="s per variant (480)")
    parser.add_argument("--out", default=None, help="all rows as JSON (default bench_multigpu.json; "
                                                    "with --merge: written only when given)")
    parser.add_argument("--work-dir", default=None,
                        help="per-variant reports and logs (default: <out without .json>.runs)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="trace every rank into DIR/<launcher>-<variant>-<N>gpu, then summarize --by-rank")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="print one table of the rows of earlier --out files (and write --out); runs nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args, job_args = parser.parse_known_args(argv)
    if args.merge is None:
        for value in args.nproc:
            if value < 1:
                parser.error(f"--nproc: must be >= 1; got {value}")
        try:
            expand_runs(args.variants, args.nproc, args.launcher)
        except ValueError as exc:
            parser.error(str(exc))
        for arg in job_args:
            if arg.split("=", 1)[0] in RESERVED_FLAGS:
                parser.error(f"{arg.split('=', 1)[0]}: set by each variant (see --variants); do not pass it")
        if args.timeout <= 0:
            parser.error(f"--timeout: must be > 0; got {args.timeout}")
        check_job_args(parser, job_args)
    return args, job_args


def check_job_args(parser: argparse.ArgumentParser, job_args: list[str]) -> None:
    """train_opsd.py's own parser on the passed-through flags: a bad one fails here, before any run."""
    try:
        import contextlib
        import io

        from rollout.job import parse_args  # torch and transformers: imported when flags are checked

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            parse_args(job_args)
    except SystemExit as exc:
        message = err.getvalue().strip().splitlines()
        parser.error(f"train_opsd.py rejects the passed-through flags {job_args}: "
                     f"{message[-1] if message else exc}")


def load_rows(paths: list[str]) -> list[VariantRow]:
    """The rows of earlier ``--out`` files (this schema or the one before it), figures added since the file was
    written recomputed from each run's report."""
    rows = []
    for path in paths:
        for row in results.rows_of(VariantRow, results.read(path)):
            if row.status == "ok" and isinstance(row.report, dict):
                row = dataclasses.replace(row, **row_from_report(dataclasses.asdict(row), row.report))
            rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, job_args = parse_args(argv)
    if args.merge is not None:
        rows = load_rows(args.merge)
        print(format_table(rows))
        if args.out is not None:
            results.write(args.out, run_meta("multigpu", argv, merged_from=args.merge), rows)
        return 0 if all(r.status == "ok" for r in rows) else 1
    out = Path(args.out or "bench_multigpu.json")
    runs = expand_runs(args.variants, args.nproc, args.launcher)
    work_dir = (Path(args.work_dir) if args.work_dir else out.with_name(out.stem + ".runs")).resolve()
    profile_dir = Path(args.profile).resolve() if args.profile else None
    if args.dry_run:
        for run in runs:
            env = run_env(run, profile_dir)
            extra = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith("OPSD_PROFILE"))
            print(f"{run['id']}: {extra} " + " ".join(launch_command(run, job_args, work_dir / f"{run['id']}.json")))
        return 0
    work_dir.mkdir(parents=True, exist_ok=True)
    meta = run_meta("multigpu", argv, job_args=job_args, variants=args.variants, nproc=args.nproc,
                    launchers=args.launcher, timeout_s=args.timeout,
                    profile_dir=None if profile_dir is None else str(profile_dir))
    print(f"{len(runs)} runs: {', '.join(r['id'] for r in runs)}; flags for train_opsd.py: "
          f"{' '.join(job_args) or '(none)'}", flush=True)
    rows = []
    for index, run in enumerate(runs, 1):
        row = run_variant(run, job_args, work_dir, args.timeout, profile_dir)
        rows.append(row)
        results.write(str(out), meta, rows)
        print(progress_line(index, len(runs), row), flush=True)
        if row.trace_summary is not None:
            print(f"\n--- summarize_trace.py --by-rank {' '.join(row.trace_dirs)} ---\n{row.trace_summary}",
                  flush=True)
    print()
    print(format_table(rows))
    print(f"\nrows: {out}  (logs and per-run reports: {work_dir})")
    return 0 if all(row.status == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
