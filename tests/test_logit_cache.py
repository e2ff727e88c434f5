"""TeacherLogitCache: packing, bf16 storage, device/host placement, top-k, vocab rule, freeing."""

import gc
import weakref

import pytest
import torch

from rollout.opsd.logit_cache import CachedTeacherLogits, LogitCacheConfig, TeacherLogitCache
from rollout.opsd.losses import generalized_jsd_loss, response_logit_positions
from rollout.testing import tiny_model
from tests.oracles import reference_jsd

CUDA = torch.cuda.is_available()


def make_case(seed, batch=3, seq=10, vocab=41, teacher_vocab=None):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, vocab, generator=gen) * 2
    teacher = torch.randn(batch, seq, teacher_vocab or vocab, generator=gen) * 3
    mask = torch.rand(batch, seq, generator=gen) < 0.5
    mask[-1, -1] = True
    return student, teacher, mask


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(location="gpu"), "location"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(dtype="bfloat16"), "dtype"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogitCacheConfig(**kwargs)


def test_config_is_frozen():
    config = LogitCacheConfig()
    with pytest.raises(AttributeError):
        config.top_k = 3


@pytest.mark.parametrize("location", ["device", "host"])
def test_full_vocab_cache_packs_masked_rows_in_bf16(location):
    _, teacher, mask = make_case(0)
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(location=location), chunk_size=3)
    cached = cache.get()
    num_positions = int(mask.sum())
    assert isinstance(cached, CachedTeacherLogits) and cached.ids is None
    assert cached.values.dtype == torch.bfloat16 and cached.values.shape == (num_positions, 41)
    assert torch.equal(cached.values, teacher[mask].to(torch.bfloat16))
    assert torch.equal(cached.mask, mask) and cached.num_positions == num_positions
    assert cache.nbytes == num_positions * 41 * 2
    assert cached.values.is_pinned() == (location == "host" and CUDA)


@pytest.mark.parametrize("top_k", [None, 6])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_device_and_host_cache_give_same_loss(top_k, beta):
    student, teacher, mask = make_case(1)
    losses, grads = [], []
    for location in ("device", "host"):
        cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=top_k, location=location))
        cached = cache.to_device(student.device)
        leaf = student.clone().requires_grad_(True)
        loss = generalized_jsd_loss(leaf, cached.values, cached.mask, beta, 1.5,
                                    teacher_top_k_ids=cached.ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append(leaf.grad)
        cache.free()
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_full_cache_loss_equals_reference_on_bf16_teacher(temperature):
    student, teacher, mask = make_case(2)
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig())
    cached = cache.get()
    loss = generalized_jsd_loss(student, cached.values, cached.mask, 0.5, temperature, chunk_size=4)
    expected = reference_jsd(student, teacher.to(torch.bfloat16), mask, 0.5, temperature)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [1, 4, 41])
def test_top_k_cache_loss_equals_renormalised_reference(beta, top_k):
    student, teacher, mask = make_case(3)
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=top_k), chunk_size=2)
    cached = cache.get()
    assert cached.ids.dtype == torch.int32 and cached.ids.shape == (int(mask.sum()), top_k)
    assert cache.nbytes == int(mask.sum()) * top_k * (2 + 4)
    top_values, top_ids = torch.topk(teacher, top_k, dim=-1)  # both: [B, T, K]
    assert torch.equal(cached.ids.long().sort(-1).values, top_ids[mask].sort(-1).values)
    leaf = student.double().requires_grad_(True)
    expected = reference_jsd(torch.gather(leaf, -1, top_ids), top_values.to(torch.bfloat16), mask,
                             beta, 0.8)
    expected.backward()
    student_leaf = student.clone().requires_grad_(True)
    loss = generalized_jsd_loss(student_leaf, cached.values, cached.mask, beta, 0.8,
                                teacher_top_k_ids=cached.ids)
    loss.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student_leaf.grad.double(), leaf.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("top_k", [None, 5])
def test_student_vocab_size_drops_teacher_only_ids(top_k):
    student, teacher, mask = make_case(4, vocab=32, teacher_vocab=40)
    teacher[..., 32:] += 100.0  # padding rows that would win every top-k if not dropped
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=top_k), student_vocab_size=32)
    cached = cache.get()
    if top_k is None:
        assert cached.values.shape[-1] == 32
    else:
        assert int(cached.ids.max()) < 32
    loss = generalized_jsd_loss(student, cached.values, cached.mask, teacher_top_k_ids=cached.ids)
    shared_teacher = teacher[..., :32]
    if top_k is not None:
        values, ids = torch.topk(shared_teacher, top_k, dim=-1)
        expected = reference_jsd(torch.gather(student, -1, ids), values.to(torch.bfloat16), mask, 0.5, 1)
    else:
        expected = reference_jsd(student, shared_teacher.to(torch.bfloat16), mask, 0.5, 1)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("location", ["device", "host"])
