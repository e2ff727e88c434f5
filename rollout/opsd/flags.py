"""The main job's command line (``scripts/train_opsd.py``): the flag table and :func:`parse_job`.

Every default lives in the dataclasses (``JobConfig``, ``OPSDConfig``, ``RolloutConfig``); argparse never
repeats one, and a flag left out keeps it. The rollout's settings make one ``RolloutConfig``
(``JobConfig.rollout``): its common settings have flags of their own (``--route``, ``--gather``,
``--keep-cache``, ``--max-cache-gib``), every other comes through the repeatable ``--rollout SETTING=VALUE``
by its dotted name (``rollout.config.setting_names()``) with a Python literal::

    --rollout kernels.cuda_graphs=False --rollout routing.eos_check_interval=2
    --rollout "kernels.decode_attention='sdpa'"      # strings quoted

The flags that were ``kernels`` settings (``--compile``, ``--cuda-graphs``, ``--prefill-graph-tokens``) fail
naming their new spelling.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Optional

from instrumentation.cli_values import parse_int_text
from rollout.config import MOVED, REMOVED, RolloutConfig, setting_names
from rollout.opsd.config import OPSDConfig
from rollout.opsd.job import JobConfig, ModelNames


def integer(text: str) -> int:
    """``int`` for argparse in ASCII digits only (``int('٣')`` is 3, ``int('1_0')`` 10); argparse names the flag of
    another value ("invalid int value")."""
    value = parse_int_text(text)
    if value is None:
        raise ValueError(f"not an int in ASCII digits: {text!r}")
    return value


integer.__name__ = "int"  # argparse's message: "invalid int value: '...'"


def switch(text: str) -> bool:
    """``0`` / ``1`` -> False / True (argparse names the flag of another value)."""
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1; got {text!r}")
    return text == "1"


def rows_setting(text: str):
    """``auto`` / ``all`` (None: every row at once) / an int >= 1: a micro-batch size flag (argparse names the flag
    of a bad value, with the accepted ones)."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    rows = parse_int_text(text) or 0
    if rows < 1:
        raise argparse.ArgumentTypeError(f"expected auto, all or an int >= 1 (rows); got {text!r}")
    return rows


#: What argparse reads as a negative number, not a flag: its own ``-1`` and ``-1.5``, and also ``-1e300``, ``-.5E-3``,
#: ``-inf`` and ``-nan`` (Python 3.11's pattern takes no exponent: ``--lr -1e300`` failed as "expected one argument").
NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?$|^-(?:inf|infinity|nan)$", re.IGNORECASE)


class JobParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reads every negative number (:data:`NEGATIVE_NUMBER`) as a value, so that a numeric
    flag's range check names the flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER


