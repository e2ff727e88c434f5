"""The main job's console (``scripts/train_opsd.py``): the opening line, a progress bar under the step lines,
and the closing line. The functions return the lines; the script prints them.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch

from rollout.opsd.job import DEFAULT_STUDENT


def banner_line(job, opsd_config, step, *, device, world: int, build_s: float) -> str:
    """What runs: world, device, ZeRO stage, models, rows per step, loss settings, build time (``job``: a
    ``rollout.opsd.job.JobConfig``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"OPSD: world {world}, device {device.type} ({name}), ZeRO-{step.student.zero_optimization_stage()}, "
            f"gather {job.rollout.gather}, {'LoRA r=' + str(job.lora) if job.lora else 'full weights'}, student "
            f"{job.student or DEFAULT_STUDENT}, teacher {job.teacher or 'tiny llama'}"
            f"{' (ZeRO-3, offloaded)' if job.teacher_offload else ''}, "
            f"{job.batch_size * job.samples_per_prompt} rows/step, beta {opsd_config.beta}, top-k "
            f"{opsd_config.teacher_top_k}, cache {opsd_config.logit_cache_location}, built in {build_s:.1f} s")


def summary_line(results) -> str:
    """Means over the steps after the first (warm-up), or over all when there is only one."""
    timed = results[1:] or results
    step_ms = sum(r.step_ms for r in timed) / len(timed)
    tokens_per_s = sum(r.rollout_tokens_per_s for r in timed) / len(timed)
    return (f"done: {len(results)} steps, loss {results[0].loss:.6f} -> {results[-1].loss:.6f}, mean step "
            f"{step_ms:.1f} ms, mean rollout {tokens_per_s:.0f} tok/s (step 0 excluded as warm-up)"
            if len(results) > 1 else f"done: 1 step, loss {results[0].loss:.6f}, step {step_ms:.1f} ms")


def loss_warning(index: int, loss: float) -> Optional[str]:
    """The warning line for step ``index`` when its loss is not finite (None when it is): the script prints the first
    only, and the JSON report holds null for it."""
    if math.isfinite(loss):
        return None
    return (f"warning: step {index}'s loss is {loss}, not finite (the JSON report holds null for it): training "
            "diverged; try a smaller --lr")


class ProgressBar:
    """A one-line progress bar on stderr; :meth:`write` prints a stdout line above it. Where stderr is not a terminal
    (a log file, CI) the bar is a line of its own, written once per step done rather than after every line."""

    def __init__(self, total: int, enabled: bool, width: int = 24):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()
        self._logged = None
        """Without a terminal: the ``done`` count whose bar line was written last."""
        if self.tty:
            self._draw()

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
        print(line, flush=True)
        self._draw()

    def update(self) -> None:
        self.done += 1

    def _draw(self) -> None:
        if not self.tty:
            if self._logged == self.done:
                return
            self._logged = self.done
        filled = self.width * self.done // self.total
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
        sys.stderr.write(("\r" + bar) if self.tty else bar + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
