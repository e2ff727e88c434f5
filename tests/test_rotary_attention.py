"""``RolloutConfig.kernels.rotary_in_attention_rows``: the decode attention kernel rotates its own queries from the q|k|v
product and writes the step's k and v into the cache (``rollout/ops/rotary_attention.py``; on the CPU through
Triton's interpreter, on CUDA compiled).

Its output and both caches equal the rotary kernel followed by the attention kernel (bitwise under the interpreter)
for every split of the window, a window that starts after column 0, a ``last`` column, rows with nothing kept,
rows reading their prompt from their run's first row, with and without bias; what it cannot take runs the two
kernels; a failing launch warns once and runs them; the step built on it gives HF generate's greedy tokens (fp32) on
both routes with it in every decode layer, and the unfused step's seeded samples; steps of fewer rows than the setting
run the rotary kernel; the setting picks it only where the folded rotary and the Triton attention run."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from rollout import KernelConfig, Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.model import step
from rollout.model.pieces import rotary
from rollout.ops import decode_attention as da
from rollout.ops import rms_scaled as rs
from rollout.ops import rotary_attention as ra
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import counter, hf_greedy, response_of, with_step_pieces
from tests.test_decode_attention import device  # noqa: F401 - the fixture
from tests.test_fold_norms import _gained

NO_EOS = TinyTokenizer(pad_token_id=0, eos_token_id=None)
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    heads: int = 4
    kv_heads: int = 2
    dim: int = 16
    hidden: int = 64
    bias: bool = True
    rows: int = 3
    capacity: int = 40
    start: int = 0
    stop: int = 40
    col: int = 30
    splits: int | None = None
    last: int | None = None
    nothing_kept: tuple = ()


def _inputs(case: Case, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = (case.heads + 2 * case.kv_heads) * case.dim
    h = (torch.randn(case.rows, case.hidden, generator=gen) * 3).to(dtype).to(device)
    product = torch.randn(case.rows, width, generator=gen).to(dtype).to(device)
    bias = torch.randn(width, generator=gen).to(dtype).to(device) if case.bias else None
    inv_freq = 1.0 / (10000 ** (torch.arange(0, case.dim, 2).float() / case.dim))
    cos, sin = rotary(torch.randint(0, 500, (case.rows,), generator=gen).to(device), inv_freq.to(device), 1.0, dtype)
    cache = torch.randn(2, case.rows, case.kv_heads, case.capacity + 3, case.dim, generator=gen).to(dtype)
    keep = torch.rand(case.rows, 1, 1, case.stop - case.start, generator=gen) > 0.3
    keep[..., case.col - case.start] = True
    keep[0, ..., : (case.stop - case.start) // 3] = False  # left padding
    if case.last is not None:
        keep[..., case.last + 1:] = False
    for row in case.nothing_kept:
        keep[row] = False
    return h, product, bias, cos, sin, cache.to(device), keep.to(device)


def _both(case: Case, dtype, device, shared=None, seed=0, kernel_runs=True):
    """(fused output, its key and value caches), (the two kernels' output, their caches), on copies of one cache
    (strided views of the layer, as the static cache's). ``kernel_runs``: the fused kernel takes the inputs."""
    h, product, bias, cos, sin, cache, keep = _inputs(case, dtype, device, seed)
    cols = torch.tensor([case.col], device=device)
    last = None if case.last is None else torch.tensor(case.last, device=device)
    common = dict(keep=keep, scale=case.dim ** -0.5, eps=EPS, heads=case.heads, kv_heads=case.kv_heads,
                  head_dim=case.dim, start=case.start, stop=case.stop, last=last, shared=shared, splits=case.splits,
                  interpret=True)
    out = []
    for fused in (True, False):
        copy = cache.clone()
        k, v = copy[0, :, :, 1:case.capacity + 1], copy[1, :, :, 1:case.capacity + 1]
        if fused:
            why = ra.unsupported_reason(product, h, k, v, keep, heads=case.heads, head_dim=case.dim, start=case.start,
                                        stop=case.stop, shared=shared, interpret=True)
            assert (why is None) == kernel_runs
            got = ra.rotary_attention(product, h, bias, cos, sin, k, v, cols, **common)
        else:
            q = rs.rotary_write_rms(product, h, bias, cos, sin, k, v, cols, eps=EPS, heads=case.heads,
                                    kv_heads=case.kv_heads, head_dim=case.dim, interpret=True)
            got = da.attention(q, k[:, :, case.start:case.stop], v[:, :, case.start:case.stop], keep,
                               case.dim ** -0.5, case.heads != case.kv_heads, splits=case.splits, interpret=True,
                               last=last, shared=shared)
        out.append((got, k, v))
    return out


def _assert_same(fused, apart, device, dtype):
    if device == "cpu":  # the interpreter: the same arithmetic in the same order
        for mine, theirs in zip(fused, apart):
            assert torch.equal(mine, theirs)
        return
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(fused, apart):
        torch.testing.assert_close(mine.float(), theirs.float(), **tol)


CASES = [
    Case(),
    Case(splits=3),                                   # the column in the last share
    Case(splits=4, col=5, stop=40, capacity=40),      # ... in the first share
    Case(bias=False, splits=2, start=6, stop=38, col=20),  # a window after column 0
    Case(heads=16, kv_heads=2, dim=128, hidden=256, capacity=300, stop=200, col=150, splits=3, last=160),
    Case(heads=6, kv_heads=6, dim=32, hidden=200, bias=False, capacity=70, start=5, stop=69, col=10, splits=4,
         nothing_kept=(1,)),                          # a row with nothing kept still writes its column
    Case(rows=5, capacity=130, stop=130, col=129, splits=None, last=129),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_equals_the_rotary_kernel_then_the_attention(device, case, dtype):
    fused, apart = _both(case, dtype, device, seed=case.col + case.heads)
    assert ra.failure(torch.device(device)) is None
    _assert_same(fused, apart, device, dtype)
    got, k, _ = fused
    assert got.shape == (case.rows, case.heads, 1, case.dim) and got.dtype == dtype


def test_rows_reading_their_prompt_from_the_first_row(device):
    """``SharedPrefix.first_row``: the prompt's tiles come from each run's first row, the step's column is written into
    each row's own copy."""
    case = Case(rows=6, capacity=100, stop=100, col=80, splits=2)
    ids = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
    shared = da.SharedPrefix(ids, 3, torch.tensor(64, device=device), first_row=True)
    fused, apart = _both(case, torch.float32, device, shared=shared, seed=7)
    _assert_same(fused, apart, device, torch.float32)


def test_a_prompt_read_in_a_pass_of_its_own_runs_the_two_kernels(device):
    case = Case(rows=4, capacity=100, stop=100, col=80)
    shared = da.SharedPrefix(torch.arange(4, device=device), 4, torch.tensor(64, device=device))
    h, product, _, _, _, cache, keep = _inputs(case, torch.float32, device)
    k, v = cache[0, :, :, 1:101], cache[1, :, :, 1:101]
    why = ra.unsupported_reason(product, h, k, v, keep, heads=4, head_dim=16, start=0, stop=100, shared=shared,
                                interpret=True)
    assert why == "the prompts are read in a pass of their own"
    fused, apart = _both(case, torch.float32, device, shared=shared, seed=2, kernel_runs=False)
    _assert_same(fused, apart, device, torch.float32)
    with pytest.raises(ValueError, match="rotary"):
        da.launch(product[:, :64].view(4, 4, 1, 16), k, v, keep, 0.25, shared=shared,
                  rotary=da.RotaryInputs(h, None, h[:, :16], h[:, :16], torch.tensor([80]), 0, EPS))


def test_inputs_it_cannot_take_are_named():
    case = Case()
    h, product, _, _, _, cache, keep = _inputs(case, torch.float32, "cpu")
    k, v = cache[0, :, :, 1:41], cache[1, :, :, 1:41]
    shape = dict(heads=4, head_dim=16, start=0, stop=40)
    assert ra.unsupported_reason(product, h, k, v, keep, **shape) in ("not a CUDA tensor", da.available())
    if da.available() is None:
        assert ra.unsupported_reason(product.bfloat16(), h, k, v, keep, **shape, interpret=True).startswith(
            "product dtype torch.bfloat16")
        assert "boolean" in ra.unsupported_reason(product, h, k, v, keep.float(), **shape, interpret=True)


def test_a_failing_launch_warns_once_and_runs_the_two_kernels(device, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no fused kernel here")

    monkeypatch.setattr(da, "launch", broken)
    monkeypatch.setattr(ra, "_FAILED", {})
    with pytest.warns(RuntimeWarning, match="no fused kernel here"):
        fused, apart = _both(Case(splits=2), torch.float32, device, seed=4)
    _assert_same(fused, apart, device, torch.float32)
    h, product, _, _, _, cache, keep = _inputs(Case(), torch.float32, device)
    assert "no fused kernel here" in ra.failure(product.device)
    assert "no fused kernel here" in ra.unsupported_reason(product, h, cache[0], cache[1], keep, heads=4, head_dim=16,
                                                           start=0, stop=40, interpret=True)


def _forced(ro, rows: int = 1):
    """``ro``'s step folds the q|k|v norm on the CPU and runs the interpreted fused kernel (counted) in steps of at
    least ``rows`` rows, the interpreted rotary kernel (counted) and Triton attention in smaller ones."""
    ro.runner.fast_step._folds = lambda device, rotary_kernel: (True, False)
    calls = {"fused": 0, "rotary": 0}
    counted = counter(calls)
    with_step_pieces(ro, rotary_write_rms=counted("rotary", functools.partial(rs.rotary_write_rms, interpret=True)),
                     rotary_attention=counted("fused", functools.partial(ra.rotary_attention, interpret=True)),
                     attention=functools.partial(da.attention, interpret=True), rotary_attention_rows=rows)
    return calls


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, none
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_step_with_the_fused_kernel_gives_hf_greedy_tokens(device, family, route):
    model = _gained(tiny_model(family, seed=41), seed=5).to(device)
    ids, mask = random_prompts(3, 8, seed=4, vocab_size=model.config.vocab_size, min_len=2)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, NO_EOS, RolloutConfig(route=route, kernels=KernelConfig(cuda_graphs=False)))
    calls = _forced(ro)
    new = 6
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=new, temperature=0.0,
                                                                continuous_batch_size=2))
    layers = model.config.num_hidden_layers
    assert calls["fused"] >= (new - 1) * layers and calls["fused"] % layers == 0
    assert calls["rotary"] == 0  # every decode layer through the fused kernel
    for row in range(ids.shape[0]):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], new)


