"""``python -m benchmarks.profiler_cost host``: where the on path's host time goes per timed step (see that module's
docstring). Each entry point profiling adds to a step is wrapped by :class:`EntryTimer` (outermost calls timed), and
the arms ``shipped`` and ``reread`` (:class:`_Forgetful` tables: every work record reads the models again) alternate
step by step."""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time

from benchmarks.harness.table import markdown_table
from instrumentation import ProfileConfig, configure, opsd_profiler

#: ``(label, owner, attribute)`` of the entry points the on path adds to a step, timed by ``measure_host``.
HOST_ENTRY_POINTS = (("stage() enter + exit", "ranges._Range", "__enter__"),
                     ("stage() enter + exit", "ranges._Range", "__exit__"),
                     ("work record: rollout", "worklog.RECORDER", "rollout"),
                     ("work record: training", "worklog.RECORDER", "training"),
                     ("work sidecar write", "worklog.RECORDER", "end"),
                     ("prof.log_step()", "profiler.ProfilerSession", "log_step"),
                     ("prof.step() (incl. the write)", "profiler.ProfilerSession", "step"))
HOST_ARMS = ("shipped", "reread")


class EntryTimer:
    """Adds the host time spent inside chosen callables to ``totals[label]`` (outermost calls only: a label's
    time is not counted twice when its callables nest)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._undo: list = []
        self._depth: dict[str, int] = {}

    def wrap(self, owner, attribute: str, label: str) -> None:
        """Time ``owner.attribute`` (a class's function or an object's method) until :meth:`restore`."""
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            depth = self._depth.get(label, 0)
            self._depth[label] = depth + 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[label] = depth
                if depth == 0:
                    self.totals[label] = self.totals.get(label, 0.0) + (time.perf_counter() - t0) * 1e3

        if isinstance(owner, type):  # the class's own function back on restore
            raw = owner.__dict__[attribute]
            self._undo.append(lambda: setattr(owner, attribute, raw))
        else:  # an instance attribute shadowing the class's method, removed on restore
            self._undo.append(lambda: delattr(owner, attribute))
        setattr(owner, attribute, timed)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class _Forgetful(dict):
    """A table that keeps nothing: the ``reread`` arm's geometry and trainable-count tables."""

    def __setitem__(self, key, value) -> None:
        pass


def _resolve_owner(path: str):
    from instrumentation import profiler, ranges, worklog

    modules = {"ranges": ranges, "worklog": worklog, "profiler": profiler}
    head, name = path.split(".")
    return getattr(modules[head], name)


def measure_host(args, workload, device: str) -> dict:
    """See the module docstring: ``args`` of ``benchmarks.profiler_cost`` (``--steps``, ``--warmup``,
    ``--output-dir``), ``workload`` one of its workloads built for ``--warmup + --steps`` steps."""
    from instrumentation import worklog

    total = args.warmup + args.steps
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="opsd_host_")
    config = ProfileConfig.from_env({}, mode="timers", output_dir=out_dir, run_name=f"host-{os.getpid()}")
    timer = EntryTimer()
    for label, owner, attribute in HOST_ENTRY_POINTS:
        timer.wrap(_resolve_owner(owner), attribute, label)
    rows: dict[str, dict[str, list[float]]] = {arm: {} for arm in HOST_ARMS}
    tables = {"shipped": (worklog._GEOMETRY, worklog._TRAINABLE), "reread": (_Forgetful(), _Forgetful())}
    try:
        configure(config)
        with opsd_profiler(config) as prof:
            for index in range(total):
                if index == args.warmup and args.gc_freeze:  # as the light measure: no collections of the model's
                    gc.collect()                             # objects inside a timed step
                    gc.freeze()
                arm = HOST_ARMS[index % 2]
                worklog._GEOMETRY, worklog._TRAINABLE = tables[arm]  # reread: every record reads them again
                timer.totals = {}
                t0 = time.perf_counter()
                figures = workload.run(index)
                prof.log_step(index, **figures)
                prof.step()
                step_ms = (time.perf_counter() - t0) * 1e3
                if index >= args.warmup:
                    cells = rows[arm]
                    cells.setdefault("step (wall)", []).append(step_ms)
                    for label in dict.fromkeys(label for label, _, _ in HOST_ENTRY_POINTS):
                        cells.setdefault(label, []).append(timer.totals.get(label, 0.0))
    finally:
        timer.restore()
        worklog._GEOMETRY, worklog._TRAINABLE = tables["shipped"]
        configure(ProfileConfig(mode="0"))
    medians = {arm: {label: statistics.median(v) for label, v in cells.items()} for arm, cells in rows.items()}
    result = {"measure": "host", "workload": args.workload, "fixed_work": args.fixed_work, "device": device,
              "gc_freeze": args.gc_freeze,
              "steps": args.steps, "warmup": args.warmup, "median_ms": medians, "ms": rows}
    print_host(result)
    return result


def on_path_ms(medians: dict) -> float:
    """The on path's host ms of a step: every entry point but ``prof.step()``'s share already counted (the
    sidecar write runs inside it)."""
    return sum(v for label, v in medians.items() if label not in ("step (wall)", "work sidecar write"))


def print_host(r: dict) -> None:
    arms = list(r["median_ms"])
    frozen = ", gc frozen" if r.get("gc_freeze") else ""
    print(f"host time of the on path (OPSD_PROFILE=timers + log_step), {r['workload']}{frozen} on {r['device']}, "
          f"median of {r['steps'] // len(arms)} steps per arm (alternating) after {r['warmup']}")
    labels = list(next(iter(r["median_ms"].values())))
    table = [[label] + [f"{r['median_ms'][arm][label]:.3f}" for arm in arms] for label in labels]
    table.append(["on path, total"] + [f"{on_path_ms(r['median_ms'][arm]):.3f}" for arm in arms])
    table.append(["share of the step"] + [f"{100 * on_path_ms(r['median_ms'][arm]) / r['median_ms'][arm]['step (wall)']:.2f}%"
                                          for arm in arms])
    print(markdown_table(["entry point (ms per step)"] + arms, table))
