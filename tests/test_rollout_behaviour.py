"""Sampling, repetition penalty, caches, mode switching and input errors of ``Rollout``."""

import gc

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer(pad_token_id=0, eos_token_id=None)


def test_repetition_penalty_matches_hf_on_the_padded_batch(qwen):
    ids, mask = random_prompts(4, 9, min_len=2, seed=21)
    batch = Rollout(qwen, TOK).generate(RolloutRequest(ids, mask), SamplingConfig(
        max_new_tokens=10, temperature=0.0, repetition_penalty=1.7))
    expected = qwen.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=None, repetition_penalty=1.7, temperature=None, top_p=None, top_k=None)
    assert torch.equal(batch.input_ids, expected)
    plain = Rollout(qwen, TOK).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=10,
                                                                                 temperature=0.0))
    assert not torch.equal(plain.input_ids, batch.input_ids), "the penalty must change something here"


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_repetition_penalty_does_not_count_the_left_padding(qwen, route):
    """A row's tokens do not depend on how much left padding its batch gave it. The history counted the pad ids, so
    this one-token prompt (the model's greedy choice at step 4 is the pad id 0, HF 5.24's answer) came out
    [14, 169, 183, 386]: 0 was penalised because the row was padded."""
    from tests.conftest import hf_greedy, response_of

    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0, repetition_penalty=1.3)
    alone = torch.tensor([[292]]), torch.tensor([[1]])
    padded = torch.tensor([[0] * 7 + [292], [5, 6, 7, 8, 9, 10, 11, 12]]), torch.tensor([[0] * 7 + [1], [1] * 8])
    rows = [Rollout(qwen, TOK, RolloutConfig(route=route)).generate(RolloutRequest(*request), sampling)
            for request in (alone, padded)]
    assert response_of(rows[0], 0) == response_of(rows[1], 0) == [14, 169, 183, 0]
    assert response_of(rows[0], 0) == hf_greedy(qwen, alone[0][0], alone[1][0], 4, repetition_penalty=1.3)
    assert response_of(rows[1], 1) == hf_greedy(qwen, padded[0][1], padded[1][1], 4, repetition_penalty=1.3)


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2),
])
def test_seeded_sampling_is_reproducible(qwen, sampling):
    ids, mask = random_prompts(3, 6, seed=22)
    ro = Rollout(qwen, TOK)
    cfg = SamplingConfig(max_new_tokens=12, n_samples_per_prompt=3, seed=123, **sampling)
    first = ro.generate(RolloutRequest(ids, mask), cfg)
    torch.manual_seed(999)  # the global RNG must not matter
    second = ro.generate(RolloutRequest(ids, mask), cfg)
    other = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=12, n_samples_per_prompt=3,
                                                                  seed=124, **sampling))
    assert torch.equal(first.input_ids, second.input_ids)
    assert not torch.equal(first.input_ids, other.input_ids)
    # samples of one prompt differ from each other (sampling is per row, not per prompt)
    assert not torch.equal(first.input_ids[0], first.input_ids[1])
    # a sample does not depend on its batch neighbours: the first prompt alone gives the same rows
    alone = ro.generate(RolloutRequest(ids[:1], mask[:1]), cfg)
    assert torch.equal(alone.input_ids, first.input_ids[:3, :alone.seq_len])


def test_top_k_one_equals_greedy(qwen):
    ids, mask = random_prompts(2, 6, seed=23)
    ro = Rollout(qwen, TOK)
    greedy = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=8, temperature=0.0))
    top1 = ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=1,
                                                                seed=1))
    assert torch.equal(greedy.input_ids, top1.input_ids)


def test_sampling_follows_the_model_distribution():
    """One decode step's samples follow softmax(logits / T) restricted to the top-k set."""
    from rollout.ops.sampling import select_next_token
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(20000, 1)
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.8, top_k=3, seed=0)
    rows = torch.arange(logits.shape[0])
    tokens = select_next_token(logits, cfg, None, torch.tensor(0), rows, torch.tensor(0))
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    expected = torch.softmax(logits[0, :3] / 0.8, dim=0)
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], expected, atol=0.015)


def test_counter_noise_is_uniform_and_keyed():
    from rollout.ops.sampling import uniform_noise
    u = uniform_noise(torch.tensor(7), torch.arange(64), torch.tensor(3), 4096)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.01
    # a row's noise depends on (seed, row, step) only, not on which other rows are in the batch
    alone = uniform_noise(torch.tensor(7), torch.tensor([5]), torch.tensor(3), 4096)
    assert torch.equal(alone[0], u[5])
    assert not torch.equal(u[5], uniform_noise(torch.tensor(7), torch.tensor([5]), torch.tensor(4), 4096)[0])
    assert not torch.equal(u[5], uniform_noise(torch.tensor(8), torch.tensor([5]), torch.tensor(3), 4096)[0])


def test_mode_switch_restores_every_submodule_flag(qwen):
    model = tiny_model(seed=3)
    model.train()
    model.model.layers[0].eval()  # a frozen submodule stays in eval
    ids, mask = random_prompts(1, 4, seed=24)
    Rollout(model, TOK).generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert model.training and model.model.layers[1].training
    assert not model.model.layers[0].training


