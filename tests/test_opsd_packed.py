"""The packed training path (issue 32): packing, variable-length attention, the teacher's and student's hidden
states against HF's padded forward, the fused head + JSD loss against ``generalized_jsd_loss``, the JSD kernel
(Triton's interpreter on the CPU), token-budget micro-batches, and whole steps equal to the padded path in fp32."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F

from rollout.config import SamplingConfig
from rollout.model import zero
from rollout.ops import jsd, masks
from rollout.opsd import OPSDConfig, OPSDStep, fast_passes, packed, sizing
from rollout.opsd.fused_loss import fused_jsd_loss
from rollout.opsd.logit_cache import LogitCacheConfig, TeacherLogitCache
from rollout.opsd.losses import _chunk_divergence, generalized_jsd_loss
from rollout.opsd.micro_batches import AUTO, RowStats, plan_micro_batches
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

SAMPLING = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, seed=5)
#: The JSD kernel on CPU tensors needs Triton's interpreter, which tests/conftest.py turns on where there is no CUDA.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter is off (tests/conftest.py sets it without CUDA)")


def ragged_rows():
    """Three rows: left-padded prompts, right-padded responses; loss masks over the last 5 columns. Row 1 holds
    the pad id 0 as a real token (a sampled response may), before positions of the loss."""
    ids = torch.randint(3, 100, (3, 10), generator=torch.Generator().manual_seed(0))
    ids[1, 4] = 0
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 8:] = 0
    mask[2, :1] = 0
    mask[2, 9:] = 0
    loss_mask = torch.zeros(3, 5, dtype=torch.bool)
    loss_mask[0, :4] = True
    loss_mask[1, :3] = True
    loss_mask[2, 1:4] = True
    return ids * mask, mask, loss_mask


# ---- packing ----------------------------------------------------------------------------------------------------------
def test_pack_lays_rows_end_to_end_with_positions_restarting():
    ids, mask, loss_mask = ragged_rows()
    rows = packed.pack(ids, mask, loss_mask)
    assert rows.layout.lengths == (7, 8, 8) and rows.layout.cu_seqlens.tolist() == [0, 7, 15, 23]
    assert rows.layout.cu_seqlens.dtype == torch.int32 and rows.layout.total == 23 and rows.layout.max_len == 8
    assert rows.input_ids[0].tolist() == ids[mask.bool()].tolist()
    assert rows.position_ids[0].tolist() == [*range(7), *range(8), *range(8)]
    # loss column j of a row is input column 5 + j: packed index = row start + real tokens before it
    expected = [0 + 2, 0 + 3, 0 + 4, 0 + 5, 7 + 5, 7 + 6, 7 + 7, 15 + 5, 15 + 6, 15 + 7]
    assert rows.loss_index.tolist() == expected


@pytest.mark.parametrize("groups", [1, 2])
def test_varlen_attention_is_causal_within_each_row(groups):
    gen = torch.Generator().manual_seed(1)
    lengths = (3, 5, 1)
    q = torch.randn(9, 4, 8, generator=gen)
    k, v = torch.randn(9, 4 // groups, 8, generator=gen), torch.randn(9, 4 // groups, 8, generator=gen)
    layout = packed.PackLayout(torch.tensor([0, 3, 8, 9], dtype=torch.int32), lengths)
    out = packed.varlen_causal_attention(q, k, v, layout, scale=0.3)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        kk, vv = (t[rows].repeat_interleave(groups, dim=1) for t in (k, v))
        ref = F.scaled_dot_product_attention(q[rows].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                             is_causal=True, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[rows], ref)
        start += n


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_hidden_states_equal_hf_padded_forward(arch):
    model = tiny_model(arch, seed=0)
    ids, mask, loss_mask = ragged_rows()
    rows = packed.pack(ids, mask, loss_mask)
    assert packed.unsupported_reason(model) is None
    before = model.config._attn_implementation
    with packed.packed_attention(model, rows.layout):
        assert model.config._attn_implementation == packed.ATTENTION
        hidden = packed.loss_hidden(model, model, rows)
    assert model.config._attn_implementation == before  # restored: the rollout shares the model
    reference = model.model(input_ids=ids, attention_mask=mask, position_ids=masks.prompt_positions(mask))
    expected = reference.last_hidden_state[:, 5:][loss_mask]
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fast_teacher_forward_equals_hf_packed_forward(arch):
    """The teacher's forward through the rollout's decoder pieces (eager on the CPU) against HF's, both packed."""
    model = tiny_model(arch, seed=0)
    ids, mask, loss_mask = ragged_rows()
    rows = packed.pack(ids, mask, loss_mask)
    parts = fast_passes.fast_parts(model, torch.device("cpu"))
    assert parts is not None
    with torch.no_grad():
        fast = fast_passes.fast_loss_hidden(parts, rows)
        with packed.packed_attention(model, rows.layout):
            reference = packed.loss_hidden(model, model, rows)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fast_student_forward_and_backward_equal_hf_packed(arch):
    """The student's pass through the pieces over its parameters (eager on the CPU), called through the model as
    the step calls it: hidden states and every parameter's gradient equal HF's packed forward, and the decoder's
    own forward is back after the block. The pad id's embedding row gets no gradient (HF's ``padding_idx``), though
    row 1 holds that id as a real token (the pieces gave it one, found by a differential fuzz of the step)."""
    model = tiny_model(arch, seed=0)
    ids, mask, loss_mask = ragged_rows()
    rows = packed.pack(ids, mask, loss_mask)
    weight = torch.randn(int(loss_mask.sum()), model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert fast_passes.student_unsupported_reason(model) is None
    results = []
    for fast in (True, False):
        model.zero_grad(set_to_none=True)
        with packed.packed_attention(model, rows.layout):
            parts = fast_passes.student_parts(model, torch.device("cpu")) if fast else None
            with fast_passes.student_decoder(model, parts, rows) if fast else contextlib.nullcontext():
                hidden = packed.loss_hidden(model, model, rows)
            (hidden * weight).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert "forward" not in packed.decoder_of(model).__dict__
    (fast_hidden, fast_grads), (hf_hidden, hf_grads) = results
    torch.testing.assert_close(fast_hidden, hf_hidden, rtol=1e-5, atol=1e-5)
    assert set(fast_grads) == set(hf_grads) == {n for n, _ in model.named_parameters()} - {"lm_head.weight"}
    for name, grad in hf_grads.items():
        assert (fast_grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, name
    pad = model.config.pad_token_id
    assert model.model.embed_tokens.padding_idx == pad == 0 and bool(((ids == pad) & (mask == 1)).any())
    assert not fast_grads["model.embed_tokens.weight"][pad].any() and fast_grads["model.embed_tokens.weight"][3:].any()


def test_fast_student_declines_what_its_pieces_do_not_compute():
    model = tiny_model("qwen2", seed=0)
    model.gradient_checkpointing_enable()
    assert "checkpointing" in fast_passes.student_unsupported_reason(model)
    dropout = tiny_model("llama", seed=0)
    dropout.config.attention_dropout = 0.1
    assert "attention_dropout" in fast_passes.student_unsupported_reason(dropout)
    odd = tiny_model("qwen2", seed=0)
    odd.config.hidden_act = "gelu"
    assert "gelu" in fast_passes.student_unsupported_reason(odd)


def test_packed_attention_outside_its_context_and_nested_raise():
    model = tiny_model("qwen2", seed=0)
    ids, mask, loss_mask = ragged_rows()
    rows = packed.pack(ids, mask, loss_mask)
    packed.register()
    model.config._attn_implementation = packed.ATTENTION
    with pytest.raises(RuntimeError, match="only inside"):
        model(input_ids=rows.input_ids, position_ids=rows.position_ids)
    model.config._attn_implementation = "sdpa"
    with packed.packed_attention(model, rows.layout), pytest.raises(RuntimeError, match="already active"):
        with packed.packed_attention(model, rows.layout):
            pass
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_models_are_named():
    model = tiny_model("qwen2", seed=0)
    odd = copy.deepcopy(model)
    odd.config.model_type = "gemma2"
    assert "gemma2" in packed.unsupported_reason(odd)
    biased = copy.deepcopy(model)
    biased.lm_head = torch.nn.Linear(biased.lm_head.in_features, biased.lm_head.out_features, bias=True)
    assert "bias-free" in packed.unsupported_reason(biased)
    windowed = copy.deepcopy(model)
    windowed.config.use_sliding_window = True
    assert "sliding" in packed.unsupported_reason(windowed)
    from transformers import MistralConfig, MistralForCausalLM
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    assert "sliding" in packed.unsupported_reason(MistralForCausalLM(MistralConfig(sliding_window=4, **shape)))
    assert packed.unsupported_reason(MistralForCausalLM(MistralConfig(sliding_window=None, **shape))) is None


# ---- the fused loss ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta, temperature, teacher_vocab", [(0.0, 1.0, 50), (0.5, 0.7, 50), (1.0, 2.0, 50),
                                                              (0.3, 1.0, 64), (0.3, 1.0, 40)])
