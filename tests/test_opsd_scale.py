"""The OPSD step at scale: micro-batches of the student and teacher, their plan, sizing and breakdown.

Oracle: the same step with every row at once (``max_student_rows=None, max_teacher_rows=None``) on
an identical fresh model. Micro-batching changes only the order of fp32 sums, so losses agree to
``rel=1e-5`` and every parameter's gradient to ``rtol=1e-4, atol=1e-7`` (measured differences are
about 1e-6 relative). Batches are built by hand: left-padded prompts, right-padded responses of mixed
lengths, one row without any response token (left out of the loss).
"""

import math

import pytest
import torch

from rollout import RolloutBatch
from rollout.config import SamplingConfig
from rollout.model import compat
from rollout.opsd import OPSDConfig, OPSDStep
from rollout.opsd import micro_batches as mb
from rollout.opsd import sizing
from rollout.opsd.breakdown import PHASES, rollout_path
from rollout.opsd.inputs import distill_inputs
from rollout.opsd.logit_cache import LogitCacheConfig, TeacherLogitCache
from rollout.opsd.teacher import TeacherStream
from rollout.stats import CallStats
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

NUM_ROWS, PROMPT_LEN, RESPONSE_LEN = 8, 6, 9
ONE_SHOT = dict(max_student_rows=None, max_teacher_rows=None)


