"""Bad inputs to the rollout API, one row each: the exact error (naming the field), raised before any work
(nothing allocated: the engine's cache pool is still empty, the model unchanged)."""

import warnings

import pytest
import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

IDS, MASK = random_prompts(3, 6, min_len=2, seed=4)
OK_SAMPLING = dict(max_new_tokens=4, temperature=0.0)


def _meta(tensor):
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


CASES = {
    # (request kwargs or a callable building them, tokenizer, sampling kwargs, config kwargs) -> message
    "soft mask": (dict(prompt_attention_mask=MASK * 0.5), {}, {}, {},
                  r"prompt_attention_mask: values must be exactly 0 or 1; \d+ entries are not"),
    "mask of 2": (dict(prompt_attention_mask=MASK * 2), {}, {}, {}, "prompt_attention_mask: values must be exactly"),
    "uint8 ids": (dict(prompt_ids=IDS.to(torch.uint8)), {}, {}, {},
                  "prompt_ids: must hold token ids as int64 or int32; got dtype torch.uint8"),
    "int16 ids": (dict(prompt_ids=IDS.to(torch.int16)), {}, {}, {}, "prompt_ids: must hold token ids as int64"),
    "float ids": (dict(prompt_ids=IDS.float()), {}, {}, {}, "prompt_ids: must hold token ids"),
    "ids on meta": (dict(prompt_ids=_meta(IDS)), {}, {}, {}, "prompt_ids: is on the meta device"),
    "mask on meta": (dict(prompt_attention_mask=_meta(MASK)), {}, {}, {}, "prompt_attention_mask: is on the meta"),
    "id outside vocab": (dict(prompt_ids=IDS + 600), {}, {}, {}, r"prompt_ids: token ids must be in \[0, 512\)"),
    "pad outside vocab": ({}, dict(pad_token_id=512), {}, {},
                          r"tokenizer.pad_token_id: 512 is outside the model's vocabulary \[0, 512\)"),
    "negative pad": ({}, dict(pad_token_id=-1), {}, {}, "tokenizer.pad_token_id: -1 is outside"),
    "eos outside vocab": ({}, dict(eos_token_id=[2, 700]), {}, {},
                          r"tokenizer.eos_token_id: \[700\] outside the model's vocabulary"),
    "seed 2**32": ({}, {}, dict(seed=2**32), {}, r"seed: must be None or an int in \[0, 2\*\*32\)"),
    "negative seed": ({}, {}, dict(seed=-5), {}, "seed: must be None or an int in"),
    "a million samples": ({}, {}, dict(n_samples_per_prompt=10**7), {},
                          r"max_cache_gib: the ordinary route \(30000000 rows\)"),
    "cap too small": ({}, {}, dict(n_samples_per_prompt=2), dict(route="continuous", max_cache_gib=1e-9),
                      "max_cache_gib: one prompt's 2 samples needs a KV cache"),
    "cap not a number": ({}, {}, {}, dict(max_cache_gib="1"), "max_cache_gib: must be None or a finite number > 0"),
    "logprobs flag": ({}, {}, dict(return_logprobs=1), {}, "return_logprobs: must be a bool"),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_before_any_work(model, name):
    request, tokenizer, sampling, config, message = CASES[name]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        ro = Rollout(model, TinyTokenizer(**{"pad_token_id": 0, "eos_token_id": 2, **tokenizer}),
                     RolloutConfig().with_settings(config))
        ro.generate(RolloutRequest(**{"prompt_ids": IDS, "prompt_attention_mask": MASK, **request}),
                    SamplingConfig(**{**OK_SAMPLING, **sampling}))
    if "ro" in locals():
        assert ro.runner.pool.nbytes == 0 and ro.held_bytes == 0  # nothing was allocated
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_seeds_below_2_32_are_accepted_and_distinct(model):
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None))
    draws = [ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(max_new_tokens=6, seed=s)).input_ids
             for s in (5, 2**32 - 1)]
    assert not torch.equal(*draws)


# ---- issue 34: tiny temperatures, construction-time checks, concurrent calls ------------------------------------

@pytest.mark.parametrize("temperature", [1e-300, 1e-39, 1e-9])
def test_tiny_temperature_is_raised_to_the_floor_with_a_warning_and_samples_near_greedy(model, temperature):
    from rollout.config import MIN_TEMPERATURE

    with pytest.warns(UserWarning, match=r"temperature: .* below the floor .*; raised to"):
        sampling = SamplingConfig(max_new_tokens=6, temperature=temperature, seed=1)
    assert sampling.temperature == MIN_TEMPERATURE and not sampling.is_greedy
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None))
    greedy = ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(max_new_tokens=6, temperature=0.0)).input_ids
    assert torch.equal(ro.generate(RolloutRequest(IDS, MASK), sampling).input_ids, greedy)


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
def test_sampling_numbers_refuse_bools(name):
    value = True  # was taken as 1.0
    with pytest.raises(ValueError, match=f"^{name}: "):
        SamplingConfig(max_new_tokens=4, **{name: value})


