"""The student's compiled pieces (issue 32): compiled with inductor's mix-order reduction in non-strict mode, whose
size checks guarded on the token count (``2560 <= T <= 4095``, ``4096 <= T`` at the 3B's width) and recompiled both
pieces, forward and backward, for micro-batches of new sizes in the first steps at RL scale. On the GPU: packed
micro-batches of token counts on both sides of those bounds compile each piece twice at most (static, then
dynamic)."""

import pytest
import torch

from rollout.model import step as step_lib
from rollout.opsd import fast_passes, packed
from rollout.testing import tiny_model


def test_the_train_options_are_the_first_choice_this_inductor_knows(monkeypatch):
    from torch._inductor import config

    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):  # torch 2.13 here
        assert config.triton.mix_order_reduction_non_strict_mode is False  # the default the pieces change
        assert fast_passes.train_compile_options() == {"triton.mix_order_reduction_non_strict_mode": True}
    else:  # an older inductor: the fusion off where it has one
        assert fast_passes.train_compile_options() in ({"triton.mix_order_reduction": False}, {})
    torch.compile(lambda x: x + 1, options=fast_passes.train_compile_options())  # accepted (an unknown one raises)
    with pytest.raises(RuntimeError, match="no_such_option"):
        torch.compile(lambda x: x + 1, options={"triton.no_such_option": True})
    # a torch whose inductor lacks non-strict mode turns the fusion off; one without either changes nothing
    monkeypatch.setattr(fast_passes, "TRAIN_INDUCTOR_CHOICES", ({"triton.no_such_option": True},
                                                                {"triton.mix_order_reduction": False}))
    assert fast_passes.train_compile_options() == {"triton.mix_order_reduction": False}
    monkeypatch.setattr(fast_passes, "TRAIN_INDUCTOR_CHOICES", ({"triton.no_such_option": True}, {"no_such": 1}))
    assert fast_passes.train_compile_options() == {}


def test_the_students_pieces_compile_with_them_and_the_rollouts_do_not(monkeypatch):
    calls, chosen = [], {"triton.mix_order_reduction": False}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    monkeypatch.setattr(fast_passes, "train_compile_options", lambda: dict(chosen))
    fast_passes.compiled_train_fns.cache_clear()
    step_lib.compiled_step_fns.cache_clear()
    try:
        fast_passes.compiled_train_fns()
        train = list(calls)
        step_lib.compiled_step_fns()
        rollout = calls[len(train):]
    finally:
        fast_passes.compiled_train_fns.cache_clear()
        step_lib.compiled_step_fns.cache_clear()
    assert len(train) == 2 and all(k == {"dynamic": None, "fullgraph": True, "options": chosen} for k in train)
    assert rollout and all("options" not in k and k["mode"] is None for k in rollout)


def _cache_entries(fn) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor's Triton backend)")
def test_micro_batches_across_the_mix_order_bounds_compile_each_piece_twice_at_most():
    pytest.importorskip("torch._dynamo.eval_frame")
    torch._dynamo.reset()
    fast_passes.compiled_train_fns.cache_clear()
    device = torch.device("cuda")
    model = tiny_model("qwen2", seed=0, dtype=torch.bfloat16, device=device, hidden_size=2048,
                       intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
                       num_key_value_heads=2, max_position_embeddings=8192).train()
    for tokens in (5000, 3000, 1000, 4600, 2600):  # >= 4096, 2560..4095, < 2560, and again
        ids = torch.randint(3, 500, (1, tokens), device=device)
        mask = torch.ones_like(ids)
        loss_mask = torch.zeros(1, 8, dtype=torch.bool, device=device)
        loss_mask[:, :4] = True
        rows = packed.pack(ids, mask, loss_mask)
        model.zero_grad(set_to_none=True)
        with packed.packed_attention(model, rows.layout):
            parts = fast_passes.student_parts(model, device)
            with fast_passes.student_decoder(model, parts, rows):
                hidden = packed.loss_hidden(model, model, rows)
            hidden.float().square().sum().backward()
    for fn in (fast_passes._train_attention_inputs, fast_passes._train_attention_output_and_mlp):
        assert _cache_entries(fn) <= 2, fn.__name__
