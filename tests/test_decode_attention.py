"""The Triton decode attention (``rollout/ops/decode_attention.py``): on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by conftest without CUDA; skipped where triton is missing), on
CUDA compiled. It equals SDPA with ``enable_gqa`` for every split of the key window, on strided cache views
and masks with left padding and holes; the step built on it gives HF generate's greedy tokens (fp32);
inputs it does not handle go to SDPA. Rows holding copies of one prompt read it once (``SharedPrefix``) and no
row reads past ``last``: NaN planted in what must not be read stays out of the output, and the ordinary route
keeps every token with both."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, KernelConfig
from rollout.ops import decode_attention as da
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of


@pytest.fixture
def device():
    """CUDA where there is one; else the CPU under the interpreter (skipped when triton cannot run)."""
    triton = pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not knobs.runtime.interpret:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    return "cpu"


def _inputs(rows, heads, kv_heads, length, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, rows, kv_heads, length + 11, dim, generator=gen).to(dtype)
    k, v = cache.to(device)[0, :, :, 5:5 + length], cache.to(device)[1, :, :, 5:5 + length]  # strided views
    q = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype).to(device)
    keep = torch.rand(rows, 1, 1, length, generator=gen) > 0.25
    keep[0, ..., : length // 2] = False  # left padding
    keep[..., -1] = True
    return q, k, v, keep.to(device)


def _sdpa(q, k, v, keep, heads, kv_heads):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep,
                                          scale=q.shape[-1] ** -0.5, enable_gqa=heads != kv_heads)


@pytest.mark.parametrize("heads,kv_heads,length,dim", [(4, 2, 70, 16), (16, 2, 150, 128), (6, 6, 5, 8),
                                                       (8, 1, 200, 32), (3, 3, 64, 24)])
@pytest.mark.parametrize("splits", [None, 1, 2, 5])
def test_equals_sdpa_fp32(device, heads, kv_heads, length, dim, splits):
    q, k, v, keep = _inputs(3, heads, kv_heads, length, dim, torch.float32, device, seed=heads + length)
    assert da.unsupported_reason(q, k, v, keep, interpret=True) is None
    got = da.attention(q, k, v, keep, dim ** -0.5, heads != kv_heads, splits=splits, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, _sdpa(q, k, v, keep, heads, kv_heads), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_sdpa_half(device, dtype):
    q, k, v, keep = _inputs(4, 16, 2, 300, 64, dtype, device, seed=3)
    expected = _sdpa(q, k, v, keep, 16, 2)
    for splits in (1, 3):
        got = da.attention(q, k, v, keep, 64 ** -0.5, True, splits=splits, interpret=True)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_row_with_nothing_kept_gives_zeros(device):
    q, k, v, keep = _inputs(3, 4, 2, 130, 16, torch.float32, device)
    keep[1] = False
    for splits in (1, 3):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        torch.testing.assert_close(got[[0, 2]], _sdpa(q, k, v, keep, 4, 2)[[0, 2]], rtol=1e-5, atol=1e-5)


def test_split_count():
    assert da.split_count(256, 2, 512, 132) == 1  # 512 programs already cover 132 SMs twice
    assert da.split_count(32, 2, 512, 132) == 4  # 8 tiles, at least 2 each
    assert da.split_count(8, 2, 128, 132) == 1  # 2 tiles: one split
    assert da.split_count(1, 1, 4096, 132) == 32  # one long window: 64 tiles over 32 programs
    assert da.split_count(4, 2, 1100, 132) == 9  # the long tail: a few rows over ~1k columns
    assert da.split_count(1024, 2, 40, 132) == 1


def test_falls_back_to_sdpa_where_it_does_not_apply():
    q, k, v, keep = _inputs(2, 4, 2, 9, 16, torch.float32, "cpu")
    assert da.unsupported_reason(q, k, v, keep) == "not a CUDA tensor" or da.available() is not None
    additive = torch.zeros(keep.shape).masked_fill_(~keep, -65504.0)
    assert "boolean" in da.unsupported_reason(q, k, v, additive, interpret=True) or da.available() is not None
    two_queries = torch.randn(2, 4, 2, 16)
    assert "[B, Hq, 1, D]" in (da.unsupported_reason(two_queries, k, v, keep, interpret=True) or "[B, Hq, 1, D]")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.25, enable_gqa=True)
    assert torch.equal(da.attention(q, k, v, additive, 0.25, True), expected)


def test_step_with_the_kernel_equals_hf_generate(device):
    """Our step with the kernel as its attention piece gives HF generate's greedy tokens (fp32); prompts of
    different lengths, so rows carry left padding."""
    from rollout.model.step import StepFns
    from tests.conftest import hf_greedy, response_of
    model = tiny_model("qwen2", seed=5).to(device)
    ids, mask = random_prompts(3, 7, min_len=2, seed=9)
    ids, mask = ids.to(device), mask.to(device)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False)))
    fns = dataclasses.replace(StepFns(), attention=functools.partial(da.attention, interpret=True))
    original = ro.runner.fast_step.parts
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fns.attention(*args, **kwargs)

    ro.runner.fast_step.parts = lambda dev, mirrored: dataclasses.replace(
        original(dev, mirrored), fns=dataclasses.replace(fns, attention=counted))
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert ro.last_stats.decode.path == "fast_eager"
    assert calls, "the step did not call the attention piece"
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


def test_left_padding_tiles_are_not_read(device):
    """Whole tiles before a row's first kept column are skipped: NaN there (never attended) cannot reach
    the output, where a kernel that read them would give NaN (0 x NaN)."""
    q, k, v, keep = _inputs(3, 4, 2, 150, 16, torch.float32, device, seed=7)
    expected = _sdpa(q, k, v, keep, 4, 2)  # row 0 keeps nothing before column 75
    k, v = k.clone(), v.clone()
    k[0, :, :da.BLOCK_L] = float("nan")
    v[0, :, :da.BLOCK_L] = float("nan")
    for splits in (1, 2):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block,splits", [(64, 1), (64, 2), (16, 3)])
def test_padding_inside_the_first_tile_is_not_read(device, block, splits):
    """A row's window starts at its first kept column, not at the tile edge before it: NaN in the padding columns
    of that tile (never attended) cannot reach the output; ``align=True`` (the window from the tile edge, as the
    first-row reads take it) reads them and gives NaN (0 x NaN), and where nothing is poisoned both equal SDPA."""
    q, k, v, keep = _inputs(3, 4, 2, 150, 16, torch.float32, device, seed=11)
    first = 75  # row 0 keeps nothing before column 75 (_inputs)
    assert not keep[0, ..., :first].any() and keep[0, ..., first:].any()
    expected = _sdpa(q, k, v, keep, 4, 2)
    for align in (False, True):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, block=block, align=align)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    k, v = k.clone(), v.clone()
    edge = first // block * block
    k[0, :, edge:first], v[0, :, edge:first] = float("nan"), float("nan")
    got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, block=block)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    aligned = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, block=block, align=True)
    assert torch.isnan(aligned[0]).all() and not torch.isnan(aligned[1:]).any()


@pytest.mark.parametrize("padding", [0, 5, 1030, 1499])
def test_long_padding_beyond_one_scan_block(device, padding):
    """Rows whose first kept column lies past the first mask block the kernel scans (``SCAN`` columns) or
    within its first tile: the same result as SDPA."""
    q, k, v, keep = _inputs(2, 4, 2, 1500, 16, torch.float32, device, seed=padding)
    keep[1, ..., :padding] = False
    keep[1, ..., padding:] = True
    for splits in (1, 4):
        got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True)
        torch.testing.assert_close(got, _sdpa(q, k, v, keep, 4, 2), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_fails_falls_back_to_sdpa_once(device, monkeypatch):
    """A kernel that cannot compile or launch (e.g. an unsupported GPU) warns once, returns SDPA's result,
    and leaves those inputs (and the device's later calls: ``attention_path``) to SDPA from then on."""
    from rollout.executors.decode import attention_path
    from rollout.ops import decode_attention_kernel as kernels

    monkeypatch.setattr(da, "_FAILED", {})
    calls = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError("no kernel image for this device")
            return launch

    monkeypatch.setattr(kernels, "decode_attention_split", Broken())
    q, k, v, keep = _inputs(3, 4, 2, 70, 16, torch.float32, device)
    with pytest.warns(RuntimeWarning, match="no kernel image"):
        got = da.attention(q, k, v, keep, 0.25, True, interpret=True)
    torch.testing.assert_close(got, _sdpa(q, k, v, keep, 4, 2), rtol=1e-5, atol=1e-5)
    assert "no kernel image" in da.unsupported_reason(q, k, v, keep, interpret=True)
    assert "no kernel image" in da.failure(q.device)
    da.attention(q, k, v, keep, 0.25, True, interpret=True)
    assert len(calls) == 1  # the second call went straight to SDPA
    if q.is_cuda:
        assert attention_path("triton", q.device) == "sdpa"


def test_gpus_before_sm80_use_sdpa(monkeypatch):
    """bf16 products need compute capability 8.0: older GPUs are refused before any launch."""
    q, k, v, keep = _inputs(2, 4, 2, 9, 16, torch.float32, "cpu")
    if da.available() is not None:
        pytest.skip(da.available())
    monkeypatch.setattr(da, "_capability", lambda index: (7, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert "compute capability (7, 0)" in da.unsupported_reason(q, k, v, keep)


def _shared_inputs(ids, samples, prefix_end, last, length=150, heads=4, kv_heads=2, dim=16, dtype=torch.float32,
                   device="cpu", seed=0):
    """Rows whose sample ids share ``id // samples`` get the same keys, values and mask in ``[0, prefix_end)``
    (the copies of one prompt); every row keeps ``last`` and nothing after it."""
    rows = len(ids)
    q, k, v, keep = _inputs(rows, heads, kv_heads, length, dim, dtype, "cpu", seed=seed)
    k, v = k.clone(), v.clone()
    first = {}
    for row, sample in enumerate(ids):
        lead = first.setdefault(sample // samples, row)
        k[row, :, :prefix_end], v[row, :, :prefix_end] = k[lead, :, :prefix_end], v[lead, :, :prefix_end]
        keep[row, ..., :prefix_end] = keep[lead, ..., :prefix_end]
    keep[..., last + 1:] = False
    keep[..., last] = True
    shared = da.SharedPrefix(torch.tensor(ids, dtype=torch.long, device=device), samples,
                             torch.tensor(prefix_end, device=device))
    return q.to(device), k.to(device), v.to(device), keep.to(device), shared, torch.tensor(last, device=device)


SHARED_LAYOUTS = [
    ([0, 1, 2, 3, 4, 5, 6, 7], 4, 70, 120),   # two prompts of four samples, in order
    ([0, 1, 5, 6, 3, 9, 2], 4, 70, 149),      # after compactions: runs of 2, 2, 1, 1 and a prompt split in two runs
    ([4, 5, 0, 2, 3, 1], 2, 33, 99),          # planned prompt order; one run cut by another prompt
    ([0, 1, 2, 3, 4], 3, 150, 149),           # the prefix is the whole window
    ([6, 7, 8, 0, 1, 2], 3, 0, 60),           # an empty prefix
]
"""Rows (their sample ids), samples per prompt, the prompts' end and the last column of the shared-prompt tests."""


@pytest.mark.parametrize("ids,samples,prefix_end,last", SHARED_LAYOUTS)
@pytest.mark.parametrize("splits,prefix_splits", [(None, None), (1, 1), (3, 2)])
def test_shared_prefix_equals_sdpa(device, ids, samples, prefix_end, last, splits, prefix_splits):
    """Rows holding copies of one prompt read it once (the prefix pass) and then their own columns: SDPA's
    result for every layout of runs, prefix length and split count of each pass (fp32)."""
    q, k, v, keep, shared, last_col = _shared_inputs(ids, samples, prefix_end, last, device=device, seed=len(ids))
    assert da.shares_prefix(shared, 4, 2)
    expected = _sdpa(q, k, v, keep, 4, 2)
    got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, last=last_col, shared=shared,
                       prefix_splits=prefix_splits)
    assert da.failure(q.device) is None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_shared_prefix_reads_one_copy_and_nothing_after_last(device):
    """NaN in every copy of a prompt but its run's first row, and after the last column, cannot reach the
    output: the prefix is read from one row per run, and the columns after ``last`` not at all (a kernel that
    read them would give NaN: 0 x NaN). Without ``shared`` the copies are read, so NaN shows in rows 5-7; rows 1-3
    attend none of their poisoned columns (row 0's prompt is left padding up to column 75), so theirs stay clean."""
    ids, samples, prefix_end, last = [0, 1, 2, 3, 4, 5, 6, 7], 4, 70, 120
    q, k, v, keep, shared, last_col = _shared_inputs(ids, samples, prefix_end, last, device=device, seed=3)
    expected = _sdpa(q, k, v, keep, 4, 2)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for row in (1, 2, 3, 5, 6, 7):
        poisoned_k[row, :, :prefix_end], poisoned_v[row, :, :prefix_end] = float("nan"), float("nan")
    poisoned_k[:, :, last + 1:], poisoned_v[:, :, last + 1:] = float("nan"), float("nan")
    for splits in (None, 1, 2):
        got = da.attention(q, poisoned_k, poisoned_v, keep, 0.25, True, splits=splits, interpret=True, last=last_col,
                           shared=shared)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    unshared = da.attention(q, poisoned_k, poisoned_v, keep, 0.25, True, interpret=True, last=last_col)
    assert torch.isnan(unshared[5:]).all() and not torch.isnan(unshared[:5]).any()


@pytest.mark.parametrize("ids,samples,prefix_end,last", SHARED_LAYOUTS)
@pytest.mark.parametrize("splits,block", [(None, 64), (3, 16)])
def test_prompt_from_the_first_row_is_the_unshared_result(device, ids, samples, prefix_end, last, splits, block):
    """Each row reading its prompt's columns from its run's first row (``SharedPrefix.first_row``) gives bitwise
    the kernel's result over every row's own copy in the same tiles (``align``: from the tile edge before the first
    kept column), and SDPA's within fp32 rounding, for every layout of runs, prefix length, split count and tile size
    (tile edges moved onto the prompt's end: with 16-column tiles and a prompt ending at column 70 the first tile
    starts before column 0)."""
    q, k, v, keep, shared, last_col = _shared_inputs(ids, samples, prefix_end, last, device=device, seed=len(ids))
    first_row = dataclasses.replace(shared, first_row=True)
    assert da.shares_prefix(first_row, 4, 2)
    got = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, last=last_col, shared=first_row,
                       block=block)
    own = da.attention(q, k, v, keep, 0.25, True, splits=splits, interpret=True, last=last_col, block=block,
                       align=True)
    assert da.failure(q.device) is None
    assert torch.equal(got, own)
    torch.testing.assert_close(got, _sdpa(q, k, v, keep, 4, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("samples,block", [(4, 64), (3, 16)])
def test_prompt_from_the_first_row_reads_no_other_copy(device, samples, block):
    """NaN in the prompt's whole tiles of every row but its run's first cannot reach the output (they are read from
    the first row only; the tile holding the prompt's end, from each row's own copy), and NaN after the prompt's
    end in the first rows reaches theirs only. Any number of samples is shared (no tile limit, unlike the prefix
    pass's 128 queries)."""
    ids, prefix_end, last = [0, 1, 2, 3, 4, 5, 6, 7], 70, 120
    q, k, v, keep, shared, last_col = _shared_inputs(ids, samples, prefix_end, last, device=device, seed=3)
    first_row = dataclasses.replace(shared, first_row=True)
    expected = _sdpa(q, k, v, keep, 4, 2)
    leads = [row for row in range(len(ids)) if row == 0 or ids[row - 1] // samples != ids[row] // samples]
    for poisoned_rows, cols in ((sorted(set(range(len(ids))) - set(leads)), slice(0, prefix_end // block * block)),
                                (leads, slice(prefix_end, None))):
        poisoned_k, poisoned_v = k.clone(), v.clone()
        poisoned_k[poisoned_rows, :, cols], poisoned_v[poisoned_rows, :, cols] = float("nan"), float("nan")
        clean = [row for row in range(len(ids)) if cols.start == 0 or row not in leads]
        for splits in (None, 1, 2):
            got = da.attention(q, poisoned_k, poisoned_v, keep, 0.25, True, splits=splits, interpret=True,
                               last=last_col, shared=first_row, block=block)
            torch.testing.assert_close(got[clean], expected[clean], rtol=1e-5, atol=1e-5)
            assert cols.start == 0 or torch.isnan(got[leads]).all()
    assert da.shares_prefix(da.SharedPrefix(shared.ids, 17, shared.end, True), 16, 2)
    assert not da.shares_prefix(da.SharedPrefix(shared.ids, 17, shared.end), 16, 2)
    assert not da.shares_prefix(da.SharedPrefix(shared.ids, 1, shared.end, True), 16, 2)


def test_shared_prefix_takes_one_prompt_end_for_every_row():
    """``SharedPrefix.end`` is one column for every row (a scalar tensor); an end per row is refused, not read as
    its first element."""
    ids = torch.arange(4)
    assert int(da.SharedPrefix(ids, 2, torch.tensor(5)).end) == 5
    with pytest.raises(ValueError, match="scalar"):
        da.SharedPrefix(ids, 2, torch.tensor([5, 5, 3, 3]))


def test_shared_prefix_bf16_and_the_tile_limit(device):
    """bf16 within rounding of SDPA; more samples x query heads than ``MAX_SHARED_QUERIES`` fall back to
    reading every row's copy (same result)."""
    ids = list(range(8))
    q, k, v, keep, shared, last_col = _shared_inputs(ids, 4, 40, 130, heads=16, kv_heads=2, dim=32,
                                                     dtype=torch.bfloat16, device=device, seed=11)
    expected = _sdpa(q, k, v, keep, 16, 2)
    got = da.attention(q, k, v, keep, 32 ** -0.5, True, interpret=True, last=last_col, shared=shared)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    wide = da.SharedPrefix(shared.ids, da.MAX_SHARED_QUERIES, shared.end)
    assert not da.shares_prefix(wide, 16, 2)
    got = da.attention(q, k, v, keep, 32 ** -0.5, True, interpret=True, last=last_col, shared=wide)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def _eos_setup(device, seed: int):
    """A tiny fp32 model, 6 left-padded prompts of up to 9 tokens, and 3 EOS ids among the tokens it generates
    greedily (so rows end at different steps)."""
    model = tiny_model("qwen2", seed=0).to(device)
    ids, mask = random_prompts(6, 9, min_len=1, seed=seed)
    ids, mask = ids.to(device), mask.to(device)
    free = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False))) \
        .generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10, temperature=0.0))
    eos = [token for token, _ in Counter(free.input_ids[:, 9:].flatten().tolist()).most_common(6)][3:6]
    return model, ids, mask, eos


def _assert_hf_greedy(out, model, ids, mask, eos, new: int, samples: int) -> None:
    """Every row's response is HF generate's greedy one for its prompt (row // samples), up to its EOS."""
    for row in range(ids.shape[0] * samples):
        expected = hf_greedy(model, ids[row // samples], mask[row // samples], new, eos=eos)
        assert response_of(out, row) == expected[:len(response_of(out, row))], f"row {row}"


def _same_tokens_and_hf_greedy(outputs, sampling, model, ids, mask, eos) -> None:
    """Two calls' outputs are equal, and (greedy) HF generate's per request."""
    assert torch.equal(outputs[0].input_ids, outputs[1].input_ids)
    assert torch.equal(outputs[0].attention_mask, outputs[1].attention_mask)
    if sampling.is_greedy:
        _assert_hf_greedy(outputs[0], model, ids, mask, eos, sampling.max_new_tokens, sampling.n_samples_per_prompt)


def _with_kernel(ro, shared_prefix_rows: int, calls: list, attention=None, lasts: list | None = None,
                 modes: list | None = None, ends: list | None = None, buckets: list | None = None):
    """``ro``'s step with ``shared_prefix_rows`` (and its ``kernels.shared_prefix_first_row_rows``, as on a GPU) and
    the kernel as its attention (interpreted on the CPU; ``attention``: another piece, e.g. SDPA); ``calls`` records
    whether each call was handed a ``SharedPrefix`` (``lasts`` whether it was handed the last column, ``modes`` each
    ``SharedPrefix.first_row``, ``ends`` its prompts' end column, ``buckets`` each call's rows). The fused rotary path
    (``StepFns.rotary_attention``, on CUDA from ``kernels.rotary_in_attention_rows`` rows) calls the kernel itself, not
    this piece, so it is off here."""
    original = ro.runner.fast_step.parts
    attend = attention or functools.partial(da.attention, interpret=True)

    def kernel(*args, **kwargs):
        calls.append(kwargs.get("shared") is not None)
        if buckets is not None:
            buckets.append(args[0].shape[0])
        if lasts is not None:
            lasts.append(kwargs.get("last") is not None)
        if modes is not None and kwargs.get("shared") is not None:
            modes.append(kwargs["shared"].first_row)
        if ends is not None and kwargs.get("shared") is not None:
            ends.append(int(kwargs["shared"].end))
        return attend(*args, **kwargs)

    ro.runner.fast_step.parts = lambda dev, mirrored: dataclasses.replace(
        original(dev, mirrored), fns=dataclasses.replace(
            original(dev, mirrored).fns, attention=kernel, rotary_attention=None, shared_prefix_rows=shared_prefix_rows,
            first_row_rows=ro.config.kernels.shared_prefix_first_row_rows))
    return ro


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=3),
    # sampled rows rarely end early, so every one of their steps runs all 18 rows through Triton's interpreter: 6 tokens
    # (8 took 37 s in make test's 2 processes on 2 cores; 6 take 25 s alone)
    SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7, n_samples_per_prompt=3),
], ids=["greedy", "sampled"])
def test_route_reading_each_prompt_once_keeps_every_token(device, sampling):
    """The ordinary route with the kernel reading each prompt's columns once for its samples, in a pass of their own
    (prompts of any length: ``kernels.shared_prefix_columns=1``) and, at the default ``shared_prefix_columns``, which
    these 9-column prompts are under, from the first row of each prompt's run (``shared_prefix_first_row_rows``; the
    prompts padded in front to end at a tile edge, ``shared_prefix_align``, and, greedy, not; and, greedy, only in
    steps of at most 16 rows), with prompts of different lengths and rows ending at different steps (compactions
    into smaller buckets): the same tokens as the kernel reading every row's copy, and, greedy, HF generate's per
    request (fp32). With ``shared_prefix_first_row_rows=0`` these prompts are not shared."""
    model, ids, mask, eos = _eos_setup(device, seed=3)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=eos)
    short_calls = []
    short = _with_kernel(Rollout(model, tok, RolloutConfig(route="ordinary", kernels=KernelConfig(
        cuda_graphs=False, shared_prefix_first_row_rows=0))), 1, short_calls, attention=da.sdpa)
    short.generate(RolloutRequest(ids, mask), sampling)
    assert ids.shape[1] < KernelConfig().shared_prefix_columns and short.last_stats.decode.shared_prefix_steps == 0
    assert short_calls and not any(short_calls)
    outputs, stats = [], []
    below, cap = KernelConfig().shared_prefix_columns, KernelConfig().shared_prefix_first_row_rows
    # (shared_prefix_rows, shared_prefix_columns, shared_prefix_align, shared_prefix_first_row_rows); the pass of
    # their own and the variants of the first-row reads greedy only (each sampled step runs all 18 rows through the
    # interpreter; the pass's kernel tests cover it)
    arms = ((1, 1, True, cap), (1, below, False, cap), (1, below, True, 16)) if sampling.is_greedy else ()
    for rows, columns, align, first_rows in arms + ((1, below, True, cap), (0, 1, True, cap)):
        calls, lasts, modes, ends, buckets = [], [], [], [], []
        ro = _with_kernel(Rollout(model, tok, RolloutConfig(route="ordinary", kernels=KernelConfig(
            cuda_graphs=False, shared_prefix_rows=rows, shared_prefix_columns=columns, shared_prefix_align=align,
            shared_prefix_first_row_rows=first_rows))), rows, calls, lasts=lasts, modes=modes, ends=ends,
            buckets=buckets)
        outputs.append(ro.generate(RolloutRequest(ids, mask), sampling))
        stats.append(ro.last_stats)
        first_row = columns > 1
        # every step of 18 rows (bucket 24) shares, but for the first-row reads only up to first_rows rows
        assert calls == [bool(rows) and (not first_row or b <= first_rows) for b in buckets], (buckets, calls)
        assert any(calls) == bool(rows) and all(lasts)  # every step stops at the current column
        assert set(modes) == ({first_row} if rows else set())  # first_row below shared_prefix_columns
        # the first-row reads' prompts end at a tile edge (the 9 columns padded to 64) unless told not to; the pass's
        # prompts are not padded
        assert set(ends) == ({da.BLOCK_L if first_row and align else ids.shape[1]} if rows else set())
        assert stats[-1].decode.shared_prefix_steps * model.config.num_hidden_layers == sum(calls)  # a call a layer
    for shared in stats[:-1]:
        assert shared.cache.compactions >= 1 or not sampling.is_greedy  # greedy rows end early (sampled ones rarely)
    assert stats[-1].decode.shared_prefix_steps == 0
    # the cache holds the padded prompts (64 columns) with the first-row reads, their own 9 columns unshared
    assert (stats[-2].cache.capacity, stats[-1].cache.capacity) == (da.BLOCK_L + sampling.max_new_tokens,
                                                                    ids.shape[1] + sampling.max_new_tokens)
    for later in outputs[2:]:  # HF generate's tokens checked once (below): the others equal them
        assert torch.equal(later.input_ids, outputs[0].input_ids)
        assert torch.equal(later.attention_mask, outputs[0].attention_mask)
    _same_tokens_and_hf_greedy(outputs[:2], sampling, model, ids, mask, eos)
    if sampling.is_greedy:  # the capped arm shared some steps, not all
        assert 0 < stats[2].decode.shared_prefix_steps < stats[2].decode.forwards


