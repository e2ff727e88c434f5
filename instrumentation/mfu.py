"""Model FLOP utilisation (MFU) of an OPSD step (no torch).

    MFU = model FLOPs of the step / (step time * peak FLOP/s of the device)

Model FLOPs count the matrix multiplies with the weights, 2 FLOPs per parameter per token for a
forward pass and 4 more for its backward pass (the usual dense estimate; attention's score and value
products and everything that is not a matmul are left out, as are padding tokens). One OPSD step
over ``rows`` sequences of ``prompt_tokens`` + ``response_tokens`` real tokens in total:

* rollout (student, forward only): ``2 * N_student * (prompt_tokens + response_tokens)``;
* teacher forward over its prompts and the responses: ``2 * N_teacher * (teacher_prompt_tokens +
  response_tokens)``;
* student forward + backward over prompts and responses: ``6 * N_student * (prompt_tokens +
  response_tokens)`` when every weight trains; the backward's weight gradients count for the trained share of
  the weights only (``trained_share``, :func:`instrumentation.geometry.trained_share`), so a LoRA student's is
  ``(4 + 2 * share) * N_student * ...``, about 4N: a frozen weight takes no gradient.

``N`` is the number of parameters that take part in matmuls (:func:`matmul_params`: tied input and
output embeddings counted once, as the output projection; an untied input embedding left out). Peak FLOP/s: :data:`PEAK_TFLOPS`, the dense (no sparsity)
tensor-core figure of the vendor's data sheet for the dtype, e.g. 989.4 TFLOP/s bf16 for an H100 or
H200 SXM (1,979 with 2:4 sparsity).
"""

from __future__ import annotations

import warnings
from typing import Optional

#: (device name substring, dtype) -> dense tensor-core peak, TFLOP/s (NVIDIA data sheets, SXM parts).
PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("H200", "bf16"): 989.4, ("H200", "fp16"): 989.4, ("H200", "fp8"): 1978.9,
    ("H100", "bf16"): 989.4, ("H100", "fp16"): 989.4, ("H100", "fp8"): 1978.9,
    ("A100", "bf16"): 312.0, ("A100", "fp16"): 312.0, ("A100", "tf32"): 156.0,
}


def peak_flops(device_name: str, dtype: str = "bf16") -> Optional[float]:
    """Peak FLOP/s of ``device_name`` (e.g. ``torch.cuda.get_device_name()``), None when unknown."""
    for (part, kind), tflops in PEAK_TFLOPS.items():
        if part in device_name and kind == dtype:
            return tflops * 1e12
    return None


def opsd_step_flops(student_params: int, teacher_params: int, prompt_tokens: int, response_tokens: int,
                    teacher_prompt_tokens: Optional[int] = None, trained_share: float = 1.0) -> float:
    """Model FLOPs of one OPSD step (see the module docstring)."""
    if isinstance(trained_share, bool) or not isinstance(trained_share, (int, float)) or not 0 <= trained_share <= 1:
        raise ValueError(f"trained_share must be a number in [0, 1]; got {trained_share!r}")
    for name, value in (("student_params", student_params), ("teacher_params", teacher_params),
                        ("prompt_tokens", prompt_tokens), ("response_tokens", response_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    teacher_prompt = prompt_tokens if teacher_prompt_tokens is None else teacher_prompt_tokens
    student_tokens = prompt_tokens + response_tokens
    student = 2.0 + 4.0 + 2.0 * trained_share  # rollout; forward + the inputs' gradients; the weights' gradients
    return student * student_params * student_tokens + 2.0 * teacher_params * (teacher_prompt + response_tokens)


def matmul_params(model) -> int:
    """Parameters of a model (or a DeepSpeed engine around one) that take part in matmuls: all of
    them at full size (``ds_numel`` under ZeRO-3), less an input embedding that is not tied to the
    output projection (a lookup, no matmul)."""
    module = getattr(model, "module", model)
    size = lambda p: int(getattr(p, "ds_numel", 0) or p.numel())
    total = sum(size(p) for p in module.parameters())
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    emb, out = (get_in() if get_in else None), (get_out() if get_out else None)
    if emb is not None and out is not None and emb.weight is not out.weight:
        total -= size(emb.weight)
    return total


#: Largest MFU returned: above it (a peak a thousand times too low, ``--peak-tflops 1e-300``) the figure says
#: nothing and would print hundreds of digits; :func:`mfu` returns None instead.
MAX_REPORTED_MFU = 1e3
_warned_above_one = False


def mfu(flops: float, step_s: float, peak: Optional[float]) -> Optional[float]:
    """``flops / (step_s * peak)``; None when the peak is unknown or the time is not positive. Above 1 the counted
    FLOPs exceed the device's peak, so the peak (``--peak-tflops`` / ``OPSD_PEAK_TFLOPS``) is too low: one
    ``RuntimeWarning`` per process says so, and above :data:`MAX_REPORTED_MFU` the result is None."""
    global _warned_above_one
    if peak is None or not peak > 0 or not step_s > 0:
        return None
    value = flops / (step_s * peak)
    if value > 1.0:
        if not _warned_above_one:
            _warned_above_one = True
            shown = "not reported" if value > MAX_REPORTED_MFU else "shown as computed"
            warnings.warn(f"MFU {100 * value:.3g}% (> 100%) with a peak of {peak / 1e12:.3g} TFLOP/s: the peak "
                          f"(--peak-tflops / OPSD_PEAK_TFLOPS) is too low; MFU {shown}", RuntimeWarning, stacklevel=2)
        if value > MAX_REPORTED_MFU:
            return None
    return value