def test_cache_is_reused_when_kept_and_released_otherwise(qwen):
    ids, mask = random_prompts(4, 8, seed=25)
    kept = Rollout(qwen, TOK, RolloutConfig(keep_cache=True))
    dropped = Rollout(qwen, TOK, RolloutConfig(keep_cache=False))
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0)
    outs = []
    for ro in (kept, dropped):
        a = ro.generate(RolloutRequest(ids, mask), cfg)
        b = ro.generate(RolloutRequest(ids[:2], mask[:2]), cfg)  # smaller: fits in the kept cache
        outs.append((a, b))
    assert kept.runner.pool.num_allocations == 1 and kept.runner.pool.nbytes > 0
    assert dropped.runner.pool.num_allocations == 2 and dropped.runner.pool.nbytes == 0
    # nothing outlives a call without keep_cache: no cache, no decode buffers
    assert dropped.held_bytes == 0 and kept.held_bytes >= kept.runner.pool.nbytes
    assert torch.equal(outs[0][0].input_ids, outs[1][0].input_ids)
    assert torch.equal(outs[0][1].input_ids, outs[1][1].input_ids)
    assert torch.equal(outs[0][1].input_ids, outs[0][0].input_ids[:2])
    kept.shutdown()
    assert kept.runner.pool.nbytes == 0


def _live_storage_ptrs() -> set[int]:
    """Data pointers of every tensor still referenced, without running the garbage collector."""
    ptrs = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): isinstance would touch deprecated proxies' __class__
            try:
                ptrs.add(obj.untyped_storage().data_ptr())
            except RuntimeError:  # a fake tensor of an earlier test's torch.compile: it holds no memory
                continue
    return ptrs


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_dropped_cache_is_freed_when_the_call_returns_not_at_the_next_gc(qwen, route, monkeypatch):
    """keep_cache=False frees the KV storage by reference counting as the call ends. A reference cycle
    (each cache layer pointing back at its cache) kept the whole cache alive until the garbage
    collector ran: on the H200 the 3B shape's 576 MiB cache was still allocated when the training
    forward that follows the rollout began."""
    from rollout.cache import aligned as aligned_cache
    from rollout.cache import static as kv_cache
    storages = []
    for cls in (kv_cache.StaticKVCache, aligned_cache.AlignedKVCache):
        init = cls.__init__

        def recording(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            storages.append(self.key_storage.untyped_storage().data_ptr())

        monkeypatch.setattr(cls, "__init__", recording)
    ids, mask = random_prompts(4, 8, seed=27)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0, continuous_batch_size=3 if route == "continuous"
                              else None)
    ro = Rollout(qwen, TOK, RolloutConfig(route=route, keep_cache=False))
    gc.collect()
    gc.disable()
    try:
        ro.generate(RolloutRequest(ids, mask), sampling)
        live = _live_storage_ptrs()
    finally:
        gc.enable()
    assert storages, "no cache was built"
    assert not live & set(storages), "a KV cache outlived its keep_cache=False call"


def test_generation_config_is_ignored(qwen):
    model = tiny_model(seed=4)
    ids, mask = random_prompts(2, 5, seed=26)
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
    before = Rollout(model, TOK).generate(RolloutRequest(ids, mask), cfg)
    model.generation_config.temperature = 5.0
    model.generation_config.top_k = 3
    model.generation_config.repetition_penalty = 3.0
    after = Rollout(model, TOK).generate(RolloutRequest(ids, mask), cfg)
    assert torch.equal(before.input_ids, after.input_ids)


def test_eager_attention_matches_sdpa():
    ids, mask = random_prompts(3, 7, min_len=2, seed=27)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0)
    sdpa = tiny_model(seed=5)
    eager = tiny_model(seed=5, attn_implementation="eager")
    a = Rollout(sdpa, TOK).generate(RolloutRequest(ids, mask), cfg)
    b = Rollout(eager, TOK).generate(RolloutRequest(ids, mask), cfg)
    assert torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize("make, field", [
    (lambda ids, mask: (ids[0], mask[0]), "prompt_ids"),
    (lambda ids, mask: (ids, mask[:, 1:]), "prompt_attention_mask"),
    (lambda ids, mask: (ids.float(), mask), "prompt_ids"),
    (lambda ids, mask: (ids[:, :0], mask[:, :0]), "prompt_ids"),
])
def test_request_shape_errors(make, field):
    ids, mask = random_prompts(2, 4, seed=28)
    with pytest.raises(ValueError, match=field):
        RolloutRequest(*make(ids, mask))


def test_value_errors_name_the_field(qwen):
    ro = Rollout(qwen, TOK)
    ids, mask = random_prompts(2, 4, seed=29)
    empty_row = mask.clone()
    empty_row[1] = 0
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        ro.generate(RolloutRequest(ids, empty_row), SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        ro.generate(RolloutRequest(ids, mask * 2), SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt_ids"):
        ro.generate(RolloutRequest(ids + 10_000, mask), SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"^max_new_tokens: .* = 513 exceeds the context limit 512 \(the model's "
                                         r"max_position_embeddings\)$"):  # 4 + 509 > 512 positions: no silent truncation
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=509))
    with pytest.raises(ValueError, match=r"^max_new_tokens: .* = 6 exceeds the context limit 5 "
                                         r"\(RolloutConfig.max_context\)$"):  # says where the limit was set
        Rollout(qwen, TOK, RolloutConfig(max_context=5)).generate(RolloutRequest(ids, mask),
                                                                  SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="sampling"):
        ro.generate(RolloutRequest(ids, mask), {"max_new_tokens": 2})


@pytest.mark.parametrize("tokenizer, field", [
    (TinyTokenizer(pad_token_id=None, eos_token_id=None), "pad_token_id"),
    (TinyTokenizer(pad_token_id=0, eos_token_id="</s>"), "eos_token_id"),
    (TinyTokenizer(pad_token_id=1.5, eos_token_id=2), "pad_token_id"),
])
def test_tokenizer_errors(qwen, tokenizer, field):
    with pytest.raises(ValueError, match=field):
        Rollout(qwen, tokenizer)


def test_unsupported_attention_is_rejected():
    model = tiny_model(seed=6)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="_attn_implementation"):
        Rollout(model, TOK)
