"""stage()/staged(): NVTX push/pop (fake nvtx), record_function gating, off path, failures."""

import sys
import types
import warnings

import pytest
import torch

from instrumentation import ProfileConfig, ProfilingWarning, configure, stages
from instrumentation import ranges
from instrumentation.collect import collect_stages
from instrumentation.ranges import NOOP_RANGE, stage, staged
from instrumentation.timers import HUB
from tests.profiling_env import clean_profiling_env  # noqa: F401  (autouse fixture)


class FakeDomain:
    """Records NVTX calls as ("push", message, color) / ("pop",)."""

    def __init__(self, name):
        self.name = name
        self.calls = []

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return (message, color)

    def push_range(self, attributes):
        self.calls.append(("push", *attributes))

    def pop_range(self):
        self.calls.append(("pop",))




@pytest.fixture
def fake_nvtx(monkeypatch):
    domains = {}
    module = types.ModuleType("nvtx")
    module.get_domain = lambda name=None: domains.setdefault(name, FakeDomain(name))
    monkeypatch.setitem(sys.modules, "nvtx", module)
    return domains


def _push(name):
    return ("push", "opsd/" + name, stages.STAGE_COLORS[name])


def _user_annotations(prof):
    return [e.name for e in prof.events() if e.name.startswith("opsd/")]


def test_off_path_is_one_shared_noop_and_never_loads_nvtx(fake_nvtx):
    configure(ProfileConfig(mode="0"))
    for name in stages.ALL_STAGES:
        assert stage(name) is NOOP_RANGE
    with stage(stages.DECODE) as value:
        assert value is None
    assert fake_nvtx == {}


@pytest.mark.parametrize("mode", ["nvtx", "1"])
def test_nvtx_ranges_use_domain_message_and_colour(fake_nvtx, mode):
    configure(ProfileConfig(mode=mode))
    with stage(stages.STEP):
        with stage(stages.PREFILL):
            pass
        with stage(stages.DECODE):
            pass
    assert list(fake_nvtx) == ["opsd"]
    assert fake_nvtx["opsd"].calls == [_push("step"), _push("prefill"), ("pop",), _push("decode"),
                                       ("pop",), ("pop",)]


@pytest.mark.parametrize("mode", ["nvtx", "1"])
def test_exception_inside_a_stage_closes_every_range(fake_nvtx, mode):
    configure(ProfileConfig(mode=mode))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with collect_stages() as collector:
            with pytest.raises(RuntimeError, match="boom"):
                with stage(stages.STEP):
                    with stage(stages.PREFILL):
                        raise RuntimeError("boom")
            with stage(stages.LOSS):
                pass
    calls = fake_nvtx["opsd"].calls
    assert calls == [_push("step"), _push("prefill"), ("pop",), ("pop",), _push("loss"), ("pop",)]
    assert sorted(_user_annotations(prof)) == ["opsd/loss", "opsd/prefill", "opsd/step"]
    assert HUB.frames == [] and HUB.sinks == []
    if mode == "1":
        assert {k: v["count"] for k, v in collector.summary().items()} == {"step": 1, "prefill": 1, "loss": 1}
    else:
        assert collector is None


