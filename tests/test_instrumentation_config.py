"""ProfileConfig: env parsing (good and bad values), precedence, the active config, the schedule."""

import os
import subprocess
import sys

import pytest

from instrumentation import schedule, state
from instrumentation.config import ENV_VARS, MAX_LIST_ITEMS, ProfileConfig, teardown_by_default


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    state.reset_for_tests()
    yield
    state.reset_for_tests()


GOOD_ENV = [
    ({}, dict(mode="0", output_dir="./opsd_traces", steps=(1, 2, 3), ranks=(0,), profile_memory=False,
              run_name=None, oom_snapshot=False)),
    ({"OPSD_PROFILE": ""}, dict(mode="0")),
    ({"OPSD_PROFILE": "0"}, dict(mode="0", profile_memory=False)),
    ({"OPSD_PROFILE": "1"}, dict(mode="1", profile_memory=True)),
    ({"OPSD_PROFILE": " NVTX "}, dict(mode="nvtx", profile_memory=False)),
    ({"OPSD_PROFILE": "1", "OPSD_PROFILE_MEMORY": "0"}, dict(profile_memory=False)),
    ({"OPSD_PROFILE": "1", "OPSD_PROFILE_MEMORY": "off"}, dict(profile_memory=False)),
    ({"OPSD_PROFILE": "nvtx", "OPSD_PROFILE_MEMORY": "true"}, dict(profile_memory=True)),
    ({"OPSD_PROFILE_DIR": "/tmp/x y"}, dict(output_dir="/tmp/x y")),
    ({"OPSD_PROFILE_STEPS": "2-4"}, dict(steps=(2, 3, 4))),
    ({"OPSD_PROFILE_STEPS": "5"}, dict(steps=(5,))),
    ({"OPSD_PROFILE_STEPS": "0-0"}, dict(steps=(0,))),
    ({"OPSD_PROFILE_STEPS": "1,3,5-7"}, dict(steps=(1, 3, 5, 6, 7))),
    ({"OPSD_PROFILE_STEPS": " 7 , 1 ,3-3,1"}, dict(steps=(1, 3, 7))),
    ({"OPSD_PROFILE_RANKS": "all"}, dict(ranks=None)),
    ({"OPSD_PROFILE_RANKS": "ALL"}, dict(ranks=None)),
    ({"OPSD_PROFILE_RANKS": "0,2"}, dict(ranks=(0, 2))),
    ({"OPSD_PROFILE_RANKS": "1-3"}, dict(ranks=(1, 2, 3))),
    ({"OPSD_PROFILE_RUN_NAME": "exp_1.a-b"}, dict(run_name="exp_1.a-b")),
    ({"OPSD_PROFILE_OOM_SNAPSHOT": "yes"}, dict(oom_snapshot=True)),
    ({"OPSD_PROFILE": "Timers"}, dict(mode="timers", profile_memory=False, every=1, teardown_cupti=None)),
    ({"OPSD_PROFILE": "timers", "OPSD_PROFILE_EVERY": " 10 "}, dict(every=10)),
    ({"OPSD_PROFILE_TEARDOWN_CUPTI": "on"}, dict(teardown_cupti=True)),
    ({"OPSD_PROFILE_TEARDOWN_CUPTI": "0"}, dict(teardown_cupti=False)),
]


@pytest.mark.parametrize("cuda,expected", [("13.0", True), ("12.6", True), ("12.8", True), ("12.4", False),
                                           ("11.8", False), (None, False), ("", False), ("rocm", False)])
def test_cupti_teardown_is_the_default_from_cuda_12_6(cuda, expected):
    """On by default where torch allows it with CUDA graphs (CUDA >= 12.6; torch resets it below)."""
    assert teardown_by_default(cuda) is expected


@pytest.mark.parametrize("env,expected", GOOD_ENV)
def test_good_env_values(env, expected):
    config = ProfileConfig.from_env(env)
    for field, value in expected.items():
        assert getattr(config, field) == value, field


BAD_ENV = [
    ("OPSD_PROFILE", "2"), ("OPSD_PROFILE", "true"), ("OPSD_PROFILE", "on"), ("OPSD_PROFILE", "nvtx2"),
    ("OPSD_PROFILE_STEPS", "3-1"), ("OPSD_PROFILE_STEPS", "a"), ("OPSD_PROFILE_STEPS", "-1"),
    ("OPSD_PROFILE_STEPS", "1,,2"), ("OPSD_PROFILE_STEPS", "1-"), ("OPSD_PROFILE_STEPS", "1.5"),
    ("OPSD_PROFILE_STEPS", f"0-{MAX_LIST_ITEMS}"), ("OPSD_PROFILE_STEPS", "1-2-3"),
    ("OPSD_PROFILE_RANKS", "any"), ("OPSD_PROFILE_RANKS", "0,x"), ("OPSD_PROFILE_RANKS", "-1"),
    ("OPSD_PROFILE_MEMORY", "2"), ("OPSD_PROFILE_MEMORY", "maybe"),
    ("OPSD_PROFILE_OOM_SNAPSHOT", "y"), ("OPSD_PROFILE_RUN_NAME", "a/b"),
    ("OPSD_PROFILE", "timer"), ("OPSD_PROFILE_EVERY", "0"), ("OPSD_PROFILE_EVERY", "2.5"),
    ("OPSD_PROFILE_EVERY", "-1"), ("OPSD_PROFILE_TEARDOWN_CUPTI", "auto"),
]


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_bad_env_values_name_the_variable_and_accepted_values(var, value):
    with pytest.raises(ValueError, match=rf"^{var}=.*accepted: "):
        ProfileConfig.from_env({var: value})


