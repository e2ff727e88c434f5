"""Work records of the rollout (prefill, decode), the loss and the logit cache (instrumentation/work.py) against
FlopCounterMode and a hand count of the shapes; a profiled tiny OPSD step writes every stage's line; the rates'
flags of the main job."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

import instrumentation
from instrumentation import stages as S
from instrumentation.geometry import head, model_geometry
from instrumentation.roofline import Rates, backward_flops, decode_roofline_s, forward_flops, training_roofline
from instrumentation.work import WORK_STAGES, Head, cache_bytes, distill_work, rollout_work, training_work
from rollout.config import SamplingConfig
from rollout.model import compat
from rollout.opsd import OPSDConfig, OPSDStep
from rollout.opsd.fused_loss import fused_jsd_loss
from rollout.opsd.losses import generalized_jsd_loss
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.profiling_env import clean_profiling_env  # noqa: F401  (autouse fixture)
from tests.test_opsd_step import load_train_opsd

R, P, N = 3, 12, 40  # rows, prompt tokens a row, loss positions


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", attn_implementation="eager")


def _ids(rows, cols):
    return torch.randint(3, 200, (rows, cols), generator=torch.Generator().manual_seed(0))


def _weight_bytes(cfg) -> int:
    """Every fp32 weight of the tiny qwen2 from its config (q/k/v with biases, o, gate/up/down, norms, untied head)."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    layer = h * h + 2 * h * kv + (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size + 2 * h
    return 4 * (2 * cfg.vocab_size * h + cfg.num_hidden_layers * layer + h)


def test_prefill_flops_match_flop_counter_and_bytes_a_hand_count(model):
    """Unique prompts once, one logits row each; eager attention computes the masked upper half too."""
    geo = model_geometry(model)
    prefill, _ = rollout_work([P] * (2 * R), 2, [1] * (2 * R), geo)  # 2 samples per prompt: R unique prompts
    counted = _count(lambda: model(input_ids=_ids(R, P), logits_to_keep=1))
    masked = geo.attn_flops_per_key * R * (P * P - P * (P + 1) / 2)
    assert counted == pytest.approx(prefill.flops + masked, rel=0.02)
    assert (prefill.rows, prefill.tokens) == (R, R * P)
    assert prefill.bytes == _weight_bytes(model.config)


def test_one_decode_step_matches_flop_counter_and_bytes_a_hand_count(model):
    """Response length 2: one decode step, the rows' context P + 1 (the prompt and the first response token)."""
    geo = model_geometry(model)
    _, decode = rollout_work([P] * R, 1, [2] * R, geo)
    kwarg, cache = compat._cache_kwarg(type(model)), DynamicCache()
    with torch.no_grad():
        model(input_ids=_ids(R, P), use_cache=True, logits_to_keep=1, **{kwarg: cache})
        counted = _count(lambda: model(input_ids=_ids(R, 1), use_cache=True, **{kwarg: cache}))
    assert counted == pytest.approx(decode.flops, rel=0.02)
    cfg = model.config
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert decode.bytes == _weight_bytes(cfg) + kv_token * R * (P + 1)
    assert (decode.rows, decode.tokens) == (R, R)


def test_decode_sums_its_steps_and_carries_its_exact_roofline(model):
    geo = model_geometry(model)
    prompts, lengths, rates = [5, 9, 7, 3], [1, 6, 3, 12], Rates(1e9, 1e9)
    _, decode = rollout_work(prompts, 1, lengths, geo, rates)
    assert decode.tokens == sum(n - 1 for n in lengths)
    assert decode.roofline_s == pytest.approx(decode_roofline_s(prompts, lengths, geo, rates))
    assert decode.roofline_s > max(decode.bytes / rates.copy_bytes_s, decode.flops / rates.gemm_flops_s)
    assert rollout_work(prompts, 1, lengths, geo)[1].roofline_s is None  # no rates: none


def test_the_fused_loss_head_gemms_match_flop_counter_and_bytes_a_hand_count(model):
    """Packed path: both heads' logits, the hidden states' and the head's gradients, all inside the loss."""
    teacher = tiny_model("llama", seed=1, vocab_size=384)
    hidden = torch.randn(N, 64, requires_grad=True)
    counted = _count(lambda: fused_jsd_loss(hidden, model.lm_head.weight, torch.randn(N, 64), teacher.lm_head.weight,
                                            chunk_size=16).backward())
    student_head, teacher_head = head(model), head(teacher)
    stored = cache_bytes(N, student_head, teacher_head, True, 2)
    cache, loss = distill_work(R, N, student_head, teacher_head, True, stored)
    assert counted == pytest.approx(loss.flops, rel=0.02)
    V, H = 384, 64  # the shared vocabulary, both hidden sizes
    assert loss.bytes == V * H * 4 * 2 + N * H * 4 + 2 * N * H * 4 + 4 * V * H
    assert (stored, cache.bytes, cache.flops) == (N * H * 4, 2 * N * H * 4, 0.0)
    frozen = Head(512, 64, 4, trainable=False)
    assert distill_work(R, N, frozen, teacher_head, True, stored)[1].flops == 2 * N * V * H * 3  # no head gradient