def test_which_steps_share_the_prompt():
    """A step shares a prompt's columns in batch buckets of at least ``shared_prefix_rows`` rows, with several
    samples per prompt, and only while their queries fit one tile."""
    from types import SimpleNamespace

    from rollout.executors.decode import shares_prefix

    def parts(rows, first_row_rows=128):
        return SimpleNamespace(spec=SimpleNamespace(num_heads=16, num_kv_heads=2),
                               fns=SimpleNamespace(shared_prefix_rows=rows, first_row_rows=first_row_rows))

    assert shares_prefix(parts(32), 32, 4) and shares_prefix(parts(32), 256, 4)
    assert not shares_prefix(parts(32), 24, 4)  # a smaller batch reads every copy
    assert not shares_prefix(parts(0), 256, 4)  # off (and SDPA: FastStep leaves it 0)
    assert not shares_prefix(parts(32), 256, 1)  # one sample a prompt: nothing to share
    assert shares_prefix(parts(32), 256, 16) and not shares_prefix(parts(32), 256, 17)  # 17 x 8 > 128 queries
    # from each run's first row: no tile limit; still the bucket's threshold and several samples a prompt
    assert shares_prefix(parts(32, 256), 256, 17, first_row=True) and shares_prefix(parts(32), 32, 2, first_row=True)
    assert not shares_prefix(parts(32), 24, 4, first_row=True) and not shares_prefix(parts(32), 128, 1, first_row=True)
    assert not shares_prefix(parts(0), 128, 4, first_row=True)
    # and only up to kernels.shared_prefix_first_row_rows rows (128 here)
    assert shares_prefix(parts(32), 128, 4, first_row=True) and not shares_prefix(parts(32), 192, 4, first_row=True)


