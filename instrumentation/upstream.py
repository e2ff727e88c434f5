"""``instrument_deepspeed()``: DeepSpeed's own rollout emits our stage ranges.

One explicit call wraps methods of DeepSpeed 0.19.8's ``HybridEngineRollout`` and
``DeepSpeedHybridEngine`` (and the few DeepSpeed objects they drive) so that a run on upstream's
rollout shows the same ``opsd/<stage>`` ranges as our core, through :func:`instrumentation.stage`
(NVTX + ``record_function``; nothing unless ``OPSD_PROFILE`` is on)::

    import instrumentation
    instrumentation.instrument_deepspeed()   # after DS_ACCELERATOR is set, before deepspeed.initialize
    engine, *_ = deepspeed.initialize(...)
    rollout = HybridEngineRollout(engine, tokenizer)

What becomes which stage (see :data:`TARGETS` in :mod:`instrumentation.upstream_targets`; no upstream code is copied, methods are wrapped):

* ``HybridEngineRollout.generate`` -> ``rollout``. While it runs, a forward pre-hook and a forward
  hook on the engine's model open/close one range per model forward: the first forward of the
  generate call is ``prefill``, later ones ``decode``; forwards inside the continuous-batching
  prefill (``_continuous_prefill_cache``) are ``prefill`` too. The hooks are removed when the call
  ends and not registered at all while profiling is off.
* ``DeepSpeedHybridEngine.generate`` -> ``rollout`` (with the same hooks) when called on its own;
  inside ``HybridEngineRollout.generate`` it is part of that rollout (no second range).
* Parameter gathering -> ``gather``: ``GatheredParameters.__enter__`` (the hybrid engine's bulk
  gather) and ZeRO-3's per-module ``PartitionedParameterCoordinator.fetch_sub_module`` (the gather
  of the ordinary route, inside each ``prefill`` / ``decode`` and in training's forward/backward).
* LoRA ``fuse_lora_weight`` / ``_fuse_lora_layer`` -> ``lora_fuse``; ``unfuse_lora_weight``,
  ``unfuse_lora_weight_non_pinned`` / ``_unfuse_lora_layer`` -> ``lora_unfuse``.
* Inference cache: ``retake_inference_cache`` and the KV cache allocation of continuous batching
  (``DeepSpeedStaticCache.__init__``) -> ``cache_acquire``; ``WorkspaceOp.release_workspace`` ->
  ``cache_release``; continuous batching's ``DeepSpeedStaticCache.compact`` / ``trim_left`` ->
  ``cache_trim``.
* ``eval`` / ``train`` of ``DeepSpeedHybridEngine`` and ``DeepSpeedEngine`` -> ``mode_switch``.

A range is not opened again while a wrapped method already holds the same stage on the thread
(``fuse_lora_weight`` calling ``_fuse_lora_layer``, ``eval`` calling ``train``), so totals are not
counted twice. Ranges opened by our own core are not visible here: do not combine this call with
``rollout.Rollout`` on a DeepSpeed engine, or ``gather`` / ``mode_switch`` appear nested twice.

Models without an inference container. ``DeepSpeedHybridEngine`` replaces ``model.generate`` by
its own ``generate`` only when DeepSpeed has an inference policy for the model's layers. For
models without one (Qwen2, and so our tiny test models) upstream never enters the hybrid engine's
own generate: ``HybridEngineRollout.generate`` calls Hugging Face's ``generate`` directly, and the
``lora_fuse`` / ``cache_acquire`` / ``cache_release`` stages of the hybrid engine never occur;
parameters are gathered by ZeRO-3's per-module hooks (``gather`` inside each forward).
``DeepSpeedHybridEngine.__init__`` binds ``generate`` at engine creation, so call this function
before ``deepspeed.initialize`` for that route to be covered.

Idempotent: a second call does nothing until :func:`uninstrument_deepspeed` restores every
original. A class or method missing in the installed DeepSpeed gives one :class:`ProfilingWarning`
naming it and is skipped; profiling never breaks training.
"""

from __future__ import annotations

import functools
import importlib
import operator
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from instrumentation import stages as S
from instrumentation.config import MODE_OFF
from instrumentation.ranges import stage
from instrumentation.state import ProfilingWarning, get_config
from instrumentation.upstream_targets import (  # noqa: F401  (public names of this module)
    KIND_GENERATE, KIND_PREFILL_REGION, KIND_STAGE, KINDS, TARGETS, Target,
)

@dataclass(frozen=True)
class _Patch:
    """An installed wrapper and what to restore."""

    owner: type
    name: str
    original: object  # the raw class attribute (function or staticmethod); None when inherited
    wrapper: object


_local = threading.local()
_lock = threading.Lock()
_patches: list[_Patch] = []


def _open_stages() -> set:
    """Stages held by wrapped methods on this thread."""
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = set()
    return held


class _ForwardRanges:
    """The model-forward ranges of one generate call: first forward prefill, later ones decode."""

    def __init__(self):
        self.num_forwards = 0
        self.prefill_depth = 0
        self.open: list = []

    def attach(self, module) -> tuple:
        """Register the hooks on ``module`` (an ``nn.Module``); returns the handles."""
        if not isinstance(module, torch.nn.Module):
            return ()
        pre = module.register_forward_pre_hook(self._pre, prepend=True)
        post = module.register_forward_hook(self._post, always_call=True)
        return pre, post

    def _pre(self, _module, _args) -> None:
        name = S.PREFILL if self.num_forwards == 0 or self.prefill_depth else S.DECODE
        self.num_forwards += 1
        rng = stage(name)
        rng.__enter__()
        self.open.append(rng)

    def _post(self, _module, _args, _output) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)

    def close(self) -> None:
        """Close ranges a failed forward left open (innermost first)."""
        while self.open:
            self.open.pop().__exit__(None, None, None)