@pytest.mark.parametrize("mode", ["nvtx", "1", "timers"])
def test_a_stage_opened_inside_itself_emits_one_range_and_one_warning(fake_nvtx, mode, monkeypatch):
    """The docs' loop wrapped in stage(STEP) around OPSDStep.step (which opens opsd/step itself): one NVTX range a
    step (Nsight Systems' nvtx_sum counted the inner one too), one annotation, one warning naming stage and rank, in
    every mode; a later, separate opsd/step is emitted again."""
    monkeypatch.setenv("RANK", "2")
    configure(ProfileConfig(mode=mode))
    with pytest.warns(ProfilingWarning) as caught:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                with stage(stages.STEP):
                    with stage(stages.STEP):
                        with stage(stages.ROLLOUT):
                            pass
    assert fake_nvtx["opsd"].calls == [_push("step"), _push("rollout"), ("pop",), ("pop",)] * 2
    assert sorted(_user_annotations(prof)) == ["opsd/rollout"] * 2 + ["opsd/step"] * 2
    messages = [str(w.message) for w in caught if "opened inside" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("stage opsd/step opened inside opsd/step (rank 2)")
    assert fake_nvtx["opsd"].calls[-1] == ("pop",)
    with stage(stages.STEP):  # every range closed: a new outermost call is emitted
        pass
    assert fake_nvtx["opsd"].calls[-2:] == [_push("step"), ("pop",)]


def test_another_threads_call_of_an_open_stage_is_emitted(fake_nvtx):
    """Only a stage open on the same thread counts as nested: a second thread's call is its own range."""
    import threading

    configure(ProfileConfig(mode="nvtx"))
    inner_done = threading.Event()

    def other():
        with stage(stages.GATHER):
            pass
        inner_done.set()

    with stage(stages.GATHER):
        worker = threading.Thread(target=other)
        worker.start()
        assert inner_done.wait(10)
        worker.join(10)
    assert fake_nvtx["opsd"].calls == [_push("gather"), _push("gather"), ("pop",), ("pop",)]
    with pytest.warns(ProfilingWarning, match="stage opsd/gather opened inside opsd/gather"):
        with stage(stages.GATHER):
            with stage(stages.GATHER):  # still nested on this thread afterwards
                pass
    assert fake_nvtx["opsd"].calls[-2:] == [_push("gather"), ("pop",)]


def test_record_function_only_while_a_profiler_is_enabled(fake_nvtx, monkeypatch):
    entered = []
    real_enter = ranges._rf_enter
    monkeypatch.setattr(ranges, "_rf_enter", lambda name: entered.append(name) or real_enter(name))
    configure(ProfileConfig(mode="1"))
    with stage(stages.DECODE):
        pass
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with stage(stages.DECODE):
            pass
    assert entered == ["opsd/decode"]
    assert _user_annotations(prof) == ["opsd/decode"]


def test_off_mode_emits_no_events_even_under_a_profiler(fake_nvtx):
    configure(ProfileConfig(mode="0"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with stage(stages.STEP):
            torch.ones(4).sum()
    assert _user_annotations(prof) == []


def test_missing_nvtx_warns_once_and_ranges_still_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    with pytest.warns(ProfilingWarning, match="NVTX ranges are skipped") as record:
        configure(ProfileConfig(mode="1"))
        configure(ProfileConfig(mode="nvtx"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with stage(stages.PREFILL):
                pass
    assert len([w for w in record if issubclass(w.category, ProfilingWarning)]) == 1
    assert _user_annotations(prof) == ["opsd/prefill"]


def test_config_is_read_lazily_from_the_environment(fake_nvtx, monkeypatch):
    monkeypatch.setenv("OPSD_PROFILE", "nvtx")
    with stage(stages.GATHER):
        pass
    monkeypatch.setenv("OPSD_PROFILE", "0")  # read once: no effect any more
    with stage(stages.GATHER):
        pass
    assert fake_nvtx["opsd"].calls == [_push("gather"), ("pop",)] * 2


@pytest.mark.parametrize("mode", ["0", "nvtx", "1"])
def test_unknown_stage_names_are_rejected(mode):
    configure(ProfileConfig(mode=mode))
    with pytest.raises(ValueError, match="unknown stage 'decod'"):
        stage("decod")
    with pytest.raises(ValueError, match="unknown stage 'opsd/decode'"):
        staged("opsd/decode")


@pytest.mark.parametrize("mode", ["0", "nvtx"])
def test_staged_wraps_the_function(fake_nvtx, mode):
    configure(ProfileConfig(mode=mode))

    @staged(stages.POSTPROCESS)
    def postprocess(x, *, scale=2):
        """Doc."""
        if x < 0:
            raise KeyError(x)
        return x * scale

    assert (postprocess.__name__, postprocess.__doc__) == ("postprocess", "Doc.")
    assert postprocess(3, scale=5) == 15
    with pytest.raises(KeyError):
        postprocess(-1)
    expected = [_push("postprocess"), ("pop",)] * 2 if mode == "nvtx" else []
    assert fake_nvtx.get("opsd", FakeDomain("opsd")).calls == expected


def test_nothing_is_emitted_while_compiling(fake_nvtx, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    configure(ProfileConfig(mode="1"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with collect_stages() as collector:
            with stage(stages.STUDENT_FORWARD):
                pass
    assert fake_nvtx["opsd"].calls == []
    assert _user_annotations(prof) == [] and collector.summary() == {}


def test_stage_inside_a_compiled_function(fake_nvtx):
    configure(ProfileConfig(mode="1"))

    def forward(x):
        with stage(stages.STUDENT_FORWARD):
            return torch.relu(x) * 2

    compiled = torch.compile(forward, backend="eager")
    x = torch.randn(8)
    fake_nvtx["opsd"].calls.clear()
    torch.testing.assert_close(compiled(x), torch.relu(x) * 2)
    assert fake_nvtx["opsd"].calls == []  # skipped while dynamo traced; not part of the graph
    assert torch._dynamo.explain(forward)(x).graph_break_count == 0


def test_failing_timers_warn_once_and_do_not_break_the_stage(fake_nvtx, monkeypatch):
    configure(ProfileConfig(mode="1"))

    def broken_open(name):
        raise RuntimeError("timer broke")

    monkeypatch.setattr(HUB, "open", broken_open)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with collect_stages():
            for _ in range(3):
                with stage(stages.DECODE):
                    pass
    assert [str(w.message) for w in record if issubclass(w.category, ProfilingWarning)] == [
        "opsd stage timers disabled for a call: RuntimeError('timer broke')"]
    assert fake_nvtx["opsd"].calls == [_push("decode"), ("pop",)] * 3
