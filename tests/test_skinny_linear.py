"""The small-batch projections of ``rollout/ops/skinny_linear.py``: on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest without CUDA), on CUDA compiled. Each fused form (RMSNorm first, bias,
SiLU·mul over a gate|up weight, residual add) equals the step's own arithmetic; uneven shapes and every launch
shape give the same result; inputs it does not take run in PyTorch, bad ones are refused; the step built on it
gives HF generate's greedy tokens (fp32) with each layer's o projection on the kernel; ``RolloutConfig.kernels.skinny_rows``
decides where it runs."""

from __future__ import annotations

import functools

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.ops import rotary_write as rw
from rollout.ops import skinny_linear as sl
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import with_step_pieces
from tests.test_decode_attention import device  # noqa: F401 - the fixture

FORMS = {
    "plain": {},
    "bias": {"bias": True},
    "norm": {"norm": True},
    "residual": {"residual": True},
    "norm+glu": {"norm": True, "glu": True},
    "norm+bias+residual": {"norm": True, "bias": True, "residual": True},
}


def _case(rows, k, n, dtype, dev, form, seed=0):
    gen = torch.Generator().manual_seed(seed)
    glu = form.get("glu", False)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    weight = (torch.randn(2 * n if glu else n, k, generator=gen) * k ** -0.5).to(dtype).to(dev)
    kwargs = {"glu": glu}
    if form.get("bias"):
        kwargs["bias"] = torch.randn(n, generator=gen).to(dtype).to(dev)
    if form.get("norm"):
        kwargs.update(norm=(torch.rand(k, generator=gen) + 0.5).to(dtype).to(dev), eps=1e-6)
    if form.get("residual"):
        kwargs["residual"] = torch.randn(rows, n, generator=gen).to(dtype).to(dev)
    return x, weight, kwargs


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (5, 100, 40), (16, 256, 32), (33, 96, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_form_equals_the_step_arithmetic(device, form, rows, k, n, dtype):
    x, weight, kwargs = _case(rows, k, n, dtype, device, FORMS[form], seed=rows + k)
    assert sl.unsupported_reason(x, weight, interpret=True) is None
    got = sl.skinny_linear(x, weight, interpret=True, block_n=16, block_k=64, **kwargs)
    expected = sl.skinny_linear_reference(x, weight, **kwargs)
    assert got.shape == expected.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # bf16: the sums' order differs from PyTorch's; a few units in the last place of the output's scale
        scale = float(expected.float().abs().max())
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.06 * scale)
        assert float((got.float() - expected.float()).abs().mean()) < 0.01 * scale


