"""The OPSD step (rollout.opsd) and the main job (scripts/train_opsd.py, rollout.job) on CPU.

In-process tests drive a plain student module with a torch optimizer (fast); the DeepSpeed cases
(ZeRO-0/3, LoRA, two ranks over gloo) run in subprocess workers (tests/ds_workers/opsd_train.py).
The loss oracle recomputes ``generalized_jsd_loss`` from *full* logits of unmodified copies of the
models (no ``logits_to_keep``, no cache, one chunk), with position ids counted independently.
"""

import copy
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from instrumentation import ProfileConfig, collect_stages, configure, reset_for_tests, stages
from rollout import Rollout, RolloutRequest
from rollout import job as job_lib
from rollout.config import SamplingConfig
from rollout.opsd.losses import generalized_jsd_loss, response_logit_positions
from rollout.opsd import OPSDConfig, OPSDStep
from rollout.request import RolloutBatch
from rollout.testing import TinyTokenizer, random_prompts, tiny_model
from tests.ds_util import run_worker

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_opsd.py"
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2, seed=3)
PROMPT_LEN = 7


def prompts(seed=0, batch=3):
    return random_prompts(batch, PROMPT_LEN, min_len=2, seed=seed)  # left-padded rows


def early_eos(student, ids, mask) -> int:
    """A token that the seeded rollout emits second in row 0: used as EOS, it ends rows early."""
    batch = Rollout(student, TinyTokenizer(eos_token_id=None)).generate(RolloutRequest(ids, mask), SAMPLING)
    return int(batch.input_ids[0, PROMPT_LEN + 1])


def make_step(config=OPSDConfig(), *, teacher_vocab=512, teacher="llama", eos=2, lr=1e-2, **kwargs):
    """(OPSDStep, student, teacher) on fresh seeded tiny models; the teacher's EOS matches ``eos``."""
    student = tiny_model("qwen2", seed=0).train()
    teacher_model = student if teacher == "self" else tiny_model(teacher, seed=1, vocab_size=teacher_vocab,
                                                                 eos_token_id=eos)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr)
    step = OPSDStep(student, teacher_model, TinyTokenizer(eos_token_id=eos), config, optimizer=optimizer, **kwargs)
    return step, student, teacher_model


def full_logits(model, ids, mask):
    positions = torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)  # [N, T]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [N, T, V]


def reference_loss(student, teacher, batch: RolloutBatch, config: OPSDConfig, teacher_ids=None, teacher_mask=None, *,
                   path: str = "padded"):
    """The step's loss from full logits of unmodified copies (the teacher rounded to the cache dtype on the padded
    path; the packed path caches the teacher's hidden states in its own dtype, its logits are not rounded)."""
    s_logits = full_logits(student, batch.input_ids, batch.attention_mask)[:, :-1]
    if teacher_ids is None:
        t_logits = full_logits(teacher, batch.input_ids, batch.attention_mask)[:, :-1]
    else:  # the teacher saw [its own prompt | response]: keep the response-aligned tail
        ids = torch.cat([teacher_ids, batch.input_ids[:, PROMPT_LEN:]], dim=1)
        mask = torch.cat([teacher_mask, batch.attention_mask[:, PROMPT_LEN:]], dim=1)
        t_logits = full_logits(teacher, ids, mask)[:, -s_logits.shape[1] - 1:-1]
    t_logits = t_logits[..., :s_logits.shape[-1]]  # the shared-ids rule (teacher ids >= V_s dropped)
    top_ids = None
    if config.teacher_top_k is not None:
        t_logits, top_ids = torch.topk(t_logits, config.teacher_top_k, dim=-1)
    if path == "padded":
        t_logits = t_logits.to(config.logit_cache_dtype).float()
    mask = response_logit_positions(batch.attention_mask, batch.response_start_idx)
    return generalized_jsd_loss(s_logits, t_logits, mask, config.beta, config.temperature, chunk_size=1 << 20,
                                teacher_top_k_ids=top_ids).item()


@pytest.fixture(autouse=True)
def _profiling_off():
    reset_for_tests()
    yield
    reset_for_tests()