def _missing_or_bad_json(tmp_path, kind):
    path = tmp_path / "cost.json"
    if kind == "not json":
        path.write_text("{nope")
    return str(path)


@pytest.mark.parametrize("kind", ["missing", "not json"])
def test_cost_model_file_is_checked_at_construction(model, tmp_path, kind):
    path = _missing_or_bad_json(tmp_path, kind)
    with pytest.raises(ValueError, match=r"^routing.cost_model: cannot read .*cost.json"):
        Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2),
                RolloutConfig().with_settings({"routing.cost_model": path}))


@pytest.mark.parametrize("route", ["auto", "continuous"])
def test_prefill_limit_below_a_prompt_names_the_setting(model, route):
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2),
                 RolloutConfig(route=route).with_settings({"routing.max_prefill_tokens": 2}))
    with pytest.raises(ValueError, match=r"^routing.max_prefill_tokens: a prompt of 6 tokens exceeds"):
        ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(**OK_SAMPLING))
    assert ro.runner.pool.nbytes == 0


def test_model_without_config_is_refused_naming_it():
    class NoConfig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"^engine: the model \(NoConfig\) has no HF `config`"):
        Rollout(NoConfig(), TinyTokenizer(pad_token_id=0, eos_token_id=2))


@pytest.mark.parametrize("value", [1e300, 2.0**31])
def test_huge_cache_cap_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"^max_cache_gib: must be None or a finite number > 0 and < 2\*\*30; got "):
        RolloutConfig(max_cache_gib=value)


@pytest.mark.parametrize("route", ["auto", "continuous"])
def test_fewer_slots_than_samples_names_both_fields(model, route):
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2), RolloutConfig(route=route))
    with pytest.raises(ValueError, match=r"^continuous_batch_size: .*n_samples_per_prompt=2.*; got 1"):
        ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(**OK_SAMPLING, n_samples_per_prompt=2,
                                                              continuous_batch_size=1))


def test_concurrent_generate_calls_are_refused(model):
    import threading

    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=2))
    inside, release, errors = threading.Event(), threading.Event(), []
    prepare = ro.runner.prepare

    def slow_prepare(*args, **kwargs):
        inside.set()
        release.wait(timeout=60)
        return prepare(*args, **kwargs)

    ro.runner.prepare = slow_prepare
    first = threading.Thread(target=lambda: ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(**OK_SAMPLING)))
    first.start()
    inside.wait(timeout=60)
    try:
        ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(**OK_SAMPLING))
    except RuntimeError as exc:
        errors.append(str(exc))
    finally:
        release.set()
        first.join()
    assert errors and errors[0].startswith("Rollout.generate: another call is running on this Rollout")
    ro.runner.prepare = prepare
    assert ro.generate(RolloutRequest(IDS, MASK), SamplingConfig(**OK_SAMPLING)).input_ids.shape == (3, 10)


def _check_nonfinite_warning(model, route: str, poison: float) -> None:
    """A healthy ``model`` neither warns nor flags; after one weight is set to ``poison`` the call warns and sets
    ``last_stats.prefill.nonfinite_logits`` (the same Rollout: its captured graphs read the weights in place)."""
    tok, sampling = TinyTokenizer(pad_token_id=0, eos_token_id=None), SamplingConfig(max_new_tokens=4,
                                                                                       temperature=0.0)
    ro = Rollout(model, tok, RolloutConfig(route=route))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro.generate(RolloutRequest(IDS, MASK), sampling)
    assert not [w for w in caught if "NaN or infinite" in str(w.message)]
    assert ro.last_stats.prefill.nonfinite_logits is False
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = poison
    with pytest.warns(RuntimeWarning, match="prefill produced NaN or infinite logits"):
        ro.generate(RolloutRequest(IDS, MASK), sampling)
    assert ro.last_stats.prefill.nonfinite_logits is True


@pytest.mark.parametrize("route", ["ordinary", "continuous"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_weights_warn_and_are_flagged(route, poison):
    """NaN/inf weights made every row's tokens 0 (argmax of NaN), silently: the call now warns and says so."""
    _check_nonfinite_warning(tiny_model(seed=3), route, poison)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the captured decode and packed prefill")
@pytest.mark.parametrize("route", ["ordinary", "continuous"])
def test_nonfinite_weights_warn_on_cuda(route):
    """The same on the GPU's default path (our packed prefill, decode steps from CUDA graphs), in bf16."""
    _check_nonfinite_warning(tiny_model(seed=3).to("cuda", torch.bfloat16), route, float("nan"))
