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

#: One ARGB colour per stage for NVTX ranges (Nsight Systems draws them in these colours) and for the
#: trace report's plot; all distinct, the strongest ones on the stages of every step.
STAGE_COLORS: dict[str, int] = {
    STEP: 0xFF4E79A7, ROLLOUT: 0xFFF28E2B, PREFILL: 0xFFE15759, DECODE: 0xFF59A14F,
    TEACHER_FORWARD: 0xFFB07AA1, STUDENT_FORWARD: 0xFF76B7B2, LOSS: 0xFFEDC948, BACKWARD: 0xFF9C755F,
    OPTIMIZER_STEP: 0xFFFF9DA7, LOGIT_CACHE: 0xFF1F77B4, EXPAND: 0xFFBAB0AC, MODE_SWITCH: 0xFFFF7F0E,
    GATHER: 0xFF2CA02C, LORA_FUSE: 0xFFD62728, LORA_UNFUSE: 0xFF9467BD, CACHE_ACQUIRE: 0xFF8C564B,
    CACHE_RELEASE: 0xFFE377C2, PLAN: 0xFF7F7F7F, CACHE_TRIM: 0xFFBCBD22, MASK_BUILD: 0xFF17BECF,
    POSTPROCESS: 0xFF393B79,
}
assert set(STAGE_COLORS) == set(ALL_STAGES) and len(set(STAGE_COLORS.values())) == len(ALL_STAGES)

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