# ---- config and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(beta=-0.1), "beta"), (dict(beta=1.5), "beta"), (dict(beta="0.5"), "beta"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(teacher_top_k=0), "teacher_top_k"), (dict(teacher_top_k=2.0), "teacher_top_k"),
    (dict(logit_cache_location="gpu"), "logit_cache_location"),
    (dict(logit_cache_dtype=torch.int8), "logit_cache_dtype"),
    (dict(loss_chunk_size=0), "loss_chunk_size"), (dict(max_teacher_rows=0), "max_teacher_rows"),
    (dict(max_teacher_rows="all"), "max_teacher_rows"), (dict(max_student_rows=0), "max_student_rows"),
    (dict(max_student_rows=2.0), "max_student_rows"), (dict(max_student_rows=True), "max_student_rows"),
    (dict(max_micro_batch_gib=0.0), "max_micro_batch_gib"), (dict(max_micro_batch_gib=float("nan")),
                                                              "max_micro_batch_gib"),
])
def test_config_rejects_bad_fields_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        OPSDConfig(**kwargs)


class VocabTokenizer(TinyTokenizer):
    def get_vocab(self):
        return dict(self.extra)


@pytest.mark.parametrize("build, match", [
    (lambda s, t: OPSDStep(s, t, TinyTokenizer()), "optimizer"),
    (lambda s, t: OPSDStep(s, t, TinyTokenizer(), "beta=0", optimizer=_opt(s)), "config"),
    (lambda s, t: OPSDStep(s, None, TinyTokenizer(), optimizer=_opt(s)), "teacher"),
    (lambda s, t: OPSDStep(s, t, TinyTokenizer(eos_token_id=5), optimizer=_opt(s)), "eos_token_id"),
    (lambda s, t: OPSDStep(s, t, TinyTokenizer(), optimizer=_opt(s), teacher_tokenizer=TinyTokenizer(pad_token_id=1)),
     "pad_token_id"),
    (lambda s, t: OPSDStep(s, t, TinyTokenizer(), optimizer=_opt(s), teacher_tokenizer=TinyTokenizer(eos_token_id=7)),
     "eos_token_id"),
    (lambda s, t: OPSDStep(s, t, VocabTokenizer(extra={"a": 5, "b": 6}), optimizer=_opt(s),
                           teacher_tokenizer=VocabTokenizer(extra={"a": 6, "b": 5})), "vocabulary"),
    (lambda s, t: OPSDStep(s, t, TinyTokenizer(), OPSDConfig(teacher_top_k=513), optimizer=_opt(s)), "teacher_top_k"),
])
def test_misaligned_teacher_and_bad_arguments_raise_naming_them(qwen, llama, build, match):
    with pytest.raises(ValueError, match=match):
        build(qwen, llama)


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.0)


def test_teacher_vocab_smaller_than_the_batch_ids_raises():
    step, student, _ = make_step(teacher_vocab=300)
    ids, mask = random_prompts(2, PROMPT_LEN, seed=0, vocab_size=512)
    assert int(ids.max()) >= 300
    before = copy.deepcopy(student.state_dict())
    with pytest.raises(ValueError, match="teacher vocab_size"):
        step.step(ids, mask, SAMPLING)
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())  # no update happened


def test_batch_without_response_position_raises_naming_mask():
    step, _, _ = make_step()
    ids, mask = prompts()
    response = torch.full((ids.shape[0], 3), 5)
    batch = RolloutBatch(torch.cat([ids, response], 1), torch.cat([mask, torch.zeros_like(response)], 1),
                         torch.full((ids.shape[0],), PROMPT_LEN))
    with pytest.raises(ValueError, match="^mask: "):
        step.train_on_batch(batch)