def test_step_with_the_fused_kernel_samples_as_the_rotary_kernel_step(device):
    model = _gained(tiny_model("qwen2", seed=42), seed=6).to(device)
    ids, mask = random_prompts(3, 8, seed=9, vocab_size=model.config.vocab_size, min_len=3)
    ids, mask = ids.to(device), mask.to(device)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, n_samples_per_prompt=2, seed=5)
    runs = []
    for fused in (True, False):
        ro = Rollout(model, NO_EOS, RolloutConfig(kernels=KernelConfig(cuda_graphs=False)))
        calls = _forced(ro)
        if not fused:
            with_step_pieces(ro, rotary_attention=None)
        runs.append(ro.generate(RolloutRequest(ids, mask), sampling).input_ids)
        assert (calls["fused"] > 0) == fused and (calls["rotary"] > 0) != fused
    assert torch.equal(runs[0], runs[1])


def test_steps_below_the_row_threshold_run_the_rotary_kernel(device):
    """``rotary_in_attention_rows`` above a call's rows: every decode layer runs the rotary kernel, none the fused one;
    at 1, the fused one; the tokens alike."""
    model = _gained(tiny_model("qwen2", seed=44), seed=7).to(device)
    ids, mask = random_prompts(3, 8, seed=3, vocab_size=model.config.vocab_size, min_len=2)
    ids, mask = ids.to(device), mask.to(device)
    outs = []
    for rows, fused in ((64, False), (1, True)):  # the call's steps: a few rows (padded to a bucket)
        ro = Rollout(model, NO_EOS, RolloutConfig(route="ordinary", kernels=KernelConfig(cuda_graphs=False)))
        calls = _forced(ro, rows=rows)
        outs.append(ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=0.0)))
        assert (calls["fused"] > 0) == fused and (calls["rotary"] > 0) != fused
    assert torch.equal(outs[0].input_ids, outs[1].input_ids)