def test_how_an_ordinary_call_shares_its_prompts():
    """``prompt_sharing``: a pass of their own from ``shared_prefix_columns`` on, below it the first-row reads
    (padded to a tile edge with ``shared_prefix_align``) where some step may take them, nothing on the HF path or with
    one sample a prompt."""
    from rollout.executors.decode import prompt_sharing

    kernels = KernelConfig()
    assert prompt_sharing(kernels, kernels.shared_prefix_columns, 4) == (4, False, False)
    assert prompt_sharing(kernels, 254, 4) == (4, True, True)
    assert prompt_sharing(KernelConfig(shared_prefix_align=False), 254, 4) == (4, True, False)
    assert prompt_sharing(KernelConfig(shared_prefix_first_row_rows=0), 254, 4) == (1, False, False)
    # no step can read from the first row: fewer rows allowed than shared_prefix_rows asks, or sharing off
    assert prompt_sharing(KernelConfig(shared_prefix_first_row_rows=16), 254, 4) == (1, False, False)
    assert prompt_sharing(KernelConfig(shared_prefix_rows=0), 254, 4) == (1, False, False)
    assert prompt_sharing(kernels, 254, 1) == (1, True, False)  # one sample: nothing to pad for
    assert prompt_sharing(None, 254, 4) == (1, False, False)
