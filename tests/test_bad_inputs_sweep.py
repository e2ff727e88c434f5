"""Issue 34, "look beyond this list": bad inputs in the neighbours of the listed cases, one row each. Every row failed
before its fix (a traceback from deep inside, a crash, a wrong value or a silent no-op); now each is a one-line error
naming the field or flag, raised before any work, or correct output (with a warning where something is ignored)."""

import argparse
import dataclasses
import gzip
import importlib
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from instrumentation import ProfileConfig, check_environment, reset_for_tests
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.opsd import OPSDStep
from rollout.opsd.losses import generalized_jsd_loss
from rollout.request import RolloutBatch
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "data" / "traces" / "cpu_tiny.pt.trace.json.gz"
IDS, MASK = random_prompts(3, 6, min_len=2, seed=4)
GREEDY = dict(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


def _tokens(model, sampling=None, config=None, tokenizer=None):
    ro = Rollout(model, tokenizer or TinyTokenizer(pad_token_id=0, eos_token_id=2), config or RolloutConfig())
    return ro.generate(RolloutRequest(IDS, MASK), sampling or SamplingConfig(**GREEDY)).input_ids


# ---- numpy scalars: refused as "not a finite number", or an OverflowError deep in the memory plan -------------------

@pytest.mark.parametrize("name, value, plain", [
    ("temperature", np.float32(0.5), 0.5), ("top_p", np.float32(0.5), 0.5), ("max_new_tokens", np.int8(4), 4),
    ("repetition_penalty", np.float32(1.5), 1.5), ("seed", np.uint64(7), 7)])
def test_numpy_scalars_are_taken_as_python_numbers(model, name, value, plain):
    sampling = SamplingConfig(**{"max_new_tokens": 4, "temperature": 0.7, "seed": 1, name: value})
    assert type(getattr(sampling, name)) is type(plain) and getattr(sampling, name) == plain
    reference = SamplingConfig(**{"max_new_tokens": 4, "temperature": 0.7, "seed": 1, name: plain})
    assert torch.equal(_tokens(model, sampling), _tokens(model, reference))


def test_numpy_numbers_in_the_rollout_config_and_tokenizer(model):
    config = RolloutConfig(max_cache_gib=np.float32(1.0), max_context=np.int64(64))
    assert type(config.max_cache_gib) is float and type(config.max_context) is int
    tokenizer = TinyTokenizer(pad_token_id=np.int64(0), eos_token_id=np.int64(2))  # refused: "must be an int"
    assert torch.equal(_tokens(model, config=config, tokenizer=tokenizer), _tokens(model))


def test_numpy_beta_reaches_the_loss():
    student, teacher = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    mask = torch.ones(2, 3, dtype=torch.bool)
    expected = generalized_jsd_loss(student, teacher, mask, 0.5, 1.0)
    assert torch.equal(generalized_jsd_loss(student, teacher, mask, np.float32(0.5), np.float64(1.0)), expected)


def test_a_context_past_the_models_positions_is_warned(model):
    with pytest.warns(UserWarning, match=r"^max_context: 1000000 is above the model's max_position_embeddings 512"):
        Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2), RolloutConfig(max_context=10**6))


def test_settings_that_are_not_a_mapping_name_the_argument():
    with pytest.raises(ValueError, match=r"^settings: must be a mapping of setting names to values; got list$"):
        RolloutConfig().with_settings([("route", "auto")])  # was AttributeError: 'list' object has no attribute


# ---- RolloutBatch built by hand for train_on_batch ------------------------------------------------------------------

def _batch():
    ids = torch.cat([IDS, torch.full((3, 2), 7)], dim=1)
    return RolloutBatch(ids, torch.cat([MASK, torch.ones(3, 2, dtype=MASK.dtype)], dim=1),
                        torch.full((3,), 6, dtype=torch.long))


def _meta(tensor):
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


