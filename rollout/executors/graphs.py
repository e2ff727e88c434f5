"""CUDA graphs of the decode step: capture (after warm-up runs on one side stream per device) and
replay, one graph per key, with an eager fallback where a capture fails.

A ``GraphSet`` belongs to one route executor: its graphs share one private memory pool, and a
changed key (bucket sizes, sampling settings, cache storage, weight addresses) captures anew.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch

GRAPH, EAGER = "graph", "eager"


class GraphSet:
    """The captured graphs of one route, keyed by whatever the captured work depends on."""

    def __init__(self, route: str):
        self.route = route
        self._graphs: dict = {}
        self._pool = None
        self.num_captures = 0
        self.fallback_reason: Optional[str] = None
        """The last failed capture's exception (that key's steps then run eagerly)."""

    def replay(self, key: Hashable, work: Callable[[], None], mutable: list[torch.Tensor]) -> str:
        """Replay the graph captured for ``key`` (capturing it on first use) and return ``"graph"``; where
        the capture fails, run ``work`` eagerly now and for every later step of that key, record the
        reason in ``fallback_reason`` and return ``"eager"``."""
        graph = self._graphs.get(key)
        if graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                graph = capture_graph(work, mutable, self._pool)
            except Exception as exc:  # noqa: BLE001 - the step still runs, eagerly, and the profile says why
                self.fallback_reason = f"{self.route} route: CUDA graph capture failed ({exc!r:.200})"
                graph = False
            else:
                self.num_captures += 1
            self._graphs[key] = graph
        if graph is False:
            work()
            return EAGER
        graph.replay()
        return GRAPH

    def clear(self) -> None:
        """Drop every graph and the pool (a private pool whose graphs are all gone cannot be reused)."""
        self._graphs.clear()
        self._pool = None


_WARMUP_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _warmup_stream(device_index: int) -> "torch.cuda.Stream":
    """One side stream per device for every warm-up. The GEMM libraries keep a workspace per stream
    they ran on for the life of the process; with a new stream per capture, each capture left ~66 MiB
    allocated for good (measured on the H200: +66 MiB per ``keep_cache=False`` call)."""
    if device_index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device_index] = torch.cuda.Stream(device_index)
    return _WARMUP_STREAMS[device_index]


def capture_graph(step: Callable[[], None], mutable: list[torch.Tensor], pool) -> "torch.cuda.CUDAGraph":
    """Warm up (compiling on first use) and capture ``step`` in ``pool``. The ``mutable`` tensors it
    writes are restored after every warm-up run, so the captured step starts from the live state; the
    cache column a warm-up writes is rewritten by the real step before anything reads it."""
    saved = [t.clone() for t in mutable]
    stream = _warmup_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            try:
                step()
            finally:  # restored after every run, also when one fails (the caller then runs it eagerly)
                for dst, src in zip(mutable, saved):
                    dst.copy_(src)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph


def sampling_key(sampling) -> tuple:
    """The sampling settings a captured step depends on (the seed lives in a buffer)."""
    if sampling.is_greedy:
        return ("greedy", sampling.repetition_penalty, sampling.return_logprobs)
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty,
            sampling.return_logprobs)
