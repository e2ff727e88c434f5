"""Findings: the few items with the most recoverable time, with the trace's evidence and what to do.

Derived from the figures of the report's stage rows and slow operators, never from stage names. Each innermost
stage (no other row nests in it) is judged by its verdict (``bound``) and its figures per recorded step:

- ``host``, ``mixed`` or ``idle``: the GPU idles while the host runs the stage. Recoverable: its CPU time minus its
  GPU busy time. Evidence: launches per step and the host time per launch; the action depends on the launch rate
  (many small launches: fuse, capture, or a fused/multi-tensor implementation; few: host work between launches;
  ``idle``: the host runs no operator either: Python, I/O or a wait outside the trace);
- ``sync``: the host waits in syncs. Recoverable: the wait;
- ``gpu`` / ``memory`` / ``compute`` with work (:mod:`traces.work`): the GPU is the limit. Recoverable: its GPU ms
  per step minus its roofline ms per step. Evidence: × roofline, the limit, the kernels that hold its GPU time and
  the matmuls' share of it; the action follows the limit and that share.

Each slow operator (:mod:`traces.operators`) is a finding too: recoverable its excess per step. All are ranked
together by recoverable time; those under :data:`MIN_SHARE` of the step are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from traces.gpu import is_gemm_kernel
from traces.records import KernelRow, SlowOperator, StageRow

#: At most this many findings.
MAX_FINDINGS = 5
#: A finding must recover at least this share of the step.
MIN_SHARE = 0.01
#: Launches per ms of host time above which a stage is called launch-bound.
LAUNCH_BOUND_PER_MS = 5.0
#: Kernels named as holding a GPU-bound stage.
TOP_KERNELS = 3
#: Below this share of a compute-bound stage's GPU time in matmuls, the other kernels are what to fix.
GEMM_SHARE = 0.5
_HEADER = "findings (time recoverable per step, largest first):"
_FIRST_STEPS = "docs/profiling.md, \"When the first steps are slow\""


@dataclass(frozen=True)
class Finding:
    """One item of the findings block."""

    stage: str | None
    kind: str
    """``host-bound``, ``mixed``, ``idle``, ``sync``, ``memory-bound``, ``compute-bound``, ``gpu-bound`` or
    ``slow operator``."""
    recoverable_ms: float
    """Per recorded step: host time the GPU did not overlap (host, mixed, idle), time in syncs (sync), GPU time above
    the roofline (memory, compute, gpu) or a slow operator's excess."""
    evidence: str
    action: str
    operator: str | None = None
    """The operator of a ``slow operator`` finding."""

    def lines(self) -> list[str]:
        """Three lines: what and its recoverable time, the evidence, the action."""
        what = self.stage or "outside every stage"
        if self.operator is not None:
            what = f"{self.operator} in {self.stage}" if self.stage else f"{self.operator} (outside every stage)"
        return [f"{what} ({self.kind}): up to {self.recoverable_ms:,.1f} ms/step", self.evidence, f"-> {self.action}"]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "recoverable_ms": self.recoverable_ms,
                "evidence": self.evidence, "action": self.action, "operator": self.operator}


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
    if row.gpu.bound == "idle":
        ops = (row.gpu.host_op_ms or 0.0) / steps
        evidence += f"; host operators run {ops:,.1f} ms of it"
        action = ("neither the GPU nor a host operator works most of the time: Python outside operators, I/O or a "
                  "wait the trace does not show (record with with_stack=True, or sample with py-spy)")
    elif rate >= LAUNCH_BOUND_PER_MS:
        action = ("fewer, larger launches: fuse elementwise work (torch.compile), capture a CUDA graph, or use a "
                  "fused / multi-tensor implementation")
    else:
        action = ("the host works between launches: look at its CPU operators in Perfetto for Python loops, "
                  "per-call setup or kernels built per shape (docs/profiling.md)")
    kind = {"host": "host-bound", "idle": "idle"}.get(row.gpu.bound, "mixed")
    return Finding(row.name, kind, recoverable, evidence, action)


def _sync_finding(row: StageRow, steps: int) -> Finding | None:
    wait = (row.gpu.wait_ms or 0.0) / steps
    if wait <= 0:
        return None
    return Finding(row.name, "sync", wait, f"the host waits {wait:,.1f} ms/step in sync calls inside it",
                   "move the sync (.item(), .tolist(), .cpu(), a blocking copy) after work that can be queued, or "
                   "drop it")