BATCHES = {  # a change to a good batch -> the message (was: RuntimeError in F.embedding, AttributeError, ...)
    "float ids": (lambda b: dict(input_ids=b.input_ids.float()), r"^input_ids: must hold token ids as int64 or int32"),
    "ids as a list": (lambda b: dict(input_ids=b.input_ids.tolist()), r"^input_ids: must be a torch.Tensor; got list"),
    "mask on meta": (lambda b: dict(attention_mask=_meta(b.attention_mask)), r"^attention_mask: is on the meta device"),
    "float starts": (lambda b: dict(response_start_idx=b.response_start_idx.float()),
                     r"^response_start_idx: must be an integer tensor; got dtype torch.float32"),
    "logprobs as a list": (lambda b: dict(logprobs=[[0.0, 0.0]] * 3), r"^logprobs: must be a torch.Tensor"),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_hand_built_batches_name_the_bad_field(name):
    change, message = BATCHES[name]
    good = _batch()
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(good, **change(good))


@pytest.fixture
def opsd_step():
    student = tiny_model("qwen2", seed=0)
    step = OPSDStep(student, tiny_model("qwen2", seed=1), TinyTokenizer(pad_token_id=0, eos_token_id=2),
                    optimizer=torch.optim.SGD(student.parameters(), lr=1e-2))
    return step, [p.detach().clone() for p in student.parameters()]


@pytest.mark.parametrize("change, message", [
    (lambda b: dict(input_ids=b.input_ids[:0], attention_mask=b.attention_mask[:0],
                    response_start_idx=b.response_start_idx[:0]), r"^batch: has no rows"),  # was min() of nothing
    (lambda b: dict(input_ids=b.input_ids - 100), r"^input_ids: token ids must be >= 0; got -100"),  # IndexError
])
def test_train_on_batch_refuses_before_training(opsd_step, change, message):
    step, before = opsd_step
    good = _batch()
    with pytest.raises(ValueError, match=message):
        step.train_on_batch(dataclasses.replace(good, **change(good)))
    assert all(torch.equal(a, b) for a, b in zip(before, step.student_module.parameters()))


@pytest.mark.parametrize("where", ["batch", "teacher prompts"])
def test_soft_masks_are_refused(opsd_step, where):
    """A mask holding values other than 0 and 1 (0.5: weights, not a token mask) was taken as 1 wherever non-zero,
    silently; now refused naming the field, before training."""
    step, before = opsd_step
    good = _batch()
    if where == "batch":
        soft = good.attention_mask.float()
        soft[0, -1] = 0.5
        with pytest.raises(ValueError, match=r"^attention_mask: must hold 0 and 1 only .*; 1 entries"):
            step.train_on_batch(dataclasses.replace(good, attention_mask=soft))
    else:
        with pytest.raises(ValueError, match=rf"^attention_mask: must hold 0 and 1 only .*; {int(MASK.sum())} entries"):
            step.train_on_batch(good, teacher_prompt_ids=IDS, teacher_prompt_attention_mask=MASK * 2)
    assert all(torch.equal(a, b) for a, b in zip(before, step.student_module.parameters()))


def test_negative_teacher_prompt_ids_are_refused(opsd_step):
    step, _ = opsd_step
    with pytest.raises(ValueError, match=r"^input_ids: token ids must be >= 0; got -1 "):
        step.train_on_batch(_batch(), teacher_prompt_ids=IDS.clamp(max=0) - 1,
                            teacher_prompt_attention_mask=torch.ones_like(MASK))


def test_a_rank_that_refused_its_inputs_makes_every_rank_raise():
    """A rank whose inputs failed their checks sends ``REFUSED_FIGURES`` through the step's all-gather: every other
    rank raises naming it (that rank raises its own error, which names the field)."""
    from rollout.opsd.ranks import REFUSED_FIGURES, RankFigures, check_figures

    with pytest.raises(ValueError, match=r"^batch: refused on data-parallel rank 1: that rank's error names the field"):
        check_figures([RankFigures(5, 1, 1, 2, 40), REFUSED_FIGURES], 512)


@pytest.mark.parametrize("kwargs, message", [
    (dict(teacher_prompt_ids=IDS[:2], teacher_prompt_attention_mask=MASK[:2]), r"^teacher_prompt_ids: "),  # rows
    (dict(teacher_prompt_ids=IDS), r"^teacher_prompt_ids: "),  # no mask
])
def test_train_on_batch_joins_the_collectives_before_raising_its_own_error(opsd_step, monkeypatch, kwargs, message):
    """Inputs refused on this rank (teacher prompts of another row count, or without a mask) raise their own error
    only after the step's all-gather, with ``REFUSED_FIGURES`` (raising before it left the other data-parallel ranks
    waiting in it); nothing trains."""
    from rollout.opsd import step as step_module
    from rollout.opsd.ranks import REFUSED_FIGURES

    sent = []
    gather = step_module.gather_figures
    monkeypatch.setattr(step_module, "gather_figures", lambda local, *a: sent.append(local) or gather(local, *a))
    step, before = opsd_step
    with pytest.raises(ValueError, match=message):
        step.train_on_batch(_batch(), **kwargs)
    assert sent == [REFUSED_FIGURES]
    assert all(torch.equal(a, b) for a, b in zip(before, step.student_module.parameters()))


def test_a_distill_input_refusal_joins_the_collectives_too(opsd_step, monkeypatch):
    """Unequal response starts with teacher prompts (``distill_inputs`` refuses them) take the same way."""
    from rollout.opsd import step as step_module
    from rollout.opsd.ranks import REFUSED_FIGURES

    sent = []
    gather = step_module.gather_figures
    monkeypatch.setattr(step_module, "gather_figures", lambda local, *a: sent.append(local) or gather(local, *a))
    step, _ = opsd_step
    good = _batch()
    uneven = dataclasses.replace(good, response_start_idx=torch.tensor([6, 5, 6]))
    with pytest.raises(ValueError, match=r"^response_start_idx: must be equal in every row"):
        step.train_on_batch(uneven, teacher_prompt_ids=IDS, teacher_prompt_attention_mask=MASK)
    assert sent == [REFUSED_FIGURES]


# ---- a path to write: one set of rules (instrumentation.cli_values) --------------------------------------------------------

@pytest.mark.parametrize("path, create, why", [
    ("", False, "is empty"), ("  ", True, "is empty"), (None, False, "is empty"), ("a\0b.json", True,
                                                                                  "contains a NUL character"),
    ("{tmp}", False, "is a directory"), ("{tmp}/x/", True, "ends in a separator (a directory)"),
    ("{tmp}/x/..", True, "names a directory"), ("{tmp}/no/x.json", False, "is in the folder {tmp}/no, which does not exist"),
    ("{tmp}/no/deeper/x.json", True, None), ("{tmp}/file.txt/x.json", True, "is under {tmp}/file.txt, which is not a directory"),
    ("{tmp}/x.json", False, None),
])
def test_output_paths_follow_one_set_of_rules(tmp_path, path, create, why):
    """``--json-out`` (folders created), the benchmarks' result files and trim_trace's output (folders must exist)
    share ``output_problem``: each words its own error around the same reason."""
    from instrumentation.cli_values import output_problem

    (tmp_path / "file.txt").write_text("x")
    fill = (lambda text: text.replace("{tmp}", str(tmp_path))) if path else (lambda text: text)
    expected = None if why is None else fill(why)
    assert output_problem(fill(path) if isinstance(path, str) else path, create_folder=create) == expected
    source = tmp_path / "in.json"
    source.write_text("{}")
    assert output_problem(str(tmp_path / "." / "in.json"), source=str(source)) == \
        "is the source file (it would be overwritten)"


# ---- counts on the command line: ASCII digits only -------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("3", 3), (" +3 ", 3), ("-2", -2), ("0", 0), ("٣", None), ("1_0", None),
                                         ("²", None), ("3.0", None), ("", None), ("0x10", None), (None, None)])
