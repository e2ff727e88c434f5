"""Synthetic torch.profiler-like Chrome traces with a realistic event mix, for benchmarks.

The writer emits text in the layout of Kineto's exporter (one key per line) so that the reader
is measured on what it meets in practice: per GPU op a ``cpu_op`` with shapes, a
``python_function`` frame, a ``cuda_runtime`` or ``cuda_driver`` launch, the ``kernel`` (or a
memcpy / memset) with its launch arguments, the ``ac2g`` flow pair and allocator ``[memory]``
samples, all inside nested ``user_annotation`` stage ranges (``opsd/step`` > ``opsd/rollout`` >
``opsd/prefill`` / ``opsd/decode``; ``opsd/backward`` with its launches on an autograd thread).
"""

from __future__ import annotations

import gzip
import random
from dataclasses import dataclass

from instrumentation import stages as S

_HEADER = """{{
  "schemaVersion": 1,
  "deviceProperties": [
    {{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096}}
  ],
  "distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": {world_size}}},
  "displayTimeUnit": "ms",
  "baseTimeNanoseconds": 1790857026000000000,
  "traceEvents": [
"""
_X = """  {{
    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": {pid}, "tid": {tid},
    "ts": {ts:.3f}, "dur": {dur:.3f},
    "args": {{
      {args}
    }}
  }},
"""
_CPU_ARGS = ('"External id": {ext}, "Record function id": 0, "Concrete Inputs": ["", "", "1"], '
             '"Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"], '
             '"Input Strides": [[2048, 1], [2048, 1], []], '
             '"Input Dims": [[8, 2048], [2048, 11008], []], "Ev Idx": {ext}')
_KERNEL_ARGS = ('"queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": {corr}, '
                '"registers per thread": 128, "shared memory": 49152, "blocks per SM": 1.5, '
                '"warps per SM": 12, "grid": [132, 1, 1], "block": [384, 1, 1], '
                '"est. achieved occupancy %": 19')
_MEMORY = """  {{
    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": {pid}, "tid": {tid},
    "ts": {ts:.3f},
    "args": {{
      "Total Reserved": {reserved}, "Total Allocated": {alloc}, "Bytes": {nbytes}, "Device Id": 0, "Device Type": 1, "Addr": 140234567, "Ev Idx": 9
    }}
  }},
"""
_FLOW = """  {{
    "ph": "{ph}", "id": {corr}, "pid": {pid}, "tid": {tid}, "ts": {ts:.3f},
    "cat": "ac2g", "name": "ac2g"{bp}
  }},
"""
_FOOTER = """  {{
    "ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
    "ts": {ts:.3f}, "dur": {dur:.3f},
    "args": {{
      "Op count": 0
    }}
  }}
  ],
  "traceName": "synthetic"
}}
"""


@dataclass(frozen=True)
class SynthConfig:
    """Shape of one synthetic trace."""

    #: Uncompressed size to reach (the writer stops after the step that crosses it).
    target_bytes: int = 1 << 20
    #: The ``distributedInfo.rank`` written in the header.
    rank: int = 0
    #: ``distributedInfo.world_size``.
    world_size: int = 1
    #: Decode ranges per rollout.
    num_decode_steps: int = 8
    #: GPU ops launched per stage range.
    ops_per_stage: int = 24
    #: Seed of the random durations.
    seed: int = 0

    def __post_init__(self):
        for name in ("target_bytes", "num_decode_steps", "ops_per_stage", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size); got {self.rank}")


class _Writer:
    def __init__(self, out, cfg: SynthConfig):
        self.out, self.cfg = out, cfg
        self.rng = random.Random(cfg.seed * 7919 + cfg.rank)
        self.pid, self.main_tid, self.bwd_tid = 1000 + cfg.rank, 1000 + cfg.rank, 2000 + cfg.rank
        self.corr, self.ext, self.alloc, self.written = 1, 1, 1 << 30, 0
        self.num_steps = 0

    def emit(self, text: str):
        self.out.write(text)
        self.written += len(text)

    def ops(self, t: float, tid: int, n: int) -> float:
        """``n`` GPU ops launched from ``tid`` starting at CPU time ``t``; returns the end time."""
        rng, pid = self.rng, self.pid
        for i in range(n):
            corr, ext = self.corr, self.ext
            self.corr, self.ext = corr + 1, ext + 1
            self.emit(_X.format(cat="python_function", name="torch/nn/modules/linear.py(125): forward",
                                pid=pid, tid=tid, ts=t, dur=30.0, args=f'"Python id": {ext}, "Ev Idx": {ext}'))
            self.emit(_X.format(cat="cpu_op", name="aten::mm", pid=pid, tid=tid, ts=t + 1, dur=25.0,
                                args=_CPU_ARGS.format(ext=ext)))
            driver = i % 5 == 2
            self.emit(_X.format(cat="cuda_driver" if driver else "cuda_runtime",
                                name="cuLaunchKernel" if driver else "cudaLaunchKernel",
                                pid=pid, tid=tid, ts=t + 5, dur=6.0,
                                args=f'"External id": {ext}, "cbid": 211, "correlation": {corr}'))
            gt = t + 40 + rng.random() * 20
            kind = "kernel" if i % 12 else "gpu_memcpy"
            self.emit(_X.format(cat=kind, name="sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
                                pid=0, tid=7, ts=gt, dur=15.0 + rng.random() * 30,
                                args=_KERNEL_ARGS.format(corr=corr)))
            if i % 7 == 6:
                self.emit(_X.format(cat="cuda_runtime", name="cudaStreamSynchronize", pid=pid, tid=tid,
                                    ts=t + 12, dur=15.0, args=f'"cbid": 131, "correlation": {corr}'))
            self.emit(_FLOW.format(ph="s", corr=corr, pid=pid, tid=tid, ts=t + 5, bp=""))
            self.emit(_FLOW.format(ph="f", corr=corr, pid=0, tid=7, ts=gt, bp=', "bp": "e"'))
            if i % 3 == 0:
                delta = rng.choice((1, -1)) * (1 << 20)
                self.alloc += delta
                self.emit(_MEMORY.format(pid=pid, tid=tid, ts=t + 2, alloc=self.alloc,
                                         reserved=1 << 34, nbytes=delta))
            t += 32
        return t

    def stage(self, name: str, t: float, tid: int, children=()) -> float:
        """A ``user_annotation`` range around ops and nested child ranges; returns its end time."""
        start, header_pos = t, None
        t = self.ops(t + 2, tid, self.cfg.ops_per_stage)
        for child in children:
            t = child(t + 1)
        end = t + 3
        self.emit(_X.format(cat="user_annotation", name=S.range_name(name), pid=self.pid, tid=tid,
                            ts=start, dur=end - start, args=f'"External id": {self.ext}'))
        return end

    def step(self, t: float) -> float:
        cfg = self.cfg
        decode = [lambda t: self.stage(S.DECODE, t, self.main_tid)] * cfg.num_decode_steps
        rollout = lambda t: self.stage(S.ROLLOUT, t, self.main_tid,
                                       [lambda t: self.stage(S.PREFILL, t, self.main_tid)] + decode)
        backward = lambda t: self.stage(S.BACKWARD, t, self.bwd_tid)
        end = self.stage(S.STEP, t, self.main_tid, [rollout, backward])
        self.num_steps += 1
        return end


