"""Work records of the training phases (instrumentation/work.py, worklog.py, rates.py) against FlopCounterMode and
a hand count of the shapes; the work sidecar; the peak rates and their sources. The rollout's, the loss's and the
cache's records: tests/test_work_stages.py."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import instrumentation
from instrumentation import stages as S
from instrumentation.environment import check_environment
from instrumentation.geometry import model_geometry, trainable_params, trained_share
from instrumentation.probe import probe_rates
from instrumentation.rates import DeviceRates, device_rates, resolve_rates
from instrumentation.roofline import ADAMW_BYTES_PER_PARAM, Rates, work_roofline_s
from instrumentation.work import StageWork, training_work
from instrumentation.worklog import NO_WORK, RECORDER, WorkLog, recorder
from rollout.opsd.micro_batches import RowStats
from rollout.testing import tiny_model

B, L, KEEP = 3, 24, 10  # rows, real tokens a row (no padding), head positions a row


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _square(geo) -> float:
    """The masked upper half of the L x L attention products: eager attention computes the full square and masks
    it afterwards, FlopCounterMode counts it; the work records count the causal triangle (the work needed)."""
    return geo.attn_flops_per_key * B * (L * L - L * (L + 1) / 2)


@pytest.fixture(scope="module")
def phases():
    """FlopCounterMode's matmul FLOPs (mm/addmm/bmm) of each phase on the tiny CPU models, eager attention."""
    student, teacher = tiny_model("qwen2", attn_implementation="eager"), tiny_model("llama", seed=1,
                                                                                   attn_implementation="eager")
    ids = torch.randint(3, 200, (B, L), generator=torch.Generator().manual_seed(0))
    counted = {S.TEACHER_FORWARD: _count(lambda: teacher(input_ids=ids, logits_to_keep=KEEP))}
    student.train()
    counted[S.STUDENT_FORWARD] = _count(lambda: student(input_ids=ids, logits_to_keep=KEEP))
    logits = student(input_ids=ids, logits_to_keep=KEEP).logits
    counted[S.BACKWARD] = _count(lambda: logits.float().pow(2).mean().backward())
    work = training_work([L] * B, [L] * B, B * KEEP, model_geometry(student), model_geometry(teacher),
                         trainable_params(student))
    return student, teacher, counted, {w.stage: w for w in work}


@pytest.mark.parametrize("stage, model, passes", [(S.TEACHER_FORWARD, 1, 1), (S.STUDENT_FORWARD, 0, 1),
                                                  (S.BACKWARD, 0, 2)])
def test_phase_flops_match_flop_counter_within_2_percent(phases, stage, model, passes):
    models, counted, work = phases[:2], phases[2], phases[3]
    expected = work[stage].flops + passes * _square(model_geometry(models[model]))
    assert counted[stage] == pytest.approx(expected, rel=0.02)
    assert work[stage].rows == B and work[stage].tokens == B * L