def test_command_line_ints_take_ascii_digits_only(text, value):
    """``int()`` reads other scripts' digits ('٣' is 3) and underscores ('1_0' is 10); a count on the command line
    does not."""
    from instrumentation.cli_values import parse_int_text

    assert parse_int_text(text) == value


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "٣"], r"argument --batch-size: invalid int value: '٣'"),
    (["--steps", "1_0"], r"argument --steps: invalid int value: '1_0'"),
    (["--max-student-rows", "٣"], r"argument --max-student-rows: expected auto, all or an int >= 1"),
])
def test_the_main_jobs_counts_refuse_other_digits(capsys, argv, message):
    from rollout import job as job_lib

    with pytest.raises(SystemExit):
        job_lib.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)
    assert job_lib.parse_args(["--batch-size", "3", "--steps", "10"]).job.batch_size == 3


def test_trace_and_benchmark_counts_refuse_other_digits():
    from benchmarks.harness.cli import int_at_least
    from traces.cli import parse_args

    with pytest.raises(argparse.ArgumentTypeError, match=r"must be an int >= 1; got '٣'"):
        int_at_least(1)("٣")
    assert int_at_least(1)("3") == 3
    with pytest.raises(SystemExit):
        parse_args(["trace.json", "--kernels", "٣"])
    assert parse_args(["trace.json", "--kernels", "3"]).kernels == 3
    trim = importlib.import_module("scripts.trim_trace")
    with pytest.raises(SystemExit):
        trim.parse_args(["in.json", "out.json.gz", "--step", "٣"])
    assert trim.parse_args(["in.json", "out.json.gz", "--step", "3"]).step == 3


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "٣"], r"argument --repeats: must be an int >= 1; got '٣'"),
    (["--threads", "0"], r"argument --threads: must be an int >= 1; got '0'"),
    (["--decode-steps", "1_0"], r"argument --decode-steps: must be an int >= 1; got '1_0'"),
    (["--batches", "1,0"], r"argument --batches: must be a comma list of ints >= 1; got '1,0'"),
    (["--lengths", "8,٣2"], r"argument --lengths: must be a comma list of ints >= 1"),
    (["--decode-shapes", "8x"], r"argument --decode-shapes: must be BxL,... shapes of ints >= 1; got '8x'"),
    (["--output", "."], r"argument --output: '.' is a directory; give a file path"),
])
def test_the_developer_tools_refuse_bad_counts_before_any_work(argv, message, capsys):
    """calibrate_prefill.py's counts and lists took ``int()`` (other scripts' digits, underscores, zero), and its
    output paths were checked only when written, after the measurements."""
    calibrate = importlib.import_module("scripts.calibrate_prefill")
    with pytest.raises(SystemExit):
        calibrate.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)
    good = calibrate.parse_args(["--batches", "1,4", "--decode-shapes", "8x32,4x128", "--repeats", "3"])
    assert (good.batches, good.decode_shapes, good.repeats) == ("1,4", "8x32,4x128", 3)


