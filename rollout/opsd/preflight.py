"""The main job's checks before anything is built (``scripts/train_opsd.py``): the flags against the models'
configs (context, vocabulary, the packed path, ZeRO-3 gathering), the ``--json-out`` path, and the memory the models,
their training state and the smallest rollout need against what the device or the host has available (the DeepSpeed
config's checks: :mod:`rollout.opsd.ds_config_checks`).

Models are described by a few numbers of their HF configs (:class:`ModelFacts`), never instantiated. Every refusal is
a one-line ``ValueError`` naming the flag; ``rollout.job.check_job`` gathers the inputs and runs them all.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

from instrumentation.cli_values import output_problem
from instrumentation.runfiles import env_int
from rollout.checks import is_int
from rollout.opsd.packed import config_unsupported_reason
from rollout.plan.calibration import check_readable
from rollout.plan.layout import check_gather
from rollout.plan.memory import GIB, MemoryNeed, row_overhead_bytes

#: Bytes per trained parameter of AdamW's two float32 moments, and of the float32 master copy under bf16/fp16.
ADAM_STATE_BYTES, MASTER_BYTES = 8, 4


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need of one model, read from its HF config."""

    name: str
    num_params: Optional[int]
    """Parameters of a Llama-family geometry (biases and norms aside: a lower bound); None for other configs."""
    vocab_size: int
    context: Optional[int]
    """``max_position_embeddings`` (None: unknown)."""
    column_elems: int
    """Key and value elements one token keeps in the KV cache, over all layers (0: unknown)."""
    hidden: Optional[int] = None
    """``hidden_size`` (None: unknown)."""

    @classmethod
    def of(cls, name: str, config) -> "ModelFacts":
        get = lambda key: getattr(config, key, None)  # noqa: E731
        hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
        if not all(is_int(v) and v > 0 for v in (hidden, heads, layers, get("intermediate_size"), get("vocab_size"))):
            return cls(name, None, int(get("vocab_size") or 0), get("max_position_embeddings"), 0,
                       hidden if is_int(hidden) and hidden > 0 else None)
        head_dim = get("head_dim") or hidden // heads
        kv_heads = get("num_key_value_heads") or heads
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        layer = attention + 3 * hidden * get("intermediate_size")
        embeddings = get("vocab_size") * hidden * (1 if get("tie_word_embeddings") else 2)
        return cls(name, embeddings + layers * layer, get("vocab_size"), get("max_position_embeddings"),
                   2 * layers * kv_heads * head_dim, hidden)


# ---- the report path ----------------------------------------------------------------------------------------------
def check_json_out(path: Optional[str]) -> None:
    """``--json-out`` must name a file in a directory this process can create or write (checked now: the report is
    written after the last step); :func:`instrumentation.cli_values.output_problem`'s rules."""
    if path is None:
        return
    why = output_problem(path, create_folder=True)
    if why:
        raise ValueError(f"--json-out {path!r}: {why}; name a file (run.json)")


# ---- the models against the flags ---------------------------------------------------------------------------------
def check_flags(job, opsd) -> None:
    """Flags that conflict with no model needed: ``--train-path packed`` with a top-k teacher cache, and a
    ``routing.cost_model`` file the rollout could not read."""
    if opsd.train_path == "packed" and opsd.teacher_top_k is not None:
        raise ValueError(f"--train-path packed: cannot run with a top-k teacher cache (--teacher-top-k "
                         f"{opsd.teacher_top_k}); use --train-path auto or padded, or leave out --teacher-top-k")
    if isinstance(job.rollout.routing.cost_model, str):
        try:
            check_readable(job.rollout.routing.cost_model)
        except ValueError as exc:
            raise ValueError(f"--rollout {exc}") from None


def check_train_path(opsd, configs: list[tuple[str, str, object]]) -> None:
    """``--train-path packed`` where a model's config rules the packed path out (its type, sliding-window attention;
    ``configs``: ``(flag, name, HF config)``): the step refuses it once the models are built. ``auto`` falls back to
    padded there, as documented (``StepBreakdown.train_path`` says which ran)."""
    if opsd.train_path != "packed":
        return
    for flag, name, config in configs:
        reason = config_unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"--train-path packed: cannot run {flag} {name}: {reason}; use --train-path auto "
                             "(padded for this model) or padded")


