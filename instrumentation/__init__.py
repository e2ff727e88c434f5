"""Per-stage instrumentation (NVTX + torch.profiler ranges, stage timers), switched by ``OPSD_PROFILE``.

Importing this package does not import torch and reads no variable: :mod:`instrumentation.stages`
(the stage-name contract), :class:`ProfileConfig`, :func:`check_environment` (every ``OPSD_*``
variable, checked before any work), the config functions and :data:`NOOP` (the one do-nothing
object of the off path; ``NOOP_RANGE`` is the same object) are torch-free; ``stage``, ``staged``,
``opsd_profiler``, ``collect_stages`` and friends are loaded on first access.

    from instrumentation import stage, staged, stages, opsd_profiler, collect_stages

    with stage(stages.PREFILL): ...
    @staged(stages.POSTPROCESS)
    def postprocess(...): ...
"""

from importlib import import_module

__opsd_rollout_package__ = "instrumentation"

from instrumentation import stages  # noqa: F401  (light: no torch)
from instrumentation.config import ProfileConfig  # noqa: F401
from instrumentation.environment import check_environment  # noqa: F401
from instrumentation.noop import NOOP, NOOP_RANGE, Noop  # noqa: F401
from instrumentation.state import (  # noqa: F401
    ProfilingWarning, configure, get_config, reset_for_tests, warn_once,
)

#: Public names that need torch, and the module that defines each.
_LAZY = {
    "stage": "instrumentation.ranges",
    "staged": "instrumentation.ranges",
    "opsd_profiler": "instrumentation.profiler",
    "ProfilerSession": "instrumentation.profiler",
    "collect_stages": "instrumentation.collect",
    "StageCollector": "instrumentation.collect",
    "format_stage_rows": "instrumentation.collect",
    "instrument_deepspeed": "instrumentation.upstream",
    "uninstrument_deepspeed": "instrumentation.upstream",
}

__all__ = ["stages", "ProfileConfig", "check_environment", "ProfilingWarning", "configure", "get_config",
           "reset_for_tests", "warn_once", "NOOP", "NOOP_RANGE", "Noop", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'instrumentation' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