@pytest.mark.parametrize("argv, message", [(["--arch", "9"], r"argument --arch: must be an int >= 70; got '9'"),
                                           (["--arch", "٩0"], r"argument --arch: must be an int >= 70"),
                                           (["--json", "."], r"argument --json: '.' is a directory")])
def test_check_kernels_refuses_bad_flags(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        importlib.import_module("scripts.check_kernels").main(argv)
    assert re.search(message, capsys.readouterr().err)


# ---- ProfileConfig and the OPSD_* variables -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=b"1-3"), r"^steps=b'1-3' is not valid"),  # was steps (45, 49, 51): the bytes' values
    (dict(steps=range(10**9)), r"^steps=range\(0, 1000000000\) is not valid; .*at most 100000 items$"),  # 10**9 ints
    (dict(output_dir="/tmp/a\x00b"), r"^output_dir must be a non-empty path without NUL characters"),
])
def test_profile_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileConfig(**kwargs)


def test_profile_config_takes_numpy_integers():
    config = ProfileConfig(steps=[np.int64(2), np.int32(1)], ranks=np.int64(0), every=np.int64(3))
    assert (config.steps, config.ranks, config.every) == ((1, 2), (0,), 3)
    assert all(type(v) is int for v in (*config.steps, *config.ranks, config.every))


