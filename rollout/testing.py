"""Tiny random models and a tokenizer-like object, for tests, demos and CPU benchmarks.

Nothing is downloaded: every model is built from a config with random weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Shapes of the embedded tiny models. ``vocab_size`` stays small so CPU tests are fast.
TINY_SHAPES = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512, max_position_embeddings=512),
}

#: The Qwen2.5-3B geometry used for GPU benchmarks (random weights).
QWEN25_3B_SHAPE = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0)

#: The Qwen2.5-7B geometry (random weights; untied embeddings): the multi-GPU issue's larger student.
QWEN25_7B_SHAPE = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, tie_word_embeddings=False, rope_theta=1000000.0)


@dataclass(frozen=True)
class TinyTokenizer:
    """The part of a tokenizer the rollout core uses: ``pad_token_id`` and ``eos_token_id``.

    ``eos_token_id`` may be an int, a list of ints, or None (no EOS: every row runs to the budget).
    """

    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    vocab_size: int = 512
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict)


def tiny_config(arch: str = "qwen2", **overrides):
    """A transformers config for a tiny random model of ``arch`` (``"qwen2"`` or ``"llama"``)."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in TINY_SHAPES:
        raise ValueError(f"arch must be one of {sorted(TINY_SHAPES)}; got {arch!r}")
    kwargs = dict(TINY_SHAPES[arch])
    kwargs.update(overrides)
    kwargs.setdefault("pad_token_id", 0)
    kwargs.setdefault("eos_token_id", 2)
    kwargs.setdefault("bos_token_id", 1)
    config_cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = config_cls(**kwargs)
    config._attn_implementation = kwargs.get("attn_implementation", "sdpa")
    return config


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **overrides):
    """A tiny random causal LM (eval mode), deterministic for a given ``seed``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    return model.to(device=device, dtype=dtype).eval()


def random_prompts(batch_size: int, max_len: int, *, min_len: int = 1, vocab_size: int = 512,
                   pad_token_id: int = 0, seed: int = 0, avoid: tuple[int, ...] = (0, 1, 2),
                   device: str | torch.device = "cpu"):
    """Left-padded random prompts: ``(prompt_ids [B, T_p], prompt_attention_mask [B, T_p])``.

    Row lengths are drawn from ``[min_len, max_len]``; the longest row is ``max_len`` so ``T_p ==
    max_len``. Token ids avoid ``avoid`` (pad/bos/eos by default) so prompts contain no EOS.
    """
    stream = PromptStream(batch_size, max_len, min_len=min_len, vocab_size=vocab_size, pad_token_id=pad_token_id,
                          seed=seed, avoid=avoid)
    return stream.take(batch_size, device)


class PromptStream:
    """The rows of ``random_prompts(num_rows, ...)`` drawn a few at a time, in order (the same rows, bit for bit):
    the lengths of all rows are drawn at once (8 bytes a row), each row's tokens only when it is taken."""

    def __init__(self, num_rows: int, max_len: int, *, min_len: int = 1, vocab_size: int = 512,
                 pad_token_id: int = 0, seed: int = 0, avoid: tuple[int, ...] = (0, 1, 2)):
        self.max_len, self.pad_token_id = max_len, pad_token_id
        self.gen = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_len, max_len + 1, (num_rows,), generator=self.gen)
        self.lengths[0] = max_len
        self.allowed = torch.tensor([t for t in range(vocab_size) if t not in avoid])
        self.taken = 0

    def take(self, num_rows: int, device: str | torch.device = "cpu"):
        """The next ``num_rows`` rows: ``(ids [num_rows, max_len], mask [num_rows, max_len])`` on ``device``."""
        lengths = self.lengths[self.taken:self.taken + num_rows].tolist()
        self.taken += len(lengths)
        ids = torch.full((len(lengths), self.max_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(lengths), self.max_len), dtype=torch.long)
        for row, length in enumerate(lengths):
            picks = self.allowed[torch.randint(len(self.allowed), (length,), generator=self.gen)]
            ids[row, self.max_len - length:] = picks
            mask[row, self.max_len - length:] = 1
        return ids.to(device), mask.to(device)


#: Named random-model shapes for scripts (``--student`` / ``--teacher``): name -> (arch, shape).
#: Built by :func:`shaped_model` from a config, nothing downloaded.
MODEL_SHAPES = {
    "tiny-qwen2": ("qwen2", TINY_SHAPES["qwen2"]),
    # the 3B's module tree (36 layers, 434 parameter tensors) at tiny width: host-side costs that grow with the
    # number of modules or parameters (benchmarks.profiler_cost host) show on the CPU
    "tiny-qwen2-deep": ("qwen2", {**TINY_SHAPES["qwen2"], "num_hidden_layers": 36, "tie_word_embeddings": True}),
    "tiny-llama": ("llama", TINY_SHAPES["llama"]),
    "qwen25-3b": ("qwen2", QWEN25_3B_SHAPE),
    "qwen25-7b": ("qwen2", QWEN25_7B_SHAPE),
}


def shape_config(name: str, **overrides):
    """The transformers config of the named shape (``MODEL_SHAPES``); pad 0, bos 1, eos 2, SDPA."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}; got {name!r}")
    arch, shape = MODEL_SHAPES[name]
    return tiny_config(arch, **{**shape, **overrides})


def shaped_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", **overrides):
    """A random causal LM of the named shape (eval mode), built directly on ``device`` in ``dtype``.

    Parameters are allocated and initialised on ``device`` (no CPU copy first: a 3B model is
    built in about a second on a GPU instead of a minute on the host). Deterministic for a given
    ``seed``, device type and dtype; the global RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM

    config = shape_config(name, **overrides)
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation,
                                                     dtype=dtype)
    return model.eval()