def _hand_weight_bytes(cfg, element: int) -> int:
    """Every weight from the config's shapes: embedding, per layer q/k/v (+ biases for qwen2), o, gate/up/down and
    two norms, the final norm, an untied head."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    bias = (h + 2 * kv) if cfg.model_type == "qwen2" else 0
    layer = h * h + 2 * h * kv + bias + h * h + 3 * h * cfg.intermediate_size + 2 * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return element * (cfg.vocab_size * h + cfg.num_hidden_layers * layer + h + head)


def test_phase_bytes_match_a_hand_count_of_the_shapes(phases):
    student, teacher, _, work = phases
    student_bytes, teacher_bytes = _hand_weight_bytes(student.config, 4), _hand_weight_bytes(teacher.config, 4)
    assert work[S.TEACHER_FORWARD].bytes == teacher_bytes
    assert work[S.STUDENT_FORWARD].bytes == student_bytes
    assert work[S.BACKWARD].bytes == 2 * student_bytes
    assert work[S.OPTIMIZER_STEP].bytes == ADAMW_BYTES_PER_PARAM * student_bytes // 4  # fp32: all trainable
    assert work[S.OPTIMIZER_STEP].flops == 0 and work[S.OPTIMIZER_STEP].rows == 0


@pytest.mark.parametrize("field, value", [("flops", -1.0), ("bytes", float("nan")), ("rows", True)])
def test_stage_work_refuses_bad_figures(field, value):
    figures = dict(stage=S.BACKWARD, rows=1, tokens=1, flops=1.0, bytes=1.0)
    with pytest.raises(ValueError, match=field):
        StageWork(**{**figures, field: value})


def _stats(num_tokens, prompt_lens, teacher_prompt_lens, column=8, teacher_column=10):
    n = len(num_tokens)
    return RowStats((1,) * n, (1,) * n, tuple(column - p for p in prompt_lens),
                    tuple(teacher_column - p for p in teacher_prompt_lens), column, teacher_column, tuple(num_tokens))


def test_the_recorder_writes_one_line_per_stage_of_the_timed_step(tmp_path, qwen, llama):
    stats = _stats([10, 7, 5], [4, 3, 2], [6, 3, 2])  # row 0's teacher prompt is 2 tokens longer
    path = str(tmp_path / "rank0.work.jsonl")
    RECORDER.begin(WorkLog(path, 0, DeviceRates(1e15, 2e12, "env", "measured")), 3)
    RECORDER.training(qwen, llama, stats, (0, 2))  # row 1 has no loss position: not processed
    RECORDER.end()
    RECORDER.training(qwen, llama, stats, (0, 2))  # no step timed: nothing recorded
    RECORDER.end()
    lines = [json.loads(x) for x in open(path)]
    expected = training_work([10, 5], [12, 5], 2, model_geometry(qwen), model_geometry(llama), trainable_params(qwen))
    assert [x["stage"] for x in lines] == [w.stage for w in expected]
    for line, w in zip(lines, expected):
        assert (line["step"], line["rank"], line["rows"], line["tokens"], line["flops"], line["bytes"]) == \
            (3, 0, w.rows, w.tokens, w.flops, w.bytes)
        assert (line["peak_flops_s"], line["copy_bytes_s"]) == (1e15, 2e12)
        assert (line["peak_flops_source"], line["copy_bytes_source"]) == ("env", "measured")
        assert line["roofline_s"] == pytest.approx(work_roofline_s(w.flops, w.bytes, Rates(2e12, 1e15)))


def test_a_models_geometry_is_read_on_its_first_recorded_step_only(tmp_path, qwen, llama, monkeypatch):
    """Geometry and the student's trainable count: passes over every parameter (~0.5 ms each on the 3B's 434
    tensors), once per model, not every step."""
    from instrumentation import worklog
    from instrumentation.geometry import trainable_params

    calls, counted = [], []
    monkeypatch.setattr(worklog, "model_geometry", lambda model: calls.append(model) or model_geometry(model))
    monkeypatch.setattr(worklog, "trainable_params", lambda model: counted.append(model) or trainable_params(model))
    monkeypatch.setattr(worklog, "_GEOMETRY", worklog.weakref.WeakKeyDictionary())
    monkeypatch.setattr(worklog, "_TRAINABLE", worklog.weakref.WeakKeyDictionary())
    path = tmp_path / "rank0.work.jsonl"
    for step in (1, 2, 3):
        RECORDER.begin(WorkLog(str(path), 0, DeviceRates(None, None)), step)
        RECORDER.training(qwen, llama, _stats([10], [4], [4]), (0,))
        RECORDER.end()
    assert calls == [qwen, llama] and counted == [qwen]  # not once per step
    lines = [json.loads(x) for x in open(path)]
    assert len({(x["stage"], x["flops"], x["bytes"]) for x in lines}) == len(lines) // 3  # the same work each step


def test_without_rates_lines_carry_no_roofline(tmp_path, qwen, llama):
    path = tmp_path / "rank0.work.jsonl"
    RECORDER.begin(WorkLog(str(path), 0, DeviceRates(None, 2e12, None, "env")), 1)
    RECORDER.training(qwen, llama, _stats([10], [4], [4]), (0,))
    RECORDER.end()
    lines = [json.loads(x) for x in open(path)]
    assert lines and all("roofline_s" not in x and x["peak_flops_source"] is None for x in lines)


@pytest.mark.parametrize("mode, on", [("0", False), ("nvtx", False), ("1", True), ("timers", True)])
def test_the_recorder_is_picked_once_per_config(mode, on):
    instrumentation.configure(instrumentation.ProfileConfig(mode=mode))
    try:
        assert recorder() is (RECORDER if on else NO_WORK)
    finally:
        instrumentation.reset_for_tests()


@pytest.mark.parametrize("var", ["OPSD_PEAK_TFLOPS", "OPSD_PEAK_TBPS"])
@pytest.mark.parametrize("raw", ["fast", "0", "-3", "nan", "inf"])
def test_a_bad_peak_rate_is_refused_naming_the_variable(var, raw):
    with pytest.raises(ValueError, match=f"^{var}="):
        check_environment({var: raw})


@pytest.mark.parametrize("environ, name, expected", [
    ({}, "cpu", (None, None)),
    ({}, "NVIDIA H200", (989.4e12, 4.8e12)),
    ({"OPSD_PEAK_TFLOPS": "100", "OPSD_PEAK_TBPS": "2"}, "cpu", (100e12, 2e12)),
    ({"OPSD_PEAK_TBPS": "1.5"}, "NVIDIA H100 80GB HBM3", (989.4e12, 1.5e12)),
])
def test_device_rates(environ, name, expected):
    assert device_rates(environ, name) == pytest.approx(expected)


MEASURED = Rates(copy_bytes_s=4.2e12, gemm_flops_s=7.5e14)


@pytest.mark.parametrize("environ, name, measured, expected", [
    ({}, "cpu", None, DeviceRates(None, None, None, None)),
    ({}, "NVIDIA H200", None, DeviceRates(989.4e12, 4.8e12, "datasheet", "datasheet")),
    ({}, "NVIDIA H200", MEASURED, DeviceRates(7.5e14, 4.2e12, "measured", "measured")),
    ({}, "a GPU of no data sheet", MEASURED, DeviceRates(7.5e14, 4.2e12, "measured", "measured")),
    ({"OPSD_PEAK_TBPS": "3"}, "NVIDIA H200", MEASURED, DeviceRates(7.5e14, 3e12, "measured", "env")),
    ({"OPSD_PEAK_TFLOPS": "100"}, "cpu", None, DeviceRates(100e12, None, "env", None)),
])
def test_each_rate_records_its_source_the_user_first_then_measured_then_the_data_sheet(environ, name, measured,
                                                                                        expected):
    assert resolve_rates(environ, name, measured) == expected


def test_the_probe_on_the_cpu_measures_nothing_and_touches_no_cuda(monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("CUDA touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("Event", "synchronize", "current_device", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, touched)
    assert probe_rates({}) is None


def test_the_probe_measures_nothing_when_the_user_set_both_rates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: (_ for _ in ()).throw(AssertionError("probed")))
    assert probe_rates({"OPSD_PEAK_TFLOPS": "100", "OPSD_PEAK_TBPS": "2"}) is None


def test_a_failed_probe_warns_once_and_gives_no_rates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cuda:0")
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no device")))
    with pytest.warns(instrumentation.ProfilingWarning, match="could not measure"):
        assert probe_rates({}) is None
    instrumentation.reset_for_tests()


def test_a_recorder_failure_warns_and_records_nothing(tmp_path):
    path = tmp_path / "rank0.work.jsonl"
    RECORDER.begin(WorkLog(str(path), 0, DeviceRates(None, None)), 1)
    with pytest.warns(instrumentation.ProfilingWarning, match="work records"):
        RECORDER.training(object(), object(), _stats([4], [2], [2]), (0,))  # not models: no geometry
    RECORDER.end()
    assert not path.exists()
    instrumentation.reset_for_tests()


def test_a_lora_students_backward_matches_flop_counter_within_2_percent():
    """A frozen base with LoRA adapters on every projection: the backward computes the inputs' gradients and the
    adapters' (about one forward, not two), and the records count what it computes (``trained_share``)."""
    peft = pytest.importorskip("peft")

    model = peft.get_peft_model(tiny_model("qwen2", attn_implementation="eager"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False))
    student = model.base_model.model
    student.train()
    ids = torch.randint(3, 200, (B, L), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids, logits_to_keep=KEEP).logits
    counted = _count(lambda: logits.float().pow(2).mean().backward())
    share = trained_share(student)
    adapters = sum(p.numel() for n, p in student.named_parameters() if "lora_" in n)
    assert share == pytest.approx(adapters / (sum(p.numel() for p in student.parameters())
                                              - student.model.embed_tokens.weight.numel()))
    geo = model_geometry(student)
    work = {w.stage: w for w in training_work([L] * B, [L] * B, B * KEEP, geo, geo, trainable_params(model),
                                              trained_share=share)}
    # autograd skips the first layer's q/k/v input gradients (their input, the frozen embedding's output, needs
    # none); the records keep them (2 layers here: 8%; 1 of 36 layers' q/k/v at the 3B shape: 0.2%)
    cfg = student.config
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    skipped = 2 * B * L * cfg.hidden_size * ((cfg.hidden_size + 2 * kv) + 3 * 4)  # base q|k|v + three rank-4 A's
    assert counted == pytest.approx(work[S.BACKWARD].flops + 2 * _square(geo) - skipped, rel=0.02)
    full = {w.stage: w for w in training_work([L] * B, [L] * B, B * KEEP, geo, geo, 1)}
    assert work[S.BACKWARD].flops < 0.6 * full[S.BACKWARD].flops  # the full model's backward: 2 forwards
    assert work[S.BACKWARD].bytes < full[S.BACKWARD].bytes