@pytest.mark.parametrize("env, warning", [
    ({"OPSD_PROFILE": "1", "OPSD_PROFILE_EVERY": "5"}, r"OPSD_PROFILE_EVERY='5' is ignored under OPSD_PROFILE='1'"),
    ({"OPSD_PROFILE": "timers", "OPSD_PROFILE_STEPS": "2-4"}, r"OPSD_PROFILE_STEPS='2-4' is ignored under "),
    ({"OPSD_PROFILE": "nvtx", "OPSD_PROFILE_STEPS": "2"}, r"OPSD_PROFILE_STEPS='2' is ignored under OPSD_PROFILE='nvt"),
])
def test_variables_the_mode_ignores_are_warned(env, warning, monkeypatch, tmp_path):
    monkeypatch.setenv("OPSD_PROFILE_DIR", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match=warning):
        check_environment()


@pytest.fixture
def profiled(tmp_path):
    from instrumentation import opsd_profiler
    reset_for_tests()
    yield lambda mode="1", **kwargs: opsd_profiler(ProfileConfig(mode=mode, output_dir=str(tmp_path), steps=(0,)),
                                                   **kwargs)
    reset_for_tests()


def test_step_outside_the_session_is_refused(profiled):
    session = profiled()
    with pytest.raises(RuntimeError, match=r"^opsd_profiler: step\(\) called on a session that is new, outside"):
        session.step()  # was counted silently, never profiled
    with session:
        session.step()
    with pytest.raises(RuntimeError, match=r"^opsd_profiler: step\(\) called on a session that is closed"):
        session.step()
    assert session.current_step == 1


def test_a_session_is_entered_once(profiled):
    session = profiled()
    with session:
        with pytest.raises(RuntimeError, match=r"^opsd_profiler: this session was entered already \(open\)"):
            session.__enter__()
        session.step()
    assert session.current_step == 1


def test_sessions_with_timers_do_not_nest(profiled):
    """Two mode-1 sessions one inside the other crashed the process (SIGSEGV in torch.profiler)."""
    with profiled("timers") as outer:
        with pytest.raises(RuntimeError, match=r"^opsd_profiler: another session with timers is open"):
            with profiled("timers"):
                pass
        with profiled("nvtx") as inner:  # ranges only: allowed
            inner.step()
        outer.step()


@pytest.mark.parametrize("rank, world_size", [(5, 2), (0, 0), (1, 1)])
def test_rank_outside_the_world_is_refused(profiled, rank, world_size):
    with pytest.raises(ValueError, match=rf"^world_size must be an int >= 1 above rank {rank}; got {world_size}$"):
        profiled(rank=rank, world_size=world_size)


# ---- trim_trace.py and summarize_trace.py ---------------------------------------------------------------------------

