"""The process-wide active ``ProfileConfig`` and one-time warnings (no torch).

The config is read from the environment once, on first use (:func:`get_config`). Modules that
pick an implementation from it (ranges, timers) register hooks here, so that :func:`configure`
and :func:`reset_for_tests` switch them without any per-call check of the mode.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

from instrumentation.config import ProfileConfig
from instrumentation.environment import config_from_environment


class ProfilingWarning(RuntimeWarning):
    """Something in the profiling machinery failed; training goes on without it."""


_config: Optional[ProfileConfig] = None
_install_hooks: list[Callable[[ProfileConfig], None]] = []
_reset_hooks: list[Callable[[], None]] = []
_warned: set[str] = set()


def get_config() -> ProfileConfig:
    """The active config; built from the environment on the first call (the checks of
    :func:`instrumentation.check_environment`: ``ValueError`` naming a bad variable)."""
    if _config is None:
        configure(config_from_environment())
    return _config


def configure(config: ProfileConfig) -> Optional[ProfileConfig]:
    """Make ``config`` the active config (and re-pick the range implementation); returns the old one."""
    global _config
    if not isinstance(config, ProfileConfig):
        raise ValueError(f"config must be a ProfileConfig; got {type(config).__name__}")
    previous, _config = _config, config
    for hook in list(_install_hooks):
        hook(config)
    return previous


def reset_for_tests() -> None:
    """Forget the active config, the one-time warnings and all open timers (tests only)."""
    global _config
    _config = None
    _warned.clear()
    for hook in list(_reset_hooks):
        hook()


def on_configure(install: Callable[[ProfileConfig], None], reset: Callable[[], None]) -> None:
    """Register ``install(config)`` (called by :func:`configure`) and ``reset()`` (by tests' reset)."""
    _install_hooks.append(install)
    _reset_hooks.append(reset)
    if _config is not None:
        install(_config)


def warn_once(cause: str, message: str) -> None:
    """Emit ``message`` as a :class:`ProfilingWarning` the first time ``cause`` is seen."""
    if cause in _warned:
        return
    _warned.add(cause)
    warnings.warn(message, ProfilingWarning, stacklevel=3)