def test_the_padded_loss_runs_no_matmul_and_moves_the_logits(model):
    logits = torch.randn(R, 8, 512, requires_grad=True)
    mask = torch.ones(R, 8)
    counted = _count(lambda: generalized_jsd_loss(logits, torch.randn(R * 8, 512).bfloat16(), mask).backward())
    student_head, teacher_head = head(model), Head(512, 64, 2)
    stored = cache_bytes(N, student_head, teacher_head, False, 2)
    cache, loss = distill_work(R, N, student_head, teacher_head, False, stored)
    assert counted == 0 and loss.flops == 0.0
    assert stored == N * 512 * 2
    assert loss.bytes == stored + 2 * N * 512 * 4  # the cache read; the student's logits read, their gradient written
    assert cache.bytes == N * 512 * 2 + stored  # the teacher's logits read (bf16), the cache written
    assert cache_bytes(N, student_head, teacher_head, False, 2, top_k=8) == N * 8 * (2 + 4)  # values + int32 ids


def test_the_packed_passes_count_no_head(model):
    geo = model_geometry(model)
    padded = {w.stage: w for w in training_work([20] * R, [20] * R, N, geo, geo, 1)}
    packed = {w.stage: w for w in training_work([20] * R, [20] * R, N, geo, geo, 1, packed=True)}
    assert packed[S.STUDENT_FORWARD].flops == forward_flops([20] * R, geo, 0)
    assert padded[S.STUDENT_FORWARD].flops - packed[S.STUDENT_FORWARD].flops == 2 * geo.lm_head_params * N
    assert packed[S.BACKWARD].flops == 2 * packed[S.STUDENT_FORWARD].flops
    assert padded[S.TEACHER_FORWARD].flops - packed[S.TEACHER_FORWARD].flops == 2 * geo.lm_head_params * N


def test_the_backward_counts_weight_gradients_for_the_trained_share_only(model):
    """Every weight trains: 2x the forward; none: the inputs' gradients (the weights' GEMMs once, attention twice);
    the student's roofline reads the weights 2 + share times."""
    geo, rows = model_geometry(model), [20] * R
    gemm = 2 * geo.nonembedding_params * sum(rows) + 2 * geo.lm_head_params * N
    attention = forward_flops(rows, geo, N) - gemm
    assert backward_flops(rows, geo, N) == pytest.approx(2 * forward_flops(rows, geo, N))
    assert backward_flops(rows, geo, N, 0.0) == pytest.approx(gemm + 2 * attention)
    assert backward_flops(rows, geo, N, 0.25) == pytest.approx(1.25 * gemm + 2 * attention)
    with pytest.raises(ValueError, match="trained_share"):
        backward_flops(rows, geo, N, 1.5)
    slow = Rates(1.0, 1e30)  # bytes bound: the weights' reads count
    full, frozen = (training_roofline(rows, rows, N, geo, geo, 0, slow, share).student_s for share in (1.0, 0.0))
    assert full == pytest.approx(3 * geo.weight_bytes) and frozen == pytest.approx(2 * geo.weight_bytes)


@pytest.mark.parametrize("train_path", ["padded", "packed"])
def test_a_profiled_opsd_step_writes_every_stage(tmp_path, monkeypatch, train_path):
    monkeypatch.setenv("OPSD_PEAK_TFLOPS", "100")
    monkeypatch.setenv("OPSD_PEAK_TBPS", "2")
    student = tiny_model("qwen2", seed=0).train()
    step = OPSDStep(student, tiny_model("llama", seed=1, eos_token_id=2), TinyTokenizer(eos_token_id=2),
                    OPSDConfig(train_path=train_path), optimizer=torch.optim.AdamW(student.parameters(), lr=1e-3))
    ids, mask = random_prompts(2, 6, min_len=2, seed=0)
    sampling = SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, seed=0)
    with instrumentation.opsd_profiler(instrumentation.ProfileConfig(mode="timers", output_dir=str(tmp_path))) as prof:
        result = step.step(ids, mask, sampling)
        prof.step()
    lines = {x["stage"]: x for x in map(json.loads, open(Path(prof.run_dir) / "rank0.work.jsonl"))}
    assert set(lines) == set(WORK_STAGES)
    assert lines[S.PREFILL]["rows"] == 2 and lines[S.PREFILL]["tokens"] == int(mask.sum())
    assert lines[S.DECODE]["rows"] == 4 and lines[S.DECODE]["tokens"] == result.num_response_tokens - 4
    assert lines[S.LOSS]["tokens"] == lines[S.LOGIT_CACHE]["tokens"] == result.num_response_tokens
    assert (lines[S.LOSS]["flops"] > 0) == (train_path == "packed")
    for line in lines.values():
        assert (line["peak_flops_source"], line["copy_bytes_source"]) == ("env", "env")
        assert line["roofline_s"] >= max(line["bytes"] / 2e12, line["flops"] / 100e12) * (1 - 1e-9)


@pytest.fixture(scope="module")
def train_opsd():
    return load_train_opsd("_train_opsd_work_under_test")


def test_the_peak_flags_set_the_rate_variables(train_opsd):
    job, _ = train_opsd.parse_args(["--peak-tflops", "500", "--peak-tbps", "3.5"])
    environ = {"OPSD_PEAK_TBPS": "1"}
    train_opsd.export_peak_rates(job, environ)
    assert environ == {"OPSD_PEAK_TFLOPS": "500.0", "OPSD_PEAK_TBPS": "3.5"}  # a flag wins over the variable
    environ = {}
    train_opsd.export_peak_rates(train_opsd.parse_args([])[0], environ)
    assert environ == {}


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "fast"])
def test_a_bad_peak_tbps_flag_is_refused_naming_it(train_opsd, capsys, bad):
    with pytest.raises(SystemExit):
        train_opsd.parse_args(["--peak-tbps", bad])
    err = capsys.readouterr().err
    assert "peak_tbps" in err or "--peak-tbps" in err
