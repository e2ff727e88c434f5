"""``check_environment()``: every ``OPSD_*`` variable checked at once, before any work (no torch).

The main job calls it before building models; ``opsd_profiler()`` calls it on entry; the first
read of the active config (:func:`instrumentation.get_config`) goes through the same checks. A bad
value raises a one-line ``ValueError`` naming the variable and the values it accepts:

* the ``OPSD_PROFILE*`` variables of :mod:`instrumentation.config` (an unknown ``OPSD_PROFILE*``
  name, e.g. the typo ``OPSD_PROFILE_STEP``, is refused with the known names);
* ``OPSD_TRACEBACK`` (``opsd-summarize``: show tracebacks) and ``OPSD_REQUIRE_REAL_MODEL`` (tests):
  a boolean; ``OPSD_WORKER_RESULT`` and ``OPSD_NVTX_LOG_DIR`` (test harness paths) and
  ``OPSD_REAL_MODEL_CACHE`` (``rollout.real_model``: a folder, ``0`` for none; one it cannot use is
  a warning there, not an error): any text;
* ``OPSD_PEAK_TFLOPS`` / ``OPSD_PEAK_TBPS`` (the rates work records are divided by,
  :mod:`instrumentation.rates`): a finite number > 0;
* with a file-writing mode (``1``, ``timers``) and an explicit ``OPSD_PROFILE_RUN_NAME``, on rank 0
  (env ``RANK`` unset or 0) and while ``torch.distributed`` is not initialised: the run directory
  must not belong to another run already (:mod:`instrumentation.runmarker`). Once it is
  initialised, the session checks that after sharing the run id, so that all ranks refuse together
  (a rank raising alone could leave the others waiting in a collective).

Other ``OPSD_*`` names belong to other parts of the project and are left alone. Importing this
module reads nothing; only calls do.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from typing import Mapping, Optional

from instrumentation import rates, runmarker
from instrumentation.config import ENV_VARS, ProfileConfig, parse_bool

PROFILE_PREFIX = "OPSD_PROFILE"
#: The other OPSD_* variables of the project: name -> True when it is a boolean.
OTHER_VARS = {"OPSD_TRACEBACK": True, "OPSD_REQUIRE_REAL_MODEL": True, "OPSD_WORKER_RESULT": False,
              "OPSD_NVTX_LOG_DIR": False, "OPSD_REAL_MODEL_CACHE": False}


def _check_names(environ: Mapping[str, str]) -> None:
    known = sorted(ENV_VARS.values())
    for var in sorted(k for k in environ if k.startswith(PROFILE_PREFIX) and k not in known):
        close = difflib.get_close_matches(var, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"{var} is not a known variable{hint}; accepted: {', '.join(known)}")


def _check_others(environ: Mapping[str, str]) -> None:
    for var, is_bool in OTHER_VARS.items():
        raw = environ.get(var, "")
        if is_bool and raw.strip():
            parse_bool(raw, var)
    rates.check_rates(environ)


def _distributed() -> bool:
    """Whether ``torch.distributed`` is initialised (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def config_from_environment(environ: Optional[Mapping[str, str]] = None) -> ProfileConfig:
    """The profiling config of ``environ`` (default ``os.environ``) after the name and value checks."""
    environ = os.environ if environ is None else environ
    _check_names(environ)
    _check_others(environ)
    return ProfileConfig.from_env(environ)


#: variable -> (the modes that read it, what it does): set under another mode it does nothing (one warning).
MODE_ONLY = {"OPSD_PROFILE_EVERY": (("timers",), "times every N-th step in mode 'timers'"),
             "OPSD_PROFILE_STEPS": (("1",), "picks the traced steps of mode '1'")}


def _warn_ignored(environ: Mapping[str, str], config: ProfileConfig) -> None:
    if config.mode == "0":
        return  # profiling off: nothing is read, as documented
    for var, (modes, does) in MODE_ONLY.items():
        if environ.get(var, "").strip() and config.mode not in modes:
            warnings.warn(f"{var}={environ[var]!r} is ignored under OPSD_PROFILE={config.mode!r} (it {does})",
                          stacklevel=3)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> ProfileConfig:
    """Validate every ``OPSD_*`` variable (see the module docstring); returns the profiling config.

    Call it first thing in a training job: a bad value stops the job before any model is built.
    """
    environ = os.environ if environ is None else environ
    config = config_from_environment(environ)
    _warn_ignored(environ, config)
    rank = environ.get("RANK", "").strip() or "0"
    if config.stage_timers and config.run_name is not None and rank == "0" and not _distributed():
        run_dir = os.path.join(config.output_dir, config.run_name)
        runmarker.check_name_free(run_dir, config.run_name, environ)
    return config


__all__ = ["check_environment", "config_from_environment", "OTHER_VARS"]