def check_context(terms: list[tuple[str, int]], context: Optional[int], whose: str, source: str) -> None:
    """Refuse sequences longer than ``context`` tokens (None: unknown, nothing checked): ``terms`` are their parts,
    ``(flag, tokens)``, summed; ``whose`` and ``source`` say whose context it is and where it was read. The message
    names every flag and number: ``--prompt-len 16 + --max-new-tokens 600 = 616 exceeds the student's context of 512
    tokens (max_position_embeddings of tiny-qwen2)``."""
    total = sum(tokens for _, tokens in terms)
    if context is None or total <= context:
        return
    what = " + ".join(f"{flag} {tokens}" for flag, tokens in terms) + (f" = {total}" if len(terms) > 1 else "")
    raise ValueError(f"{what} exceeds {whose} context of {context} tokens ({source})")


def student_context(job, student: ModelFacts) -> tuple[Optional[int], str]:
    """``(tokens, where it was read)``: the rollout's ``max_context`` where set, else the student's
    ``max_position_embeddings`` (None: unknown)."""
    if job.rollout.max_context:
        return job.rollout.max_context, f"max_context of {student.name}"
    return student.context, f"max_position_embeddings of {student.name}"


def check_models(job, opsd, student: ModelFacts, teacher: ModelFacts, zero_stage: int, synthetic: bool,
                 self_context: int = 0, chat: Optional[tuple[int, int]] = None, *,
                 student_tokens: Optional[int] = None) -> None:
    """Context, vocabulary (a teacher's at least the student's) and gathering: what the step and its rollout refuse
    once the models are built (a smaller teacher vocabulary only at a step that samples past it), and the
    teacher's context, which nothing checks later (a teacher scoring past its context gives wrong numbers silently).
    ``teacher`` is ``student`` when the student is its own teacher (``--teacher self``: its prompts are
    ``self_context`` tokens longer) or the teacher's config cannot be read. ``chat``: the real model's longest chat
    prompts (student's, teacher's; :func:`rollout.real_model.longest_chat_prompts`), where they were counted.
    ``student_tokens``: the size of the student's tokenizer where it was read; a teacher vocabulary below the student's
    head but holding every tokenizer id (a padded head, as Qwen2.5's) is warned, not refused."""
    context, source = student_context(job, student)
    prompt = [("--prompt-len", job.prompt_len)] if synthetic else []
    response = [("--max-new-tokens", job.max_new_tokens)]
    counted = not synthetic and chat is not None
    if counted:
        prompt = [("the longest chat prompt", chat[0])]
    check_context(prompt + response, context, "the student's", source)
    if counted:  # the teacher's prompts open with its system prompt
        teacher_context = context if teacher is student else teacher.context
        check_context([("the teacher's longest chat prompt", chat[1])] + response, teacher_context, "the teacher's",
                      source if teacher is student else f"max_position_embeddings of {teacher.name}")
    if self_context:
        check_context(prompt + [("--teacher self's context", self_context)] + response, context, "the teacher's",
                      f"--teacher self: {source}")
    elif teacher is not student:
        check_context(prompt + response, teacher.context, "the teacher's", f"max_position_embeddings of {teacher.name}")
    if teacher is not student and 0 < teacher.vocab_size < student.vocab_size:
        if student_tokens is None or teacher.vocab_size < student_tokens:
            raise ValueError(f"--teacher {teacher.name}: its vocabulary (vocab_size {teacher.vocab_size}) is smaller "
                             f"than the student's ({student.vocab_size}, {student.name}); the student can sample ids "
                             "the teacher cannot score")
        warnings.warn(f"--teacher {teacher.name}: its vocabulary ({teacher.vocab_size}) is smaller than the student's "
                      f"head ({student.vocab_size}) but holds all {student_tokens} ids of the student's tokenizer: the "
                      "ids above are padding; a step whose rollout samples one stops with an error naming it",
                      UserWarning, stacklevel=3)
    if job.lora is not None and student.hidden is not None and job.lora > student.hidden:
        raise ValueError(f"--lora: rank {job.lora} exceeds the student's hidden size {student.hidden} ({student.name}; "
                         "a LoRA update's rank is at most its weight's smaller side, which is at most the hidden size)")
    shared = min(student.vocab_size, teacher.vocab_size)
    if opsd.teacher_top_k is not None and shared and opsd.teacher_top_k > shared:
        raise ValueError(f"--teacher-top-k: {opsd.teacher_top_k} exceeds the shared vocabulary size {shared} "
                         f"({student.name}, {teacher.name})")
    try:
        check_gather(job.rollout.route, job.rollout.gather, zero_stage == 3)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


