"""``RolloutConfig.kernels.blas_library="cublaslt-tuned"`` (``rollout.ops.tuned_gemm``): the decode step's projections
on each shape's fastest cuBLASLt algorithm. On the CPU: the choice among timed candidates, PyTorch's products
wherever the tuned path cannot run, the step handing exactly o, down and gate|up (q|k|v with folded norms) to it, and
the setting's plumbing; on CUDA: the tuned products equal PyTorch's, also replayed from a CUDA graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.config import BLAS_LIBRARIES, TUNED_BLAS
from rollout.executors import blas
from rollout.model.step import decode_logits
from rollout.ops import tuned_gemm
from rollout.ops.tuned_gemm import Candidate, TunedGemm, choose
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.test_residual_in_place import _step_inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_choose_takes_the_fastest_within_tolerance():
    cands = [Candidate("heuristic 0", 1.0, 0.0), Candidate("heuristic 1", 0.5, 0.5),  # fast but wrong
             Candidate("heuristic 2, split-K 4 reduction 2", 0.8, 0.01), Candidate("heuristic 3", 0.8, 0.0)]
    assert choose(cands, tolerance=0.02) == 2  # a tie goes to the earlier
    assert choose(cands, tolerance=1.0) == 1
    assert choose([Candidate("a", float("nan"), 0.0), Candidate("b", 2.0, 0.0)]) == 1
    assert choose([Candidate("a", 1.0, 0.3)], tolerance=0.02) is None
    assert choose([]) is None


def test_choose_keeps_pytorchs_product_unless_an_algorithm_beats_it_by_min_gain():
    cands = [Candidate(tuned_gemm.PYTORCH, 1.0, 0.0), Candidate("heuristic 0", 0.995, 0.0),
             Candidate("heuristic 1", 0.98, 0.0), Candidate("heuristic 2", 0.5, 0.3)]  # the last: fast but wrong
    assert choose(cands, min_gain=0.01) == 2  # 2% faster replaces it
    assert choose(cands[:2], min_gain=0.01) == 0  # 0.5% is a near tie: PyTorch keeps the shape
    assert choose(cands[:2]) == 1  # without a margin the fastest
    assert choose([Candidate("heuristic 0", 1.0, 0.0), Candidate(tuned_gemm.PYTORCH, 0.9, 0.0)], min_gain=0.5) == 1
    assert tuned_gemm.MIN_GAIN == TunedGemm(0).min_gain == 0.01


def test_sweep_times_the_heuristics_then_split_k_variants_of_the_fastest():
    """``cublaslt.sweep``: every heuristic algorithm, then for the ``finalists`` fastest each split-K count with each
    reduction cuBLASLt accepts (a count of 1 without one), named by where they came from."""
    from types import SimpleNamespace

    from rollout.ops import cublaslt

    class FakeProduct:
        def heuristics(self, requested):
            return [SimpleNamespace(algo=f"a{i}") for i in range(min(requested, 3))]

        def variant(self, algo, splitk, reduction):
            return None if (splitk, reduction) == (4, cublaslt.INPLACE) else (algo, splitk, reduction)

    speed = {"a0": 3.0, "a1": 1.0, "a2": 2.0}
    got = cublaslt.sweep(FakeProduct(), lambda source, algo: speed.get(algo, 0.5), requested=8, finalists=2,
                         splits=(1, 4), reductions=(cublaslt.INPLACE, cublaslt.COMPUTE_TYPE), ms=lambda r: r)
    assert [source for source, _, _ in got] == [
        "heuristic 0", "heuristic 1", "heuristic 2",
        "heuristic 1, split-K 1 reduction 0", "heuristic 1, split-K 4 reduction 2",
        "heuristic 2, split-K 1 reduction 0", "heuristic 2, split-K 4 reduction 2"]
    assert got[4][1] == ("a1", 4, cublaslt.COMPUTE_TYPE) and got[1][2] == 1.0


def test_off_cuda_the_products_are_pytorchs():
    gen = torch.Generator().manual_seed(0)
    x, w, h = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(5, 6, generator=gen)
    t = TunedGemm(0)
    assert torch.equal(t.mm(x, w), torch.mm(x, w.t()))
    want = h + x @ w.t()
    got = t.addmm_(h, x, w)
    assert got is h
    torch.testing.assert_close(h, want, rtol=0, atol=1e-6)
    assert t.plans == {} and t.failure is None


def test_summary_names_each_shape_its_pick_pytorchs_time_and_the_heuristics_first():
    t = TunedGemm(0)
    first, pick = Candidate("heuristic 0", 0.0345, 0.0), Candidate("heuristic 3, split-K 3 reduction 2", 0.0292, 1e-3)
    mine = Candidate(tuned_gemm.PYTORCH, 0.0341, 0.0)
    t.plans[(256, 11008, 2048, True, torch.bfloat16, (256, 256, 256))] = tuned_gemm.Plan(pick, first, {},
                                                                                          (mine, first, pick))
    t.plans[(64, 2048, 2560, False, torch.bfloat16, (256, 256, 256))] = tuned_gemm.Plan(mine, first, {}, (first, mine))
    t.plans[(8, 2048, 2048, False, torch.bfloat16, (256, 256, 256))] = tuned_gemm.Plan(first, first, {}, (first,))
    assert t.summary() == [
        "rows 256 K 11008 N 2048 +=: heuristic 3, split-K 3 reduction 2 29.2 us against PyTorch's 34.1 us, the "
        "heuristic's first 34.5 us (3 candidates)",
        "rows 64 K 2048 N 2560: pytorch 34.1 us against PyTorch's 34.1 us, the heuristic's first 34.5 us (2 candidates)",
        "rows 8 K 2048 N 2048: heuristic 0 34.5 us against the heuristic's first 34.5 us (1 candidates)"]


@pytest.mark.parametrize("shape, dense", [((4, 8), True), ((1, 8), True), ((4, 8, 1), False)])
def test_only_back_to_back_rows_are_handed_to_cublaslt(shape, dense):
    t = torch.zeros(*shape)
    assert tuned_gemm._dense(t) is dense
    if dense and shape[0] > 1:
        assert not tuned_gemm._dense(torch.zeros(8, shape[0]).t())  # a transposed view


class Recorder:
    """Stands in for ``TunedGemm``: records each product's shapes and in-place flag, computes PyTorch's."""

    def __init__(self):
        self.calls = []

    def mm(self, x, w):
        self.calls.append(("mm", tuple(x.shape), tuple(w.shape)))
        return torch.mm(x, w.t())

    def addmm_(self, h, x, w):
        self.calls.append(("addmm_", tuple(x.shape), tuple(w.shape)))
        return h.addmm_(x, w.t())


def test_the_step_hands_o_and_down_in_place_to_the_tuned_products():
    """On the CPU the default step adds o and down into the residual in place (the norms are not folded there, so
    gate|up and q|k|v stay in the pieces): both go to ``fns.tuned`` in every layer, with the logits unchanged."""
    from rollout.executors.decode import FastStep

    model = tiny_model("qwen2", seed=31)
    cfg = model.config
    base = FastStep(model, KernelConfig(), mirror_weights=False).parts(torch.device("cpu"), mirrored=False)
    assert base.fns.tuned is None and base.fns.residual_in_place
    rows = 3
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    keys, values, *args = _step_inputs(model, rows, 6)
    rec = Recorder()
    with torch.no_grad():
        got = decode_logits(dataclasses.replace(base, fns=dataclasses.replace(base.fns, tuned=rec)), keys.clone(),
                            values.clone(), *args)
        want = decode_logits(base, keys.clone(), values.clone(), *args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    o = ("addmm_", (rows, cfg.num_attention_heads * head_dim), (hidden, cfg.num_attention_heads * head_dim))
    down = ("addmm_", (rows, inter), (hidden, inter))
    assert rec.calls == [o, down] * cfg.num_hidden_layers


def test_folded_norms_hand_qkv_and_gate_up_too():
    """With the norms folded (a CUDA default, forced here with the eager stand-ins of its kernels) q|k|v and gate|up
    are plain products as well: four per layer, in the step's order."""
    from rollout.executors.decode import FastStep
    from rollout.ops import rms_scaled

    model = tiny_model("llama", seed=32)
    cfg = model.config
    step = FastStep(model, KernelConfig(), mirror_weights=False)
    step._folds = lambda device, rotary: (True, True)
    parts = step.parts(torch.device("cpu"), mirrored=False)
    rec = Recorder()
    fns = dataclasses.replace(parts.fns, tuned=rec, rotary_write_rms=rms_scaled.rotary_write_rms_reference,
                              silu_mul_rms=rms_scaled.silu_mul_rms_reference)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    keys, values, *args = _step_inputs(model, 2, 4)
    with torch.no_grad():
        decode_logits(dataclasses.replace(parts, fns=fns), keys, values, *args)
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["mm", "addmm_", "mm", "addmm_"] * cfg.num_hidden_layers
    qkv_n = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    assert rec.calls[0][2] == (qkv_n, cfg.hidden_size) and rec.calls[2][2] == (2 * cfg.intermediate_size,
                                                                               cfg.hidden_size)


