"""instrument_deepspeed(): wrapping mechanics on stand-in classes, then DeepSpeed 0.19.8 itself.

The first part wraps small stand-in classes (a module registered for the test) to check the
mechanics: ranges and their NVTX push/pop, prefill/decode from forward hooks, no nested duplicate,
exceptions, idempotence, restoration, warnings for missing methods. The second part runs upstream's
own rollout on a tiny model in a DeepSpeed subprocess (tests/ds_workers/upstream_rollout.py) under
torch.profiler: our stage names appear as user_annotation events, nested as expected, and outputs
are bit-identical with and without instrumentation.
"""

import sys
import types
import warnings
from collections import Counter

import pytest
import torch

from instrumentation import ProfileConfig, ProfilingWarning, configure, reset_for_tests, stages
from instrumentation import upstream
from instrumentation.config import ENV_VARS
from instrumentation.upstream import (KIND_GENERATE, KIND_PREFILL_REGION, TARGETS, Target,
                                      instrument_deepspeed, uninstrument_deepspeed)
from tests.ds_util import run_worker

FAKE = "opsd_test_fake_upstream"
#: Tokens generated per generate call in the worker (HF generate: 1 prefill + N-1 decode forwards).
WORKER_MAX_NEW_TOKENS = 4


class FakeDomain:
    def __init__(self):
        self.calls = []

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return message

    def push_range(self, message):
        self.calls.append(message)

    def pop_range(self):
        self.calls.append("pop")


def _fake_classes():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fail_at = None
            self.calls = 0
            self.hooks_seen = []

        def forward(self, x):
            self.calls += 1
            self.hooks_seen.append(len(self._forward_pre_hooks))
            if self.calls == self.fail_at:
                raise RuntimeError("forward failed")
            return x + 1

    class Engine:
        def __init__(self):
            self.module = Model()

        def fuse(self):
            return self.fuse_layer() + 1

        def fuse_layer(self):
            return 1

        def generate(self, x, steps):
            for _ in range(steps):
                x = self.module(x)
            return x

        @staticmethod
        def helper(value):
            return value * 2

        def boom(self):
            raise ValueError("inside")

    class Base:
        def inherited(self):
            return "base"

    class Sub(Base):
        pass

    class Rollout:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, x, steps, nested=False, prefill_calls=0):
            for _ in range(prefill_calls):
                x = self.prefill_region(x)
            if nested:
                return self.engine.generate(x, steps)
            for _ in range(steps):
                x = self.engine.module(x)
            return x

        def prefill_region(self, x):
            return self.engine.module(x)

    return Model, Engine, Sub, Rollout


FAKE_TARGETS = (
    Target(FAKE, "Rollout", "generate", stages.ROLLOUT, KIND_GENERATE, "engine.module"),
    Target(FAKE, "Rollout", "prefill_region", stages.PREFILL, KIND_PREFILL_REGION),
    Target(FAKE, "Engine", "generate", stages.ROLLOUT, KIND_GENERATE, "module"),
    Target(FAKE, "Engine", "fuse", stages.LORA_FUSE),
    Target(FAKE, "Engine", "fuse_layer", stages.LORA_FUSE),
    Target(FAKE, "Engine", "helper", stages.CACHE_TRIM),
    Target(FAKE, "Engine", "boom", stages.GATHER),
    Target(FAKE, "Sub", "inherited", stages.MODE_SWITCH),
)


