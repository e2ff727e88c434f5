"""``stage(name)`` / ``@staged(name)``: one NVTX range + one ``record_function`` per stage call.

The implementation is picked once, when the config is first read (or re-set by ``configure``),
and bound to a module global; ``stage()`` itself never tests the mode:

* off (``OPSD_PROFILE`` unset/``0``): ``stage(name)`` is a dict lookup returning one shared
  do-nothing :data:`instrumentation.NOOP` (the lookup also rejects unknown stage names).
* ``nvtx`` / ``1`` / ``timers``: a small per-call object that pushes the stage's NVTX range (domain ``opsd``,
  message ``opsd/<stage>``, the stage colour), opens a ``record_function``-equivalent user annotation
  ``opsd/<stage>`` **only while a torch profiler is enabled** (``torch.autograd._profiler_enabled()``;
  ``torch.profiler.record_function`` costs ~10 us per call even with no profiler, so outside profiler
  windows it is skipped; inside, we call the binding torch.profiler uses itself,
  ``torch.autograd._record_function_with_args_enter/_exit``, a few us instead of ~15), and in modes
  ``1`` and ``timers`` opens a timer frame while a sink (a timed step or a ``collect_stages``
  block) listens.
  Everything is closed in ``finally`` order. The annotations appear in traces as ``user_annotation``
  events, exactly like ``record_function``'s.
* Nothing is emitted while ``torch.compile`` traces (``torch.compiler.is_compiling()``) or while the
  current CUDA stream is capturing a graph.
* A stage opened inside itself on the same thread (a loop wrapped in ``stage(STEP)`` around ``OPSDStep.step``,
  which opens ``opsd/step`` itself) emits nothing: no second NVTX range (Nsight Systems' ``nvtx_sum`` would count
  it twice), no second annotation, no second timer frame; one ``ProfilingWarning`` per stage names it and the
  rank, in every enabled mode (``nvtx`` included).

If the ``nvtx`` package is missing or unusable, one warning is issued and NVTX ranges are skipped;
when it is present but no tool (Nsight Systems) is attached, NVTX calls are skipped as well.
"""

from __future__ import annotations

import functools
from threading import get_ident as _thread_id

import torch

from instrumentation import stages, state
from instrumentation.config import MODE_OFF, ProfileConfig
from instrumentation.noop import NOOP, NOOP_RANGE  # noqa: F401  (NOOP_RANGE: the former name)
from instrumentation.timers import HUB, warn_nested

try:  # the bindings torch.profiler itself uses: ~4x cheaper than the record_function ops
    from torch.autograd import _profiler_enabled
    from torch.autograd import _record_function_with_args_enter as _rf_enter
    from torch.autograd import _record_function_with_args_exit as _rf_exit
except ImportError:  # pragma: no cover - older/newer torch without these private bindings
    _profiler_enabled = torch._C._autograd._profiler_enabled

    def _rf_enter(name):
        return torch.ops.profiler._record_function_enter_new(name, None)

    _rf_exit = torch.ops.profiler._record_function_exit._RecordFunction


class _StageMap(dict):
    """stage -> value; an unknown stage raises ``ValueError`` naming the accepted stages."""

    def __missing__(self, name):
        raise ValueError(f"unknown stage {name!r}; expected one of {', '.join(stages.ALL_STAGES)} "
                         "(use the constants of instrumentation.stages)")


_OFF = _StageMap({name: NOOP for name in stages.ALL_STAGES})


def _noop() -> None:
    pass


class _Spec:
    """Everything a range of one stage needs, resolved once at install time; and which thread has the stage open,
    how deep (``owner``, ``depth``: a stage opened inside itself on that thread emits nothing)."""

    __slots__ = ("stage", "name", "push", "pop", "skip", "timing", "owner", "depth")

    def __init__(self, stage, push, pop, skip, timing):
        self.stage, self.name = stage, stages.range_name(stage)
        self.push, self.pop, self.skip, self.timing = push, pop, skip, timing
        self.owner, self.depth = None, 0


def _open_frame(stage: str):
    try:
        return HUB.open(stage)
    except Exception as exc:  # profiling never breaks training
        state.warn_once("timers", f"opsd stage timers disabled for a call: {exc!r}")
        return None


def _close_frame(frame) -> None:
    try:
        HUB.close(frame)
    except Exception as exc:
        state.warn_once("timers", f"opsd stage timers disabled for a call: {exc!r}")