@pytest.mark.parametrize("kwargs, match", [
    (dict(teacher_prompt_ids=torch.ones(3, 4, dtype=torch.long)), "teacher_prompt_ids"),
    (dict(teacher_prompt_ids=torch.ones(2, 4, dtype=torch.long),
          teacher_prompt_attention_mask=torch.ones(2, 4, dtype=torch.long)), "teacher_prompt_ids"),
    (dict(teacher_prompt_ids=torch.ones(3, 4, dtype=torch.long),
          teacher_prompt_attention_mask=torch.ones(3, 5, dtype=torch.long)), "teacher_prompt_attention_mask"),
])
def test_bad_teacher_prompts_raise_naming_them(kwargs, match):
    step, _, _ = make_step(teacher="self")
    ids, mask = prompts()
    with pytest.raises(ValueError, match=match):
        step.step(ids, mask, SAMPLING, **kwargs)


# ---- the loss of a step ---------------------------------------------------------------------
@pytest.mark.parametrize("config, teacher_vocab", [
    (OPSDConfig(beta=0.5), 512),
    (OPSDConfig(beta=0.0, temperature=2.0, max_teacher_rows=4, loss_chunk_size=5), 512),
    (OPSDConfig(beta=1.0, teacher_top_k=16, logit_cache_location="host"), 512),
    (OPSDConfig(beta=0.3, max_teacher_rows=5), 520),  # a larger teacher vocabulary: shared ids compared
    (OPSDConfig(beta=0.7, teacher_top_k=8, max_teacher_rows=2), 520),
])
def test_step_loss_equals_independent_recomputation(config, teacher_vocab):
    ids, mask = prompts()
    eos = early_eos(tiny_model("qwen2", seed=0), ids, mask)
    step, student, teacher = make_step(config, teacher_vocab=teacher_vocab, eos=eos)
    oracle, teacher_before = copy.deepcopy(student), copy.deepcopy(teacher.state_dict())
    result = step.step(ids, mask, SAMPLING)
    batch = result.batch
    assert not bool(batch.attention_mask[:, PROMPT_LEN:].all())  # some rows ended early (right padding)
    assert result.num_response_tokens == int(batch.attention_mask[:, PROMPT_LEN:].sum())
    expected = reference_loss(oracle, teacher, batch, config, path=step.train_path)
    assert result.loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert result.loss > 0 and result.rollout_tokens_per_s > 0 and result.step_ms >= result.rollout_ms > 0
    changed = [n for n, p in student.named_parameters() if not torch.equal(p, oracle.get_parameter(n))]
    assert len(changed) == len(list(student.parameters()))  # one AdamW step moved every weight
    assert all(torch.equal(p, teacher_before[n]) for n, p in teacher.named_parameters())
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinned host memory needs CUDA"))])
@pytest.mark.parametrize("top_k", [None, 8])
def test_host_and_device_logit_caches_give_the_same_loss(device, top_k):
    ids, mask = prompts(seed=1)
    losses, batches = {}, {}
    for location in ("device", "host"):
        step, student, _ = make_step(OPSDConfig(teacher_top_k=top_k, logit_cache_location=location))
        if device == "cuda":
            student.cuda(), step.teacher.cuda()
        result = step.step(ids.to(device), mask.to(device), SAMPLING)
        losses[location], batches[location] = result.loss, result.batch.input_ids.cpu()
    assert torch.equal(batches["device"], batches["host"])  # same seed: the same rollout
    assert losses["host"] == losses["device"]


def test_self_distillation_zero_on_same_prompt_and_aligned_with_teacher_prompt():
    config = OPSDConfig(logit_cache_dtype=torch.float32)
    step, student, _ = make_step(config, teacher="self", lr=0.0)
    assert step.is_self_distillation
    ids, mask = prompts(seed=2)
    same = step.step(ids, mask, SAMPLING)
    assert abs(same.loss) < 1e-6  # the teacher is the student on identical inputs
    teacher_ids, teacher_mask = random_prompts(3, 10, min_len=4, seed=5)  # a different (e.g. privileged) prompt
    oracle = copy.deepcopy(student)
    other = step.step(ids, mask, SAMPLING, teacher_prompt_ids=teacher_ids, teacher_prompt_attention_mask=teacher_mask)
    expand = SAMPLING.n_samples_per_prompt
    expected = reference_loss(oracle, oracle, other.batch, config, teacher_ids.repeat_interleave(expand, 0),
                              teacher_mask.repeat_interleave(expand, 0))
    assert other.loss > 1e-4
    assert other.loss == pytest.approx(expected, rel=1e-5)
    assert student.training and all(m.training for m in student.modules())  # eval only for the teacher forward


