"""The main job's checks of its DeepSpeed config (``--deepspeed-config`` or the built-in one) before anything is built:
read as DeepSpeed 0.19.8 reads it, every value the job or DeepSpeed would trip on after the models are built refused
in one ``ValueError`` line naming the key (``scheduler.params.warmup_num_steps``). ``rollout.job.check_job`` runs
them with the other checks of :mod:`rollout.opsd.preflight`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from typing import Optional

from rollout.checks import is_int, is_number

#: The DeepSpeed batch settings, each a positive int when given.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
#: DeepSpeed 0.19.8's own optimizer names (``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS``, matched lower-cased) and
#: LR schedules (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``): other names must be classes of
#: ``torch.optim`` / ``torch.optim.lr_scheduler``, as DeepSpeed looks them up (copied: importing deepspeed here would
#: fix its accelerator too early; ``tests/test_job_checks_more.py`` compares them with DeepSpeed's).
DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
DS_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
#: The largest learning rate the job takes (``--lr``, ``optimizer.params.lr``, a schedule's rates). AdamW's first step
#: moves each weight by lr / (1 - beta1), passed as a float32 scalar (at most 3.4e38): torch raises there, after the
#: models are built, above about 3.4e37 with beta1 = 0.9. 1e30 holds for any beta1 up to 1 - 1e-8.
MAX_LR = 1e30
#: ``optimizer.params`` that must be finite numbers >= 0 where given (``betas``: two numbers in [0, 1); ``lr`` at
#: most :data:`MAX_LR`).
OPTIMIZER_NUMBERS = ("lr", "eps", "weight_decay")
#: ``zero_optimization``'s offload sections and the devices DeepSpeed knows (``nvme`` needs ``nvme_path``).
OFFLOADS, OFFLOAD_DEVICES = ("offload_param", "offload_optimizer"), ("none", "cpu", "nvme")

#: What each kind of scheduler parameter must be, and its test (a trailing ``?`` in a kind also takes null).
PARAM_KINDS = {
    "lr": (f"a finite number in [0, {MAX_LR:g}] or a list of them",
           lambda v: _lr(v) or (isinstance(v, list) and v != [] and all(_lr(x) for x in v))),
    "number": ("a finite number", is_number),
    "ratio": ("a finite number >= 0", lambda v: is_number(v) and v >= 0),
    "size": ("a finite number > 0", lambda v: is_number(v) and v > 0),
    "steps": ("an int >= 1", lambda v: is_int(v) and v >= 1),
    "count": ("an int >= 0", lambda v: is_int(v) and v >= 0),
    "iteration": ("an int >= -1", lambda v: is_int(v) and v >= -1),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "warmup": ("'log' or 'linear'", lambda v: v in ("log", "linear")),
}
_WARMUP = {"warmup_min_lr": "lr", "warmup_max_lr": "lr?", "warmup_num_steps": "steps", "warmup_type": "warmup",
           "last_batch_iteration": "iteration"}
#: The parameters of DeepSpeed 0.19.8's schedules (``deepspeed.runtime.lr_schedules``, the optimizer aside) -> kind
#: (:data:`PARAM_KINDS`); ``tests/test_job_checks_last.py`` compares the names with DeepSpeed's signatures.
SCHEDULER_PARAMS = {
    "LRRangeTest": {"lr_range_test_min_lr": "lr", "lr_range_test_step_size": "steps",
                    "lr_range_test_step_rate": "number", "lr_range_test_staircase": "bool",
                    "last_batch_iteration": "iteration"},
    "OneCycle": {"cycle_min_lr": "lr", "cycle_max_lr": "lr", "decay_lr_rate": "number", "cycle_first_step_size": "size",
                 "cycle_second_step_size": "ratio?", "cycle_first_stair_count": "count",
                 "cycle_second_stair_count": "count?", "decay_step_size": "count", "cycle_momentum": "bool",
                 "cycle_min_mom": "number", "cycle_max_mom": "number", "decay_mom_rate": "number",
                 "last_batch_iteration": "iteration"},
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": "count", **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": "count", "warmup_min_ratio": "ratio", "warmup_num_steps": "steps",
                       "cos_min_ratio": "ratio", "warmup_type": "warmup", "last_batch_iteration": "iteration"},
}
#: The parameters without a default (DeepSpeed raises TypeError once the models are built without them).
SCHEDULER_REQUIRED = {"OneCycle": ("cycle_min_lr", "cycle_max_lr"), "WarmupDecayLR": ("total_num_steps",),
                      "WarmupCosineLR": ("total_num_steps",)}


def _lr(value) -> bool:
    return is_number(value) and 0 <= value <= MAX_LR


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


def _need(ok: bool, where: str, key: str, what: str, value) -> None:
    if not ok:
        raise ValueError(f"{where}: {key} must be {what}; got {json.dumps(value)[:80]}")


def check_sections(config: dict, where: str) -> None:
    """The sections the job reads or changes, as DeepSpeed reads them: ``zero_optimization`` (``--zero-stage`` sets its
    stage) and its offload sections, ``bf16`` (null: absent, the older ``bfloat16`` then), ``fp16``, ``optimizer``
    and ``scheduler`` are objects; an ``enabled`` is true or false (DeepSpeed reads ``"false"`` as false but
    ``"auto"`` as absent: refused, as any non-bool)."""
    zero = config.get("zero_optimization", {})
    _need(isinstance(zero, dict), where, "zero_optimization", 'an object ({"stage": 0-3, ...})', zero)
    for key in OFFLOADS:
        offload = zero.get(key)
        _need(offload is None or isinstance(offload, dict), where, f"zero_optimization.{key}", "an object", offload)
        device = (offload or {}).get("device", "none")
        _need(device in OFFLOAD_DEVICES, where, f"zero_optimization.{key}.device", "'none', 'cpu' or 'nvme'", device)
        _need(device != "nvme" or (offload.get("nvme_path") and isinstance(offload["nvme_path"], str)), where,
              f"zero_optimization.{key}.nvme_path", "a path with device 'nvme'", offload and offload.get("nvme_path"))
    for key in ("fp16", "bf16" if config.get("bf16") is not None else "bfloat16"):
        section = config.get(key, {})
        _need(isinstance(section, dict), where, key, 'an object ({"enabled": true})', section)
        _need(isinstance(section.get("enabled", False), bool), where, f"{key}.enabled", "true or false",
              section.get("enabled"))
    for key in ("optimizer", "scheduler"):
        part = config.get(key)
        _need(key not in config or (isinstance(part, dict) and isinstance(part.get("type"), str)), where, key,
              "an object with a 'type'", part)
        params = (part or {}).get("params")
        _need(params is None or isinstance(params, dict), where, f"{key}.params", "an object", params)


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
    check_scheduler(config.get("scheduler"), where)


def _torch_class(module_name: str, name: str) -> Optional[type]:
    found = getattr(importlib.import_module(module_name), name, None)
    return found if isinstance(found, type) else None


def check_optimizer(config: dict, where: str) -> None:
    """``optimizer.type`` one of DeepSpeed's names or a ``torch.optim`` class, its numeric ``params`` numbers (a string
    ``lr`` would fail inside the first step)."""
    optimizer = config.get("optimizer")
    if optimizer is None:
        return
    name = optimizer["type"]
    if name.lower() not in DS_OPTIMIZERS and not _torch_class("torch.optim", name):
        raise ValueError(f"{where}: optimizer.type {name!r} is neither DeepSpeed's ({', '.join(DS_OPTIMIZERS)}; "
                         "any case) nor a torch.optim class")
    params = optimizer.get("params") or {}
    for key in OPTIMIZER_NUMBERS:
        if key in params and not (is_number(params[key]) and params[key] >= 0):
            raise ValueError(f"{where}: optimizer.params.{key} must be a finite number >= 0; got {params[key]!r}")
    _need(params.get("lr", 0) <= MAX_LR, where, "optimizer.params.lr",
          f"at most {MAX_LR:g} (AdamW's float32 step overflows above it)", params.get("lr"))
    betas = params.get("betas", [0, 0])
    if not (isinstance(betas, list) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"{where}: optimizer.params.betas must be two numbers in [0, 1); got {betas!r}")
    if "max_grad_norm" in params:
        raise ValueError(f"{where}: optimizer.params.max_grad_norm: DeepSpeed refuses it; use gradient_clipping")


def check_scheduler(scheduler: Optional[dict], where: str) -> None:
    """``scheduler.type`` one of DeepSpeed's schedules or a ``torch.optim.lr_scheduler`` class, and its ``params`` an
    object (DeepSpeed calls the schedule with ``**params``: without them it fails) whose keys the schedule takes, the
    required ones given: DeepSpeed's by :data:`SCHEDULER_PARAMS` (each value of its kind), torch's by its signature
    (every number finite)."""
    if scheduler is None:
        return
    name, params = scheduler["type"], scheduler.get("params")
    torch_class = None if name in DS_SCHEDULERS else _torch_class("torch.optim.lr_scheduler", name)
    if name not in DS_SCHEDULERS and torch_class is None:
        raise ValueError(f"{where}: scheduler.type {name!r} is neither DeepSpeed's ({', '.join(DS_SCHEDULERS)}) nor "
                         "a torch.optim.lr_scheduler class")
    if params is None:
        raise ValueError(f"{where}: scheduler.params: {name} needs an object ({{}} for its defaults); DeepSpeed calls "
                         "the schedule with **params and fails without it")
    if torch_class is not None:
        try:
            inspect.signature(torch_class).bind(None, **params)  # None: the optimizer
        except TypeError as exc:
            raise ValueError(f"{where}: scheduler.params: {exc} (torch.optim.lr_scheduler.{name})") from None
        for key, value in params.items():
            _need(not isinstance(value, float) or math.isfinite(value), where, f"scheduler.params.{key}",
                  "a finite number", value)
        return
    table = SCHEDULER_PARAMS[name]
    for key, value in params.items():
        if key not in table:
            raise ValueError(f"{where}: scheduler.params.{key}: not a parameter of {name} (DeepSpeed's {name} takes "
                             f"{', '.join(table)})")
        kind = table[key]
        what, test = PARAM_KINDS[kind.rstrip("?")]
        _need(test(value) or (kind.endswith("?") and value is None), where, f"scheduler.params.{key}",
              what + (" or null" if kind.endswith("?") else ""), value)
    for key in SCHEDULER_REQUIRED.get(name, ()):
        if key not in params:
            raise ValueError(f"{where}: scheduler.params.{key}: {name} needs it (it has no default)")