class _Range:
    """One stage call in an enabled mode (see the module docstring)."""

    __slots__ = ("_spec", "_rf", "_frame", "_open", "_nested", "_owns")

    def __init__(self, spec: _Spec):
        self._spec = spec
        self._rf = self._frame = None
        self._open = self._nested = self._owns = False

    def __enter__(self) -> None:
        spec = self._spec
        if spec.skip():
            return None
        if spec.depth:
            if spec.owner == _thread_id():  # inside itself on this thread: counted once, as the outer call
                spec.depth += 1
                self._nested = True
                warn_nested(spec.stage)
                return None
        else:  # the outermost call (another thread's concurrent call of an open stage is emitted, untracked)
            spec.owner, spec.depth, self._owns = _thread_id(), 1, True
        try:
            spec.push()
        except BaseException:
            self._release()
            raise
        self._open = True
        try:
            if _profiler_enabled():
                self._rf = _rf_enter(spec.name)
            if spec.timing and HUB.sinks:
                self._frame = _open_frame(spec.stage)
        except BaseException:
            self._close()
            raise
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._nested:
            self._nested = False
            self._spec.depth -= 1
        elif self._open:
            self._close()
        return False

    def _release(self) -> None:
        if self._owns:
            self._owns = False
            self._spec.owner, self._spec.depth = None, 0

    def _close(self) -> None:
        self._open = False
        try:
            if self._frame is not None:
                _close_frame(self._frame)
        finally:
            try:
                if self._rf is not None:
                    _rf_exit(self._rf)
            finally:
                spec = self._spec
                if self._owns:
                    self._owns, spec.owner, spec.depth = False, None, 0
                spec.pop()


def _nvtx_domain():
    """The ``opsd`` NVTX domain; None when nvtx is unusable (one warning) or no tool is attached."""
    try:
        import nvtx

        domain = nvtx.get_domain(stages.NVTX_DOMAIN)
    except Exception as exc:
        state.warn_once("nvtx", f"NVTX ranges are skipped: the 'nvtx' package is not usable ({exc!r}); "
                                "torch.profiler ranges and timers still work")
        return None
    return None if type(domain).__name__ == "DummyDomain" else domain


def _skip_check():
    """``torch.compiler.is_compiling`` (+ CUDA graph capture where CUDA is available)."""
    is_compiling = torch.compiler.is_compiling
    if not torch.cuda.is_available():
        return is_compiling
    capturing = torch.cuda.is_current_stream_capturing
    return lambda: is_compiling() or capturing()


def _build_specs(config: ProfileConfig) -> _StageMap:
    domain = _nvtx_domain()
    skip, timing = _skip_check(), config.stage_timers
    specs = _StageMap()
    for name in stages.ALL_STAGES:
        push, pop = _noop, _noop
        if domain is not None:
            try:
                attributes = domain.get_event_attributes(message=stages.range_name(name),
                                                         color=stages.STAGE_COLORS[name])
                push, pop = functools.partial(domain.push_range, attributes), domain.pop_range
            except Exception as exc:
                state.warn_once("nvtx", f"NVTX ranges are skipped: {exc!r}")
        specs[name] = _Spec(name, push, pop, skip, timing)
    return specs


def _install(config: ProfileConfig) -> None:
    """Bind ``_open`` to the implementation of ``config.mode`` (called by ``configure``)."""
    global _open
    if config.mode == MODE_OFF:
        _open = _OFF.__getitem__
        return
    specs = _build_specs(config)

    def open_range(name: str) -> _Range:
        return _Range(specs[name])

    _open = open_range


def _bootstrap(name: str):
    """First call: read the config (which installs the real implementation), then delegate."""
    state.get_config()
    if _open is _bootstrap:  # get_config() found a config installed before this module was imported
        _install(state.get_config())
    return _open(name)


def _reset() -> None:
    global _open
    _open = _bootstrap


_open = _bootstrap
state.on_configure(_install, _reset)


def stage(name: str):
    """Context manager for one call of stage ``name`` (a constant of :mod:`instrumentation.stages`)."""
    return _open(name)


def staged(name: str):
    """Decorator form of :func:`stage`: the whole call of the function is one ``name`` range."""
    stages.range_name(name)  # validate at decoration time

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with _open(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate
