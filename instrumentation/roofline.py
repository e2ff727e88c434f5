"""Rooflines of a rollout call (no torch): the least time its bytes and FLOPs allow at measured rates.

One implementation for the benchmarks (``benchmarks.rl``, ``benchmarks.suites``) and the trace report. The
rates are measured by the benchmarks (``benchmarks.harness.device.measure_rates``: a device copy and a GEMM);
here they are plain numbers in a :class:`Rates`. Definitions (issue 15):

- a decode step reads every weight once and the keys and values of every live row's context, and computes
  ``2 * params`` FLOPs per row plus attention over the context: its time is ``max(bytes / copy rate, FLOPs /
  GEMM rate)``;
- a call's prefill computes each unique prompt once (not once per sample) and reads the weights once;
- a call's roofline is its prefill's plus every decode step's, each row live until its realised length.

The copy rate counts bytes read + written per second (a device copy of N bytes moves 2N), the convention of
the measured figures (a 6.17 GB read at 4.25 TB/s: 1.45 ms).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class ModelGeometry:
    """What the roofline needs of a model, as plain ints."""

    weight_bytes: int
    """Bytes of all weights (tied matrices once)."""
    kv_bytes_per_token: int
    """K + V of one token over all layers: 2 * layers * kv_heads * head_dim * element size."""
    nonembedding_params: int
    """Parameters other than the input embedding and the output embedding (lm_head)."""
    lm_head_params: int
    """vocab x hidden."""
    attn_flops_per_key: int
    """4 * layers * q_heads * head_dim: QK^T and PV FLOPs of one query against one key."""


@dataclass(frozen=True)
class Rates:
    """Measured device rates the rooflines divide by."""

    copy_bytes_s: float
    """Copy bandwidth, bytes read + written per second."""
    gemm_flops_s: float
    """Dense GEMM rate in the model's dtype, FLOP/s."""

    def __post_init__(self) -> None:
        for name in ("copy_bytes_s", "gemm_flops_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: must be a number > 0; got {value!r}")

    @classmethod
    def measured(cls, copy_gbps: float, gemm_tflops: float) -> "Rates":
        """From the units benchmarks print and record (GB/s, TFLOP/s)."""
        return cls(copy_gbps * 1e9, gemm_tflops * 1e12)


def decode_step_floor_s(geo: ModelGeometry, live_tokens: int, rates: Rates) -> float:
    """The bandwidth floor of one decode step: every weight and the keys and values of ``live_tokens`` cached
    tokens (summed over the rows) read once at the copy rate."""
    return (geo.weight_bytes + geo.kv_bytes_per_token * live_tokens) / rates.copy_bytes_s


