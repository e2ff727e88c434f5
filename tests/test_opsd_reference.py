"""The OPSD step against a reference written apart from it (fp32, CPU): HF's own forward of the student and the
teacher over the step's rollout (positions from the attention mask, as generation counts them), the response
positions picked one by one, and the generalized JSD written out from its definition. The step's loss and every
student gradient must match it, on each path (padded, packed with our pieces or HF's layers), with micro-batches and
loss chunks, a top-k cache, unequal vocabularies, teacher prompts, a LoRA student, and a response that holds the pad
id as a real token. (The other tests compare the step's paths with each other, which share the loss code.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from rollout.config import SamplingConfig
from rollout.opsd import OPSDConfig, OPSDStep
from rollout.request import RolloutBatch
from rollout.testing import TinyTokenizer, random_prompts, tiny_model


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float, top_k) -> torch.Tensor:
    """Per position ``[P]``: the generalized JSD of ``[P, V]`` logits over the shared ids (or the teacher's top k)."""
    vocab = min(student.shape[-1], teacher.shape[-1])
    student, teacher = student[:, :vocab] / temperature, teacher[:, :vocab] / temperature
    if top_k is not None:
        ids = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, ids), teacher.gather(-1, ids)
    log_s, log_t = F.log_softmax(student, -1), F.log_softmax(teacher, -1)

    def kl(log_p, log_q):
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    if beta == 0:
        return kl(log_t, log_s)
    if beta == 1:
        return kl(log_s, log_t)
    log_m = torch.logaddexp(math.log(beta) + log_t, math.log(1 - beta) + log_s)
    return beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)


def reference(student, teacher, batch: RolloutBatch, config: OPSDConfig, teacher_prompts=None):
    """The loss and the student's gradients by the definition (``student``/``teacher``: untouched copies)."""
    ids, mask = batch.input_ids, batch.attention_mask
    start = int(batch.response_start_idx[0])
    t_ids, t_mask, t_start = ids, mask, start
    if teacher_prompts is not None:
        t_ids = torch.cat([teacher_prompts[0], ids[:, start:]], 1)
        t_mask = torch.cat([teacher_prompts[1], mask[:, start:]], 1)
        t_start = teacher_prompts[0].shape[1]

    def logits(model, tokens, real):
        return model(input_ids=tokens, attention_mask=real, position_ids=(real.cumsum(-1) - 1).clamp(min=0)).logits

    rows, cols = zip(*[(r, t) for r in range(ids.shape[0]) for t in range(start - 1, ids.shape[1] - 1)
                       if mask[r, t + 1]])
    rows, cols = torch.tensor(rows), torch.tensor(cols)
    with torch.no_grad():
        teacher_logits = logits(teacher, t_ids, t_mask)[rows, cols - start + t_start]
    loss = divergence(logits(student, ids, mask)[rows, cols], teacher_logits, config.beta, config.temperature,
                      config.teacher_top_k).mean()
    loss.backward()
    grads = {name: p.grad for name, p in student.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, len(rows)


def lora(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                      init_lora_weights=False))


CASES = {
    "padded": dict(config=dict(train_path="padded", beta=0.5, temperature=0.7), paths=("padded",) * 3),
    "packed, our pieces, forward KL": dict(config=dict(train_path="packed", beta=0.0, temperature=1.0),
                                           paths=("packed", "fast", "fast")),
    "packed, HF's layers, reverse KL": dict(config=dict(train_path="packed", beta=1.0, temperature=1.5,
                                                        fast_teacher=False, fast_student=False),
                                            paths=("packed", "hf", "hf")),
    "top-k cache, unequal vocabularies": dict(config=dict(teacher_top_k=7, beta=0.3, temperature=0.7),
                                              teacher=dict(vocab_size=600), paths=("padded",) * 3),
    "itself with other prompts": dict(config=dict(train_path="packed", beta=0.5), teacher="self",
                                      teacher_prompts=True, paths=("packed", "fast", "fast")),
    "LoRA student": dict(config=dict(train_path="packed", beta=0.5, temperature=0.7), lora=True,
                         paths=("packed", "fast", "fast")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_the_reference(case):
    spec = CASES[case]
    student = tiny_model("qwen2", seed=0)
    if spec.get("lora"):
        student = lora(student)
    teacher = student if spec.get("teacher") == "self" else tiny_model("llama", seed=1, **spec.get("teacher", {}))
    copies = copy.deepcopy((student, teacher))  # the teacher stays the student where it is
    config = OPSDConfig(logit_cache_dtype=torch.float32, max_student_rows=2, max_teacher_rows=3, loss_chunk_size=5,
                        **spec["config"])
    step = OPSDStep(student, teacher, TinyTokenizer(pad_token_id=0, eos_token_id=2), config,
                    optimizer=torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.0))
    step._trainer.step = lambda: None  # keep the gradients
    ids, mask = random_prompts(3, 7, min_len=2, vocab_size=400, pad_token_id=0, seed=4)
    extra, teacher_prompts = {}, None
    if spec.get("teacher_prompts"):
        t_ids, t_mask = random_prompts(3, 9, min_len=3, vocab_size=400, pad_token_id=0, seed=5)
        extra = dict(teacher_prompt_ids=t_ids, teacher_prompt_attention_mask=t_mask)
        teacher_prompts = (t_ids.repeat_interleave(2, 0), t_mask.repeat_interleave(2, 0))
    result = step.step(ids, mask, SamplingConfig(max_new_tokens=7, n_samples_per_prompt=2, seed=3), **extra)
    assert (step.train_path, step.teacher_path, step.student_path) == spec["paths"]
    loss, grads, positions = reference(*copies, result.batch, config, teacher_prompts)
    assert result.num_response_tokens == positions > 6 and result.loss > 1e-3
    assert result.loss == pytest.approx(loss, rel=1e-5)
    ours = {name: p.grad for name, p in student.named_parameters() if p.grad is not None}
    assert set(ours) == set(grads)
    for name, grad in grads.items():
        assert (ours[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-9, name


@pytest.mark.parametrize("fast_student", [True, False])
def test_a_response_holding_the_pad_id_as_a_token(fast_student):
    """A sampled response may hold the pad id as a real token (mask 1; pad and EOS differ). HF's embedding gives its
    row no gradient (``padding_idx``), and so must the packed path's own student pass."""
    student, teacher = tiny_model("llama", seed=2), tiny_model("qwen2", seed=3)
    copies = copy.deepcopy((student, teacher))
    ids = torch.tensor([[0, 0, 41, 42, 43, 7, 0, 9, 11, 2, 0],
                        [0, 51, 52, 53, 54, 0, 0, 13, 2, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0],
                         [0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    batch = RolloutBatch(ids, mask, torch.tensor([5, 5]))
    config = OPSDConfig(train_path="packed", fast_student=fast_student, logit_cache_dtype=torch.float32)
    step = OPSDStep(student, teacher, TinyTokenizer(pad_token_id=0, eos_token_id=2), config,
                    optimizer=torch.optim.SGD(student.parameters(), lr=0.0))
    step._trainer.step = lambda: None
    result = step.train_on_batch(batch)
    assert step.student_path == ("fast" if fast_student else "hf")
    loss, grads, _ = reference(*copies, batch, config)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    embed = student.model.embed_tokens.weight.grad
    assert not embed[0].any() and embed[41].any()
    assert (embed - grads["model.embed_tokens.weight"]).norm() <= 1e-4 * grads["model.embed_tokens.weight"].norm()
