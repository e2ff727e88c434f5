"""``rollout/ops/split_k.py``: ``out += x @ weight.T`` as inner-dimension chunks (a batched GEMM with fp32 outputs, then
one sum kernel with the residual), on the CPU through Triton's interpreter, on CUDA compiled. The kernel equals its
PyTorch reference (same order of additions), the result equals ``addmm_``'s up to the sum's order, the chunks are
views (no copy), what cannot run falls back to ``addmm_``, and a decode step with the down projection split gives the
step's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout.config import KernelConfig
from rollout.executors.decode import FastStep
from rollout.model.step import decode_logits
from rollout.ops import split_k
from rollout.testing import tiny_model
from tests.test_decode_attention import device  # noqa: F401 - the fixture


def _inputs(rows, inner, outer, dtype, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, inner, generator=gen) / inner ** 0.5).to(dtype).to(dev)
    weight = torch.randn(outer, inner, generator=gen).to(dtype).to(dev)
    residual = torch.randn(rows, outer, generator=gen).to(dtype).to(dev)
    return residual, x, weight


@pytest.mark.parametrize("rows,inner,outer,splits", [(3, 64, 48, 4), (8, 96, 100, 2), (1, 1376, 40, 8),
                                                     (5, 2046, 24, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_reference_and_addmm(device, rows, inner, outer, splits, dtype):
    residual, x, weight = _inputs(rows, inner, outer, dtype, device, seed=rows + splits)
    assert split_k.unsupported_reason(residual, x, weight, splits, interpret=True) is None
    got = split_k.addmm_split_(residual.clone(), x, weight, splits, interpret=True)
    ref = split_k.addmm_split_reference(residual.clone(), x, weight, splits)
    plain = residual.clone().addmm_(x, weight.t())
    assert got.shape == residual.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=0, atol=0 if device == "cpu" else 1e-5)
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    else:  # one rounding into bf16 from fp32 sums in another order (the interpreter truncates where CUDA rounds)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), plain.float(), rtol=1e-2, atol=1e-2)


def test_the_chunks_are_views_of_the_operands():
    x = torch.arange(24.0).view(2, 12)
    weight = torch.arange(36.0).view(3, 12)
    xs, ws = split_k.chunks(x, weight, 3)
    assert xs.shape == (3, 2, 4) and ws.shape == (3, 4, 3)
    assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == weight.data_ptr()
    for s in range(3):
        assert torch.equal(xs[s], x[:, 4 * s:4 * s + 4]) and torch.equal(ws[s], weight[:, 4 * s:4 * s + 4].t())
    torch.testing.assert_close(split_k.partial_products(x, weight, 3).sum(0), x @ weight.t())


@pytest.mark.parametrize("case,reason", [
    (lambda r, x, w: (r, x, w, 1), "one split"),
    (lambda r, x, w: (r, x, w, 5), "5 splits do not divide the inner dimension 64"),
    (lambda r, x, w: (r, x.t().contiguous().t(), w, 4), "must be 2-D with contiguous rows"),
    (lambda r, x, w: (r[:, :40], x, w, 4), "must be 2-D with contiguous rows"),
    (lambda r, x, w: (r[:2], x, w, 4), "do not match"),
])
def test_what_cannot_run_falls_back_to_addmm(case, reason):
    residual, x, weight = _inputs(3, 64, 48, torch.float32, "cpu")
    out, x, weight, splits = case(residual.clone(), x, weight)
    assert reason in split_k.unsupported_reason(out, x, weight, splits, interpret=True)
    if out.shape == (x.shape[0], weight.shape[0]):
        expected = out.clone().addmm_(x, weight.t())
        torch.testing.assert_close(split_k.addmm_split_(out, x, weight, splits, interpret=True), expected)
    assert split_k.unsupported_reason(residual, x, weight, 4) == "not a CUDA tensor" or torch.cuda.is_available()


def test_a_decode_step_with_the_down_projection_split_gives_the_steps_logits(device):
    """fp32, the step's eager pieces with the residual added in place: the same logits with ``StepFns.add_down`` as
    the split kernel (4 chunks of the tiny model's intermediate size), which every layer calls."""
    model = tiny_model("qwen2", seed=3).to(device)
    parts = FastStep(model, KernelConfig(compile=False), mirror_weights=False).parts(torch.device(device),
                                                                                      mirrored=False)
    parts = dataclasses.replace(parts, fns=dataclasses.replace(parts.fns, residual_in_place=True))
    calls = []

    def split(h, act, down):
        calls.append(act.shape)
        return split_k.addmm_split_(h, act, down, 4, interpret=True)

    spec = parts.spec
    gen = torch.Generator().manual_seed(0)
    rows, live = 3, 7
    cache = torch.randn(2, spec.num_layers, rows, spec.num_kv_heads, live + 2, spec.head_dim, generator=gen).to(device)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen).to(device)
    positions = torch.full((rows,), live, device=device)
    keep = torch.ones(rows, 1, 1, live + 1, dtype=torch.bool, device=device)
    col = torch.tensor(live, device=device)
    logits = {}
    for name, fns in (("addmm", parts.fns), ("split", dataclasses.replace(parts.fns, add_down=split))):
        keys, values = cache[0].clone(), cache[1].clone()
        logits[name] = decode_logits(dataclasses.replace(parts, fns=fns), keys, values, tokens, positions, col, keep)
    assert len(calls) == spec.num_layers and all(shape == (rows, model.config.intermediate_size) for shape in calls)
    torch.testing.assert_close(logits["split"], logits["addmm"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,in_place,expected", [(256, True, 256), (0, True, None), (256, False, None)])
def test_config_decides_the_piece(monkeypatch, rows, in_place, expected):
    """``RolloutConfig.kernels.down_split_rows`` puts :func:`split_k.add_down` in a CUDA call's step (built without a GPU
    here) with its row threshold; only with the residual added in place, never on the CPU; it splits from that many
    rows on and leaves fewer rows to ``addmm_``."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    from rollout import KernelConfig as Kernels, Rollout, RolloutConfig
    from rollout.model import step
    from rollout.testing import TinyTokenizer
    step.compiled_step_fns.cache_clear()
    try:
        ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(),
                     RolloutConfig(kernels=Kernels(down_split_rows=rows, residual_in_place=in_place)))
        fns = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False).fns
        if expected is None:
            assert fns.add_down is None
        else:
            assert fns.add_down.func is split_k.add_down and fns.add_down.keywords == {"min_rows": expected}
        assert ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False).fns.add_down is None
    finally:
        step.compiled_step_fns.cache_clear()


def test_add_down_splits_from_its_row_threshold(monkeypatch):
    calls = []
    monkeypatch.setattr(split_k, "addmm_split_", lambda out, x, w, splits, interpret: calls.append(splits) or out)
    residual, x, weight = _inputs(4, 64, 48, torch.float32, "cpu")
    expected = residual.clone().addmm_(x, weight.t())
    torch.testing.assert_close(split_k.add_down(residual.clone(), x, weight, min_rows=5), expected)
    assert calls == []
    split_k.add_down(residual.clone(), x, weight, min_rows=4)
    assert calls == [split_k.DOWN_SPLITS]