def test_fused_loss_equals_generalized_jsd_loss_on_logits(beta, temperature, teacher_vocab):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(23, 12, generator=gen), torch.randn(teacher_vocab, 12, generator=gen)
    loss = fused_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, beta, temperature, chunk_size=5, divisor=30)
    (loss * 2.5).backward()  # a scaled loss: the backward's scale reaches both gradients
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.T)[None]  # [1, N, V_s]: every position a loss position
    reference = generalized_jsd_loss(logits, (teacher_hidden @ teacher_weight.T)[None], torch.ones(1, 23), beta,
                                     temperature, num_positions_total=30)
    (reference * 2.5).backward()
    assert teacher_vocab >= 50 or not grads[1][teacher_vocab:].any()  # ids past the shared vocabulary: no gradient
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-7)


def test_fused_loss_gives_the_teacher_no_gradient_and_checks_its_inputs():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    fused_jsd_loss(hidden, weight, teacher_hidden, teacher_weight).backward()
    assert teacher_hidden.grad is None and teacher_weight.grad is None and hidden.grad is not None
    with pytest.raises(ValueError, match="same N positions"):
        fused_jsd_loss(hidden, weight, teacher_hidden[:3], teacher_weight)
    with pytest.raises(ValueError, match="divisor"):
        fused_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, divisor=3)
    with pytest.raises(ValueError, match="beta"):
        fused_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, beta=2.0)


