"""EOS emulation and the peaked cell: weights scaled in place for a cell (restored exactly after it), and the
calibration of those scales, cached in ``--eos-scales`` so later runs, old code and new, use identical weights."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from typing import Optional

import torch

from benchmarks.rl.cells import EOS_ID, CellSpec, make_prompts
from benchmarks.rl.figures import nucleus_sizes, response_lengths, search_scale
from benchmarks.rl.running import Bench, sampling_for
from rollout import Rollout, RolloutConfig, RolloutRequest
from instrumentation.table import finite_json as finite

#: Rows x columns of the calibration probes: the first CALIB_PROMPTS prompts of the long-tail family.
CALIB_PROMPTS = 32


class scaled_weights:
    """Multiply the EOS row of the output embedding and / or the final norm weight in place for a cell;
    restore the saved originals (exactly) after it."""

    def __init__(self, model, eos_scale: Optional[float], norm_factor: Optional[float]):
        self.targets = []
        if eos_scale is not None and eos_scale != 1.0:
            self.targets.append((model.get_output_embeddings().weight[EOS_ID], eos_scale))
        if norm_factor is not None and norm_factor != 1.0:
            self.targets.append((final_norm(model).weight, norm_factor))
        self.saved = []

    def __enter__(self):
        with torch.no_grad():
            for tensor, factor in self.targets:
                self.saved.append(tensor.detach().clone())
                tensor.mul_(factor)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for (tensor, _), original in zip(self.targets, self.saved):
                tensor.copy_(original)
        self.saved = []
        return False


def final_norm(model):
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise ValueError("model: no final norm at model.model.norm (needed by the peaked cell)")
    return norm


def scale_key_prefix(model_name: str, dtype: torch.dtype, scale: str) -> str:
    return f"{model_name}|{str(dtype).replace('torch.', '')}|{scale}"


def key_prefix(bench: Bench) -> str:
    return scale_key_prefix(bench.model_name, bench.dtype, bench.args.scale)


def eos_key(prefix: str, cell: CellSpec) -> str:
    """Key of a cell's EOS scale in ``--eos-scales``: cells of one budget, target and prompt range share it."""
    return f"{prefix}|eos|budget={cell.budget}|mean={cell.mean_target}|prompts={cell.prompt_lens[0]}..{cell.prompt_lens[1]}"


def norm_key(prefix: str, cell: CellSpec, target: int) -> str:
    return f"{prefix}|norm|top_p={cell.top_p}|target={target}|prompts={cell.prompt_lens[0]}..{cell.prompt_lens[1]}"


def save_scales(bench: Bench) -> None:
    path = bench.args.eos_scales
    if path:
        with open(path, "w") as f:
            json.dump(finite(bench.scales), f, indent=1, allow_nan=False, sort_keys=True)


def eos_scale_for(bench: Bench, cell: CellSpec) -> dict:
    """The cached (or freshly calibrated) EOS-row scale for the cell's (budget, target mean)."""
    key = eos_key(key_prefix(bench), cell)
    if key in bench.scales:
        return bench.scales[key]
    family = dataclasses.replace(cell, num_prompts=CALIB_PROMPTS, cap_slots=None)
    ids, mask, _ = make_prompts(family, bench.model.config.vocab_size, bench.device)
    ro = Rollout(bench.model, bench.tokenizer(True), RolloutConfig(route="ordinary"))
    short = min(cell.budget, 4 * cell.mean_target)

    def mean_length(scale: float, budget: int) -> float:
        sampling = sampling_for(dataclasses.replace(family, budget=budget), None)
        with scaled_weights(bench.model, scale, None):
            lengths = response_lengths(ro.generate(RolloutRequest(ids, mask), sampling))
        mean = sum(lengths) / len(lengths)
        print(f"  calibrate {cell.name}: eos scale {scale:.4g}, budget {budget} -> mean length {mean:.1f} "
              f"(target {cell.mean_target})", flush=True)
        return mean

    t0 = time.perf_counter()
    scale, mean, seen = search_scale(lambda s: mean_length(s, cell.budget), float(cell.mean_target),
                                     lower=(lambda s: mean_length(s, short)) if short < cell.budget else None)
    ro.shutdown()
    gc.collect()
    entry = {"scale": scale, "calibration_mean": mean, "probes": seen, "rows": family.rows,
             "seconds": time.perf_counter() - t0}
    bench.scales[key] = entry
    save_scales(bench)
    return entry


def norm_factor_for(bench: Bench, cell: CellSpec) -> dict:
    """Smallest factor 2^(j/8) of the final norm weight (= of the logits) whose median top-p nucleus over the
    prefill logits of 8 of the cell's prompts is <= the target; the median measured at it with real weights."""
    target = bench.args.nucleus_target or min(1000, bench.model.config.vocab_size // 8)
    key = norm_key(key_prefix(bench), cell, target)
    if key in bench.scales:
        return bench.scales[key]
    ids, mask, _ = make_prompts(dataclasses.replace(cell, num_prompts=8), bench.model.config.vocab_size, bench.device)

    def last_logits():
        with torch.no_grad():
            return bench.model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()

    base = last_logits()
    factor = 1.0
    for j in range(0, 8 * 10 + 1):
        factor = 2.0 ** (j / 8)
        if statistics.median(nucleus_sizes(base * factor, cell.top_p)) <= target:
            break
    with scaled_weights(bench.model, None, factor):
        measured = statistics.median(nucleus_sizes(last_logits(), cell.top_p))
    entry = {"factor": factor, "nucleus_median": measured, "nucleus_target": target,
             "nucleus_median_unscaled": statistics.median(nucleus_sizes(base, cell.top_p))}
    bench.scales[key] = entry
    save_scales(bench)
    return entry