def decode_steps(prompt_lens: Sequence[int], response_lens: Sequence[int], geo: ModelGeometry,
                 samples: int = 1) -> Iterator[tuple[float, float, int]]:
    """``(bytes_t, flops_t, live rows)`` of every decode step t = 1 .. max(L) - 1.

    Row r (real prompt tokens P_r, realised response length L_r) is live at step t iff L_r > t (the first
    response token comes from the prefill's logits; step t produces token t + 1); its current length is
    P_r + t. bytes_t = weight_bytes + kv_bytes_per_token * [sum over live rows of t + sum over the prompts with a
    live row of P]; flops_t = sum over live rows of [2 * (nonembedding_params + lm_head_params) + attn_flops_per_key *
    (P_r + t)]. Rows r // ``samples`` share one prompt, read once a step for its live rows (1, the issue-15
    roofline: every row its own prompt; n: what a step that reads each prompt once for its n samples must read).
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"prompt_lens/response_lens: lengths differ ({len(prompt_lens)} vs {len(response_lens)})")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: must be an int >= 1; got {samples!r}")
    if not response_lens:
        return
    order = sorted(range(len(response_lens)), key=lambda i: response_lens[i])
    lens = [response_lens[i] for i in order]
    prompts = [prompt_lens[i] for i in order]
    dense = 2 * (geo.nonembedding_params + geo.lm_head_params)
    live, live_prompt, first = len(lens), sum(prompts), 0
    rows_of = Counter(i // samples for i in order)  # prompt -> its live rows
    read_prompt = sum(prompt_lens[group * samples] for group in rows_of)  # the prompts with a live row, once each
    for t in range(1, lens[-1]):
        while first < len(lens) and lens[first] <= t:  # rows that ended before step t leave
            live -= 1
            live_prompt -= prompts[first]
            group = order[first] // samples
            rows_of[group] -= 1
            read_prompt -= prompts[first] if rows_of[group] == 0 else 0
            first += 1
        context = live_prompt + live * t
        read = read_prompt + live * t
        yield geo.weight_bytes + geo.kv_bytes_per_token * read, live * dense + geo.attn_flops_per_key * context, live


def decode_roofline_s(prompt_lens: Sequence[int], response_lens: Sequence[int], geo: ModelGeometry,
                      rates: Rates, samples: int = 1) -> float:
    """Sum over decode steps (:func:`decode_steps`, ``samples`` as there) of max(bytes_t / copy rate, flops_t / GEMM
    rate)."""
    return sum(max(step_bytes / rates.copy_bytes_s, step_flops / rates.gemm_flops_s)
               for step_bytes, step_flops, _ in decode_steps(prompt_lens, response_lens, geo, samples))


def prefill_flops(unique_prompt_lens: Sequence[int], geo: ModelGeometry) -> float:
    """FLOPs of the prefill of the unique prompts (each once, not once per sample): sum over prompts of
    [2 * nonembedding_params * P + 2 * lm_head_params (one logits row per prompt) + attn_flops_per_key * P (P + 1) / 2
    (causal: query i attends i keys)]."""
    return sum(2 * geo.nonembedding_params * p + 2 * geo.lm_head_params + geo.attn_flops_per_key * p * (p + 1) / 2
               for p in unique_prompt_lens)


def prefill_roofline_s(unique_prompt_lens: Sequence[int], geo: ModelGeometry, rates: Rates) -> float:
    """max(weight_bytes / copy rate, :func:`prefill_flops` / GEMM rate)."""
    return max(geo.weight_bytes / rates.copy_bytes_s, prefill_flops(unique_prompt_lens, geo) / rates.gemm_flops_s)


def call_roofline_s(unique_prompt_lens: Sequence[int], n: int, response_lens: Sequence[int], geo: ModelGeometry,
                    rates: Rates, prompt_once: bool = False) -> float:
    """Roofline of one call: prefill of the unique prompts + every decode step. Row i of the output (``n`` samples
    per prompt) belongs to prompt i // n. ``prompt_once``: each decode step reads a prompt's keys and values once
    for its live samples (the issue-15 roofline, the default, reads them once per row)."""
    expanded = [p for p in unique_prompt_lens for _ in range(n)]
    return prefill_roofline_s(unique_prompt_lens, geo, rates) + decode_roofline_s(
        expanded, response_lens, geo, rates, n if prompt_once else 1)


#: Bytes an AdamW step moves per parameter: reads fp32 master, gradient, both moments (16); writes master,
#: moments and the bf16 working copy (14).
ADAMW_BYTES_PER_PARAM = 30


def _weight_gemm_flops(row_lens: Sequence[int], geo: ModelGeometry, head_positions: int) -> float:
    """The forward's GEMMs with the weights: 2 * nonembedding_params * sum(L) + 2 * lm_head_params * head_positions."""
    return 2 * geo.nonembedding_params * sum(row_lens) + 2 * geo.lm_head_params * head_positions


def _attention_flops(row_lens: Sequence[int], geo: ModelGeometry) -> float:
    """Causal attention of the forward: sum over rows of attn_flops_per_key * L (L + 1) / 2."""
    return sum(geo.attn_flops_per_key * n * (n + 1) / 2 for n in row_lens)


