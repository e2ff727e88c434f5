"""The main job's checks before anything is built (``scripts/train_opsd.py``): the flags against the models'
configs (context, vocabulary, ZeRO-3 gathering), the DeepSpeed config, the ``--json-out`` path, and the memory the
models, their training state and the smallest rollout need against what the device or the host has available.

Models are described by a few numbers of their HF configs (:class:`ModelFacts`), never instantiated. Every refusal is
a one-line ``ValueError`` naming the flag; ``rollout.job.check_job`` gathers the inputs and runs them all.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Optional

from instrumentation.runfiles import env_int
from rollout.checks import is_int, is_number
from rollout.plan.calibration import check_readable
from rollout.plan.layout import check_gather
from rollout.plan.memory import GIB, MemoryNeed, row_overhead_bytes

#: Bytes per trained parameter of AdamW's two float32 moments, and of the float32 master copy under bf16/fp16.
ADAM_STATE_BYTES, MASTER_BYTES = 8, 4
#: The DeepSpeed batch settings, each a positive int when given.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


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


# ---- the DeepSpeed config and the report path ---------------------------------------------------------------------
#: DeepSpeed 0.19.8's own optimizer names (``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS``, matched lower-cased) and
#: LR schedules (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``): other names must be classes of
#: ``torch.optim`` / ``torch.optim.lr_scheduler``, as DeepSpeed looks them up (copied: importing deepspeed here would
#: fix its accelerator too early; ``tests/test_job_checks_more.py`` compares them with DeepSpeed's).
DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
DS_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
#: ``optimizer.params`` that must be finite numbers >= 0 where given (``betas``: two numbers in [0, 1)).
OPTIMIZER_NUMBERS = ("lr", "eps", "weight_decay")
#: ``zero_optimization``'s offload sections and the devices DeepSpeed knows (``nvme`` needs ``nvme_path``).
OFFLOADS, OFFLOAD_DEVICES = ("offload_param", "offload_optimizer"), ("none", "cpu", "nvme")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:  # DeepSpeed refuses them in a config file it reads itself
            raise ValueError(f"duplicate key {key!r}; DeepSpeed refuses one")
        out[key] = value
    return out


def read_deepspeed_config(path: str) -> dict:
    """The JSON object of ``--deepspeed-config`` with its sections checked (:func:`check_sections`); ValueError naming
    the flag and the file otherwise."""
    try:
        with open(path) as handle:
            config = json.load(handle, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed-config {path}: not valid JSON ({exc})") from None
    except IsADirectoryError:
        raise ValueError(f"--deepspeed-config {path}: is a directory; name a JSON file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"--deepspeed-config {path}: cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed-config {path}: must hold a JSON object; got {type(config).__name__}")
    check_sections(config, f"--deepspeed-config {path}")
    return config


def check_sections(config: dict, where: str) -> None:
    """The sections the job reads or changes, as DeepSpeed reads them: ``zero_optimization`` (``--zero-stage`` sets its
    stage) and its offload sections, ``bf16`` (null: absent, the older ``bfloat16`` then), ``fp16``, ``optimizer``
    and ``scheduler`` are objects; an ``enabled`` is true or false (DeepSpeed reads ``"false"`` as false but
    ``"auto"`` as absent: refused, as any non-bool)."""
    def need(ok: bool, key: str, what: str, value) -> None:
        if not ok:
            raise ValueError(f"{where}: {key} must be {what}; got {json.dumps(value)[:80]}")

    zero = config.get("zero_optimization", {})
    need(isinstance(zero, dict), "zero_optimization", 'an object ({"stage": 0-3, ...})', zero)
    for key in OFFLOADS:
        offload = zero.get(key)
        need(offload is None or isinstance(offload, dict), f"zero_optimization.{key}", "an object", offload)
        device = (offload or {}).get("device", "none")
        need(device in OFFLOAD_DEVICES, f"zero_optimization.{key}.device", "'none', 'cpu' or 'nvme'", device)
        need(device != "nvme" or (offload.get("nvme_path") and isinstance(offload["nvme_path"], str)),
             f"zero_optimization.{key}.nvme_path", "a path with device 'nvme'", offload and offload.get("nvme_path"))
    for key in ("fp16", "bf16" if config.get("bf16") is not None else "bfloat16"):
        section = config.get(key, {})
        need(isinstance(section, dict), key, 'an object ({"enabled": true})', section)
        need(isinstance(section.get("enabled", False), bool), f"{key}.enabled", "true or false", section.get("enabled"))
    for key in ("optimizer", "scheduler"):
        part = config.get(key)
        need(key not in config or (isinstance(part, dict) and isinstance(part.get("type"), str)), key,
             "an object with a 'type'", part)
        params = (part or {}).get("params")
        need(params is None or isinstance(params, dict), f"{key}.params", "an object", params)


def precision_sections(config: dict) -> tuple[dict, dict]:
    """``(bf16, fp16)``: the precision sections DeepSpeed reads (``bf16``, else the older ``bfloat16`` where ``bf16``
    is absent or null), ``{}`` where absent."""
    bf16 = config.get("bf16")
    return (config.get("bfloat16") or {} if bf16 is None else bf16), config.get("fp16") or {}


def zero_stage(config: dict) -> int:
    """The ZeRO stage of a checked DeepSpeed config (0 without ``zero_optimization``, as DeepSpeed)."""
    return config.get("zero_optimization", {}).get("stage", 0)


def fp16_supported(device_type: str) -> bool:
    """Whether DeepSpeed's accelerator takes fp16: every CUDA device here, the CPU where oneDNN has fp16 (DeepSpeed's
    ``CPU_Accelerator.is_fp16_supported``)."""
    if device_type == "cuda":
        return True
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - what DeepSpeed does: any failure means no fp16
        return False


def check_deepspeed_config(config: dict, path: Optional[str], world: int, fp16_ok: bool = True) -> None:
    """What DeepSpeed would refuse only after the models are built: the ZeRO stage, two precisions at once (fp16 where
    the device has none: ``fp16_ok`` False), batch settings that do not multiply up (``train_batch_size = micro x
    accumulation x ranks``), a ``gradient_clipping`` that is no number, the optimizer and the scheduler."""
    where = f"--deepspeed-config {path}" if path else "the built-in DeepSpeed config"
    check_sections(config, where)
    stage = zero_stage(config)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3; got {stage!r}")
    bf16, fp16 = precision_sections(config)
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ValueError(f"{where}: bf16 and fp16 are both enabled; enable at most one")
    if fp16.get("enabled") and not fp16_ok:
        raise ValueError(f"{where}: fp16.enabled: this device has no fp16 (DeepSpeed: 'Type fp16 is not supported "
                         "on your device'); use bf16 or neither")
    batch = {key: config[key] for key in BATCH_KEYS if key in config}
    for key, value in batch.items():
        if not (is_int(value) and value >= 1):
            raise ValueError(f"{where}: {key} must be an int >= 1; got {value!r}")
    total, micro = batch.get("train_batch_size"), batch.get("train_micro_batch_size_per_gpu")
    accumulation = batch.get("gradient_accumulation_steps")
    if total is not None and micro is not None and accumulation is not None and total != micro * accumulation * world:
        raise ValueError(f"{where}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {accumulation} x {world} rank(s)")
    if total is not None and total % ((micro or accumulation or 1) * world):
        raise ValueError(f"{where}: train_batch_size {total} is not a multiple of "
                         f"{'train_micro_batch_size_per_gpu' if micro else 'gradient_accumulation_steps'} "
                         f"{micro or accumulation or 1} x {world} rank(s)")
    if "gradient_clipping" in config and not is_number(config["gradient_clipping"]):
        raise ValueError(f"{where}: gradient_clipping must be a finite number; got {config['gradient_clipping']!r}")
    check_optimizer(config, where)


def _torch_class(module_name: str, name: str) -> bool:
    return isinstance(getattr(importlib.import_module(module_name), name, None), type)


def check_optimizer(config: dict, where: str) -> None:
    """``optimizer.type`` one of DeepSpeed's names or a ``torch.optim`` class, its numeric ``params`` numbers (a string
    ``lr`` would fail inside the first step), ``scheduler.type`` one of DeepSpeed's or ``torch.optim.lr_scheduler``'s.
    """
    optimizer, scheduler = config.get("optimizer"), config.get("scheduler")
    if optimizer is not None:
        name = optimizer["type"]
        if name.lower() not in DS_OPTIMIZERS and not _torch_class("torch.optim", name):
            raise ValueError(f"{where}: optimizer.type {name!r} is neither DeepSpeed's ({', '.join(DS_OPTIMIZERS)}; "
                             "any case) nor a torch.optim class")
        params = optimizer.get("params") or {}
        for key in OPTIMIZER_NUMBERS:
            if key in params and not (is_number(params[key]) and params[key] >= 0):
                raise ValueError(f"{where}: optimizer.params.{key} must be a finite number >= 0; got {params[key]!r}")
        betas = params.get("betas", [0, 0])
        if not (isinstance(betas, list) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"{where}: optimizer.params.betas must be two numbers in [0, 1); got {betas!r}")
        if "max_grad_norm" in params:
            raise ValueError(f"{where}: optimizer.params.max_grad_norm: DeepSpeed refuses it; use gradient_clipping")
    if scheduler is not None and scheduler["type"] not in DS_SCHEDULERS \
            and not _torch_class("torch.optim.lr_scheduler", scheduler["type"]):
        raise ValueError(f"{where}: scheduler.type {scheduler['type']!r} is neither DeepSpeed's "
                         f"({', '.join(DS_SCHEDULERS)}) nor a torch.optim.lr_scheduler class")


def check_json_out(path: Optional[str]) -> None:
    """``--json-out`` must name a file (not empty, not a directory, not ending in a separator) in a directory this
    process can create or write (checked now: the report is written after the last step)."""
    if path is None:
        return
    name = os.path.basename(path)
    why = "is empty" if not path else "is a directory" if os.path.isdir(path) else "ends in a separator (a " \
        "directory)" if not name else "names a directory" if name in (".", "..") else None
    if why:
        raise ValueError(f"--json-out {path!r}: {why}; name a file (run.json)")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--json-out {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--json-out {path}: the directory {existing} is not writable")


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
                 self_context: int = 0, chat: Optional[tuple[int, int]] = None) -> None:
    """Context, vocabulary and gathering: what the step and its rollout refuse once the models are built, and the
    teacher's context, which nothing checks later (a teacher scoring past its context gives wrong numbers silently).
    ``teacher`` is ``student`` when the student is its own teacher (``--teacher self``: its prompts are
    ``self_context`` tokens longer) or the teacher's config cannot be read. ``chat``: the real model's longest chat
    prompts (student's, teacher's; :func:`rollout.real_model.longest_chat_prompts`), where they were counted."""
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