def _script(name):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_trim_refuses_its_own_source_as_output(tmp_path, capsys):
    source = tmp_path / "in.pt.trace.json.gz"
    source.write_bytes(TRACE.read_bytes())
    assert _script("trim_trace").main([str(source), str(tmp_path / "." / source.name)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("output is the source file (it would be overwritten); give another path") and "\n" not in err
    assert source.read_bytes() == TRACE.read_bytes()  # was overwritten by its own trimmed copy


def test_trim_warns_about_a_gzip_output_named_json(tmp_path, capsys):
    out = tmp_path / "small.json"
    assert _script("trim_trace").main([str(TRACE), str(out)]) == 0
    assert "warning: " in capsys.readouterr().err and out.read_bytes()[:2] == b"\x1f\x8b"
    with gzip.open(out) as f:
        assert f.read(1) == b"{"


def test_summarize_warns_about_repeated_flags_and_paths(capsys):
    from traces.cli import main
    assert main([str(TRACE), str(ROOT / "tests" / "data" / ".." / "data" / "traces" / TRACE.name),
                 "--format", "json", "--format=csv"]) == 0
    err = capsys.readouterr().err
    assert "warning: --format given 2 times: only the last one is used" in err
    assert "given twice; read once" in err


# ---- demo_rollout.py and the benchmark CLIs: refused by the parser, before any model ---------------------------------

def test_demo_reads_negative_infinity_as_a_value(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script("demo_rollout").parse_args(["--temperature", "-inf"])  # was "expected one argument"
    assert exit_info.value.code == 2
    assert "--temperature: must be a finite number; got -inf" in capsys.readouterr().err


class WorkStarted(Exception):
    pass


def _started(*args, **kwargs):
    raise WorkStarted


BENCHMARK_FLAGS = [  # module, the work it would start, argv, the message
    ("step", "measure_rates", ["--steps", "0"], "argument --steps: must be an int >= 1; got '0'"),
    ("step", "measure_rates", ["--steps", "-1"], "argument --steps: must be an int >= 1; got '-1'"),  # quoted 0
    ("step", "measure_rates", ["--out", ""], "argument --out: '' is empty; give a file path"),
    ("step", "measure_rates", ["--cells", ""], "argument --cells: '' not among"),
    ("step", "measure_rates", ["--cells", "small,bogus"], "argument --cells: ['bogus'] not among"),  # KeyError
    ("step", "measure_rates", ["--check-tokens", "0"], "argument --check-tokens: must be an int >= 1"),
    ("jsd", "measure_rates", ["--temperature", "nan"], "argument --temperature: must be a finite number > 0"),
    ("jsd", "measure_rates", ["--json", ""], "argument --json: '' is empty; give a file path"),
    ("optimizer", "parent", ["--lr", "nan"], "argument --lr: must be a finite number > 0 and <= 1e+30; got 'nan'"),
    ("optimizer", "parent", ["--lr", "1e300"], "argument --lr: must be a finite number > 0 and <= 1e+30; got '1e300'"),
    ("optimizer", "parent", ["--port", "70000"], "argument --port: must be an int in [1, 65535]; got '70000'"),
    ("optimizer", "parent", ["--tokens", "0"], "argument --tokens: must be an int >= 2"),
    ("optimizer", "parent", ["--out", "/nonexistent-folder/x.json"],
     "argument --out: '/nonexistent-folder/x.json' is in the folder /nonexistent-folder, which does not exist"),
    ("multigpu", "run_variant", ["--timeout", "nan"], "argument --timeout: must be a finite number > 0"),
    ("planner", "plan_rows", ["--repeats", "0"], "argument --repeats: must be an int >= 1"),  # a traceback
    ("keep_cache", "load_model", ["--batch-size", "0"], "argument --batch-size: must be an int >= 1"),  # IndexError
    ("keep_cache", "load_model", ["--rounds", "0"], "argument --rounds: must be an int >= 1"),
    ("keep_cache", "load_model", ["--dtype", "float13"], "argument --dtype: invalid choice: 'float13'"),
    ("keep_cache", "load_model", ["--device", "cuda:99"], "argument --device: 'cuda:99': this machine has"),
    ("postprocess", "measure", ["--device", "xpu"], "argument --device: must be cpu or cuda[:N]; got 'xpu'"),
    ("postprocess", "measure", ["--repeats", "0"], "argument --repeats: must be an int >= 1"),
    ("jsd", "measure_rates", ["--configs", "\u0668x4"], "--configs: expected BLOCKxWARPS"),  # int() read 8
    ("sampler", "bench_case", ["--rows", "0"], "argument --rows: must be an int >= 1"),
    ("sampler", "bench_case", ["--iters", "1_0"], "argument --iters: must be an int >= 1"),
    ("sampler", "bench_case", ["--kernel-configs", "2048x8x2x1"], "argument --kernel-configs: must be 2 or 3 'x'-separated"),
    ("sampler", "bench_case", ["--chunk-configs", "8192x2048"], "argument --chunk-configs: must be 3 or 4 or 5 'x'-sep"),
    ("sampler", "bench_case", ["--json", ""], "argument --json: '' is empty; give a file path"),
    ("trace_summary", "write_synthetic_trace", ["--num-ranks", "\u0663"], "argument --num-ranks: must be an int >= 1"),
    ("trace_summary", "write_synthetic_trace", ["--size-mb", "nan"], "argument --size-mb: must be a finite number > 0"),
    ("trace_summary", "write_synthetic_trace", ["--json", ""], "argument --json: '' is empty; give a file path"),
]


@pytest.mark.parametrize("module, work, argv, message", BENCHMARK_FLAGS)
def test_benchmark_flags_are_refused_before_any_work(module, work, argv, message, monkeypatch, capsys):
    bench = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(bench, work, _started)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shared_types_accept_good_values():
    from benchmarks.harness.cli import finite_number, int_in, int_tuple, names_among, out_path
    assert finite_number(0.0, above=True)("1e-3") == 1e-3 and int_in(1, 65535)("29610") == 29610
    assert int_tuple(2)("256, 384") == (256, 384) and int_tuple(4, 5, minimum=0)("0,64,64,4,4") == (0, 64, 64, 4, 4)
    for text in ("256", "256,384,1", "256,0", "256,\u0663", "256,1_0"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be 2 comma-separated ints >= 1"):
            int_tuple(2)(text)
    assert names_among({"a": 1, "b": 2})(" a, b ") == ("a", "b") and out_path("x.json") == "x.json"
    with pytest.raises(argparse.ArgumentTypeError):
        finite_number(0.0, above=True)("0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from benchmarks.harness.models import device_arg
        assert device_arg("cpu") == "cpu"


# ---- the two left by the sweep: OPSDStep.step's sampling, a huge loss chunk in the estimate ---------------------------

def test_step_names_a_sampling_that_is_not_a_sampling_config():
    """A dict or None as ``sampling`` failed with AttributeError deep in the step."""
    model = tiny_model("qwen2", seed=0)
    step = OPSDStep(model, tiny_model("qwen2", seed=1), TinyTokenizer(pad_token_id=0, eos_token_id=None),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ids, mask = random_prompts(2, 5, seed=3)
    for bad in ({"max_new_tokens": 4}, None):
        with pytest.raises(ValueError, match="sampling: must be a SamplingConfig; got"):
            step.step(ids, mask, bad)


def test_a_loss_chunk_larger_than_a_micro_batch_costs_its_positions_only():
    """The chunk scratch holds at most the micro-batch's positions: ``loss_chunk_size=10**18`` estimated 2.29e13 GiB a
    row; now any chunk at least as large as the rows' positions costs the same (those positions), a smaller one less."""
    from rollout.opsd import sizing
    from rollout.opsd.micro_batches import RowStats

    student, teacher = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    stats = RowStats((5, 7), (9, 11), (0, 0), (0, 0), 4, 4, (9, 11))
    for cost_of in (sizing.packed_row_cost, lambda s, t, c: sizing.row_cost(s, t, sizing.LogitCacheConfig(), c)):
        huge, exact = cost_of(student, teacher, 10**18), cost_of(student, teacher, 10**4)
        assert huge.micro_batch_bytes(stats, [0, 1]) == exact.micro_batch_bytes(stats, [0, 1]) < 2**30
        assert cost_of(student, teacher, 1).micro_batch_bytes(stats, [0, 1]) < exact.micro_batch_bytes(stats, [0, 1])


def test_negative_ids_are_refused_by_every_rank():
    """A negative id on one data-parallel rank: every rank raises the same error after the one all-gather (raising on
    that rank alone, before the collective, would leave the others waiting in it)."""
    from rollout.opsd.ranks import RankFigures, check_figures

    good, bad = RankFigures(5, 1, 1, 2, 40), RankFigures(5, 1, 1, 2, 40, -3)
    check_figures([good, good], 512)
    with pytest.raises(ValueError, match=r"^input_ids: token ids must be >= 0; got -3 in the batch on data-parallel "
                                         r"rank 1"):
        check_figures([good, bad], 512)


def test_an_empty_batch_on_one_rank_is_refused_by_every_rank():
    """A rank whose batch has no rows sends ``EMPTY_FIGURES`` through the step's all-gather, so every rank raises
    (it raised on its own before the collective, where the other ranks would have waited)."""
    from rollout.opsd.ranks import EMPTY_FIGURES, RankFigures, check_figures

    with pytest.raises(ValueError, match=r"^batch: has no rows on data-parallel rank 0 \(nothing to distil on\)"):
        check_figures([EMPTY_FIGURES, RankFigures(5, 1, 1, 2, 40)], 512)
    with pytest.raises(ValueError, match=r"^batch: has no rows \(nothing to distil on\)"):
        check_figures([EMPTY_FIGURES], 512)


# ---- outputs that are not plain files (stop 48) ---------------------------------------------------------------------

def test_a_named_pipe_is_written_where_it_is(tmp_path):
    """``--json-out /dev/null`` (or ``/dev/full``) renamed a file over the device node: as root, /dev/null became a plain
    file holding the report, for every process of the machine. A named pipe in a test folder shows the same rename."""
    import os
    import stat
    import threading

    from instrumentation.export import write_atomic, written_in_place

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(str(fifo), b'{"a": 1}\n')
    reader.join(timeout=30)
    assert got == [b'{"a": 1}\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert written_in_place("/dev/null") == "/dev/null" and written_in_place(str(tmp_path / "run.json")) is None
    assert written_in_place("/dev/stdout") == 1 and written_in_place("/dev/fd/2") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_descriptor_path_writes_through_the_descriptor_instead_of_replacing_its_file(tmp_path):
    """``--json-out /dev/stdout`` with stdout redirected to a log: following the links to the log and renaming a new
    file over it replaced the log (its earlier lines gone, the process's later lines into the unlinked file). The
    report goes through the descriptor, between the lines written before and after it."""
    import os

    from instrumentation.export import write_atomic

    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        handle.write("step 0\n")
        handle.flush()
        inode = os.stat(log).st_ino
        write_atomic(f"/proc/self/fd/{handle.fileno()}", b"{}\n")
        handle.write("done\n")
    assert os.stat(log).st_ino == inode and log.read_text() == "step 0\n{}\ndone\n"


def test_a_symbolic_link_keeps_pointing_at_the_replaced_file(tmp_path):
    from instrumentation.export import write_atomic

    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "7.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_atomic(str(link), b"new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["7.json"]


def test_a_socket_is_refused_as_an_output(tmp_path):
    import socket

    from instrumentation.cli_values import output_problem

    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        assert output_problem(str(path)) == "is a socket, not a file"
    assert output_problem("/dev/null") is None  # written where it is


def test_a_report_that_cannot_be_written_goes_to_the_temporary_folder(tmp_path, monkeypatch):
    """The report of a finished run is not lost to a full disk: it lands in the system's temporary folder, and the
    main job says where (stderr) and exits 1."""
    import json

    from rollout.opsd import report

    monkeypatch.setattr(report.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "file.txt").write_text("x")
    where, why = report.save_report(str(tmp_path / "file.txt" / "run.json"), {"loss": float("nan"), "steps": 2})
    assert why and where.startswith(str(tmp_path / "tmp" / "opsd-report-")) and where.endswith(".json")
    assert json.loads(Path(where).read_text()) == {"loss": None, "steps": 2}
    assert report.save_report(str(tmp_path / "run.json"), {"steps": 2}) == (str(tmp_path / "run.json"), None)


def test_the_main_job_says_where_its_report_went_and_exits_1(tmp_path):
    """The whole job, its own process, with a disk that is full when the report is written."""
    import json
    import os
    import subprocess

    wanted = str(tmp_path / "run.json")
    run = f"""
import errno, os, runpy, sys
from rollout.opsd import report
real = report.write_json
def full_disk(path, doc):
    if path == {wanted!r}:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real(path, doc)
report.write_json = full_disk
sys.argv = ["train_opsd.py", "--steps", "1", "--print-every", "0", "--json-out", {wanted!r}]
runpy.run_path({str(ROOT / "scripts" / "train_opsd.py")!r}, run_name="__main__")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), OPSD_PROFILE="0", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    line = [text for text in proc.stderr.splitlines() if text.startswith("error: --json-out")]
    assert proc.returncode == 1 and len(line) == 1, proc.stderr[-3000:]
    assert "cannot write (No space left on device); the report is in " + str(tmp_path / "opsd-report-") in line[0]
    saved = line[0].rsplit(" ", 1)[1]
    assert json.loads(Path(saved).read_text())["ranks"][0]["losses"] and not os.path.exists(wanted)
