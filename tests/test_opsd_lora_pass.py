"""A peft LoRA student's packed pass through the compiled pieces (rollout.opsd.fast_passes with the LoRA pieces of
rollout.model.pieces): hidden states and adapter gradients equal peft's unmerged forward through HF's layers, whole
steps equal the padded path, and the adapters the pieces do not compute send the pass to HF's layers, named."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from rollout.config import SamplingConfig
from rollout.model.lora import training_adapters
from rollout.opsd import OPSDConfig, OPSDStep, fast_passes, packed
from rollout.opsd.report import StepFlops
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.test_opsd_packed import ragged_rows

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(arch="qwen2", targets=ALL, seed=0, dtype=torch.float32, device="cpu", **config):
    """A tiny model with random adapters (B != 0, so the updates count)."""
    base = tiny_model(arch, seed=seed, dtype=dtype, device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                         init_lora_weights=False, **config))


def rows_of(device="cpu"):
    return packed.pack(*(t.to(device) for t in ragged_rows()))


def hidden_and_grads(model, rows, fast: bool):
    """Hidden states at the loss positions and the gradients of a fixed projection of them."""
    lm = model.base_model.model
    weight = torch.randn(rows.loss_index.numel(), lm.config.hidden_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    with packed.packed_attention(lm, rows.layout):
        parts = fast_passes.student_parts(lm, rows.input_ids.device) if fast else None
        with fast_passes.student_decoder(lm, parts, rows) if fast else contextlib.nullcontext():
            hidden = packed.loss_hidden(model, lm, rows)
        (hidden.float() * weight.to(hidden.device)).sum().backward()
    return hidden.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                     if p.grad is not None}


@pytest.mark.parametrize("arch,targets", [("qwen2", ALL), ("llama", ALL), ("qwen2", ["q_proj", "v_proj", "o_proj"])])
def test_lora_student_pass_equals_peft_unmerged_forward(arch, targets):
    model = lora_model(arch, targets)
    lm = model.base_model.model
    assert fast_passes.student_unsupported_reason(lm) is None
    parts = fast_passes.student_parts(lm, torch.device("cpu"))
    adapted = sum(adapter is not None for layer in parts.adapters for adapter in layer)
    assert adapted == len(targets) * lm.config.num_hidden_layers and parts.lora_fns is not None
    (fast_hidden, fast_grads), (hf_hidden, hf_grads) = (hidden_and_grads(model, rows_of(), fast) for fast in (True, False))
    torch.testing.assert_close(fast_hidden, hf_hidden, rtol=1e-5, atol=1e-5)
    assert set(fast_grads) == set(hf_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in fast_grads) and len(fast_grads) == 2 * adapted
    for name, grad in hf_grads.items():
        assert grad.norm() > 0 and (fast_grads[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_fp32_adapters_on_a_bf16_model_follow_peft_casts():
    """peft keeps a bf16 model's adapters in float32 and casts the input up: the pieces do the same."""
    model = lora_model("qwen2", dtype=torch.bfloat16)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    (fast_hidden, fast_grads), (hf_hidden, hf_grads) = (hidden_and_grads(model, rows_of(), fast) for fast in (True, False))
    assert (fast_hidden - hf_hidden).norm() <= 1e-2 * hf_hidden.norm()
    for name, grad in hf_grads.items():
        assert (fast_grads[name] - grad).norm() <= 2e-2 * grad.norm(), name


def test_adapters_the_pieces_do_not_compute_are_named_and_run_hf():
    cases = {
        "DoRA": lora_model(targets=["q_proj"], use_dora=True),
        "lora_bias": lora_model(targets=["v_proj"], lora_bias=True),
        "embed_tokens": lora_model(targets=["embed_tokens", "q_proj"]),
        "lora_dropout 0.1 in training": lora_model(targets=["q_proj"], lora_dropout=0.1).train(),
    }
    two = lora_model(targets=["q_proj"])
    two.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "other"])
    cases["2 active adapters"] = two
    for expected, model in cases.items():
        reason = fast_passes.student_unsupported_reason(model.base_model.model)
        assert reason is not None and reason.startswith("LoRA") and expected in reason, (expected, reason)
    evaluated = lora_model(targets=["q_proj"], lora_dropout=0.1).eval()  # dropout is off: computed
    assert fast_passes.student_unsupported_reason(evaluated.base_model.model) is None
    merged = lora_model(targets=["q_proj"], use_dora=True)
    merged.base_model.merge_adapter()  # a merged adapter is in the base weight: nothing to compute
    assert fast_passes.student_unsupported_reason(merged.base_model.model) is None
    assert not training_adapters(merged.base_model.model).any
    with merged.disable_adapter():
        assert fast_passes.student_unsupported_reason(merged.base_model.model) is None
    from transformers import GPT2Config, GPT2LMHeadModel  # another layout: declined before its adapters are read
    gpt2 = peft.get_peft_model(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)),
                               peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    assert fast_passes.fast_parts(gpt2.base_model.model, torch.device("cpu")) is None
    assert "gpt2" in fast_passes.student_unsupported_reason(gpt2.base_model.model)