def test_the_setting_is_accepted_named_and_inert_on_the_cpu():
    assert TUNED_BLAS in BLAS_LIBRARIES
    with pytest.raises(ValueError, match="kernels.blas_library"):
        KernelConfig(blas_library="cublaslt-autotuned")
    model = tiny_model("qwen2", seed=33)
    ids, mask = random_prompts(2, 6, seed=2, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    outs = []
    for name in (TUNED_BLAS, "cublaslt"):
        ro = Rollout(model, tok, RolloutConfig(route="ordinary", kernels=KernelConfig(blas_library=name)))
        seen, build = [], ro.runner.fast_step.parts

        def parts(device, mirrored):
            got = build(device, mirrored)
            seen.append(got.fns.tuned)
            return got

        ro.runner.fast_step.parts = parts
        outs.append(ro.generate(RolloutRequest(ids, mask), sampling).input_ids)
        assert seen and all(t is None for t in seen)  # no tuned products off CUDA
        assert ro.last_stats.blas_library == ""  # nothing chosen off CUDA
    assert torch.equal(outs[0], outs[1])


def test_a_calls_stats_count_the_tuning_it_did(monkeypatch):
    """``CallStats.blas_tune_ms`` and ``blas_untuned``: the tuner's growth during the call, 0 without a tuner."""
    assert blas.tuner_of("cublaslt", torch.device("cuda", 0)) is None
    assert blas.tuner_of(TUNED_BLAS, torch.device("cpu")) is None
    assert blas.tuner_of(TUNED_BLAS, torch.device("cuda", 0)) is tuned_gemm.tuner(0)  # no CUDA call to get it
    fake = TunedGemm(0)
    fake.tune_s, fake.untuned_in_capture = 2.0, 5  # an earlier call's tuning is not this call's
    monkeypatch.setattr(blas, "tuner_of", lambda name, device: fake if name == TUNED_BLAS else None)
    model = tiny_model("qwen2", seed=33)
    ids, mask = random_prompts(2, 6, seed=2, vocab_size=model.config.vocab_size, min_len=3)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None),
                 RolloutConfig(route="ordinary", kernels=KernelConfig(blas_library=TUNED_BLAS)))
    executor = ro.runner.executors["ordinary"]
    route_run = executor.run

    def run(call):  # the route tunes two shapes, 0.25 s, and meets one inside a capture
        fake.tune_s += 0.25
        fake.untuned_in_capture += 1
        return route_run(call)

    monkeypatch.setattr(executor, "run", run)
    ro.generate(RolloutRequest(ids, mask), sampling)
    assert ro.last_stats.blas_tune_ms == pytest.approx(250.0) and ro.last_stats.blas_untuned == 1
    ro.generate(RolloutRequest(ids, mask), sampling)  # the next call: its own growth only
    assert ro.last_stats.blas_tune_ms == pytest.approx(250.0) and ro.last_stats.blas_untuned == 1
    plain = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig(route="ordinary"))
    plain.generate(RolloutRequest(ids, mask), sampling)
    assert plain.last_stats.blas_tune_ms == 0.0 and plain.last_stats.blas_untuned == 0