@interpreted
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jsd_kernel_equals_the_pytorch_chunk(beta, dtype):
    """The Triton kernel (interpreted on the CPU) against ``_chunk_divergence``: loss per row and the gradient it
    writes over the student's logits (rounded once to their dtype)."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    student, teacher = (torch.randn(6, 9000, generator=gen) * 3).to(dtype), (torch.randn(6, 9000, generator=gen) * 3).to(dtype)
    loss, grad = _chunk_divergence(student.float(), teacher.float(), beta, 0.7, True)
    assert jsd.unsupported_reason(student, teacher, interpret=True) is None
    written = student.clone()
    rows = jsd.jsd_rows(written, teacher, beta, 0.7, 0.25, interpret=True, fallback=lambda: pytest.fail("fell back"))
    torch.testing.assert_close(rows.sum(), loss, rtol=1e-5, atol=1e-5)
    tol = 1e-4 if dtype == torch.float32 else 4e-3  # fp32: an online softmax against log_softmax
    torch.testing.assert_close(written.float(), (grad * 0.25).to(dtype).float(), rtol=tol, atol=tol)
    loss_only = student.clone()
    jsd.jsd_rows(loss_only, teacher, beta, 0.7, 0.25, write_grad=False, interpret=True, fallback=None)
    assert torch.equal(loss_only, student)


@interpreted
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
def test_jsd_kernel_holds_on_peaked_rows(beta):
    """Logits of spread 200 (most probabilities underflow float32): the kernel's online softmax and its
    mixture floored before the log give the reference's divergence and gradient, all finite."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(3, 5000, generator=gen) * 200, torch.randn(3, 5000, generator=gen) * 200
    loss, grad = _chunk_divergence(student, teacher, beta, 1.0, True)
    written = student.clone()
    rows = jsd.jsd_rows(written, teacher, beta, 1.0, 1.0, interpret=True, fallback=lambda: pytest.fail("fell back"))
    assert torch.isfinite(written).all() and torch.isfinite(rows).all()
    torch.testing.assert_close(rows.sum(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(written, grad, rtol=1e-4, atol=2e-2 if beta == 1.0 else 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_jsd_kernel_on_cuda_equals_the_reference_at_the_vocabulary_of_qwen(beta):
    """The compiled kernel (its exp and log are the GPU's approximate instructions) over 64 rows of 151,936 bf16
    logits, normal and peaked rows, against the float32 reference of the same bf16 values."""
    gen = torch.Generator().manual_seed(6)
    spread = torch.tensor([3.0] * 32 + [40.0] * 32)[:, None]
    student = (torch.randn(64, 151936, generator=gen) * spread).to("cuda", torch.bfloat16)
    teacher = (torch.randn(64, 151936, generator=gen) * spread).to("cuda", torch.bfloat16)
    loss, grad = _chunk_divergence(student.float(), teacher.float(), beta, 0.8, True)
    written = student.clone()
    rows = jsd.jsd_rows(written, teacher, beta, 0.8, 0.5, fallback=lambda: pytest.fail("fell back"))
    torch.testing.assert_close(rows.sum(), loss, rtol=1e-4, atol=1e-4)
    # peaked rows of reverse KL subtract terms of ~100 (log p_s - log p_t - the row's sum) under the GPU's
    # approximate log: an absolute error of ~1e-3 on gradients up to 0.5
    torch.testing.assert_close(written.float(), (grad * 0.5).to(torch.bfloat16).float(), rtol=1e-2, atol=2e-3)


@interpreted
def test_fused_loss_through_the_kernel_equals_its_pytorch_path():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(4)
    args = [torch.randn(37, 16, generator=gen), torch.randn(50, 16, generator=gen),
            torch.randn(37, 16, generator=gen), torch.randn(60, 16, generator=gen)]
    out = []
    for interpret in (False, True):
        hidden, weight = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
        loss = fused_jsd_loss(hidden, weight, args[2], args[3], 0.5, 0.8, chunk_size=5, divisor=40,
                              interpret=interpret)
        loss.backward()
        out.append((loss.detach(), hidden.grad, weight.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert jsd.unsupported_reason(args[0], args[2]) == "not a CUDA tensor"  # without interpret: PyTorch


def test_hidden_state_cache_holds_rows_where_asked():
    values = torch.randn(5, 8)
    cache = TeacherLogitCache.from_rows(values, LogitCacheConfig(location="host", dtype=torch.float32))
    got, ids = cache.take(1, 4, "cpu")
    assert ids is None and torch.equal(got, values[1:4]) and cache.nbytes == values.nbytes
    with pytest.raises(ValueError, match="top_k"):
        TeacherLogitCache.from_rows(values, LogitCacheConfig(top_k=2))


# ---- token-budget micro-batches ----------------------------------------------------------------------------------------
def test_packed_micro_batches_are_sized_by_real_tokens():
    stats = RowStats(num_positions=(10, 10, 2, 2), response_extent=(10, 10, 2, 2), first_column=(0, 90, 0, 90),
                     teacher_first_column=(0, 90, 0, 90), response_column=100, teacher_response_column=100,
                     num_tokens=(110, 20, 102, 12))
    student, teacher = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)
    cost = sizing.packed_row_cost(student, teacher, 8)
    assert cost.packed and stats.tokens((1, 3), True) == 32 and stats.tokens((1, 3), False) == 2 * 20
    bytes_ = cost.micro_batch_bytes(stats, (1, 3))
    chunk = 8 * cost.chunk_bytes_per_position  # a chunk of 8 positions (both micro-batches hold more)
    assert bytes_ == pytest.approx(32 * cost.bytes_per_token + 12 * cost.bytes_per_position + cost.fixed_bytes + chunk)
    # a budget for ~140 tokens: the long rows go alone or together with a short one, by their own tokens
    budget = cost.fixed_bytes + chunk + 140 * cost.bytes_per_token + 20 * cost.bytes_per_position
    plan = plan_micro_batches(stats, AUTO, AUTO, cost, budget)
    assert plan.order == (0, 1, 2, 3) and plan.groups == ((0, 2), (2, 4))
    padded = sizing.row_cost(student, teacher, LogitCacheConfig(), 8)
    assert not padded.packed and cost.bytes_per_position < padded.bytes_per_position / 5  # no logits per position


# ---- whole steps ------------------------------------------------------------------------------------------------------
def run_step(path: str, *, beta=0.5, teacher="llama", checkpointing=False, teacher_prompts=None, rows=2,
             fast_teacher=True, fast_student=True):
    student = tiny_model("qwen2", seed=0)
    if checkpointing:
        enable = getattr(student, "activation_checkpointing_enable", None) or student.gradient_checkpointing_enable
        enable()
        student.train()
    other = student if teacher == "self" else tiny_model(teacher, seed=1)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    config = OPSDConfig(beta=beta, temperature=0.7, train_path=path, max_student_rows=rows, loss_chunk_size=7,
                        logit_cache_dtype=torch.float32, fast_teacher=fast_teacher, fast_student=fast_student)
    step = OPSDStep(student, other, TinyTokenizer(pad_token_id=0, eos_token_id=2), config, optimizer=optimizer)
    step._trainer.step = lambda: None  # keep the gradients
    ids, mask = random_prompts(3, 8, min_len=3, vocab_size=100, pad_token_id=0, seed=3)
    extra = {} if teacher_prompts is None else dict(zip(("teacher_prompt_ids", "teacher_prompt_attention_mask"),
                                                       teacher_prompts))
    result = step.step(ids, mask, SAMPLING, **extra)
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    return result, grads, step


@pytest.mark.parametrize("kwargs", [dict(beta=0.0), dict(beta=0.5), dict(beta=1.0), dict(rows=None),
                                    dict(teacher="self", teacher_prompts=random_prompts(3, 10, min_len=4, seed=5)),
                                    dict(checkpointing=True), dict(fast_teacher=False), dict(fast_student=False)])
def test_packed_step_equals_padded_step_in_fp32(kwargs):
    """Loss and every student gradient after one step, fp32 on the CPU, within 1e-5 relative."""
    padded, padded_grads, padded_step = run_step("padded", **kwargs)
    result, grads, step = run_step("packed", **kwargs)
    assert (padded_step.train_path, step.train_path) == ("padded", "packed")
    assert step.teacher_path == ("fast" if kwargs.get("fast_teacher", True) else "hf")
    assert result.breakdown.teacher_path == step.teacher_path and padded.breakdown.teacher_path == "padded"
    assert result.breakdown.train_path == "packed" and padded.breakdown.train_path == "padded"
    fast_student = kwargs.get("fast_student", True) and not kwargs.get("checkpointing")
    assert (step.student_path, padded_step.student_path) == ("fast" if fast_student else "hf", "padded")
    assert result.breakdown.student_path == step.student_path and padded.breakdown.student_path == "padded"
    assert torch.equal(result.batch.input_ids, padded.batch.input_ids)
    assert result.loss == pytest.approx(padded.loss, rel=1e-5)
    assert result.loss > 1e-5 and set(grads) == set(padded_grads)
    for name, grad in padded_grads.items():
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, name


def test_the_path_is_chosen_and_reported():
    ids_step = lambda config: OPSDStep(tiny_model("qwen2", seed=0), tiny_model("llama", seed=1),
                                       TinyTokenizer(pad_token_id=0, eos_token_id=2), config,
                                       optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    auto = ids_step(OPSDConfig())
    assert (auto.train_path, auto.train_path_reason) == ("packed", None)
    top_k = ids_step(OPSDConfig(teacher_top_k=4))
    assert top_k.train_path == "padded" and "top-k" in top_k.train_path_reason
    assert ids_step(OPSDConfig(train_path="padded")).train_path == "padded"
    with pytest.raises(ValueError, match="train_path.*top-k"):
        ids_step(OPSDConfig(train_path="packed", teacher_top_k=4))
    with pytest.raises(ValueError, match="train_path"):
        OPSDConfig(train_path="fast")
    with pytest.raises(ValueError, match="fast_teacher"):
        OPSDConfig(fast_teacher=1)
    with pytest.raises(ValueError, match="fast_student"):
        OPSDConfig(fast_student="yes")


def test_a_teacher_with_a_lora_variant_runs_hf_forward_packed():
    """DoRA is not what the LoRA pieces compute (plain LoRA teachers run them: tests/test_opsd_lora_pass.py)."""
    peft = pytest.importorskip("peft")
    teacher = peft.get_peft_model(tiny_model("llama", seed=1), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                                use_dora=True))
    step = OPSDStep(tiny_model("qwen2", seed=0), teacher, TinyTokenizer(pad_token_id=0, eos_token_id=2),
                    OPSDConfig(max_student_rows=2), optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert (step.train_path, step.teacher_path) == ("packed", "hf")
    ids, mask = random_prompts(2, 8, min_len=3, vocab_size=100, pad_token_id=0, seed=3)
    result = step.step(ids, mask, SAMPLING)
    assert result.breakdown.teacher_path == "hf" and result.loss > 0


def test_the_fused_loss_runs_as_the_heads_own_forward_with_its_hooks_and_the_same_gradient():
    """ZeRO-3 gathers a module's weights in its forward hooks: :func:`packed.through_head` calls the loss through the
    head module (hooks run, the result and the head's gradient equal the direct call's, the module is left as it
    was)."""
    model = tiny_model("qwen2", seed=3)
    hidden = torch.randn(7, model.config.hidden_size, requires_grad=True)
    teacher_hidden = torch.randn(7, model.config.hidden_size)
    teacher_head = torch.randn_like(model.lm_head.weight)
    calls = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(len(args)))

    def loss_of(head, hidden_in):
        return fused_jsd_loss(hidden_in, head, teacher_hidden, teacher_head, 0.5, 1.0, chunk_size=3)

    direct = loss_of(model.lm_head.weight, hidden)
    direct.backward()
    expected_head, expected_hidden = model.lm_head.weight.grad.clone(), hidden.grad.clone()
    model.lm_head.weight.grad, hidden.grad = None, None
    through = packed.through_head(model, loss_of, hidden)
    through.backward()
    handle.remove()
    assert calls == [1] and torch.equal(through, direct)
    assert torch.equal(model.lm_head.weight.grad, expected_head) and torch.equal(hidden.grad, expected_hidden)
    assert "forward" not in model.lm_head.__dict__  # the class's forward again
    x = torch.randn(2, model.config.hidden_size)
    assert torch.equal(model.lm_head(x), x @ model.lm_head.weight.T)
    with zero.gathered(model.lm_head, "once"):  # not partitioned: nothing to gather (the teacher head's case)
        assert not zero.is_zero3(model.lm_head)