def test_free_releases_storage(location):
    _, teacher, mask = make_case(5)
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=3, location=location))
    values_ref = weakref.ref(cache.get().values)
    ids_ref = weakref.ref(cache.get().ids)
    assert cache.nbytes > 0 and not cache.is_freed
    cache.free()
    gc.collect()
    assert values_ref() is None and ids_ref() is None
    assert cache.is_freed and cache.nbytes == 0 and cache.num_positions == 0
    with pytest.raises(RuntimeError, match="freed"):
        cache.get()
    with pytest.raises(RuntimeError, match="freed"):
        cache.to_device("cpu")
    cache.free()  # idempotent


@pytest.mark.parametrize("location", ["device", "host"])
@pytest.mark.parametrize("top_k", [None, 4])
def test_take_slices_the_packed_positions(location, top_k):
    _, teacher, mask = make_case(7)
    cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=top_k, location=location))
    whole = cache.get()
    for start, stop in [(0, 0), (0, 3), (2, cache.num_positions), (0, cache.num_positions)]:
        values, ids = cache.take(start, stop, "cpu")
        assert torch.equal(values, whole.values[start:stop])
        assert (ids is None) == (top_k is None) and (ids is None or torch.equal(ids, whole.ids[start:stop]))
    with pytest.raises(ValueError, match="positions"):
        cache.take(1, cache.num_positions + 1, "cpu")
    cache.free()
    with pytest.raises(RuntimeError, match="freed"):
        cache.take(0, 1, "cpu")


@pytest.mark.parametrize("kwargs,match", [
    (dict(mask="zeros"), "mask"),
    (dict(mask="short"), "mask"),
    (dict(teacher_logits="2d"), "teacher_logits"),
    (dict(config=LogitCacheConfig(top_k=42)), "top_k"),
    (dict(student_vocab_size=0), "student_vocab_size"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_build_errors_name_the_argument(kwargs, match):
    _, teacher, mask = make_case(6)
    args = dict(teacher_logits=teacher, mask=mask, config=LogitCacheConfig())
    replacements = {"zeros": torch.zeros_like(mask), "short": mask[:, :-1], "2d": teacher[0]}
    args.update({key: replacements.get(value, value) if isinstance(value, str) else value
                 for key, value in kwargs.items()})
    with pytest.raises(ValueError, match=match):
        TeacherLogitCache.build(args.pop("teacher_logits"), args.pop("mask"), args.pop("config"), **args)


@pytest.mark.parametrize("top_k", [None, 16])
def test_tiny_models_end_to_end_device_and_host(top_k):
    """Teacher forward -> cache over response positions -> student loss -> student grads."""
    teacher, student = tiny_model(seed=1), tiny_model(seed=2).train()
    input_ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    attention_mask[0, -2:] = 0  # right padding after an early EOS
    mask = response_logit_positions(attention_mask, torch.tensor([6, 7]))
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    losses = []
    for location in ("device", "host"):
        cache = TeacherLogitCache.build(teacher_logits, mask,
                                        LogitCacheConfig(top_k=top_k, location=location))
        cached = cache.to_device("cpu")
        student.zero_grad()
        logits = student(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        loss = generalized_jsd_loss(logits, cached.values, cached.mask, 0.5, 1.0,
                                    teacher_top_k_ids=cached.ids, chunk_size=4)
        loss.backward()
        cache.free()
        losses.append(loss.detach())
        assert torch.isfinite(loss) and loss > 0
        assert student.lm_head.weight.grad.abs().sum() > 0
    assert torch.equal(losses[0], losses[1])


@pytest.mark.skipif(not CUDA, reason="needs CUDA: pinned host memory and non-blocking copies")
@pytest.mark.parametrize("top_k", [None, 8])
def test_cuda_pinned_host_cache_matches_device_cache(top_k):
    student, teacher, mask = (t.cuda() for t in make_case(7))
    losses = []
    for location in ("device", "host"):
        cache = TeacherLogitCache.build(teacher, mask, LogitCacheConfig(top_k=top_k, location=location))
        if location == "host":
            stored = cache.get().values
            assert stored.is_pinned() and not stored.is_cuda
        cached = cache.to_device("cuda")
        assert cached.values.is_cuda
        losses.append(generalized_jsd_loss(student, cached.values, cached.mask,
                                           teacher_top_k_ids=cached.ids))
        cache.free()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