@pytest.mark.parametrize("block_n,block_k,warps", [(16, 16, 1), (32, 128, 4), (64, 32, 2)])
def test_launch_shapes_give_the_same_result(device, block_n, block_k, warps):
    x, weight, kwargs = _case(7, 200, 72, torch.float32, device, FORMS["norm+glu"], seed=3)
    got = sl.skinny_linear(x, weight, interpret=True, block_n=block_n, block_k=block_k, warps=warps, **kwargs)
    torch.testing.assert_close(got, sl.skinny_linear_reference(x, weight, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("rows,block_m", [(sl.MAX_ROWS + 9, 16), (40, 32), (128, 64)])
def test_tiled_rows_equal_the_step_arithmetic(device, form, rows, block_m):
    """Wide batches: rows cut into ``block_m`` tiles (the last one partial where rows do not divide), past the
    single tile's ``MAX_ROWS``."""
    x, weight, kwargs = _case(rows, 96, 40, torch.float32, device, FORMS[form], seed=rows)
    assert sl.unsupported_reason(x, weight, interpret=True, tiled=True) is None
    got = sl.skinny_linear(x, weight, interpret=True, block_m=block_m, block_n=16, block_k=32, **kwargs)
    torch.testing.assert_close(got, sl.skinny_linear_reference(x, weight, **kwargs), rtol=1e-5, atol=1e-5)


def test_block_m_must_be_a_power_of_two(device):
    x, weight, kwargs = _case(4, 32, 16, torch.float32, device, FORMS["plain"])
    for bad in (8, 48, 0):
        with pytest.raises(ValueError, match="block_m"):
            sl.skinny_linear(x, weight, interpret=True, block_m=bad, **kwargs)


def test_inputs_it_does_not_take_run_in_pytorch_and_bad_ones_are_refused(device):
    x, weight, kwargs = _case(sl.MAX_ROWS + 1, 32, 16, torch.float32, device, FORMS["norm"])
    assert "rows" in sl.unsupported_reason(x, weight, interpret=True)
    assert "block_m" in sl.unsupported_reason(x, weight, interpret=True)
    assert torch.equal(sl.skinny_linear(x, weight, interpret=True, **kwargs),
                       sl.skinny_linear_reference(x, weight, **kwargs))
    strided = torch.randn(4, 64, device=device)[:, ::2]
    assert "contiguous" in sl.unsupported_reason(strided, torch.randn(8, 32, device=device), interpret=True)
    with pytest.raises(ValueError, match="even number of rows"):
        sl.skinny_linear(torch.randn(2, 8, device=device), torch.randn(5, 8, device=device), glu=True, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        sl.skinny_linear(torch.randn(2, 8, device=device), torch.randn(4, 8, device=device),
                         residual=torch.randn(2, 3, device=device), interpret=True)
    if not torch.cuda.is_available():
        assert sl.unsupported_reason(torch.randn(2, 8), torch.randn(4, 8)) == "not a CUDA tensor"


def test_a_failing_kernel_warns_once_and_falls_back(device, monkeypatch):
    x, weight, kwargs = _case(3, 32, 16, torch.float32, device, FORMS["norm+bias+residual"])

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(sl, "_launch", broken)
    monkeypatch.setattr(sl, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="no kernel for you"):
        got = sl.skinny_linear(x, weight, interpret=True, **kwargs)
    assert torch.equal(got, sl.skinny_linear_reference(x, weight, **kwargs))
    assert sl.failure(x.device) is not None
    assert "no kernel for you" in sl.unsupported_reason(x, weight, interpret=True)


def _with_skinny(ro, rows_limit, calls):
    """The rollout's parts with the interpreted skinny projections and rotary kernel (the CPU has neither)."""
    def counted(*args, **kwargs):
        calls.append((args[0].shape[0], args[1].data_ptr(), kwargs.get("residual") is not None))
        return sl.skinny_linear(*args, **kwargs, interpret=True)

    with_step_pieces(ro, skinny_linear=counted, skinny_rows=rows_limit,
                     rotary_write=functools.partial(rw.rotary_write, interpret=True))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
def test_step_with_the_kernels_equals_hf_generate(device, family):
    """Our step with each layer's o projection and residual on the kernel gives HF generate's greedy tokens
    (fp32), rows with left padding; every layer of every decode step calls it once, at the batch's rows, with
    the o weight and the residual."""
    from tests.conftest import hf_greedy, response_of
    model = tiny_model(family, seed=5).to(device)
    ids, mask = random_prompts(3, 7, min_len=2, seed=9)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False)))
    calls = []
    _with_skinny(ro, 8, calls)
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert ro.last_stats.decode.path == "fast_eager"
    assert len(calls) == 5 * model.config.num_hidden_layers  # 5 decode steps
    o_weights = {w.o.data_ptr() for w in ro.runner.fast_step.parts(torch.device(device), mirrored=False).weights.layers}
    assert {rows for rows, _, _ in calls} == {4}  # the batch bucket of 3 rows
    assert {weight for _, weight, _ in calls} == o_weights and all(residual for _, _, residual in calls)
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


def test_batches_above_the_limit_keep_the_compiled_pieces(device):
    model = tiny_model("qwen2", seed=6).to(device)
    ids, mask = random_prompts(4, 6, min_len=2, seed=2)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False)))
    calls = []
    _with_skinny(ro, 3, calls)  # 4 rows > 3
    ro.generate(RolloutRequest(ids.to(device), mask.to(device)), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert calls == []


@pytest.mark.parametrize("rows,rotary,gate_up,expected", [(16, True, True, 16), (200, True, True, sl.MAX_ROWS),
                                                          (0, True, True, None), (16, False, True, None),
                                                          (16, True, False, None)])
def test_config_decides_the_piece(monkeypatch, rows, rotary, gate_up, expected):
    """``RolloutConfig.kernels.skinny_rows`` puts the kernels in a CUDA call's step (built without a GPU here), capped at
    ``MAX_ROWS``; only with the rotary kernel and fused gate|up, never on the CPU."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    from rollout.model import step
    step.compiled_step_fns.cache_clear()
    try:
        ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(),
                     RolloutConfig(kernels=KernelConfig(skinny_rows=rows, rotary_kernel=rotary, fuse_gate_up=gate_up)))
        fns = ro.runner.fast_step.parts(torch.device("cuda"), mirrored=False).fns
        if expected is None:
            assert fns.skinny_linear is None
        else:
            assert fns.skinny_linear is sl.skinny_linear and fns.skinny_rows == expected
        assert ro.runner.fast_step.parts(torch.device("cpu"), mirrored=False).fns.skinny_linear is None
    finally:
        step.compiled_step_fns.cache_clear()
