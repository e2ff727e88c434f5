"""Stage names: the contract between instrumentation/, the rollout core and traces/.

This module imports nothing heavy (no torch) so that trace tooling can use it on machines without
a GPU stack. Every range the project emits is named ``opsd/<stage>`` from the constants below,
never from a function name: traces and reports key on these strings.
"""

from __future__ import annotations

PREFIX = "opsd/"
NVTX_DOMAIN = "opsd"

STEP = "step"
ROLLOUT = "rollout"
EXPAND = "expand"
MODE_SWITCH = "mode_switch"
GATHER = "gather"
LORA_FUSE = "lora_fuse"
LORA_UNFUSE = "lora_unfuse"
CACHE_ACQUIRE = "cache_acquire"
CACHE_RELEASE = "cache_release"
PLAN = "plan"
PREFILL = "prefill"
DECODE = "decode"
CACHE_TRIM = "cache_trim"
MASK_BUILD = "mask_build"
POSTPROCESS = "postprocess"
TEACHER_FORWARD = "teacher_forward"
LOGIT_CACHE = "logit_cache"
STUDENT_FORWARD = "student_forward"
LOSS = "loss"
BACKWARD = "backward"
OPTIMIZER_STEP = "optimizer_step"

#: Every stage, in the order a step passes through them (used for report ordering).
ALL_STAGES: tuple[str, ...] = (
    STEP, ROLLOUT, EXPAND, MODE_SWITCH, GATHER, LORA_FUSE, CACHE_ACQUIRE, PLAN, PREFILL, DECODE,
    CACHE_TRIM, MASK_BUILD, POSTPROCESS, LORA_UNFUSE, CACHE_RELEASE, TEACHER_FORWARD, LOGIT_CACHE,
    STUDENT_FORWARD, LOSS, BACKWARD, OPTIMIZER_STEP,
)

#: One ARGB colour per stage for NVTX ranges (Nsight Systems draws them in these colours).
STAGE_COLORS: dict[str, int] = {
    name: color for name, color in zip(ALL_STAGES, (
        0xFF4E79A7, 0xFFF28E2B, 0xFFE15759, 0xFF76B7B2, 0xFF59A14F, 0xFFEDC948, 0xFFB07AA1,
        0xFFFF9DA7, 0xFF9C755F, 0xFFBAB0AC, 0xFF1F77B4, 0xFFFF7F0E, 0xFF2CA02C, 0xFFD62728,
        0xFF9467BD, 0xFF8C564B, 0xFFE377C2, 0xFF7F7F7F, 0xFFBCBD22, 0xFF17BECF, 0xFF393B79,
    ))
}

_STAGE_SET = frozenset(ALL_STAGES)


def range_name(stage: str) -> str:
    """The full range name of ``stage`` (``"decode"`` -> ``"opsd/decode"``)."""
    if stage not in _STAGE_SET:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(ALL_STAGES)}")
    return PREFIX + stage


def stage_of(name: str) -> str | None:
    """The stage of a full range name, or None when ``name`` is not one of ours."""
    if name.startswith(PREFIX) and name[len(PREFIX):] in _STAGE_SET:
        return name[len(PREFIX):]
    return None
