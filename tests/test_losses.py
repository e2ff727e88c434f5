"""generalized_jsd_loss against an unchunked float64 reference, chunking, gradients, alignment."""

import pytest
import torch

from rollout.opsd.losses import align_vocab, generalized_jsd_loss, response_logit_positions
from tests.oracles import reference_jsd


def make_case(seed, batch=3, seq=9, vocab=37, teacher_vocab=None, density=0.5):
    """Random student/teacher logits (teacher sharper) and a random mask with >= 1 position."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, vocab, generator=gen) * 2
    teacher = torch.randn(batch, seq, teacher_vocab or vocab, generator=gen) * 3
    mask = torch.rand(batch, seq, generator=gen) < density
    mask[0, 0] = True
    return student, teacher, mask


def loss_and_grad(student, teacher, mask, beta, temperature, **kwargs):
    student = student.detach().clone().requires_grad_(True)
    loss = generalized_jsd_loss(student, teacher, mask, beta, temperature, **kwargs)
    loss.backward()
    return loss.detach(), student.grad


def reference_loss_and_grad(student, teacher, mask, beta, temperature):
    student = student.detach().double().requires_grad_(True)
    loss = reference_jsd(student, teacher, mask, beta, temperature)
    loss.backward()
    return loss.detach(), student.grad


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seed,density", [(0, 0.5), (1, 0.2), (2, 1.0)])
def test_matches_float64_reference(beta, temperature, seed, density):
    student, teacher, mask = make_case(seed, density=density)
    loss, grad = loss_and_grad(student, teacher, mask, beta, temperature, chunk_size=4)
    ref_loss, ref_grad = reference_loss_and_grad(student, teacher, mask, beta, temperature)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_beta_endpoints_are_forward_and_reverse_kl():
    student, teacher, mask = make_case(3)
    p_s, p_t = torch.softmax(student.double(), -1), torch.softmax(teacher.double(), -1)
    forward_kl = (p_t * (p_t.log() - p_s.log())).sum(-1)[mask].mean()
    reverse_kl = (p_s * (p_s.log() - p_t.log())).sum(-1)[mask].mean()
    torch.testing.assert_close(generalized_jsd_loss(student, teacher, mask, beta=0.0).double(),
                               forward_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(generalized_jsd_loss(student, teacher, mask, beta=1.0).double(),
                               reverse_kl, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 7])
def test_chunked_and_unchunked_agree(beta, chunk_size):
    student, teacher, mask = make_case(4, batch=4, seq=11)
    loss, grad = loss_and_grad(student, teacher, mask, beta, 1.3, chunk_size=chunk_size)
    full_loss, full_grad = loss_and_grad(student, teacher, mask, beta, 1.3, chunk_size=10**9)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, full_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("teacher_requires_grad", [False, True])
def test_gradients_flow_to_student_only(teacher_requires_grad):
    student, teacher, mask = make_case(5)
    student.requires_grad_(True)
    teacher.requires_grad_(teacher_requires_grad)
    generalized_jsd_loss(student, teacher, mask, 0.5, 1.0, chunk_size=2).backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad[mask].abs().sum() > 0
    assert torch.count_nonzero(student.grad[~mask]) == 0


def test_grad_output_scales_and_second_backward_raises():
    student, teacher, mask = make_case(6)
    _, grad = loss_and_grad(student, teacher, mask, 0.5, 1.0)
    leaf = student.clone().requires_grad_(True)
    loss = generalized_jsd_loss(leaf, teacher, mask, 0.5, 1.0)
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(leaf.grad, 3.0 * grad)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("beta, top_k", [(0.0, None), (0.5, None), (1.0, 5)])
@pytest.mark.parametrize("splits", [[1, 3], [1, 2, 3]])
def test_row_splits_over_the_total_count_add_up_to_the_whole(beta, top_k, splits):
    """Micro-batches: each split's loss over the batch's position count; losses and gradients add up."""
    student, teacher, mask = make_case(14, batch=4, seq=8)
    mask[:, 0] = True  # every split has a position (as every micro-batch of the step)
    ids = None if top_k is None else torch.topk(teacher, top_k, dim=-1).indices
    target = teacher if ids is None else torch.gather(teacher, -1, ids)
    whole, whole_grad = loss_and_grad(student, target, mask, beta, 1.5, teacher_top_k_ids=ids)
    total, leaf = torch.zeros(()), student.detach().clone().requires_grad_(True)
    for rows in zip([0, *splits], [*splits, 4]):
        part = slice(*rows)
        loss = generalized_jsd_loss(leaf[part], target[part], mask[part], beta, 1.5,
                                    teacher_top_k_ids=None if ids is None else ids[part],
                                    num_positions_total=int(mask.sum()))
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaf.grad, whole_grad, rtol=1e-6, atol=1e-9)


def test_no_grad_mode_gives_same_loss_without_graph():
    student, teacher, mask = make_case(7)
    leaf = student.clone().requires_grad_(True)
    with torch.no_grad():
        loss = generalized_jsd_loss(leaf, teacher, mask, 0.3, 2.0)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), reference_jsd(student, teacher, mask, 0.3, 2.0),
                               rtol=1e-5, atol=1e-6)


def test_bf16_student_gradient_keeps_dtype():
    student, teacher, mask = make_case(8)
    student16 = student.to(torch.bfloat16)
    loss, grad = loss_and_grad(student16, teacher.to(torch.bfloat16), mask, 0.5, 1.0, chunk_size=5)
    ref_loss, ref_grad = reference_loss_and_grad(student16, teacher.to(torch.bfloat16), mask, 0.5, 1.0)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [1, 5, 37])
def test_top_k_renormalises_over_teacher_ids(beta, top_k):
    student, teacher, mask = make_case(9)
    values, ids = torch.topk(teacher, top_k, dim=-1)  # both: [B, T, K]
    loss, grad = loss_and_grad(student, values, mask, beta, 0.7, chunk_size=3, teacher_top_k_ids=ids)
    ref_student = student.double().requires_grad_(True)
    ref = reference_jsd(torch.gather(ref_student, -1, ids), values, mask, beta, 0.7)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_student.grad, rtol=1e-4, atol=1e-7)
    outside = torch.ones_like(student, dtype=torch.bool).scatter_(-1, ids, False)
    assert torch.count_nonzero(grad[outside]) == 0


@pytest.mark.parametrize("top_k", [None, 4])
def test_packed_teacher_equals_dense(top_k):
    student, teacher, mask = make_case(10)
    ids = None
    if top_k is not None:
        teacher, ids = torch.topk(teacher, top_k, dim=-1)
    dense, dense_grad = loss_and_grad(student, teacher, mask, 0.5, 1.0, teacher_top_k_ids=ids)
    packed_ids = None if ids is None else ids[mask].to(torch.int32)
    packed, packed_grad = loss_and_grad(student, teacher[mask], mask, 0.5, 1.0, chunk_size=2,
                                        teacher_top_k_ids=packed_ids)
    torch.testing.assert_close(packed, dense)
    torch.testing.assert_close(packed_grad, dense_grad)


@pytest.mark.parametrize("student_vocab,teacher_vocab", [(40, 48), (48, 40), (40, 40)])
def test_vocab_mismatch_compares_shared_ids(student_vocab, teacher_vocab):
    student, _, mask = make_case(11, vocab=student_vocab)
    _, teacher, _ = make_case(12, vocab=student_vocab, teacher_vocab=teacher_vocab)
    shared = min(student_vocab, teacher_vocab)
    loss, grad = loss_and_grad(student, teacher, mask, 0.5, 1.0, chunk_size=4)
    ref_loss, ref_grad = reference_loss_and_grad(student[..., :shared], teacher[..., :shared], mask,
                                                 0.5, 1.0)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[..., :shared].double(), ref_grad, rtol=1e-4, atol=1e-7)
    assert torch.count_nonzero(grad[..., shared:]) == 0
    aligned_s, aligned_t = align_vocab(student, teacher)
    assert aligned_s.shape[-1] == aligned_t.shape[-1] == shared
    assert aligned_s.data_ptr() == student.data_ptr()  # a view, not a copy


def _error_cases():
    student, teacher, mask = make_case(13)
    ids = torch.topk(teacher, 3, dim=-1).indices
    return [
        (dict(beta=-0.1), "beta"),
        (dict(beta=1.5), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(num_positions_total=int(mask.sum()) - 1), "num_positions_total"),
        (dict(num_positions_total=float(mask.sum())), "num_positions_total"),
        (dict(mask=torch.zeros_like(mask)), "mask"),
        (dict(mask=mask[:, :-1]), "mask"),
        (dict(student_logits=student[0]), "student_logits"),
        (dict(teacher_logits=teacher[:, :-1]), "teacher_logits"),
        (dict(teacher_logits=teacher[mask][:-1]), "teacher_logits"),
        (dict(teacher_logits=torch.gather(teacher, -1, ids), teacher_top_k_ids=ids + 37),
         "teacher_top_k_ids"),
        (dict(teacher_logits=torch.gather(teacher, -1, ids), teacher_top_k_ids=ids - 37),
         "teacher_top_k_ids"),
        (dict(teacher_logits=torch.gather(teacher, -1, ids), teacher_top_k_ids=ids[..., :2]),
         "teacher_top_k_ids"),
        (dict(teacher_logits=torch.gather(teacher, -1, ids), teacher_top_k_ids=ids.float()),
         "teacher_top_k_ids"),
    ]


@pytest.mark.parametrize("overrides,match", _error_cases())
def test_bad_arguments_raise_value_error_naming_them(overrides, match):
    student, teacher, mask = make_case(13)
    kwargs = dict(student_logits=student, teacher_logits=teacher, mask=mask, beta=0.5, temperature=1.0)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=match):
        generalized_jsd_loss(**kwargs)


def test_response_logit_positions_shift_by_one():
    # Row 0: 2 left-pad, prompt at 2..3, response 4..6, 1 right pad. Row 1: prompt 0..4, response 5..7.
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0],
                                   [1, 1, 1, 1, 1, 1, 1, 1]])
    start = torch.tensor([4, 5])
    mask = response_logit_positions(attention_mask, start)
    expected = torch.zeros(2, 7, dtype=torch.bool)
    for row in range(2):
        for t in range(7):  # logits at t predict token t + 1
            expected[row, t] = bool(attention_mask[row, t + 1]) and t + 1 >= int(start[row])
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert mask[1].nonzero().flatten().tolist() == [4, 5, 6]
    full = response_logit_positions(attention_mask, start, full_length=True)
    assert full.shape == (2, 8) and torch.equal(full[:, :-1], mask) and not full[:, -1].any()


def test_full_length_mask_on_unsliced_logits_equals_sliced():
    student, teacher, _ = make_case(14, batch=2, seq=8)
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])
    start = torch.tensor([3, 4])
    sliced = generalized_jsd_loss(student[:, :-1], teacher[:, :-1],
                                  response_logit_positions(attention_mask, start))
    unsliced = generalized_jsd_loss(student, teacher,
                                    response_logit_positions(attention_mask, start, full_length=True))
    torch.testing.assert_close(sliced, unsliced)


@pytest.mark.parametrize("attention_mask,start,match", [
    (torch.ones(2, 5, dtype=torch.long), torch.tensor([0, 2]), "response_start_idx"),
    (torch.ones(2, 5, dtype=torch.long), torch.tensor([2, 6]), "response_start_idx"),
    (torch.ones(2, 5, dtype=torch.long), torch.tensor([2]), "response_start_idx"),
    (torch.ones(2, 5, dtype=torch.long), torch.tensor([2.0, 3.0]), "response_start_idx"),
    (torch.ones(5, dtype=torch.long), torch.tensor([2]), "attention_mask"),
])
def test_response_logit_positions_errors(attention_mask, start, match):
    with pytest.raises(ValueError, match=match):
        response_logit_positions(attention_mask, start)