@pytest.fixture
def fake(monkeypatch):
    """The stand-in module, the fake ``opsd`` NVTX domain, profiling in ``nvtx`` mode; cleaned up after."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    domain = FakeDomain()
    nvtx = types.ModuleType("nvtx")
    nvtx.get_domain = lambda name=None: domain
    monkeypatch.setitem(sys.modules, "nvtx", nvtx)
    module = types.ModuleType(FAKE)
    module.Model, module.Engine, module.Sub, module.Rollout = _fake_classes()
    monkeypatch.setitem(sys.modules, FAKE, module)
    reset_for_tests()
    configure(ProfileConfig(mode="nvtx"))
    yield module, domain
    uninstrument_deepspeed()
    reset_for_tests()


def _balanced(calls) -> bool:
    depth = 0
    for call in calls:
        depth += -1 if call == "pop" else 1
        if depth < 0:
            return False
    return depth == 0


def _pushes(calls):
    return [c for c in calls if c != "pop"]


@pytest.mark.parametrize("field, kwargs, match", [
    ("module", dict(module=""), "module"),
    ("method", dict(method=None), "method"),
    ("stage", dict(stage="opsd/decode"), "unknown stage"),
    ("kind", dict(kind="other"), "kind"),
    ("forward_module", dict(kind=KIND_GENERATE), "forward_module"),
    ("forward_module", dict(forward_module="module"), "forward_module"),
])
def test_target_validation_names_the_field(field, kwargs, match):
    base = dict(module="m", owner="C", method="f", stage=stages.GATHER)
    with pytest.raises(ValueError, match=match):
        Target(**{**base, **kwargs})


def test_targets_must_be_target_objects():
    with pytest.raises(ValueError, match="targets must be"):
        instrument_deepspeed(("deepspeed.runtime.engine", "DeepSpeedEngine", "eval"))


def test_default_targets_are_valid_and_unique():
    names = [t.qualname for t in TARGETS]
    assert len(names) == len(set(names))
    assert {t.stage for t in TARGETS} <= set(stages.ALL_STAGES)
    assert {"HybridEngineRollout.generate", "DeepSpeedHybridEngine.generate"} <= set(names)


def test_wrapped_methods_emit_their_stage_and_keep_results(fake):
    module, domain = fake
    engine = module.Engine()
    wrapped = instrument_deepspeed(FAKE_TARGETS)
    assert set(wrapped) == {t.qualname for t in FAKE_TARGETS}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert engine.fuse() == 2
        assert module.Engine.helper(4) == 8 and engine.helper(5) == 10
        assert module.Sub().inherited() == "base"
    # fuse -> fuse_layer holds lora_fuse already: one range, not two nested ones
    assert domain.calls == ["opsd/lora_fuse", "pop", "opsd/cache_trim", "pop", "opsd/cache_trim", "pop",
                            "opsd/mode_switch", "pop"]
    names = [e.name for e in prof.events() if e.name.startswith("opsd/")]
    assert Counter(names) == {"opsd/lora_fuse": 1, "opsd/cache_trim": 2, "opsd/mode_switch": 1}


def test_second_call_does_nothing_and_uninstrument_restores_originals(fake):
    module, domain = fake
    originals = {name: module.Engine.__dict__[name] for name in ("fuse", "generate", "helper")}
    first = instrument_deepspeed(FAKE_TARGETS)
    installed = module.Engine.__dict__["fuse"]
    assert instrument_deepspeed(FAKE_TARGETS) == ()
    assert module.Engine.__dict__["fuse"] is installed and installed.__wrapped__ is originals["fuse"]
    assert "inherited" in module.Sub.__dict__
    assert set(uninstrument_deepspeed()) == set(first)
    for name, original in originals.items():
        assert module.Engine.__dict__[name] is original
    assert "inherited" not in module.Sub.__dict__
    assert uninstrument_deepspeed() == ()
    module.Engine().fuse()
    assert domain.calls == []
    assert instrument_deepspeed(FAKE_TARGETS) != ()  # can be installed again


def test_missing_method_and_missing_class_warn_once_each_and_are_skipped(fake):
    module, _ = fake
    targets = FAKE_TARGETS + (Target(FAKE, "Engine", "no_such_method", stages.GATHER),
                              Target(FAKE, "NoSuchClass", "a", stages.GATHER),
                              Target(FAKE, "NoSuchClass", "b", stages.GATHER),
                              Target("opsd_no_such_module", "C", "f", stages.GATHER))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        wrapped = instrument_deepspeed(targets)
    messages = [str(w.message) for w in record if issubclass(w.category, ProfilingWarning)]
    assert len(messages) == 3
    assert any("Engine.no_such_method" in m for m in messages)
    assert any("NoSuchClass" in m and "NoSuchClass.a" in m and "NoSuchClass.b" in m for m in messages)
    assert any("opsd_no_such_module.C" in m for m in messages)
    assert set(wrapped) == {t.qualname for t in FAKE_TARGETS}


def test_exception_in_a_wrapped_method_closes_its_range(fake):
    module, domain = fake
    instrument_deepspeed(FAKE_TARGETS)
    with pytest.raises(ValueError, match="inside"):
        module.Engine().boom()
    assert domain.calls == ["opsd/gather", "pop"]
    assert upstream._open_stages() == set()


def test_generate_forwards_are_prefill_then_decode(fake):
    module, domain = fake
    rollout = module.Rollout(module.Engine())
    x = torch.zeros(2)
    instrument_deepspeed(FAKE_TARGETS)
    assert torch.equal(rollout.generate(x, 3), x + 3)
    assert domain.calls == ["opsd/rollout", "opsd/prefill", "pop", "opsd/decode", "pop", "opsd/decode",
                            "pop", "pop"]
    model = rollout.engine.module
    assert model.hooks_seen == [1, 1, 1]
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0


def test_nested_generate_is_one_rollout_and_prefill_region_marks_prefill(fake):
    module, domain = fake
    rollout = module.Rollout(module.Engine())
    instrument_deepspeed(FAKE_TARGETS)
    rollout.generate(torch.zeros(1), 2, nested=True, prefill_calls=2)
    assert _pushes(domain.calls) == ["opsd/rollout", "opsd/prefill", "opsd/prefill", "opsd/decode",
                                     "opsd/decode"]
    assert _balanced(domain.calls)
    domain.calls.clear()
    rollout.engine.generate(torch.zeros(1), 2)  # the engine's own generate, called alone
    assert domain.calls == ["opsd/rollout", "opsd/prefill", "pop", "opsd/decode", "pop", "pop"]


def test_failing_forward_closes_ranges_and_removes_hooks(fake):
    module, domain = fake
    rollout = module.Rollout(module.Engine())
    rollout.engine.module.fail_at = 2
    instrument_deepspeed(FAKE_TARGETS)
    with pytest.raises(RuntimeError, match="forward failed"):
        rollout.generate(torch.zeros(1), 3)
    assert _pushes(domain.calls) == ["opsd/rollout", "opsd/prefill", "opsd/decode"]
    assert _balanced(domain.calls)
    model = rollout.engine.module
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0
    domain.calls.clear()
    model.fail_at = None
    rollout.generate(torch.zeros(1), 1)  # the next call starts a fresh rollout
    assert domain.calls == ["opsd/rollout", "opsd/prefill", "pop", "pop"]


def test_profiling_off_registers_no_hooks_and_emits_nothing(fake):
    module, domain = fake
    configure(ProfileConfig(mode="0"))
    rollout = module.Rollout(module.Engine())
    instrument_deepspeed(FAKE_TARGETS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(rollout.generate(torch.zeros(1), 2), torch.full((1,), 2.0))
    assert rollout.engine.module.hooks_seen == [0, 0]
    assert domain.calls == []
    assert [e.name for e in prof.events() if e.name.startswith("opsd/")] == []


# ---- DeepSpeed 0.19.8 itself (subprocess) ---------------------------------------------------------

def _inside(inner, outer) -> bool:
    return inner[1] == outer[1] and outer[2] <= inner[2] and inner[3] <= outer[3]


def _by_name(ranges):
    out = {}
    for r in ranges:
        out.setdefault(r[0], []).append(r)
    return out


def _check_forwards(ranges, num_generates):
    """Each rollout holds one prefill then decodes; every prefill/decode lies inside a rollout."""
    named = _by_name(ranges)
    rollouts = named["opsd/rollout"]
    forwards = named["opsd/prefill"] + named["opsd/decode"]
    assert len(rollouts) == num_generates
    assert len(named["opsd/prefill"]) == num_generates
    assert len(named["opsd/decode"]) == num_generates * (WORKER_MAX_NEW_TOKENS - 1)
    for rollout in rollouts:
        inside = sorted((f for f in forwards if _inside(f, rollout)), key=lambda f: f[2])
        assert [f[0] for f in inside] == ["opsd/prefill"] + ["opsd/decode"] * (WORKER_MAX_NEW_TOKENS - 1)
    return named, forwards


@pytest.fixture(scope="module", params=[0, 3], ids=["zero0", "zero3"])
def upstream_run(request):
    results = run_worker("upstream_rollout.py", request.param, env={"OPSD_PROFILE": "nvtx"}, timeout=240)
    return request.param, results[0].result


def test_upstream_engine_is_hybrid_without_inference_container(upstream_run):
    _, out = upstream_run
    assert out["engine"] == "DeepSpeedHybridEngine"
    assert out["num_containers"] == 0  # Qwen2: upstream's ordinary route never enters its own generate
    assert out["module_generate_is_hf"] is True


@pytest.mark.parametrize("route", ["ordinary", "container", "direct"])
def test_upstream_outputs_bit_identical_and_instrumentation_reversible(upstream_run, route):
    _, out = upstream_run
    run = out[route]
    assert run["identical"] and run["identical_after"]
    assert run["second_call"] == []
    assert set(run["wrapped"]) == {t.qualname for t in TARGETS}
    assert set(run["restored"]) == set(run["wrapped"])
    assert run["ranges_off"] == []


def test_upstream_ordinary_route_stages_in_trace(upstream_run):
    zero_stage, out = upstream_run
    named, forwards = _check_forwards(out["ordinary"]["ranges_on"], num_generates=2)
    assert len(named["opsd/mode_switch"]) == 2  # engine.eval() and engine.train()
    assert set(named) <= {"opsd/rollout", "opsd/prefill", "opsd/decode", "opsd/mode_switch", "opsd/gather"}
    gathers = named.get("opsd/gather", [])
    if zero_stage == 3:  # ZeRO-3 fetches each module's parameters inside every forward
        assert gathers and all(any(_inside(g, f) for f in forwards) for g in gathers)
    else:
        assert gathers == []


def test_upstream_container_route_stages_in_trace(upstream_run):
    zero_stage, out = upstream_run
    named, forwards = _check_forwards(out["container"]["ranges_on"], num_generates=2)
    rollouts = named["opsd/rollout"]
    for name in ("opsd/cache_acquire", "opsd/cache_release"):
        assert len(named[name]) == 2 and all(any(_inside(r, o) for o in rollouts) for r in named[name])
    bulk = [g for g in named.get("opsd/gather", []) if not any(_inside(g, f) for f in forwards)]
    if zero_stage == 3:  # GatheredParameters around the hybrid engine's generate: once per call
        assert len(bulk) == 2 and all(any(_inside(g, o) for o in rollouts) for g in bulk)
    else:
        assert named.get("opsd/gather", []) == []


def test_upstream_cache_calls_stages_in_trace(upstream_run):
    _, out = upstream_run
    assert Counter(r[0] for r in out["direct"]["ranges_on"]) == {"opsd/cache_acquire": 1, "opsd/cache_trim": 2}