def _kernel_evidence(kernels: tuple[KernelRow, ...]) -> tuple[str, float | None]:
    """``"k1 41%, k2 20%, k3 9%"`` (shares of the summed kernel time) and the matmuls' share (None: no kernels)."""
    total = sum(k.gpu_ms for k in kernels)
    if total <= 0:
        return "", None
    gemm = sum(k.gpu_ms for k in kernels if is_gemm_kernel(k.name)) / total
    from traces.format import short_kernel_names

    names = short_kernel_names([k.name for k in kernels[:TOP_KERNELS]], 48)
    top = ", ".join(f"{n} {100 * k.gpu_ms / total:.0f}%" for n, k in zip(names, kernels))
    return top, gemm


def _roofline_finding(row: StageRow, kernels: tuple[KernelRow, ...]) -> Finding | None:
    work, spread = row.work, row.per_step
    if work is None or not work.roofline_ms or spread is None or spread.gpu_mean_ms is None:
        return None
    recoverable = spread.gpu_mean_ms - work.roofline_ms
    if recoverable <= 0:
        return None
    limit = work.limit or "gpu"
    top, gemm = _kernel_evidence(kernels)
    evidence = (f"{spread.gpu_mean_ms:,.1f} ms of GPU work, {spread.gpu_mean_ms / work.roofline_ms:,.1f}x its "
                f"{limit} roofline of {work.roofline_ms:,.2f} ms")
    if top:
        evidence += f"; held by {top} (matmuls {100 * gemm:.0f}% of its kernel time)"
    if limit == "memory":
        action = ("read the weights fewer times: more rows per pass (larger batches), fuse passes over the same "
                  "weights, keep activations and states in bf16")
    elif gemm is not None and gemm < GEMM_SHARE:
        action = ("the matmuls are not what holds it: fuse the elementwise, normalisation and softmax kernels "
                  "between them (torch.compile, fused kernels)")
    else:
        action = ("its matmuls run far from peak: larger, fewer matmuls (batch rows together, fuse projections), "
                  "shapes in multiples of 64/128, bf16 throughout")
    return Finding(row.name, f"{limit}-bound", recoverable, evidence, action)


def _operator_finding(op: SlowOperator, steps: int) -> Finding:
    evidence = (f"{op.slow_calls:,} of {op.calls:,} calls at {op.host_ms:,.1f} ms of host each, against a median "
                f"of {op.median_ms:,.3f} ms and {op.gpu_ms:,.3f} ms of GPU work ({op.launches:,.0f} launches) per "
                f"call; {op.excess_ms:,.1f} ms above that in all, while the GPU idled")
    if op.rule == "median":
        cause = "some calls take far longer than its usual call"
    else:
        cause = "its calls keep the host far longer than the GPU work they launch"
    action = (f"{cause}: work done per new shape or on first use (kernels built or autotuned per shape, "
              f"recompiles): keep the compute cache (CUDA_CACHE_PATH), bucket or pad shapes to a few sizes, or use a "
              f"kernel built ahead of time such as varlen attention ({_FIRST_STEPS})")
    return Finding(op.stage, "slow operator", op.excess_ms / steps, evidence, action, operator=op.name)


def findings(rows: list[StageRow], step_ms: float | None = None,
             kernels: dict[str, tuple[KernelRow, ...]] | None = None,
             operators: list[SlowOperator] = ()) -> list[Finding]:
    """The findings of a report's merged rows and slow operators (see the module docstring); ``step_ms``: the
    step's time per step (default: the largest root's CPU time per step); ``kernels``: every kernel of the
    GPU-bound stages with work (:attr:`traces.report.Report.stage_kernels`)."""
    steps = _steps(rows)
    if step_ms is None:
        roots = [r for r in rows if r.parent is None]
        step_ms = max((r.cpu_ms.total for r in roots), default=0.0) / steps
    out = []
    for row in _innermost(rows):
        if row.gpu.bound in ("host", "mixed", "idle"):
            found = _host_finding(row, steps)
        elif row.gpu.bound == "sync":
            found = _sync_finding(row, steps)
        elif row.gpu.bound in ("gpu", "memory", "compute"):
            found = _roofline_finding(row, (kernels or {}).get(row.name, ()))
        else:
            found = None
        if found is not None:
            out.append(found)
    out += [_operator_finding(op, steps) for op in operators]
    out = [f for f in out if f.recoverable_ms >= MIN_SHARE * step_ms]
    out.sort(key=lambda f: -f.recoverable_ms)
    return out[:MAX_FINDINGS]


def report_findings(report) -> list[Finding]:
    """The findings of a :class:`traces.report.Report` (its merged rows, kernels and slow operators)."""
    return findings(report.stages, kernels=report.stage_kernels, operators=report.operators)


def format_findings(items: list[Finding]) -> str:
    """The findings block (empty text when there is none)."""
    if not items:
        return ""
    lines = [_HEADER]
    for i, item in enumerate(items, 1):
        head, evidence, action = item.lines()
        lines += [f"  {i}. {head}", f"     {evidence}", f"     {action}"]
    return "\n".join(lines) + "\n"