def write_synthetic_trace(path: str, cfg: SynthConfig, *, compress: bool = True) -> int:
    """Write a synthetic trace to ``path`` (gzip when ``compress``); returns the number of steps."""
    opener = (lambda: gzip.open(path, "wt", compresslevel=1, encoding="utf-8")) if compress \
        else (lambda: open(path, "w", encoding="utf-8"))
    with opener() as out:
        w = _Writer(out, cfg)
        w.emit(_HEADER.format(rank=cfg.rank, world_size=cfg.world_size))
        t0 = t = 5_000_000.0
        while w.written < cfg.target_bytes:
            t = w.step(t) + 50
        w.emit(_FOOTER.format(ts=t0, dur=t - t0))
    return w.num_steps


def write_events(path: str, events: list[dict], *, rank: int | None = None, compress: bool = False,
                 indent: int | None = None) -> str:
    """Write hand-built events as a Chrome-trace document (with ``distributedInfo`` when ``rank``)."""
    import json

    doc: dict = {"schemaVersion": 1}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": rank + 1}
    doc["traceEvents"] = events
    text = json.dumps(doc, indent=indent)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return path


def annotation(name: str, ts: float, dur: float, pid: int = 1, tid: int = 1) -> dict:
    """A ``user_annotation`` complete event."""
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": tid, "ts": ts,
            "dur": dur, "args": {"External id": 1}}


def launch(ts: float, correlation: int, pid: int = 1, tid: int = 1, driver: bool = False) -> dict:
    """A ``cuda_runtime`` (or ``cuda_driver``) launch event."""
    return {"ph": "X", "cat": "cuda_driver" if driver else "cuda_runtime",
            "name": "cuLaunchKernel" if driver else "cudaLaunchKernel", "pid": pid, "tid": tid,
            "ts": ts, "dur": 2.0, "args": {"cbid": 211, "correlation": correlation}}


#: Default names of hand-built GPU ops per category (Kineto's names of copies and sets).
_OP_NAMES = {"kernel": "k", "gpu_memcpy": "Memcpy DtoD (Device -> Device)", "gpu_memset": "Memset (Device)"}


def gpu_op(ts: float, dur: float, correlation: int, cat: str = "kernel", device: int = 0,
           name: str | None = None, stream: int = 7) -> dict:
    """A kernel / ``gpu_memcpy`` / ``gpu_memset`` event on ``device`` and ``stream``."""
    return {"ph": "X", "cat": cat, "name": _OP_NAMES[cat] if name is None else name, "pid": device,
            "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": stream, "correlation": correlation}}


def sync(ts: float, dur: float, pid: int = 1, tid: int = 1, name: str = "cudaStreamSynchronize",
         correlation: int = 0) -> dict:
    """A host call that waits for the GPU (``cudaStreamSynchronize`` by default)."""
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": pid, "tid": tid, "ts": ts,
            "dur": dur, "args": {"cbid": 131, "correlation": correlation}}


def profiler_step(step: int, ts: float, dur: float, pid: int = 1, tid: int = 1) -> dict:
    """torch.profiler's ``ProfilerStep#N`` annotation of training step ``step``."""
    return annotation(f"ProfilerStep#{step}", ts, dur, pid, tid)


def memory(ts: float, allocated: int, reserved: int = 0, pid: int = 1, device_type: int = 1,
           device_id: int = 0) -> dict:
    """A ``[memory]`` allocator sample."""
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": pid,
            "tid": 1, "ts": ts, "args": {"Total Reserved": reserved, "Total Allocated": allocated,
                                          "Bytes": 0, "Device Id": device_id,
                                          "Device Type": device_type}}


def cpu_op(name: str, ts: float, dur: float, pid: int = 1, tid: int = 1) -> dict:
    """A host operator call (a ``cpu_op`` complete event, as torch.profiler writes ``aten::mm``)."""
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 1, "Record function id": 0}}