def test_blas_context_sets_cublaslt_for_the_tuned_name(monkeypatch):
    state = {"value": "cublas", "sets": []}

    class Backend:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return f"_BlasBackend.{self.name.capitalize()}"

    def fake(backend=None):
        if backend is not None:
            name = getattr(backend, "name", backend)
            state["sets"].append(name)
            state["value"] = name
        return Backend(state["value"])

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", fake)
    with blas.blas_library(TUNED_BLAS, torch.device("cuda")) as in_effect:
        assert in_effect == TUNED_BLAS and state["value"] == "cublaslt"
    assert state["sets"] == ["cublaslt", "cublas"]
    state.update(value="cublaslt", sets=[])
    with blas.blas_library(TUNED_BLAS, torch.device("cuda")) as in_effect:
        assert in_effect == TUNED_BLAS
    assert state["sets"] == []


@cuda
@pytest.mark.parametrize("rows, k, n, residual", [(256, 11008, 2048, True), (64, 2048, 2560, False),
                                                  (8, 2048, 2048, True)])
def test_cuda_tuned_products_equal_pytorchs_also_in_a_graph(rows, k, n, residual):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
    h0 = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    t = TunedGemm(torch.cuda.current_device())
    want = (h0.float() + (x @ w.t()).float()) if residual else (x @ w.t()).float()
    h = h0.clone()
    got = t.addmm_(h, x, w) if residual else t.mm(x, w)
    assert t.failure is None and len(t.plans) == 1
    plan = next(iter(t.plans.values()))
    assert plan.chosen.rel_diff <= tuned_gemm.TOLERANCE and plan.pytorch is not None
    assert plan.chosen.ms <= plan.pytorch.ms and (plan.algo is None) == (plan.chosen.source == tuned_gemm.PYTORCH)
    if plan.algo is None:  # PyTorch kept the shape: its product exactly
        torch.testing.assert_close(got, (h0.clone().addmm_(x, w.t()) if residual else x @ w.t()), rtol=0, atol=0)
    scale = want.abs().max()
    assert float((got.float() - want).abs().max() / scale) <= tuned_gemm.TOLERANCE
    # replayed from a CUDA graph: the plan is reused, the product the same
    h.copy_(h0)
    out = {}

    def work():
        out["y"] = t.addmm_(h, x, w) if residual else t.mm(x, w)

    from rollout.executors.graphs import capture_graph
    graph = capture_graph(work, [], torch.cuda.graph_pool_handle())
    h.copy_(h0)
    graph.replay()
    torch.cuda.synchronize()
    assert len(t.plans) == 1 and t.untuned_in_capture == 0
    torch.testing.assert_close(out["y"].float(), got.float(), rtol=0, atol=0)