# ---- memory -------------------------------------------------------------------------------------------------------
def model_bytes(job, student: ModelFacts, teacher: Optional[ModelFacts], dtype_bytes: int, zero_stage: int,
                world: int, cuda: bool) -> tuple[int, str]:
    """``(bytes, what)``: a lower bound of the memory a rank's device holds for the models and the student's
    training state (gradients, AdamW moments, a float32 master copy under bf16/fp16), ZeRO partitioning counted.
    An offloaded teacher (``--teacher-offload 1``) leaves the GPU, not the host."""
    params = student.num_params or 0
    trained = 0 if job.lora is not None else params
    parts = {"student": params * dtype_bytes // (world if zero_stage == 3 else 1),
             "its gradients": trained * dtype_bytes // (world if zero_stage >= 2 else 1),
             "AdamW state": trained * (ADAM_STATE_BYTES + (MASTER_BYTES if dtype_bytes != 4 else 0))
             // (world if zero_stage >= 1 else 1)}
    if teacher is not None and not (job.teacher_offload and cuda):
        parts["teacher"] = (teacher.num_params or 0) * dtype_bytes
    what = ", ".join(f"{name} {value / GIB:.3g} GiB" for name, value in parts.items() if value)
    return sum(parts.values()), f"{student.name}: {params:.3g} parameters x {dtype_bytes} B; {what}"


def rollout_need(job, student: ModelFacts, dtype_bytes: int, synthetic: bool) -> MemoryNeed:
    """The smallest KV cache (with its per-row buffers) the first rollout can run with: every row at once on the
    ordinary route, one prompt's samples on the others; each row at its shortest prompt."""
    rows = job.samples_per_prompt * (job.batch_size if job.rollout.route == "ordinary" else 1)
    return cache_need(rows, max(1, job.prompt_len // 2) if synthetic else 1, job.max_new_tokens, student, dtype_bytes)


def cache_need(rows: int, prompt_len: int, max_new_tokens: int, model: ModelFacts, dtype_bytes: int) -> MemoryNeed:
    """The KV cache of ``rows`` rows of ``prompt_len + max_new_tokens`` columns, with their per-row buffers."""
    columns = prompt_len + max_new_tokens
    return MemoryNeed(rows, columns, model.column_elems * dtype_bytes,
                      row_overhead_bytes(model.vocab_size, max_new_tokens, columns))


def check_memory(job, models: tuple[int, str], need: MemoryNeed, available: Optional[int], where: str) -> None:
    """Refuse the models, or the samples, that cannot fit ``available`` bytes (or ``--max-cache-gib``)."""
    model_need, what = models
    samples = f"--samples-per-prompt {job.samples_per_prompt}"
    cap = job.rollout.max_cache_gib
    if cap is not None and need.cache_bytes > cap * GIB:
        raise ValueError(f"{samples}: the rollout needs a KV cache of at least {need.rows} rows x {need.columns} "
                         f"columns = {need.cache_bytes / GIB:.3g} GiB, over --max-cache-gib {cap:g}; use fewer "
                         "samples, --route continuous or a larger --max-cache-gib")
    if available is None:
        return
    if model_need > available:
        raise ValueError(f"--student/--teacher: the models need at least {model_need / GIB:.3g} GiB ({what}) but "
                         f"{where} has {available / GIB:.3g} GiB available; use smaller models, bf16 "
                         "(--deepspeed-config), --lora, --teacher-offload 1 or ZeRO over more ranks")
    if model_need + need.total_bytes > available:
        raise ValueError(f"{samples}: the models ({model_need / GIB:.3g} GiB) and the smallest rollout "
                         f"({need.rows} rows x {need.columns} columns: {need.total_bytes / GIB:.3g} GiB) need more "
                         f"than the {available / GIB:.3g} GiB {where} has available; use fewer samples, "
                         "--route continuous, or shorter --max-new-tokens")


def available_bytes(device_type: str) -> Optional[int]:
    """Memory this rank may use: the free memory of its GPU, or its share of the host's available memory (the
    cgroup's limit counted) among the ranks of this node. None when it cannot be read."""
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info(env_int("LOCAL_RANK", 0))[0]
    limits = [_meminfo_available(), _cgroup_available()]
    limits = [value for value in limits if value is not None]
    return min(limits) // env_int("LOCAL_WORLD_SIZE", 1) if limits else None


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> Optional[int]:
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            return None if text == "max" else int(text) - int(current.read())
    except (OSError, ValueError):
        return None