def make_batch(seed=0, num_rows=NUM_ROWS, empty_row=3) -> RolloutBatch:
    """Prompts of 2..6 real tokens, responses of 1..9 (row 0 the longest), row ``empty_row`` none."""
    ids, mask = random_prompts(num_rows, PROMPT_LEN, min_len=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, RESPONSE_LEN + 1, (num_rows,), generator=gen)
    lengths[0] = RESPONSE_LEN
    if empty_row is not None:
        lengths[empty_row] = 0
    response_mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).long()  # [N, T_r]
    response = torch.randint(3, 512, (num_rows, RESPONSE_LEN), generator=gen) * response_mask
    return RolloutBatch(torch.cat([ids, response], 1), torch.cat([mask, response_mask], 1),
                        torch.full((num_rows,), PROMPT_LEN))


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it applies."""

    def step(self, closure=None):
        self.applied = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def run(config: OPSDConfig, batch, *, teacher="llama", teacher_vocab=512, teacher_prompts=None):
    """``(result, {name: gradient}, {name: updated weight}, step)`` of one step on fresh seeded models."""
    student = tiny_model("qwen2", seed=0).train()
    teacher_model = student if teacher == "self" else tiny_model(teacher, seed=1, vocab_size=teacher_vocab)
    optimizer = RecordingSGD(student.parameters(), lr=1.0)
    step = OPSDStep(student, teacher_model, TinyTokenizer(eos_token_id=2), config, optimizer=optimizer)
    kwargs = {} if teacher_prompts is None else dict(zip(("teacher_prompt_ids", "teacher_prompt_attention_mask"),
                                                        teacher_prompts))
    result = step.train_on_batch(batch, **kwargs)
    names = [name for name, _ in student.named_parameters()]
    weights = {name: p.detach().clone() for name, p in student.named_parameters()}
    return result, dict(zip(names, optimizer.applied)), weights, step


def assert_same_step(micro, one_shot):
    (result, grads, weights, _), (ref, ref_grads, ref_weights, _) = micro, one_shot
    assert result.loss == pytest.approx(ref.loss, rel=1e-5)
    assert result.num_response_tokens == ref.num_response_tokens
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert ref_grads[name].abs().max() > 0, name  # every weight gets a gradient: nothing vacuous
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-4, atol=1e-7, msg=name)


# ---- micro-batched == one-shot ------------------------------------------------------------------
@pytest.mark.parametrize("config, teacher_vocab, micro_batches, teacher_forwards", [
    (dict(max_student_rows=1), 512, 7, 7),
    (dict(max_student_rows=2, beta=0.0, temperature=2.0), 512, 4, 4),  # 7 rows: 2, 2, 2, 1
    (dict(max_student_rows=3, max_teacher_rows=None), 512, 3, 1),      # 3, 2, 2; one teacher forward
    (dict(max_student_rows=3, max_teacher_rows=2, beta=1.0), 520, 3, 4),  # teacher chunks straddle them
    (dict(max_student_rows=5, teacher_top_k=8), 512, 2, 2),            # 4, 3
    (dict(max_student_rows=2, max_teacher_rows=3, teacher_top_k=8, logit_cache_location="host"), 520, 4, 3),
    (dict(max_student_rows="auto", max_micro_batch_gib=1e-3, loss_chunk_size=4), 512, None, None),
])
def test_micro_batched_step_equals_one_shot(config, teacher_vocab, micro_batches, teacher_forwards):
    batch = make_batch()
    micro = run(OPSDConfig(**config), batch, teacher_vocab=teacher_vocab)
    one_config = {**config, **ONE_SHOT}
    one_config.pop("max_micro_batch_gib", None)
    assert_same_step(micro, run(OPSDConfig(**one_config), batch, teacher_vocab=teacher_vocab))
    breakdown = micro[0].breakdown
    if micro_batches is None:  # "auto" under a tiny budget: several micro-batches, each within it
        assert 1 < breakdown.num_micro_batches < NUM_ROWS - 1
        assert breakdown.budget_gib == config["max_micro_batch_gib"]
    else:
        assert (breakdown.num_micro_batches, breakdown.num_teacher_forwards) == (micro_batches, teacher_forwards)


def test_auto_micro_batches_fit_the_budget():
    batch = make_batch()
    budget = 1e-3 * sizing.GIB
    step = OPSDStep(tiny_model("qwen2", seed=0), tiny_model("llama", seed=1), TinyTokenizer(eos_token_id=2),
                    OPSDConfig(loss_chunk_size=4), optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    stats = distill_inputs(batch, None).stats
    plan = mb.plan_micro_batches(stats, "auto", "auto", step.row_cost, budget)
    sizes = [step.row_cost.micro_batch_bytes(stats, plan.rows(span)) for span in plan.groups]
    assert all(size <= budget for size in sizes)
    assert any(b - a > 1 for a, b in plan.groups) and len(plan.groups) > 1  # packed, and more than one
    for (a, b), (c, _) in zip(plan.groups, plan.groups[1:]):  # each stopped because the next row did not fit
        assert step.row_cost.micro_batch_bytes(stats, plan.order[a:c + 1]) > budget
    assert sorted(plan.order) == [r for r in range(NUM_ROWS) if r != 3]


def test_self_distillation_with_teacher_prompts_micro_batched_equals_one_shot():
    batch = make_batch(seed=4)
    teacher_prompts = random_prompts(NUM_ROWS, 10, min_len=3, seed=9)  # privileged context, longer prompts
    kwargs = dict(logit_cache_dtype=torch.float32, beta=0.5)
    micro = run(OPSDConfig(max_student_rows=3, max_teacher_rows=2, **kwargs), batch, teacher="self",
                teacher_prompts=teacher_prompts)
    one = run(OPSDConfig(**ONE_SHOT, **kwargs), batch, teacher="self", teacher_prompts=teacher_prompts)
    assert one[0].loss > 1e-4  # the teacher sees another prompt: a real target
    assert_same_step(micro, one)


def test_step_with_rollout_micro_batched_equals_one_shot():
    ids, mask = random_prompts(3, PROMPT_LEN, min_len=2, seed=2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2, seed=3)
    results = []
    for config in (OPSDConfig(max_student_rows=4, max_teacher_rows=1), OPSDConfig(**ONE_SHOT)):
        student = tiny_model("qwen2", seed=0).train()
        step = OPSDStep(student, tiny_model("llama", seed=1), TinyTokenizer(eos_token_id=2), config,
                        optimizer=torch.optim.SGD(student.parameters(), lr=1.0))
        results.append((step.step(ids, mask, sampling), dict(student.named_parameters())))
    (micro, micro_weights), (one, one_weights) = results
    assert torch.equal(micro.batch.input_ids, one.batch.input_ids)  # same seed, same rollout
    assert micro.loss == pytest.approx(one.loss, rel=1e-5)
    for name, weight in one_weights.items():
        torch.testing.assert_close(micro_weights[name], weight, rtol=1e-4, atol=1e-7)
    assert micro.breakdown.num_micro_batches == 2 and micro.breakdown.num_teacher_forwards == 6


# ---- memory: no [N, k, V] logits, at most one micro-batch of teacher logits cached -------------------
def record_logits(model, shapes: list):
    return compat.causal_lm(model).lm_head.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(out.shape)))


def record_live_caches(monkeypatch) -> dict:
    """Counts the teacher logit caches alive (built, not yet freed); returns ``{"live", "max"}``."""
    counts = {"live": 0, "max": 0}
    build, free = TeacherLogitCache.build.__func__, TeacherLogitCache.free

    def counting_build(cls, *args, **kwargs):
        cache = build(cls, *args, **kwargs)
        counts["live"] += 1
        counts["max"] = max(counts["max"], counts["live"])
        return cache

    def counting_free(self):
        if not self.is_freed:
            counts["live"] -= 1
        free(self)

    monkeypatch.setattr(TeacherLogitCache, "build", classmethod(counting_build))
    monkeypatch.setattr(TeacherLogitCache, "free", counting_free)
    return counts


@pytest.mark.parametrize("config, max_student_rows, max_live", [  # the padded path's logits (packed: none)
    (OPSDConfig(max_student_rows=2, train_path="padded"), 2, 1),  # teacher per micro-batch: one cache at a time
    (OPSDConfig(max_student_rows=2, max_teacher_rows=3, train_path="padded"), 3, 2),  # straddling chunks: two at most
    (OPSDConfig(**ONE_SHOT, train_path="padded"), NUM_ROWS - 1, 1),
])
def test_logits_exist_for_one_micro_batch_at_a_time(monkeypatch, config, max_student_rows, max_live):
    batch = make_batch()
    student, teacher = tiny_model("qwen2", seed=0).train(), tiny_model("llama", seed=1)
    student_shapes, teacher_shapes = [], []
    handles = [record_logits(student, student_shapes), record_logits(teacher, teacher_shapes)]
    caches = record_live_caches(monkeypatch)
    step = OPSDStep(student, teacher, TinyTokenizer(eos_token_id=2), config,
                    optimizer=torch.optim.SGD(student.parameters(), lr=0.1))
    step.train_on_batch(batch)
    for handle in handles:
        handle.remove()
    one_shot_numel = (NUM_ROWS - 1) * (RESPONSE_LEN + 1) * 512  # [valid rows, k, V]
    assert max(shape[0] for shape in student_shapes) == min(config.max_student_rows or NUM_ROWS, NUM_ROWS - 1)
    assert max(shape[0] for shape in teacher_shapes) <= max_student_rows
    assert max(math.prod(shape) for shape in student_shapes) <= one_shot_numel
    if config.max_student_rows is not None:
        assert max(math.prod(shape) for shape in student_shapes + teacher_shapes) < one_shot_numel
    assert caches["max"] == max_live and caches["live"] == 0  # all freed by the end of the step


def test_a_failing_micro_batch_leaves_no_gradient(monkeypatch):
    batch = make_batch()
    student = tiny_model("qwen2", seed=0).train()
    step = OPSDStep(student, tiny_model("llama", seed=1), TinyTokenizer(eos_token_id=2),
                    OPSDConfig(max_student_rows=2), optimizer=torch.optim.SGD(student.parameters(), lr=0.1))
    calls = []

    def failing_backward(loss):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        loss.backward()

    monkeypatch.setattr(step.student, "backward", failing_backward)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    with pytest.raises(RuntimeError, match="injected"):
        step.train_on_batch(batch)
    assert all(p.grad is None for p in student.parameters())
    assert all(torch.equal(p, before[n]) for n, p in student.named_parameters())


# ---- the breakdown ---------------------------------------------------------------------------------
def test_breakdown_times_every_phase_on_cpu():
    ids, mask = random_prompts(2, PROMPT_LEN, min_len=2, seed=2)
    student = tiny_model("qwen2", seed=0).train()
    step = OPSDStep(student, tiny_model("llama", seed=1), TinyTokenizer(eos_token_id=2), OPSDConfig(max_student_rows=2),
                    optimizer=torch.optim.SGD(student.parameters(), lr=0.1))
    result = step.step(ids, mask, SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, seed=1))
    breakdown = result.breakdown
    assert all(getattr(breakdown.host_ms, name) > 0 for name in PHASES)
    assert breakdown.host_ms.total() <= result.step_ms
    assert breakdown.host_ms.rollout == pytest.approx(result.rollout_ms, rel=0.2)
    assert breakdown.device_ms is None and breakdown.peak_gib is None  # no device clock or allocator on CPU
    assert (breakdown.num_micro_batches, breakdown.max_micro_batch_rows) == (2, 2)
    assert breakdown.budget_gib is None  # an int max_student_rows reads no budget
    text = "\n".join(breakdown.lines())
    assert "rollout" in text and "student fwd" in text and "2 micro-batches of <= 2 rows" in text
    path = "ordinary route, prefill packed, decode fast_eager (eager fast step: device cpu has no CUDA graphs)"
    assert breakdown.rollout_path == path and breakdown.lines()[-1] == f"rollout: {path}"
    again = step.train_on_batch(result.batch).breakdown
    assert again.host_ms.rollout is None and "rollout" not in again.lines()[0]
    assert again.rollout_path == "" and not any(line.startswith("rollout:") for line in again.lines())


def test_a_rollout_through_hf_layers_says_why_in_the_breakdown():
    stats = CallStats(route="continuous")
    stats.decode.path, stats.decode.fallback_reason = "hf", "kernels.fast_decode disabled in RolloutConfig"
    assert rollout_path(stats) == ("continuous route, prefill hf, decode hf (kernels.fast_decode disabled in "
                                   "RolloutConfig)")
    stats.decode.path = "graph"  # a reason the graph path keeps (none) is not printed
    assert rollout_path(stats) == "continuous route, prefill hf, decode graph"
    stats.decode.path, stats.decode.fallback_reason = "fast_eager", "graph capture failed: RuntimeError('x')"
    assert rollout_path(stats).endswith("decode fast_eager (graph capture failed: RuntimeError('x'))")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: events and the allocator's peak")
def test_breakdown_has_gpu_times_and_peaks_on_cuda():
    ids, mask = random_prompts(2, PROMPT_LEN, min_len=2, seed=2, device="cuda")
    student = tiny_model("qwen2", seed=0, device="cuda").train()
    step = OPSDStep(student, tiny_model("llama", seed=1, device="cuda"), TinyTokenizer(eos_token_id=2),
                    OPSDConfig(), optimizer=torch.optim.SGD(student.parameters(), lr=0.1))
    breakdown = step.step(ids, mask, SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, seed=1)).breakdown
    assert all(getattr(breakdown.device_ms, name) > 0 for name in PHASES)
    assert all(getattr(breakdown.peak_gib, name) > 0 for name in PHASES)
    assert breakdown.budget_gib > 0


# ---- the plan (pure) -----------------------------------------------------------------------------
def stats_of(extents, firsts=None, counts=None, response_column=10):
    n = len(extents)
    firsts = firsts or [0] * n
    counts = counts if counts is not None else list(extents)
    return mb.RowStats(tuple(counts), tuple(extents), tuple(firsts), tuple(firsts), response_column, response_column)


@pytest.mark.parametrize("num_rows, parts, expected", [
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (6, 2, [(0, 3), (3, 6)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (5, 1, [(0, 5)]),
])
def test_even_spans(num_rows, parts, expected):
    assert mb.even_spans(num_rows, parts) == expected


@pytest.mark.parametrize("spans, parts, expected", [
    ([(0, 4)], 2, [(0, 2), (2, 4)]),
    ([(0, 2), (2, 5)], 3, [(0, 2), (2, 4), (4, 5)]),
    ([(0, 3), (3, 6)], 4, [(0, 2), (2, 3), (3, 5), (5, 6)]),
    ([(0, 1), (1, 2)], 2, [(0, 1), (1, 2)]),
])
def test_split_spans_splits_the_largest_first(spans, parts, expected):
    assert mb.split_spans(spans, parts) == expected


def test_order_leaves_out_rows_without_positions_and_sorts_longest_first():
    stats = stats_of([3, 0, 5, 5, 1], firsts=[0, 0, 4, 2, 1])
    assert mb.processing_order(stats, by_length=False) == [0, 2, 3, 4]
    assert mb.processing_order(stats, by_length=True) == [3, 2, 0, 4]  # ties: the longer prompt first
    assert stats.columns([2, 0]) == (0, 15, 6)
    assert stats.columns([2, 3]) == (2, 15, 6)
    assert stats.columns([4], teacher=True) == (1, 11, 2)


def test_budget_packing_grows_while_the_estimate_fits():
    stats = stats_of([8, 8, 4, 4, 2, 2, 1])
    cost = mb.RowCost(bytes_per_token=1.0, bytes_per_position=0.0, fixed_bytes=0.0)
    order = mb.processing_order(stats, by_length=True)
    spans = mb.budget_spans(stats, order, cost, budget_bytes=40.0)  # widths 18, 14, 12, 11
    assert spans == [(0, 2), (2, 4), (4, 7)]
    assert all(cost.micro_batch_bytes(stats, order[a:b]) <= 40.0 for a, b in spans)
    with pytest.warns(UserWarning, match=r"^max_micro_batch_gib: one row needs .* over the micro-batch budget") as seen:
        assert mb.budget_spans(stats, order, cost, budget_bytes=1.0) == [(i, i + 1) for i in range(7)]
    assert len(seen) == 1  # one warning a call, not one a row


def test_rows_within_the_budget_raise_no_warning(recwarn):
    stats = stats_of([8, 8, 4, 4, 2, 2, 1])
    cost = mb.RowCost(bytes_per_token=1.0, bytes_per_position=0.0, fixed_bytes=0.0)
    mb.budget_spans(stats, mb.processing_order(stats, by_length=True), cost, budget_bytes=40.0)
    assert not [w for w in recwarn if "max_micro_batch_gib" in str(w.message)]


@pytest.mark.parametrize("student_rows, teacher_rows, groups, chunks", [
    (None, None, 1, 1), (None, 2, 1, 3), (2, "auto", 3, 3), (2, None, 3, 1),
    ("auto", 4, 3, 2),  # auto, budget 40: rows of widths 18, 18 | 14, 14 | 12
])
def test_plan_counts(student_rows, teacher_rows, groups, chunks):
    stats = stats_of([8, 8, 4, 4, 2, 0])
    cost = mb.RowCost(1.0, 0.0, 0.0)
    plan = mb.plan_micro_batches(stats, student_rows, teacher_rows, cost, budget_bytes=40.0)
    assert (len(plan.groups), len(plan.teacher_chunks)) == (groups, chunks)
    assert plan.groups[0][0] == 0 and plan.groups[-1][1] == plan.num_rows == 5
    assert all(a[1] == b[0] for a, b in zip(plan.groups, plan.groups[1:]))


def test_agree_splits_to_the_ranks_counts_or_names_the_field():
    plan = mb.plan_micro_batches(stats_of([8, 4, 4, 2]), 2, 3, mb.RowCost(1.0, 0.0, 0.0), 0.0)
    agreed = mb.agree(plan, num_groups=3, num_chunks=3)
    assert agreed.groups == agreed.teacher_chunks == ((0, 1), (1, 2), (2, 4))
    follows = mb.plan_micro_batches(stats_of([8, 4, 4, 2]), 2, "auto", mb.RowCost(1.0, 0.0, 0.0), 0.0)
    assert mb.agree(follows, 4, 4).teacher_chunks == mb.agree(follows, 4, 4).groups
    with pytest.raises(ValueError, match="^max_student_rows: .*5 micro-batches"):
        mb.agree(plan, num_groups=5, num_chunks=3)


# ---- the teacher stream ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks, groups", [
    ([(0, 5)], [(0, 2), (2, 5)]),
    ([(0, 2), (2, 4), (4, 5)], [(0, 3), (3, 5)]),
    ([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], [(0, 5)]),
])
def test_teacher_stream_returns_each_spans_positions_and_frees_read_chunks(chunks, groups):
    counts = [2, 1, 3, 1, 2]  # loss positions per row (every row of a plan has some)
    values = torch.arange(sum(counts) * 4, dtype=torch.float32).view(-1, 4)  # position p holds 4p..4p+3
    offsets = [0, 2, 3, 6, 7, 9]
    built = []

    def build(span):
        rows = range(*span)
        mask = torch.zeros(len(rows), 3, dtype=torch.bool)
        for i, row in enumerate(rows):
            mask[i, :counts[row]] = True
        logits = torch.zeros(len(rows), 3, 4)
        logits[mask] = values[offsets[span[0]]:offsets[span[1]]]
        cache = TeacherLogitCache.build(logits, mask, LogitCacheConfig(dtype=torch.float32))
        built.append(cache)
        return cache

    stream = TeacherStream(build, chunks, counts)
    for start, stop in groups:
        stream.prepare((start, stop))
        got, ids = stream.take((start, stop), "cpu")
        assert ids is None and torch.equal(got, values[offsets[start]:offsets[stop]])
        stream.release((start, stop))
        assert all(cache.is_freed for cache, chunk in zip(built, chunks) if chunk[1] <= stop)
    assert stream.num_built == len(chunks)
    stream.close()
    assert all(cache.is_freed for cache in built)


# ---- sizing --------------------------------------------------------------------------------------------
def test_activation_estimate_covers_the_measured_saved_tensors():
    """The per-token estimate is at least what autograd keeps for backward (bf16 Qwen2 shape, no padding)."""
    model = tiny_model("qwen2", seed=0, hidden_size=128, intermediate_size=688, num_attention_heads=8,
                       num_key_value_heads=2, dtype=torch.bfloat16).train()
    cost = sizing.row_cost(model, model, LogitCacheConfig(), 16)
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    rows, tokens = 2, 64
    ids = torch.randint(3, 512, (rows, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, use_cache=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(size for ptr, size in seen.items() if ptr not in params) / (rows * tokens)
    teacher_scratch = (2 * 688 + 4 * 128) * 2
    assert measured <= cost.bytes_per_token - teacher_scratch <= 1.5 * measured


def test_three_b_shape_estimate_follows_the_formula():
    from transformers import AutoModelForCausalLM

    from rollout.testing import shape_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config("qwen25-3b"), dtype=torch.bfloat16)
    cost = sizing.row_cost(model, model, LogitCacheConfig(), 512)
    hidden, mlp, layers, vocab = 2048, 11008, 36, 151936
    per_layer = sizing.ACTIVATION_H * hidden + sizing.ACTIVATION_I * mlp
    assert cost.bytes_per_token == layers * per_layer + 8 * hidden + (2 * mlp + 4 * hidden) * 2
    assert cost.bytes_per_position == vocab * (2 * 2 + 2 + 2)
    # the chunk scratch: 10 float32 [chunk, V] temporaries, a chunk of at most the micro-batch's positions
    assert cost.fixed_bytes == 0 and cost.chunk_size == 512 and cost.chunk_bytes_per_position == 10 * vocab * 4
    top_k = sizing.row_cost(model, model, LogitCacheConfig(top_k=64), 512)
    assert top_k.bytes_per_position == vocab * (2 * 2 + 2) + 64 * (2 + 4)


@pytest.mark.parametrize("gib, expected", [(3.0, 3.0 * sizing.GIB), (None, sizing.CPU_MICRO_BATCH_GIB * sizing.GIB)])
def test_budget_bytes_on_cpu(gib, expected):
    assert sizing.budget_bytes(gib, torch.device("cpu")) == expected