def test_explicit_arguments_beat_environment_beat_defaults():
    env = {"OPSD_PROFILE": "1", "OPSD_PROFILE_STEPS": "4-5", "OPSD_PROFILE_DIR": "/env"}
    config = ProfileConfig.from_env(env, steps="7", output_dir="/arg")
    assert (config.mode, config.steps, config.output_dir) == ("1", (7,), "/arg")
    assert config.ranks == (0,)  # default
    assert ProfileConfig.from_env(env, mode="nvtx").profile_memory is False  # default follows mode


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("OPSD_PROFILE", "nvtx")
    monkeypatch.setenv("OPSD_PROFILE_RANKS", "all")
    config = ProfileConfig.from_env()
    assert (config.mode, config.ranks) == ("nvtx", None)


@pytest.mark.parametrize("kwargs,field", [
    (dict(mode="yes"), "mode"), (dict(mode=True), "mode"), (dict(steps=[]), "steps"),
    (dict(steps=[1, -2]), "steps"), (dict(steps="2-1"), "steps"), (dict(ranks="x"), "ranks"),
    (dict(profile_memory="sometimes"), "profile_memory"), (dict(output_dir=""), "output_dir"),
    (dict(run_name="a b"), "run_name"), (dict(oom_snapshot=3), "oom_snapshot"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ProfileConfig(**kwargs)


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match="unknown ProfileConfig argument"):
        ProfileConfig.from_env({}, stepz="1")


def test_config_normalises_and_answers_queries():
    config = ProfileConfig(mode=1, steps={3, 1}, ranks=2)
    assert (config.mode, config.steps, config.ranks) == ("1", (1, 3), (2,))
    assert config.enabled and config.timing and config.profile_memory
    assert config.records_step(3) and not config.records_step(2)
    assert config.selects_rank(2) and not config.selects_rank(0)
    assert ProfileConfig(ranks="all").selects_rank(17)
    assert not ProfileConfig(mode="nvtx").timing and ProfileConfig(mode="nvtx").enabled
    with pytest.raises(Exception):
        config.mode = "0"  # frozen


def test_active_config_is_read_once_and_can_be_reset(monkeypatch):
    monkeypatch.setenv("OPSD_PROFILE", "nvtx")
    first = state.get_config()
    monkeypatch.setenv("OPSD_PROFILE", "1")
    assert state.get_config() is first and first.mode == "nvtx"
    replacement = ProfileConfig(mode="0")
    assert state.configure(replacement) is first
    assert state.get_config() is replacement
    state.reset_for_tests()
    assert state.get_config().mode == "1"
    with pytest.raises(ValueError, match="ProfileConfig"):
        state.configure({"mode": "1"})


def test_warn_once_warns_once_per_cause():
    with pytest.warns(state.ProfilingWarning) as record:
        state.warn_once("a", "first a")
        state.warn_once("a", "second a")
        state.warn_once("b", "first b")
    assert [str(w.message) for w in record] == ["first a", "first b"]


def test_package_import_does_not_import_torch():
    code = ("import sys; import instrumentation; from instrumentation import stages, ProfileConfig, "
            "get_config; get_config(); assert 'torch' not in sys.modules, 'torch imported'; "
            "print(stages.range_name(stages.DECODE))")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS.values()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "opsd/decode"


SCHEDULES = [
    # steps, number of steps run, expected action per step
    ((1, 2), 4, ["warmup", "record", "record_and_save", "none"]),
    ((1, 2, 3), 5, ["warmup", "record", "record", "record_and_save", "none"]),
    ((0, 1), 3, ["record", "record_and_save", "none"]),
    ((1, 3), 5, ["warmup", "record_and_save", "warmup", "record_and_save", "none"]),
    ((2, 3, 6), 8, ["none", "warmup", "record", "record_and_save", "none", "warmup",
                    "record_and_save", "none"]),
]


@pytest.mark.parametrize("steps,num_steps,expected", SCHEDULES)
def test_window_schedule(steps, num_steps, expected):
    plan = schedule.WindowSchedule(steps)
    assert [plan(step) for step in range(num_steps)] == expected


def test_step_windows():
    assert schedule.step_windows([7, 1, 2, 3, 5, 6, 9]) == [(1, 3), (5, 7), (9, 9)]
    assert schedule.step_windows([]) == []