#: The records the flags set: key of the flag table -> class (``rollout``: ``JobConfig.rollout``).
RECORDS = {"job": JobConfig, "opsd": OPSDConfig, "rollout": RolloutConfig}
#: flag -> (record, field, type, help). Defaults come from the dataclasses, never from argparse.
FLAGS = {
    "--student": ("job", "student", str, "student: HF name, local dir, shape name or smollm2-135m"),
    "--teacher": ("job", "teacher", str, "teacher: HF name, local dir, shape name, smollm2-135m or 'self'"),
    "--deepspeed-config": ("job", "deepspeed_config", str, "DeepSpeed JSON config file"),
    "--zero-stage": ("job", "zero_stage", integer, "ZeRO stage, overrides the config's"),
    "--lora": ("job", "lora", integer, "peft LoRA rank (train adapters only)"),
    "--batch-size": ("job", "batch_size", integer, "prompts per step and rank"),
    "--samples-per-prompt": ("job", "samples_per_prompt", integer, "responses per prompt"),
    "--max-new-tokens": ("job", "max_new_tokens", integer, "response budget"),
    "--prompt-len": ("job", "prompt_len", integer, "synthetic prompt length"),
    "--sampling-temperature": ("job", "sampling_temperature", float, "rollout temperature"),
    "--steps": ("job", "steps", integer, "training steps"),
    "--lr": ("job", "lr", float, "AdamW learning rate (None: 1e-5 for smollm2-135m, else 5e-3)"),
    "--seed": ("job", "seed", integer, "seed"),
    "--route": ("rollout", "route", str, "rollout route: ordinary, continuous or auto"),
    "--keep-cache": ("rollout", "keep_cache", switch, "1: keep the KV cache between rollouts, 0: release it"),
    "--gather": ("rollout", "gather", str, "ZeRO-3 rollout gathering: once or per_forward"),
    "--max-cache-gib": ("rollout", "max_cache_gib", float, "cap on a rollout's KV cache, GiB (None: free memory)"),
    "--teacher-offload": ("job", "teacher_offload", integer,
                          "1: teacher in an inference-only ZeRO-3 engine, parameters offloaded to host"),
    "--json-out": ("job", "json_out", str, "rank 0 writes the run's JSON report (all ranks) here"),
    "--peak-tflops": ("job", "peak_tflops", float,
                      "the device's peak TFLOP/s for MFU and the work rooflines (default: a listed GPU's)"),
    "--peak-tbps": ("job", "peak_tbps", float,
                    "the device's copy TB/s (read + written) for the work rooflines (default: measured or listed)"),
    "--print-every": ("job", "print_every", integer, "print 2 rollout rows decoded every N steps (0: never)"),
    "--max-student-rows": ("opsd", "max_student_rows", rows_setting, "rows per student micro-batch: auto, all or N"),
    "--max-teacher-rows": ("opsd", "max_teacher_rows", rows_setting, "rows per teacher forward: auto, all or N"),
    "--max-micro-batch-gib": ("opsd", "max_micro_batch_gib", float, "micro-batch memory budget for auto"),
    "--train-path": ("opsd", "train_path", str, "teacher/student passes: auto, packed (varlen, fused loss) or padded"),
    "--beta": ("opsd", "beta", float, "generalized JSD beta (0 forward KL, 1 reverse KL)"),
    "--temperature": ("opsd", "temperature", float, "loss temperature"),
    "--teacher-top-k": ("opsd", "teacher_top_k", integer, "cache the teacher's top-k logits only"),
    "--logit-cache": ("opsd", "logit_cache_location", str, "teacher logit cache: device or host"),
    "--coalesce-gradients": ("opsd", "coalesce_gradients", switch,
                             "1: a ZeRO-3 student gathered once reduces its gradients once a step, 0: every micro-batch"),
}
#: The flag of every other rollout setting: ``--rollout SETTING=VALUE``.
ROLLOUT_FLAG = "--rollout"
#: Rollout settings with a flag of their own -> the flag.
COMMON_SETTINGS = {name: flag for flag, (key, name, _, _) in FLAGS.items() if key == "rollout"}
#: The settings ``--rollout`` takes: every dotted name of ``RolloutConfig`` without a flag of its own.
ROLLOUT_SETTINGS = tuple(name for name in setting_names() if name not in COMMON_SETTINGS)
#: Flags that became settings of ``RolloutConfig.kernels`` -> the setting: they fail naming ``--rollout``.
MOVED_FLAGS = {"--compile": "kernels.compile", "--cuda-graphs": "kernels.cuda_graphs",
               "--prefill-graph-tokens": "kernels.prefill_graph_tokens"}


@dataclass(frozen=True)
class JobArgs:
    """What the command line asked for."""

    job: JobConfig
    opsd: OPSDConfig
    local_rank_arg: Optional[int]
    """The ``--local_rank`` value a launcher passed (the deepspeed launcher does); None when none was."""