def _wrap_stage(original, target: Target):
    name = target.stage

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        held = _open_stages()
        if name in held:  # the same stage is already open through a wrapped caller
            return original(*args, **kwargs)
        held.add(name)
        try:
            with stage(name):
                return original(*args, **kwargs)
        finally:
            held.discard(name)

    return wrapper


def _wrap_generate(original, target: Target):
    module_of = operator.attrgetter(target.forward_module)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if getattr(_local, "forwards", None) is not None:  # nested: part of the outer rollout
            return original(self, *args, **kwargs)
        forwards = _local.forwards = _ForwardRanges()
        try:
            with stage(target.stage):
                handles = ()
                if get_config().mode != MODE_OFF:
                    try:
                        handles = forwards.attach(module_of(self))
                    except AttributeError:  # no model where expected: the rollout range only
                        pass
                try:
                    return original(self, *args, **kwargs)
                finally:
                    for handle in handles:
                        handle.remove()
                    forwards.close()
        finally:
            _local.forwards = None

    return wrapper


def _wrap_prefill_region(original, target: Target):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        forwards = getattr(_local, "forwards", None)
        if forwards is None:
            return original(*args, **kwargs)
        forwards.prefill_depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            forwards.prefill_depth -= 1

    return wrapper


_WRAPPERS = {KIND_STAGE: _wrap_stage, KIND_GENERATE: _wrap_generate,
             KIND_PREFILL_REGION: _wrap_prefill_region}


def _warn(message: str) -> None:
    warnings.warn(message, ProfilingWarning, stacklevel=4)  # the caller of instrument_deepspeed


def _owners(targets) -> dict:
    """``(module, class name) -> class`` for every importable owner; one warning per missing one."""
    owners = {}
    for key in dict.fromkeys((t.module, t.owner) for t in targets):
        module, owner = key
        methods = ", ".join(t.qualname for t in targets if (t.module, t.owner) == key)
        try:
            cls = getattr(importlib.import_module(module), owner)
        except Exception as exc:  # ImportError, AttributeError, or an import-time failure
            _warn(f"instrument_deepspeed: {module}.{owner} is not available ({type(exc).__name__}: "
                  f"{exc}); skipped {methods}")
            continue
        if not isinstance(cls, type):
            _warn(f"instrument_deepspeed: {module}.{owner} is not a class; skipped {methods}")
            continue
        owners[key] = cls
    return owners


def _patch(cls: type, target: Target) -> Optional[_Patch]:
    """Install the wrapper of ``target`` on ``cls``; None (one warning) when it cannot."""
    raw = next((k.__dict__[target.method] for k in cls.__mro__ if target.method in k.__dict__), None)
    if raw is None:
        _warn(f"instrument_deepspeed: {target.qualname} does not exist in this DeepSpeed version; skipped")
        return None
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    if isinstance(raw, (classmethod, property)) or not callable(fn):
        _warn(f"instrument_deepspeed: {target.qualname} is not a plain method; skipped")
        return None
    wrapper = _WRAPPERS[target.kind](fn, target)
    wrapper.__opsd_stage__ = target.stage
    installed = staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper
    own = cls.__dict__.get(target.method)  # None: inherited, so restoring deletes our attribute
    setattr(cls, target.method, installed)
    return _Patch(cls, target.method, own, installed)


def instrument_deepspeed(targets: tuple[Target, ...] = TARGETS) -> tuple[str, ...]:
    """Wrap DeepSpeed's rollout methods with stage ranges (see the module docstring).

    Returns the ``Class.method`` names wrapped by this call; ``()`` when already instrumented (a
    second call does nothing) or when nothing could be wrapped (each skip gives one warning).
    """
    targets = tuple(targets)
    bad = [t for t in targets if not isinstance(t, Target)]
    if bad:
        raise ValueError(f"targets must be instrumentation.upstream.Target objects; got {bad[0]!r}")
    with _lock:
        if _patches:
            return ()
        owners = _owners(targets)
        for target in targets:
            cls = owners.get((target.module, target.owner))
            if cls is None:
                continue
            patch = _patch(cls, target)
            if patch is not None:
                _patches.append(patch)
        return tuple(f"{p.owner.__name__}.{p.name}" for p in _patches)


def uninstrument_deepspeed() -> tuple[str, ...]:
    """Restore every method :func:`instrument_deepspeed` wrapped; returns their names.

    A method that someone else re-patched after us is left alone, with one warning.
    """
    with _lock:
        restored = []
        while _patches:
            patch = _patches.pop()
            qualname = f"{patch.owner.__name__}.{patch.name}"
            if patch.owner.__dict__.get(patch.name) is not patch.wrapper:
                _warn(f"uninstrument_deepspeed: {qualname} was replaced after instrumentation; left as is")
                continue
            if patch.original is None:
                delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
            restored.append(qualname)
        return tuple(reversed(restored))


def is_instrumented() -> bool:
    """Whether :func:`instrument_deepspeed` wrappers are installed."""
    return bool(_patches)
