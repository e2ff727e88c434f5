"""Test-side harness for DeepSpeed tests: run a worker in fresh subprocess(es), one per rank.

DeepSpeed's process-global state (comm backend, ZeRO hooks, patched module init) leaks between
tests, so every DeepSpeed test runs its DeepSpeed part in a subprocess. Usage::

    from tests.ds_util import run_worker
    results = run_worker("lora_engine.py", 3, world_size=2)   # argv: ["3"]
    assert results[1].result["full_identical"]

A worker is a script in ``tests/ds_workers/`` (a bare ``*.py`` name is looked up there), a path to
a script, or a string of Python code. The worker imports ``common`` (``tests/ds_workers/
common.py``: ``init_deepspeed_cpu``, ``make_engine``, ``emit``) and calls ``emit(obj)`` once, at
the end, on every rank, to return a JSON-serialisable result (with torch.distributed initialised,
``emit`` is collective: barrier, then the process group is destroyed; then the worker exits without
interpreter finalization). Any non-zero exit, a timeout, or a missing result fails the calling test
with that rank's stderr.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
WORKERS_DIR = TESTS_DIR / "ds_workers"
REPO_ROOT = TESTS_DIR.parent
#: Default wall-clock limit for one worker run (all ranks together).
DEFAULT_TIMEOUT_S = 180.0
#: How many characters of a failing rank's stdout/stderr go into the failure message.
MAX_LOG_CHARS = 8000
_POLL_S = 0.05


@dataclass(frozen=True)
class WorkerResult:
    """What one rank left behind."""

    rank: int
    """Global rank of the process."""
    returncode: int
    """Exit status (0 on success; the harness fails the test before returning otherwise)."""
    stdout: str
    """Everything the rank printed to stdout (DeepSpeed logs go here too)."""
    stderr: str
    """Everything the rank printed to stderr."""
    result: object
    """The JSON value the rank passed to ``common.emit`` (None when it emitted nothing)."""
    wall_s: float
    """Seconds from launch until this rank exited (cold start included)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(script_or_code: str | os.PathLike, args: tuple) -> list[str]:
    """The argv for one worker: ``python script args...`` or ``python -c code args...``."""
    text = os.fspath(script_or_code)
    if isinstance(script_or_code, os.PathLike) or (text.endswith(".py") and "\n" not in text):
        path = Path(text)
        if not path.is_absolute() and not path.exists():
            path = WORKERS_DIR / path
        if not path.is_file():
            raise FileNotFoundError(f"worker script not found: {text!r} (looked in {WORKERS_DIR})")
        return [sys.executable, str(path), *map(str, args)]
    return [sys.executable, "-c", text, *map(str, args)]


def worker_env(rank: int, world_size: int, port: int, result_path: Path,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank: CPU accelerator, rendezvous, result file, import path."""
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    pythonpath = [str(WORKERS_DIR), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        pythonpath.append(env["PYTHONPATH"])
    env.update({
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(threads)),
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "PYTHONUNBUFFERED": "1",
        "OPSD_WORKER_RESULT": str(result_path),
    })
    env.update(extra or {})
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill every still-running rank (each was started in its own process group)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, started: float) -> tuple[list, bool]:
    """Wait for all ranks; stop early when one fails (its peers would hang in a collective).

    Returns (per-rank exit wall times, timed_out).
    """
    ended: list[float | None] = [None] * len(procs)
    while True:
        now = time.monotonic()
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = now - started
        if all(e is not None for e in ended):
            return ended, False
        if any(p.returncode not in (None, 0) for p in procs) or now - started > timeout_s:
            timed_out = now - started > timeout_s
            _kill(procs)
            return [e if e is not None else now - started for e in ended], timed_out
        time.sleep(_POLL_S)


def _read_result(path: Path):
    return json.loads(path.read_text()) if path.exists() and path.stat().st_size else None


def _failure(rank: int, why: str, out: str, err: str) -> str:
    return (f"DeepSpeed worker rank {rank} {why}\n--- stderr (tail) ---\n{err[-MAX_LOG_CHARS:]}"
            f"\n--- stdout (tail) ---\n{out[-MAX_LOG_CHARS:]}")


def run_worker(script_or_code: str | os.PathLike, *args, world_size: int = 1,
               timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None,
               require_result: bool = True) -> list[WorkerResult]:
    """Run a DeepSpeed worker as ``world_size`` fresh processes; one :class:`WorkerResult` per rank.

    Fails the calling test (``pytest.fail``, with the rank's stderr) when a rank exits non-zero,
    the run exceeds ``timeout`` seconds (all ranks are then killed), or — with
    ``require_result`` — a rank did not call ``emit``. ``env`` adds/overrides environment variables.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0; got {timeout!r}")
    argv = _command(script_or_code, args)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="opsd_ds_worker_") as tmp:
        tmp_dir = Path(tmp)
        procs, logs = [], []
        started = time.monotonic()
        try:
            for rank in range(world_size):
                out = open(tmp_dir / f"stdout_{rank}.txt", "w+")
                err = open(tmp_dir / f"stderr_{rank}.txt", "w+")
                logs.append((out, err))
                env_r = worker_env(rank, world_size, port, tmp_dir / f"result_{rank}.json", env)
                procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=env_r, cwd=REPO_ROOT,
                                              start_new_session=True))
            ended, timed_out = _wait_all(procs, timeout, started)
        except BaseException:  # Ctrl-C or a launch error: leave no rank behind
            _kill(procs)
            for out, err in logs:
                out.close()
                err.close()
            raise
        results = []
        for rank, (proc, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0)
            err.seek(0)
            text_out, text_err = out.read(), err.read()
            out.close()
            err.close()
            results.append(WorkerResult(rank, proc.returncode, text_out, text_err,
                                        _read_result(tmp_dir / f"result_{rank}.json"), ended[rank]))
    _check(results, timed_out, timeout, require_result)
    return results


def _check(results: list[WorkerResult], timed_out: bool, timeout: float, require_result: bool):
    """Fail the test on the first (lowest-rank) real failure; timeouts name the limit."""
    if timed_out:
        first = results[0]
        pytest.fail(_failure(first.rank, f"timed out after {timeout:.0f} s", first.stdout,
                             first.stderr), pytrace=False)
    failed = [r for r in results if r.returncode != 0]
    # A rank killed by us (SIGKILL) only because a peer failed is not the interesting one.
    primary = [r for r in failed if r.returncode != -signal.SIGKILL] or failed
    if primary:
        r = primary[0]
        pytest.fail(_failure(r.rank, f"exited with status {r.returncode}", r.stdout, r.stderr),
                    pytrace=False)
    if require_result:
        for r in results:
            if r.result is None:
                pytest.fail(_failure(r.rank, "emitted no result (call common.emit)", r.stdout,
                                     r.stderr), pytrace=False)