def test_every_stage_of_the_step_is_timed_when_profiling(tmp_path):
    configure(ProfileConfig(mode="1", output_dir=str(tmp_path)))
    step, _, _ = make_step()
    ids, mask = prompts()
    with collect_stages() as collector:
        result = step.step(ids, mask, SAMPLING)
    summary = collector.summary()
    for name in (stages.STEP, stages.ROLLOUT, stages.PREFILL, stages.TEACHER_FORWARD, stages.LOGIT_CACHE,
                 stages.STUDENT_FORWARD, stages.LOSS, stages.BACKWARD, stages.OPTIMIZER_STEP):
        assert summary[name]["count"] == 1, name
    assert result.rollout_profile is not None and result.rollout_profile["num_generated_tokens"] > 0


# ---- DeepSpeed engines (subprocess workers, gloo) -------------------------------------------
@pytest.mark.parametrize("stage, kinds, world_size, extra", [
    (0, "full,lora", 1, ("micro",)),
    (3, "full", 2, ("self", "micro")),
    (3, "lora", 2, ()),
])
def test_deepspeed_steps_train_the_student_only(stage, kinds, world_size, extra):
    results = run_worker("opsd_train.py", str(stage), kinds, *extra, world_size=world_size,
                         env={"OMP_NUM_THREADS": "1"})
    if "micro" in extra:  # ZeRO-3 coalesces the micro-batches' gradients (a step gathers the student once)
        assert check_micro_batched_engine_equals_one_shot([r.result["micro"] for r in results]) == (stage == 3)
    for kind in kinds.split(","):
        outs = [r.result[kind] for r in results]
        for out in outs:
            assert out["is_zero3"] == (stage == 3)
            assert out["train_path"] == "packed"  # ZeRO-3 too: the head's module call gathers its weight
            # LoRA too: its training pass runs the LoRA pieces; ZeRO-3 too: the step gathers the student once for its
            # passes (gather="once", the default), and with gather="per_forward" runs HF's layers, gathered per module
            assert out["student_path"] == "fast"
            assert out["coalesced"] == (stage == 3)  # gathered once: its gradients reduced once a step
            if stage == 3:
                assert out["per_forward_path"][0] == "hf" and "gather='per_forward'" in out["per_forward_path"][1]
            # LoRA too: the adapters are fused before the rollout decodes, through our step (CPU: eagerly)
            assert "decode fast_eager (" in out["rollout_path"], out["rollout_path"]
            assert len(out["losses"]) == 3 and all(math.isfinite(x) and x > 0 for x in out["losses"])
            assert out["losses"][0] == pytest.approx(out["reference_loss"], rel=1e-5)
            assert out["teacher_changed"] == [] and out["teacher_grads"] == []
            assert out["changed"] == out["trainable"]  # every trainable weight moved, nothing else did
            if kind == "lora":
                assert out["trainable"] and all("lora_" in name for name in out["trainable"])
                assert len(out["trainable"]) < out["num_params"]
            else:
                assert len(out["trainable"]) == out["num_params"]
            if "self" in extra:
                assert out["self"]["is_self"] and abs(out["self"]["same_prompt_loss"]) < 1e-6
                assert out["self"]["teacher_prompt_loss"] > 1e-4
                assert out["self"]["micro_batches"] == [4, 4]  # 2 prompts x 2 samples, one row each
        # token counts 10 and 30 on two ranks: weights n * world / total = 0.5 and 1.5
        assert [out["rank_weight"] for out in outs] == ([1.0] if world_size == 1 else [0.5, 1.5])
        if world_size == 2:  # rank 1's teacher prompts refused: both ranks raise, neither waits in a collective
            assert outs[0]["refusal"].startswith("batch: refused on data-parallel rank 1: "), outs[0]["refusal"]
            assert outs[1]["refusal"].startswith("teacher_prompt_ids: "), outs[1]["refusal"]
        if world_size == 2:  # each rank distils its own prompts
            assert outs[0]["tokens0"] != outs[1]["tokens0"]