def test_setting_picks_the_fused_kernel_only_where_its_two_halves_run(monkeypatch):
    """CUDA parts (built without a GPU here) carry it with folded norms and the Triton attention; not with the setting
    off, SDPA, unfolded norms or on the CPU; the setting is a bool."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    step.compiled_step_fns.cache_clear()
    cuda = torch.device("cuda")
    try:
        model = tiny_model("qwen2", seed=43)

        def fns(device=cuda, **kernels):
            ro = Rollout(model, TinyTokenizer(), RolloutConfig(kernels=KernelConfig(**kernels)))
            return ro.runner.fast_step.parts(device, mirrored=False).fns

        default = fns()
        assert default.rotary_attention is ra.rotary_attention
        assert default.rotary_attention_rows == KernelConfig().rotary_in_attention_rows
        assert fns(rotary_in_attention_rows=8).rotary_attention_rows == 8
        assert fns(rotary_in_attention_rows=0).rotary_attention is None
        assert fns(rotary_in_attention_rows=0).rotary_write_rms is rs.rotary_write_rms
        assert fns(decode_attention="sdpa").rotary_attention is None
        assert fns(fold_norms=False).rotary_attention is None
        assert fns(torch.device("cpu")).rotary_attention is None
    finally:
        step.compiled_step_fns.cache_clear()
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="kernels.rotary_in_attention_rows"):
            KernelConfig(rotary_in_attention_rows=bad)
