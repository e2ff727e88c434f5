"""Split-K o and down projections for wide decode batches (``RolloutConfig.split_k_rows``,
``rollout.model.step.split_k_linear``): off by default; where a batch reaches the limit, every layer's output
piece runs split-K, and both routes give HF generate's greedy tokens (fp32); below it, the usual piece runs."""

from __future__ import annotations

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.model import step
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.conftest import hf_greedy, response_of, with_step_pieces


def _counting(ro, rows_limit: int, calls: list):
    def counted(h, *args):
        calls.append(h.shape[0])
        return step.attention_output_and_gate_up_mlp_split_k(h, *args)

    with_step_pieces(ro, split_k_rows=rows_limit, attention_output_and_gate_up_mlp_split_k=counted)


@pytest.mark.parametrize("route,slots", [("ordinary", None), ("continuous", 3)])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_split_k_steps_equal_hf_generate(family, route, slots):
    model = tiny_model(family, seed=7)
    ids, mask = random_prompts(5, 9, min_len=2, seed=8)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route=route, cuda_graphs=False))
    calls = []
    _counting(ro, 1, calls)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0,
                              **({} if slots is None else {"continuous_batch_size": slots}))
    out = ro.generate(RolloutRequest(ids, mask), sampling)
    assert calls and len(calls) % model.config.num_hidden_layers == 0  # every layer of every decode step
    for row in range(5):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 6)


def test_batches_below_the_limit_keep_the_usual_piece():
    model = tiny_model("qwen2", seed=7)
    ids, mask = random_prompts(3, 6, min_len=2, seed=8)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", cuda_graphs=False))
    calls = []
    _counting(ro, 5, calls)  # the 3 rows' bucket (4) is below 5
    ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert calls == []


@pytest.mark.parametrize("rows,gate_up,expected", [(0, True, 0), (128, True, 128), (128, False, 0)])
def test_config_decides_the_piece(rows, gate_up, expected):
    """Off by default; with fused gate|up only (the split-K piece is the fused MLP's)."""
    assert RolloutConfig().split_k_rows == 0
    ro = Rollout(tiny_model("qwen2", seed=0), TinyTokenizer(), RolloutConfig(split_k_rows=rows, fuse_gate_up=gate_up))
    assert ro._fast_step.parts(torch.device("cpu"), mirrored=False).fns.split_k_rows == expected


def test_with_the_rotary_kernel_q_k_v_is_split_too():
    """With the rotary + cache-write kernel (interpreted on the CPU), the fused q|k|v projection of a batch at the
    limit runs split-K as well, every layer, and the tokens stay HF generate's (fp32)."""
    pytest.importorskip("triton")
    import functools

    from rollout.ops import rotary_write as rw

    model = tiny_model("qwen2", seed=7)
    ids, mask = random_prompts(3, 8, min_len=2, seed=9)
    ro = Rollout(model, TinyTokenizer(eos_token_id=None), RolloutConfig(route="ordinary", cuda_graphs=False))
    calls = []

    def counted(h, *args):
        calls.append(h.shape[0])
        return step.qkv_projection_split_k(h, *args)

    with_step_pieces(ro, split_k_rows=1, qkv_projection_split_k=counted,
                     rotary_write=functools.partial(rw.rotary_write, interpret=True))
    out = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=5, temperature=0.0))
    assert len(calls) == 4 * model.config.num_hidden_layers  # 4 decode steps
    for row in range(3):
        assert response_of(out, row) == hf_greedy(model, ids[row], mask[row], 5)