def forward_flops(row_lens: Sequence[int], geo: ModelGeometry, head_positions: int) -> float:
    """FLOPs of one forward over rows of ``row_lens`` real tokens each (no padding), with the head applied at
    ``head_positions`` positions: sum over rows of [2 * nonembedding_params * L + attn_flops_per_key * L (L + 1) / 2]
    + 2 * lm_head_params * head_positions."""
    return _weight_gemm_flops(row_lens, geo, head_positions) + _attention_flops(row_lens, geo)


def backward_flops(row_lens: Sequence[int], geo: ModelGeometry, head_positions: int,
                   trained_share: float = 1.0) -> float:
    """FLOPs of the backward of :func:`forward_flops`'s forward: the gradients of every GEMM's input (its weight
    GEMMs once more) and of attention's inputs (twice its forward), and the weights' gradients in proportion to
    ``trained_share``, the share of the matmul weights that train (1.0: 2x the forward; a frozen base with LoRA
    adapters, whose parameters count in ``nonembedding_params``: their share, a fraction of a percent)."""
    if not 0.0 <= trained_share <= 1.0:
        raise ValueError(f"trained_share: must be in [0, 1]; got {trained_share!r}")
    return (1 + trained_share) * _weight_gemm_flops(row_lens, geo, head_positions) + 2 * _attention_flops(row_lens, geo)


def pass_bytes(geo: ModelGeometry, passes: float = 1) -> int:
    """Bytes a training pass must move: every weight read ``passes`` times (activations are not counted)."""
    return int(round(passes * geo.weight_bytes))


def optimizer_bytes(trainable_params: int) -> int:
    """Bytes an AdamW step moves over ``trainable_params`` parameters (:data:`ADAMW_BYTES_PER_PARAM` each)."""
    return ADAMW_BYTES_PER_PARAM * trainable_params


def work_roofline_s(flops: float, num_bytes: float, rates: Rates) -> float:
    """max(``num_bytes`` / copy rate, ``flops`` / GEMM rate): the least time of any work."""
    return max(num_bytes / rates.copy_bytes_s, flops / rates.gemm_flops_s)


def pass_roofline_s(flops: float, geo: ModelGeometry, rates: Rates, passes: float = 1) -> float:
    """max(weights read ``passes`` times / copy rate, ``flops`` / GEMM rate): one training pass or several."""
    return work_roofline_s(flops, pass_bytes(geo, passes), rates)


@dataclass(frozen=True)
class TrainingRoofline:
    """The least time of an OPSD step's training phases (seconds), from its realised row lengths."""

    teacher_s: float
    """Teacher forward over prompt + response, head at the loss positions."""
    student_s: float
    """Student forward + backward (:func:`backward_flops`: 3x the forward's FLOPs when every weight trains), the
    head at the loss positions included wherever it runs (the fused loss computes it)."""
    optimizer_s: float
    """AdamW over the student's trainable parameters (:data:`ADAMW_BYTES_PER_PARAM`)."""

    @property
    def total_s(self) -> float:
        return self.teacher_s + self.student_s + self.optimizer_s


def training_roofline(student_rows: Sequence[int], teacher_rows: Sequence[int], loss_positions: int,
                      student: ModelGeometry, teacher: ModelGeometry, trainable_params: int,
                      rates: Rates, trained_share: float = 1.0) -> TrainingRoofline:
    """:class:`TrainingRoofline` of rows of ``student_rows`` / ``teacher_rows`` real tokens (prompt + response);
    ``trained_share``: of the student's matmul weights (:func:`backward_flops`; the weights are read in the forward
    and the backward, and the trained share's gradients written)."""
    teacher_s = pass_roofline_s(forward_flops(teacher_rows, teacher, loss_positions), teacher, rates)
    flops = forward_flops(student_rows, student, loss_positions) \
        + backward_flops(student_rows, student, loss_positions, trained_share)
    student_s = pass_roofline_s(flops, student, rates, passes=2 + trained_share)
    return TrainingRoofline(teacher_s, student_s, optimizer_bytes(trainable_params) / rates.copy_bytes_s)
