"""Findings: the few stages whose time the host leaves on the table, with the trace's evidence and what to do.

Derived from the figures of the report's stage rows, never from stage names: each innermost stage (no other row
nests in it) is judged by its verdict (``bound``, :mod:`traces.figures`) and its figures per recorded step:

- ``host`` or ``mixed``: the GPU idles while the host runs the stage. Recoverable time: its CPU time minus its GPU
  busy time. The evidence: launches per step and the host time per launch; the action depends on the launch rate
  (many small launches: fuse, capture, or a fused/multi-tensor implementation; few: host work between launches);
- ``sync``: the host waits in syncs. Recoverable time: the wait.

``gpu``-bound stages need their work (FLOPs, bytes) to say how far they are from the hardware's limit: not here
yet. The findings are ranked by recoverable time; those under :data:`MIN_SHARE` of the step are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from traces.records import StageRow

#: At most this many findings.
MAX_FINDINGS = 5
#: A finding must recover at least this share of the step.
MIN_SHARE = 0.01
#: Launches per ms of host time above which a stage is called launch-bound.
LAUNCH_BOUND_PER_MS = 5.0


@dataclass(frozen=True)
class Finding:
    """One item of the findings block."""

    stage: str
    kind: str
    """``host-bound``, ``mixed`` or ``sync``."""
    recoverable_ms: float
    """Per recorded step: host time the GPU did not overlap (host, mixed) or time in syncs (sync)."""
    evidence: str
    action: str

    def lines(self) -> list[str]:
        """Three lines: the stage and its recoverable time, the evidence, the action."""
        return [f"{self.stage} ({self.kind}): up to {self.recoverable_ms:,.1f} ms/step", self.evidence,
                f"-> {self.action}"]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "recoverable_ms": self.recoverable_ms,
                "evidence": self.evidence, "action": self.action}


def _steps(rows: list[StageRow]) -> int:
    roots = [r for r in rows if r.parent is None]
    spread = next((r.per_step for r in roots if r.per_step is not None), None)
    return spread.n if spread is not None else 1


def _innermost(rows: list[StageRow]) -> list[StageRow]:
    parents = {r.parent for r in rows}
    return [r for r in rows if r.name not in parents]


def _host_finding(row: StageRow, steps: int) -> Finding | None:
    cpu, gpu = row.cpu_ms.total / steps, (row.gpu_ms.total if row.gpu_ms else 0.0) / steps
    launches = (row.gpu.launches or 0) / steps
    recoverable = cpu - gpu
    if recoverable <= 0:
        return None
    rate = launches / cpu if cpu > 0 else 0.0
    evidence = (f"{cpu:,.1f} ms of host for {gpu:,.1f} ms of GPU work, {launches:,.0f} launches "
                f"({1e3 * cpu / launches:,.1f} us of host each)" if launches else
                f"{cpu:,.1f} ms of host for {gpu:,.1f} ms of GPU work, no launches")
    if rate >= LAUNCH_BOUND_PER_MS:
        action = ("fewer, larger launches: fuse elementwise work (torch.compile), capture a CUDA graph, or use a "
                  "fused / multi-tensor implementation")
    else:
        action = ("the host works between launches: look at its CPU operators in Perfetto for Python loops, "
                  "per-call setup or kernels built per shape (docs/profiling.md)")
    kind = "host-bound" if row.gpu.bound == "host" else "mixed"
    return Finding(row.name, kind, recoverable, evidence, action)


def _sync_finding(row: StageRow, steps: int) -> Finding | None:
    wait = (row.gpu.wait_ms or 0.0) / steps
    if wait <= 0:
        return None
    return Finding(row.name, "sync", wait, f"the host waits {wait:,.1f} ms/step in sync calls inside it",
                   "move the sync (.item(), .tolist(), .cpu(), a blocking copy) after work that can be queued, or "
                   "drop it")


def findings(rows: list[StageRow], step_ms: float | None = None) -> list[Finding]:
    """The findings of a report's merged rows (see the module docstring); ``step_ms``: the step's time per step
    (default: the root row's CPU time per step), for :data:`MIN_SHARE`."""
    steps = _steps(rows)
    if step_ms is None:
        roots = [r for r in rows if r.parent is None]
        step_ms = max((r.cpu_ms.total for r in roots), default=0.0) / steps
    out = []
    for row in _innermost(rows):
        if row.gpu.bound in ("host", "mixed"):
            found = _host_finding(row, steps)
        elif row.gpu.bound == "sync":
            found = _sync_finding(row, steps)
        else:
            found = None
        if found is not None and found.recoverable_ms >= MIN_SHARE * step_ms:
            out.append(found)
    out.sort(key=lambda f: -f.recoverable_ms)
    return out[:MAX_FINDINGS]


def format_findings(items: list[Finding]) -> str:
    """The findings block (empty text when there is none)."""
    if not items:
        return ""
    lines = ["findings (per step: host time the GPU did not overlap, or time in syncs; largest first):"]
    for i, item in enumerate(items, 1):
        head, evidence, action = item.lines()
        lines += [f"  {i}. {head}", f"     {evidence}", f"     {action}"]
    return "\n".join(lines) + "\n"
