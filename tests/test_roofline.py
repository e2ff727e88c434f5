"""instrumentation/roofline.py: the rooflines against figures worked out by hand, and no torch at import."""

import subprocess
import sys
from pathlib import Path

import pytest

from instrumentation.roofline import (ModelGeometry, Rates, call_roofline_s, decode_roofline_s, decode_step_floor_s,
                                      prefill_roofline_s)

ROOT = Path(__file__).resolve().parent.parent
# weights 60 B, KV 10 B per token, 3 non-embedding + 2 lm_head params (10 FLOPs per token), 1 FLOP per key
GEO = ModelGeometry(weight_bytes=60, kv_bytes_per_token=10, nonembedding_params=3, lm_head_params=2,
                    attn_flops_per_key=1)


def test_a_decode_step_floor_reads_the_weights_and_the_live_cache_once():
    # 6.0 GB of weights + 32 rows x 100 tokens x 36864 B of keys and values = 6.1179648 GB at 4 TB/s: 1.5294912 ms
    geo = ModelGeometry(weight_bytes=6_000_000_000, kv_bytes_per_token=36864, nonembedding_params=0,
                        lm_head_params=0, attn_flops_per_key=0)
    assert decode_step_floor_s(geo, 32 * 100, Rates(4e12, 1e15)) == pytest.approx(1.5294912e-3)
    assert decode_step_floor_s(GEO, 4, Rates(10.0, 1.0)) == pytest.approx((60 + 40) / 10.0)


@pytest.mark.parametrize("prompts, lengths, copy, gemm, expected", [
    # steps t=1,2; only row 1 is live (L=3 > t); context 3+1=4 then 5: bytes 100, 110; FLOPs 14, 15
    ([2, 3], [1, 3], 10.0, 1e12, 10.0 + 11.0),     # bandwidth-bound
    ([2, 3], [1, 3], 1e12, 1.0, 14.0 + 15.0),      # compute-bound
    ([3, 2], [3, 1], 10.0, 1e12, 21.0),            # row order does not matter
    # t=1: 3 rows live, context 3*1 + 3 = 6: bytes 120 -> 30 s at 4 B/s, FLOPs 3*10 + 6 = 36 -> 36 s
    # t=2: rows 0, 1 live, context 2*1 + 2*2 = 6: bytes 120 -> 30 s, FLOPs 2*10 + 6 = 26 -> 30 s (the max flips)
    ([1, 1, 1], [3, 3, 2], 4.0, 1.0, 36.0 + 30.0),
    ([5, 5], [1, 1], 1.0, 1.0, 0.0),               # every row ends at the prefill's token: no decode step
])
def test_decode_roofline(prompts, lengths, copy, gemm, expected):
    assert decode_roofline_s(prompts, lengths, GEO, Rates(copy, gemm)) == pytest.approx(expected)


def test_decode_roofline_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="prompt_lens/response_lens"):
        decode_roofline_s([1, 2], [3], GEO, Rates(1.0, 1.0))


@pytest.mark.parametrize("copy, gemm, expected", [
    # FLOPs: P=2: 2*3*2 + 2*2 + 2*3/2 = 19; P=3: 2*3*3 + 4 + 3*4/2 = 28; total 47. Weight read 60 B.
    (10.0, 1.0, 47.0),   # compute-bound
    (10.0, 10.0, 6.0),   # one weight read (60 / 10) beats 4.7
])
def test_prefill_roofline(copy, gemm, expected):
    assert prefill_roofline_s([2, 3], GEO, Rates(copy, gemm)) == pytest.approx(expected)


def test_call_roofline_expands_samples_but_prefills_each_prompt_once():
    # n=2: rows [p0, p0, p1, p1] = prompts [2, 2, 3, 3]; rows 1 and 3 live at t=1, 2: contexts 2+3+2*1 = 7 and
    # 2+3+2*2 = 9 -> bytes 130, 150 -> 13 + 15 s at 10 B/s; prefill: max(60 / 10, ~0) = 6 s
    assert call_roofline_s([2, 3], 2, [1, 3, 1, 3], GEO, Rates(10.0, 1e12)) == pytest.approx(13.0 + 15.0 + 6.0)


def test_a_prompt_read_once_for_its_live_samples():
    """``samples``: a prompt's keys and values count once a step while any of its rows is live; the FLOPs do not
    change. Prompts of 4 and 2 tokens, 2 samples each (rows 0, 1 and 2, 3), lengths 3, 2, 2, 2: at t=1 every row is
    live, bytes 60 + 10 x (4 + 2 + 4 x 1) = 160 (per row: 60 + 10 x (4 + 4 + 2 + 2 + 4) = 220); at t=2 only row 0,
    bytes 60 + 10 x (4 + 2) = 120 either way."""
    prompts, lengths, rates = [4, 4, 2, 2], [3, 2, 2, 2], Rates(10.0, 1e12)
    assert decode_roofline_s(prompts, lengths, GEO, rates) == pytest.approx(22.0 + 12.0)
    assert decode_roofline_s(prompts, lengths, GEO, rates, samples=2) == pytest.approx(16.0 + 12.0)
    flops_bound = Rates(1e12, 1.0)  # FLOPs: t=1 4 x 10 + 16 = 56, t=2 10 + 6 = 16, with or without the sharing
    assert decode_roofline_s(prompts, lengths, GEO, flops_bound, samples=2) == pytest.approx(56.0 + 16.0)
    assert decode_roofline_s(prompts, lengths, GEO, flops_bound) == pytest.approx(56.0 + 16.0)
    with pytest.raises(ValueError, match="samples"):
        decode_roofline_s(prompts, lengths, GEO, rates, samples=0)
    one = call_roofline_s([4, 2], 2, lengths, GEO, rates, prompt_once=True)
    assert one == pytest.approx(prefill_roofline_s([4, 2], GEO, rates) + 28.0)
    assert call_roofline_s([4, 2], 1, [3, 2], GEO, rates, prompt_once=True) == call_roofline_s([4, 2], 1, [3, 2],
                                                                                                 GEO, rates)


def test_rates_from_the_printed_units_and_their_checks():
    rates = Rates.measured(4000.0, 750.0)
    assert (rates.copy_bytes_s, rates.gemm_flops_s) == (4e12, 7.5e14)
    with pytest.raises(ValueError, match="copy_bytes_s"):
        Rates(float("nan"), 1.0)
    with pytest.raises(ValueError, match="gemm_flops_s"):
        Rates(1.0, 0.0)


def test_the_module_imports_no_torch():
    code = "import sys, instrumentation.roofline; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