def check_micro_batched_engine_equals_one_shot(outs):
    """Micro-batches of <= 2 rows (gradient_accumulation_steps 3 in the config) against all rows at once
    (1): the same losses and updates to fp32 rounding, one optimizer step per OPSD step, and every rank
    running the most micro-batches of any rank (6 rows on rank 0 -> 3, 4 rows on rank 1 -> 2, agreed 3)."""
    for out in outs:
        one = out["one_shot"]
        assert out["max_update"] > 1e-3 and out["max_total"] > 1e-3  # SGD moved the weights: not vacuous
        assert one["coalesced"] == out["micro"]["coalesced"] and not out["micro_hooks"]["coalesced"]
        for name in ("micro", "micro_hooks"):  # ZeRO-3: the gradients reduced once, and by the hooks each micro-batch
            micro = out[name]
            assert micro["losses"] == pytest.approx(one["losses"], rel=1e-5)
            assert micro["max_update_diff"] <= 1e-5 * out["max_update"], name
            assert micro["max_total_diff"] <= 1e-5 * out["max_total"], name
            assert one["global_steps"] == micro["global_steps"] == 2
            assert one["micro_batches"] == [1, 1] and micro["micro_batches"] == [3, 3]
            assert micro["teacher_forwards"] == [2, 2]
    return outs[0]["micro"]["coalesced"]


# ---- the main job -----------------------------------------------------------------------------
def run_script(*args, env=None, timeout=240):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    base.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=base,
                          cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def step_lines(stdout):
    """The per-step console lines: ``[k/N] step k-1  loss ...`` (one step index everywhere)."""
    return [line for line in stdout.splitlines() if line.startswith("[") and " step " in line and "loss" in line]


def test_script_runs_zero3_lora_self_distillation_without_profiling(tmp_path):
    report = tmp_path / "run.json"
    out = run_script("--steps", "2", "--zero-stage", "3", "--lora", "4", "--teacher", "self", "--teacher-top-k", "8",
                     "--logit-cache", "host", "--batch-size", "1", "--max-new-tokens", "6",
                     "--rollout", "kernels.cuda_graphs=False", "--rollout", "routing.eos_check_interval=2",
                     "--json-out", str(report), env={"OPSD_PROFILE": "0", "OPSD_PROFILE_DIR": str(tmp_path / "traces")})
    lines = step_lines(out)
    assert [line.split()[:3] for line in lines] == [["[1/2]", "step", "0"], ["[2/2]", "step", "1"]]
    assert all(math.isfinite(float(line.split()[4])) for line in lines)
    assert "ZeRO-3" in out and "LoRA r=4" in out and "teacher self" in out and "done: 2 steps" in out
    assert "per-stage" not in out and not (tmp_path / "traces").exists()
    doc = json.loads(report.read_text())  # the settings the step's rollout ran with, every one by its dotted name
    assert doc["rollout"]["kernels.cuda_graphs"] is False and doc["rollout"]["routing.eos_check_interval"] == 2
    assert doc["rollout"]["kernels.compile"] is True and doc["zero_stage"] == 3 and doc["job"]["lora"] == 4


def test_script_rejects_a_bad_flag_naming_the_field():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--logit-cache", "gpu"], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2 and "logit_cache_location" in proc.stderr


# ---- the main job's flags, in-process ---------------------------------------------------------------
def tiny_step(job, opsd_config, monkeypatch):
    """The main job's step on the CPU: a plain student module with an SGD optimizer instead of a DeepSpeed engine
    (no process group here)."""
    monkeypatch.setattr(job_lib, "make_student_engine", lambda model, config, **kwargs: model)
    monkeypatch.setattr(job_lib, "OPSDStep", lambda student, *args, **kwargs: OPSDStep(
        student, *args, optimizer=torch.optim.SGD(student.parameters(), lr=0.1), **kwargs))
    return job_lib.build_step(job, opsd_config, torch.device("cpu"))


