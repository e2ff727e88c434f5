"""The student's compiled pieces (issue 32): compiled with inductor's mix-order reduction in non-strict mode, whose
size checks guarded on the token count (``2560 <= T <= 4095``, ``4096 <= T`` at the 3B's width) and recompiled both
pieces, forward and backward, for micro-batches of new sizes in the first steps at RL scale; and the token count is
marked dynamic before the first compile, which otherwise specialised on the first micro-batch's count and compiled
again at the second. On the GPU: packed micro-batches of token counts on both sides of those bounds compile each
piece once; on the CPU (dynamo with an eager backend) the student's, the teacher's and the LoRA pieces compile once
for every token count."""

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
def test_micro_batches_across_the_mix_order_bounds_compile_each_piece_once():
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
        assert _cache_entries(fn) == 1, fn.__name__  # the token count is dynamic from the first compile


def _rows(tokens: int):
    ids = torch.randint(3, 100, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros(2, 4, dtype=torch.bool)
    loss_mask[:, :3] = True
    return packed.pack(ids, mask, loss_mask)


def test_the_training_pieces_compile_once_for_every_token_count():
    """The packed token count is marked dynamic before the first compile: micro-batches of new sizes reuse it (left
    to dynamo, the second size compiled every piece again, forward and backward, in the first steps). Dynamo's
    frontend with the eager autograd backend, so that this runs on the CPU."""
    peft = pytest.importorskip("peft")
    from rollout.model import pieces

    compiled = lambda fn: torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=None)
    torch._dynamo.reset()
    student = tiny_model("qwen2", seed=0).train()
    lora = peft.get_peft_model(tiny_model("qwen2", seed=1), peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    lora_lm = lora.base_model.model
    teacher = fast_passes.fast_parts(tiny_model("llama", seed=2), torch.device("cpu"))
    teacher = fast_passes.PassParts(step_lib.StepParts(teacher.step.spec, teacher.step.weights, step_lib.StepFns(
        attention_inputs=compiled(fast_passes._teacher_attention_inputs),
        attention_output_and_mlp=compiled(fast_passes._teacher_attention_output_and_mlp))))
    train_fns = step_lib.StepFns(attention_inputs=compiled(fast_passes._train_attention_inputs),
                                 attention_output_and_mlp=compiled(fast_passes._train_attention_output_and_mlp))
    lora_fns = fast_passes.LoraFns(compiled(pieces.lora_attention_inputs),
                                   compiled(pieces.lora_attention_output_and_mlp))
    functions = (fast_passes._train_attention_inputs, fast_passes._train_attention_output_and_mlp,
                 fast_passes._teacher_attention_inputs, fast_passes._teacher_attention_output_and_mlp,
                 pieces.lora_attention_inputs, pieces.lora_attention_output_and_mlp)
    first = None
    for tokens in (9, 13, 6):
        rows = _rows(tokens)
        for model, causal_lm in ((student, student), (lora, lora_lm)):
            parts = fast_passes.student_parts(causal_lm, torch.device("cpu"))
            parts = fast_passes.PassParts(
                step_lib.StepParts(parts.step.spec, parts.step.weights, train_fns), parts.adapters,
                lora_fns if parts.adapters else None)
            with packed.packed_attention(causal_lm, rows.layout), fast_passes.student_decoder(causal_lm, parts, rows):
                packed.loss_hidden(model, causal_lm, rows).square().sum().backward()
        with torch.no_grad():
            assert fast_passes.fast_loss_hidden(teacher, rows).shape[0] == int(rows.loss_index.numel())
        first = first or [_cache_entries(fn) for fn in functions]
    # one graph each; the LoRA pieces two: a frozen base's first layer takes an input that needs no gradient
    assert first == [1, 1, 1, 1, 2, 2]
    assert [_cache_entries(fn) for fn in functions] == first  # no compile for the later token counts
    torch._dynamo.reset()