def run_step(path: str, model, teacher=None, teacher_prompts=None, **settings):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    config = OPSDConfig(beta=0.5, temperature=0.7, train_path=path, max_student_rows=2, loss_chunk_size=7,
                        logit_cache_dtype=torch.float32, **settings)
    step = OPSDStep(model, tiny_model("llama", seed=1) if teacher is None else teacher,
                    TinyTokenizer(pad_token_id=0, eos_token_id=2), config, optimizer=optimizer)
    step._trainer.step = lambda: None  # keep the gradients
    ids, mask = random_prompts(3, 8, min_len=3, vocab_size=100, pad_token_id=0, seed=3)
    extra = {} if teacher_prompts is None else dict(zip(("teacher_prompt_ids", "teacher_prompt_attention_mask"),
                                                       teacher_prompts))
    result = step.step(ids, mask, SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, seed=5), **extra)
    return result, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, step


def test_packed_lora_step_on_the_pieces_equals_the_padded_step():
    """A whole step (the rollout fuses the adapters, training unfuses them): loss and adapter gradients, fp32."""
    model = lora_model("qwen2", ALL)
    padded, padded_grads, _ = run_step("padded", model)
    model.zero_grad(set_to_none=True)
    result, grads, step = run_step("packed", model)
    assert step.student_path == "fast" and result.breakdown.student_path == "fast"
    assert 0 < StepFlops(step, torch.device("cpu")).trained_share < 0.2  # the MFU counts no base weight gradients
    assert torch.equal(result.batch.input_ids, padded.batch.input_ids)
    assert result.loss == pytest.approx(padded.loss, rel=1e-5) and result.loss > 1e-5
    assert set(grads) == set(padded_grads) and all("lora_" in name for name in grads)
    for name, grad in padded_grads.items():
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, name


@pytest.mark.parametrize("self_distillation", [True, False])
def test_a_lora_teacher_runs_the_lora_pieces_and_equals_hf(self_distillation):
    """A LoRA teacher (the student itself, or another peft model) runs the LoRA pieces without gradients: the step's
    loss and the student's gradients equal those with the teacher through HF's layers, fp32. The teacher runs in
    eval mode, so its adapters' dropout rate does not send it to HF's layers (the training student's does)."""
    results = []
    for fast_teacher in (True, False):
        model = lora_model("qwen2", ALL)
        teacher = model if self_distillation else lora_model("llama", ALL, seed=1)
        privileged = random_prompts(3, 10, min_len=4, seed=5) if self_distillation else None  # a prompt of its own
        results.append(run_step("packed", model, teacher, privileged, fast_teacher=fast_teacher))
    (fast, fast_grads, fast_step), (hf, hf_grads, hf_step) = results
    assert (fast_step.teacher_path, hf_step.teacher_path) == ("fast", "hf")
    parts = fast_passes.fast_parts(model.base_model.model, torch.device("cpu"))
    assert sum(a is not None for layer in parts.adapters for a in layer) == 7 * model.config.num_hidden_layers
    assert torch.equal(fast.batch.input_ids, hf.batch.input_ids)
    assert fast.loss == pytest.approx(hf.loss, rel=1e-5) and fast.loss > 1e-5
    assert set(fast_grads) == set(hf_grads) and fast_grads
    for name, grad in hf_grads.items():
        assert (fast_grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, name
    dropping = lora_model("qwen2", ALL, lora_dropout=0.1).train().base_model.model
    assert fast_passes.fast_parts(dropping, torch.device("cpu")) is not None
    assert "lora_dropout 0.1 in training" in fast_passes.student_unsupported_reason(dropping)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_lora_pieces_on_cuda_match_peft_in_bf16():
    """Compiled pieces (forward and backward), bf16 base and float32 adapters, and peft's layers in bf16, each
    against peft's layers in float32 (the same weights): the pieces' error is within twice peft's own bf16 error
    (or 1e-2 relative L2), for the hidden states and for every adapter gradient."""
    model = lora_model("qwen2", ALL, dtype=torch.bfloat16, device="cuda")
    rows = rows_of("cuda")
    (fast_hidden, fast_grads), (hf_hidden, hf_grads) = (hidden_and_grads(model, rows, fast) for fast in (True, False))
    ref_hidden, ref_grads = hidden_and_grads(copy.deepcopy(model).float(), rows, False)
    error = lambda x, ref: ((x - ref).norm() / ref.norm()).item()
    assert error(fast_hidden, ref_hidden) <= max(2 * error(hf_hidden, ref_hidden), 1e-2)
    assert set(fast_grads) == set(hf_grads) == set(ref_grads) and fast_grads
    for name, ref in ref_grads.items():
        assert error(fast_grads[name], ref) <= max(2 * error(hf_grads[name], ref), 1e-2), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_lora_teacher_pieces_on_cuda_match_peft_in_bf16():
    """The teacher's LoRA pass (fast_parts of a peft model, eval mode, no gradients: compiled on CUDA) against peft's
    layers in float32: within twice peft's own bf16 error (or 1e-2 relative L2), at the loss positions."""
    model = lora_model("qwen2", ALL, dtype=torch.bfloat16, device="cuda").eval()
    lm, rows = model.base_model.model, rows_of("cuda")
    reference = copy.deepcopy(model).float()
    parts = fast_passes.fast_parts(lm, torch.device("cuda"))
    assert parts is not None and parts.lora_fns is not None
    with torch.no_grad():
        fast = fast_passes.fast_loss_hidden(parts, rows).float()
        with packed.packed_attention(lm, rows.layout):
            hf = packed.loss_hidden(model, lm, rows).float()
        with packed.packed_attention(reference.base_model.model, rows.layout):
            ref = packed.loss_hidden(reference, reference.base_model.model, rows).float()
    error = lambda x: ((x - ref).norm() / ref.norm()).item()
    assert fast.shape == ref.shape and error(fast) <= max(2 * error(hf), 1e-2)