def rollout_setting(text: str) -> tuple[str, object]:
    """``(name, value)`` of a ``--rollout SETTING=VALUE``: a name of :data:`ROLLOUT_SETTINGS` and a Python literal."""
    name, sep, literal = text.partition("=")
    name = name.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"expected SETTING=VALUE (kernels.cuda_graphs=False); got {text!r}")
    if name in COMMON_SETTINGS:
        raise argparse.ArgumentTypeError(f"{name}: has a flag of its own, {COMMON_SETTINGS[name]}")
    if name not in ROLLOUT_SETTINGS:
        raise argparse.ArgumentTypeError(f"{name!r} is not a rollout setting; {setting_hint(name)}")
    try:
        return name, ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{name}: {literal!r} is not a Python literal (True, 2, None, 'sdpa', ...; "
                                         "quote strings)") from None


def setting_hint(name: str) -> str:
    """What an unknown ``--rollout`` name may have meant: its new place (an old flat name), why it was removed,
    the close matches, or else every setting."""
    if name in REMOVED:
        return f"it was removed in 0.2: {REMOVED[name]}"
    close = [MOVED[name]] if name in MOVED else difflib.get_close_matches(name, ROLLOUT_SETTINGS, n=3, cutoff=0.75)
    return f"did you mean {' or '.join(close)}?" if close else f"the settings: {', '.join(ROLLOUT_SETTINGS)}"


class MovedFlag(argparse.Action):
    """A flag that became a ``RolloutConfig.kernels`` setting: fails naming its ``--rollout`` spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        setting = MOVED_FLAGS[option_string]
        is_switch = isinstance(RolloutConfig().settings()[setting], bool)
        value = str(values == "1") if is_switch and values in ("0", "1") else values or "VALUE"
        parser.error(f"{option_string}: moved; use {ROLLOUT_FLAG} {setting}={value}")


def rollout_config(common: dict, settings: dict) -> RolloutConfig:
    """The job's one ``RolloutConfig``: the defaults with the common flags' values (``--keep-cache`` already a bool:
    :func:`switch`) and the ``--rollout`` settings applied."""
    return RolloutConfig().with_settings({**common, **settings})


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The job's parser: every flag of :data:`FLAGS`, ``--rollout``, the moved flags and the launcher's
    ``--local_rank`` (both hidden)."""
    defaults = {key: {f.name: f.default for f in dataclasses.fields(cls)} for key, cls in RECORDS.items()}
    parser = JobParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, (key, name, kind, text) in FLAGS.items():
        parser.add_argument(flag, dest=f"{key}.{name}", type=kind, default=argparse.SUPPRESS,
                            help=f"{text} (default: {defaults[key][name]})")
    parser.add_argument(ROLLOUT_FLAG, dest="rollout_settings", type=rollout_setting, action="append", default=[],
                        metavar="SETTING=VALUE", help="any other RolloutConfig setting by its dotted name, with a "
                        f"Python literal; repeatable. Settings: {', '.join(ROLLOUT_SETTINGS)}")
    for flag in MOVED_FLAGS:
        parser.add_argument(flag, action=MovedFlag, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK (set by every launcher) is what counts.
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    return parser


def parse_job(argv=None, *, models: ModelNames, description: str = "") -> JobArgs:
    """The job's settings from the command line (``sys.argv`` when ``argv`` is None), every one checked
    before anything is built: a bad value exits through argparse (status 2) naming its field."""
    parser = build_parser(description)
    values = vars(parser.parse_args(argv))
    local_rank_arg = values.pop("local_rank")
    settings = dict(values.pop("rollout_settings"))
    kwargs = {key: {name.split(".", 1)[1]: v for name, v in values.items() if name.startswith(key + ".")}
              for key in RECORDS}
    try:
        job = JobConfig(**kwargs["job"], rollout=rollout_config(kwargs["rollout"], settings))
        models.check(job)
        return JobArgs(job, OPSDConfig(**kwargs["opsd"]), local_rank_arg)
    except ValueError as exc:
        parser.error(str(exc))