def load_train_opsd(name: str = "_train_opsd_under_test"):
    """``scripts/train_opsd.py`` as a module named ``name``: its ``main`` and ``parse_args`` in this process."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_opsd():
    return load_train_opsd()


def test_rollout_flags_reach_the_rollout_config_the_step_uses(train_opsd, monkeypatch):
    job, opsd_config = train_opsd.parse_args(["--rollout", "kernels.cuda_graphs=False", "--route", "auto",
                                              "--keep-cache", "0", "--rollout", "routing.eos_check_interval=2"])
    step = tiny_step(job, opsd_config, monkeypatch)
    config = step.rollout.config
    assert config is job.rollout
    assert config.kernels.cuda_graphs is False and config.routing.eos_check_interval == 2
    assert (config.route, config.keep_cache, config.kernels.compile) == ("auto", False, True)  # the rest: defaults


def test_the_main_loop_keeps_no_step_tensors(train_opsd, monkeypatch):
    """A long run must not hold every step's rollout batch (device tensors) until the end: the records ``train``
    returns hold no tensor, and still carry what the report reads."""
    job, opsd_config = train_opsd.parse_args(["--steps", "2", "--max-new-tokens", "4"])
    step = tiny_step(job, opsd_config, monkeypatch)
    results, _ = train_opsd.train(step, job, 0, torch.device("cpu"))
    assert len(results) == 2
    for result in results:
        assert not any(isinstance(value, torch.Tensor) or hasattr(value, "input_ids") for value in vars(result).values())
        assert result.batch is None and result.loss > 0 and result.num_response_tokens > 0 and result.breakdown


def no_model(*args, **kwargs):
    raise AssertionError("a model was built (or the process group started) before the flags were checked")


@pytest.mark.parametrize("argv, words", [
    (["--rollout", "kernels.cuda_graph=False"], ["argument --rollout", "'kernels.cuda_graph'",
                                                 "did you mean kernels.cuda_graphs?"]),
    (["--rollout", "kernels.nonsense=1"], ["the settings:", "routing.eos_check_interval", "sampler.fused"]),
    (["--rollout", "compile=False"], ["did you mean kernels.compile?"]),  # an old flat name: its new place
    (["--rollout", "route=auto"], ["route: has a flag of its own, --route"]),
    (["--rollout", "kernels.cuda_graphs"], ["expected SETTING=VALUE"]),
    (["--rollout", "kernels.cuda_graphs=maybe"], ["kernels.cuda_graphs: 'maybe' is not a Python literal"]),
    (["--rollout", "kernels.cuda_graphs=1"], ["kernels.cuda_graphs: must be a bool; got 1"]),
    (["--rollout", "kernels.prefill_graph_tokens=-1"], ["kernels.prefill_graph_tokens:", "0: off"]),
    (["--rollout", "kernels.decode_attention='flash'"], ["kernels.decode_attention:", "'triton'"]),
    (["--keep-cache", "2"], ["argument --keep-cache: expected 0 or 1; got '2'"]),
    (["--max-cache-gib", "0"], ["max_cache_gib:", "> 0"]),
])
def test_a_bad_rollout_setting_fails_before_any_model_is_built(train_opsd, monkeypatch, capsys, argv, words):
    monkeypatch.setattr(job_lib, "load_model", no_model)
    monkeypatch.setattr(train_opsd, "init_distributed", no_model)
    with pytest.raises(SystemExit) as exc:
        train_opsd.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


@pytest.mark.parametrize("argv, spelling", [
    (["--compile", "0"], "--compile: moved; use --rollout kernels.compile=False"),
    (["--cuda-graphs=1"], "--cuda-graphs: moved; use --rollout kernels.cuda_graphs=True"),
    (["--prefill-graph-tokens", "8192"],
     "--prefill-graph-tokens: moved; use --rollout kernels.prefill_graph_tokens=8192"),
    (["--steps", "2", "--compile"], "--compile: moved; use --rollout kernels.compile=VALUE"),
])
def test_an_old_kernel_flag_names_its_new_spelling(train_opsd, monkeypatch, capsys, argv, spelling):
    monkeypatch.setattr(job_lib, "load_model", no_model)
    monkeypatch.setattr(train_opsd, "init_distributed", no_model)
    with pytest.raises(SystemExit) as exc:
        train_opsd.main(argv)
    assert exc.value.code == 2 and spelling in capsys.readouterr().err


def save_tiny(path: Path, arch: str, seed: int, with_tokenizer: bool) -> str:
    tiny_model(arch, seed=seed).save_pretrained(path)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 512)}}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                eos_token="<eos>").save_pretrained(path)
    return str(path)


def test_script_from_saved_models_with_profiling_writes_traces_and_table(tmp_path):
    student = save_tiny(tmp_path / "student", "qwen2", 0, with_tokenizer=True)
    teacher = save_tiny(tmp_path / "teacher", "llama", 1, with_tokenizer=False)
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
                                     "zero_allow_untested_optimizer": True, "steps_per_print": 1000}))
    out = run_script("--student", student, "--teacher", teacher, "--deepspeed-config", str(ds_config),
                     "--steps", "2", "--batch-size", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
                     env={"OPSD_PROFILE": "1", "OPSD_PROFILE_DIR": str(tmp_path / "traces"),
                          "OPSD_PROFILE_STEPS": "1"})
    assert len(step_lines(out)) == 2
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for name in (stages.STEP, stages.ROLLOUT, stages.DECODE, stages.TEACHER_FORWARD, stages.LOGIT_CACHE,
                 stages.STUDENT_FORWARD, stages.LOSS, stages.BACKWARD, stages.OPTIMIZER_STEP):
        assert name in rows and int(rows[name][1]) >= 1, name  # count column
    assert rows[stages.STEP][4] == "100.0%"
    traces = [Path(line.split("trace: ", 1)[1]) for line in out.splitlines() if line.startswith("trace: ")]
    assert traces and all(p.is_file() and p.parent.parent == tmp_path / "traces" for p in traces)
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert {f"opsd/{stages.TEACHER_FORWARD}", f"opsd/{stages.LOSS}"} <= {e.get("name") for e in events}


def test_a_settable_peak_gives_mfu_on_any_device(train_opsd, capsys):
    """Issue 33: --peak-tflops sets the peak MFU divides by (no MFU off the listed GPUs before); a bad one fails at
    parse time naming the field; the train_path and peak flags reach their configs."""
    from types import SimpleNamespace

    from rollout.opsd.report import StepFlops
    job, opsd_config = train_opsd.parse_args(["--peak-tflops", "0.5", "--train-path", "padded"])
    assert job.peak_tflops == 0.5 and opsd_config.train_path == "padded"
    model = tiny_model("qwen2", seed=0)
    step = SimpleNamespace(student=model, teacher=model, is_self_distillation=True)
    flops = StepFlops(step, torch.device("cpu"), job.peak_tflops)
    result = SimpleNamespace(num_response_tokens=40, step_ms=100.0)
    value = flops.mfu(torch.ones(2, 8), {}, 2, result)
    assert value is not None and value > 0
    assert StepFlops(step, torch.device("cpu")).mfu(torch.ones(2, 8), {}, 2, result) is None  # no peak on a CPU
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            train_opsd.parse_args(["--peak-tflops", bad])
        assert "peak_tflops" in capsys.readouterr().err


def test_coalesce_gradients_flag_and_field(capsys):
    """``--coalesce-gradients 0|1`` sets ``OPSDConfig.coalesce_gradients`` (True by default); other values and a
    non-bool field are refused naming them. A plain module + optimizer has nothing to coalesce."""
    from rollout.opsd.student import PlainStudent

    assert job_lib.parse_args([]).opsd.coalesce_gradients is True
    assert job_lib.parse_args(["--coalesce-gradients", "0"]).opsd.coalesce_gradients is False
    with pytest.raises(SystemExit):
        job_lib.parse_args(["--coalesce-gradients", "yes"])
    assert "--coalesce-gradients: expected 0 or 1; got 'yes'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="coalesce_gradients"):
        OPSDConfig(coalesce_gradients=1)
    model = tiny_model("qwen2", seed=0)
    plain = PlainStudent(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert plain.can_coalesce is False
    with plain.coalesced():
        pass
