"""Nucleus (top-p) sampling in one Triton kernel: the CUDA path of :class:`rollout.ops.sampling.Sampler`.

Why: at 256 rows x 151,936 tokens the compiled sort-free nucleus (:mod:`rollout.ops.nucleus`) still
ran ~22 passes over fp32 ``[B, V]`` tensors (softmax, keys, 4 search passes, the tie group, noise,
argmax, log-softmax), ~3.9 ms a decode step (sampled minus greedy in the RL wide cell). Here the row's logits are
read in their own dtype (bf16: 2 bytes a token) ``3 + passes`` times and one token (and its log-probability) is
written. Two forms with the same algorithm: one program per row (:mod:`rollout.ops.nucleus_kernel`; 0.80 ms at 256
rows, but 0.43 ms at 8, where 8 programs leave most of the GPU idle), and, by default, each row cut into chunks of
``CHUNK_TOKENS`` with a program per chunk and a launch per pass (:mod:`rollout.ops.nucleus_split_kernel`; 0.08 ms at
8 rows, 0.23 at 64, 0.77 at 256 on the H200; ``docs/BENCHMARKS.md``). The chunking depends on the vocabulary only,
so a row's token never depends on how many rows share the call.
Keys are those of the raw logits (dividing by ``T > 0`` keeps order and ties), so bf16 logits search 16-bit
keys at any temperature.
Each pass keeps per-lane partial results in registers and reduces across the program once, at its end:

1. the row's largest score and smallest key;
2. the search for the boundary key (:mod:`rollout.ops.nucleus`'s definition: the largest order-preserving
   key ``t`` whose strictly-lower mass is ``<= 1 - top_p``) between the smallest and the largest key,
   ``ARITY`` thresholds a pass, until one key is left (``Z = sum exp(s - max)`` on the first pass);
3. the straddling tie group: its member of rank ``floor((1 - top_p - mass below) / p)`` (clamped to the
   group) is the first kept one, as a stable ascending sort's cumulative sum has it;
4. Gumbel-max over the kept tokens with the counter-based noise of :func:`rollout.ops.sampling.uniform_noise`
   (same hash, same ``(seed, sample id, token index, token id)`` keys, computed in uint32), and the kept
   mass for the log-probability.

Plain temperature sampling (top-p 1, the on-policy setting) takes step 4 alone over every token
(:func:`sample_plain`: one pass over the row, a second for the log-probability's maximum).

Semantics are those of HF's ``TopPLogitsWarper`` after temperature; masses are summed in another order
(and with the GPU's fast ``exp``), so, as with the compiled path, a token can differ from the eager
(sorting) path only where a cumulative mass lies within rounding of ``1 - top_p``. Covers temperature +
top-p without top-k and without a repetition penalty (the RL setting); :func:`supports` says when.
No host sync; the kernel is captured in CUDA graphs like any other. ``TRITON_INTERPRET=1`` runs it on
the CPU (the tests do).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from rollout.checks import pow2_at_least
from rollout.ops.decode_attention import sm_count

ARITY = 16
"""Thresholds per search pass, a power of two (more: fewer passes over the row, more work per token and pass)."""
WIDE_ARITY = 8
"""The arity where the rows fill the GPU (at least one program per multiprocessor; :func:`arity`): on the H200 at
256 rows 8 thresholds took 0.80 ms against 16's 0.91, at 8 rows 0.48 against 0.43 (``docs/BENCHMARKS.md``,
"2026-12-01 (23:20 UTC session)"). Same tokens: the search ends on the same boundary key at any arity."""
BLOCK = 2048
"""Tokens a program reads per iteration (2048 x 8 warps measured best on the H200 at 8 and 256 rows,
``docs/BENCHMARKS.md``)."""
NUM_WARPS = 8
CHUNK_TOKENS = 8192
"""Tokens of a row one program reads when the row is cut into chunks (:mod:`rollout.ops.nucleus_split_kernel`: a
program per chunk and a launch per pass, instead of one program per row reading the whole row ``3 + passes``
times); 0, or a vocabulary of one chunk: one program per row. Depends on the vocabulary only, never on the rows,
so a row's token does not depend on its batch (the two forms sum masses in different orders)."""
SPLIT_ARITY = 16
"""Thresholds per pass of the chunked form while its programs do not fill the GPU twice over (its passes are
launches, as many as a key's width needs at this arity: fewer, longer passes). The arity changes no result: a
threshold's mass sums the same tokens in the same order whatever the others."""
SPLIT_WIDE_ARITY = 8
"""The arity once the programs fill the GPU more than twice over (less work per token and pass, more passes)."""
SPLIT_WIDEST_ARITY = 4
"""The arity once they fill it more than 16 times over. On the H200 (T=1, top-p 0.9; ms): 8 rows 0.080 at 16 against 0.092 at 8;
16 rows 0.115 / 0.101 / 0.112 at 16 / 8 / 4; 64 rows 0.272 / 0.232 at 16 / 8; 256 rows 1.085 / 0.870 / 0.779 and 512
rows 2.109 / 1.689 / 1.498 at 16 / 8 / 4 (``docs/BENCHMARKS.md``, 2026-12-02 04:50 UTC session)."""
SPLIT_BLOCK = 1024
SPLIT_WARPS = 4
"""Tokens a program of the chunked form reads per iteration, and its warps: both fix the order of its sums, so they
never depend on the rows."""
CHUNKS_PER_PROGRAM = 1
"""Consecutive chunks one program of the chunked form takes (each still summed and stored on its own, so this
changes no result): a program per chunk was the fastest or within 5% at 8 to 512 rows on the H200 (against 2, 4
and a program per row)."""


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when the kernel can run; else why not (no triton)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the other path
        return f"triton unavailable: {exc!r:.200}"
    return None


def applies(temperature: float, top_k: int, top_p: float, penalised: bool, vocab: int) -> bool:
    """Whether the kernel computes this selection: sampling (T > 0) with 0 < top_p < 1, no top-k, no
    repetition penalty."""
    return temperature > 0.0 and 0.0 < top_p < 1.0 and (top_k <= 0 or top_k >= vocab) and not penalised


def supports(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, penalised: bool) -> bool:
    """:func:`applies`, for 2-D floating logits on a CUDA device, with triton importable."""
    return (logits.dim() == 2 and logits.is_floating_point() and logits.device.type == "cuda"
            and applies(temperature, top_k, top_p, penalised, logits.shape[-1]) and available() is None)


def applies_plain(temperature: float, top_k: int, top_p: float, penalised: bool, vocab: int) -> bool:
    """Whether :func:`sample_plain` computes this selection: sampling (T > 0) with top_p 1 (every token kept), no
    top-k, no repetition penalty (the on-policy setting)."""
    return temperature > 0.0 and top_p >= 1.0 and (top_k <= 0 or top_k >= vocab) and not penalised


def supports_plain(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, penalised: bool) -> bool:
    """:func:`applies_plain`, for 2-D floating logits on a CUDA device, with triton importable."""
    return (logits.dim() == 2 and logits.is_floating_point() and logits.device.type == "cuda"
            and applies_plain(temperature, top_k, top_p, penalised, logits.shape[-1]) and available() is None)


def sample_plain(logits: torch.Tensor, temperature: float, seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor,
                 with_logprobs: bool, chunk_tokens: Optional[int] = None):
    """``(tokens [B] int64, logprobs [B] fp32 or None)``: one sample per row of ``logits [B, V]`` from the whole
    softmax of ``logits / temperature`` (top-p 1): the Gumbel-max draw of :func:`sample_top_p` with every token kept,
    so no boundary search runs: one pass over the row (two with ``with_logprobs``, whose first finds each chunk's
    largest logit), then one program per row picks the best chunk. The noise and the tie order are the compiled
    path's (:func:`rollout.ops.sampling.uniform_noise`; the first index among equal values). ``chunk_tokens`` as for
    :func:`sample_top_p` (0: one chunk per row)."""
    k = _split_kernels()
    logits, tokens, logprobs, span = _prepared(logits, with_logprobs, chunk_tokens)
    num_rows, vocab = logits.shape
    if not num_rows:
        return tokens, (logprobs if with_logprobs else None)
    step = step.reshape(-1)
    chunks = chunk_count(vocab, span)
    span = span if chunks > 1 else vocab
    cells = num_rows * chunks
    floats = torch.empty(cells * 4, dtype=torch.float32, device=logits.device)
    top, best, score, kept = torch.split(floats, [cells] * 4)
    ints = torch.empty(cells * 2, dtype=torch.int32, device=logits.device)
    low, index = torch.split(ints, [cells] * 2)
    per_program = min(CHUNKS_PER_PROGRAM, chunks)
    grid, width = (num_rows, -(-chunks // per_program)), pow2_at_least(chunks, 2)
    common = dict(BLOCK=SPLIT_BLOCK, num_warps=SPLIT_WARPS)
    scale = temperature != 1.0
    if with_logprobs:
        k.chunk_stats[grid](logits, logits.stride(0), vocab, span, top, low, chunks, per_program,
                            SHIFT=key_shift(logits.dtype), **common)
    k.draw_all[grid](logits, logits.stride(0), vocab, span, top, seed.reshape(1), rows, step,
                     1 if step.numel() > 1 else 0, best, index, score, kept, chunks, per_program, float(temperature),
                     SCALE=scale, WITH_LOGPROBS=with_logprobs, CHUNKS=width, **common)
    k.finish[(num_rows,)](top, best, index, score, kept, tokens, logprobs, chunks, float(temperature), SCALE=scale,
                          WITH_LOGPROBS=with_logprobs, CHUNKS=width, num_warps=1)
    return tokens, (logprobs if with_logprobs else None)


def key_shift(dtype: torch.dtype) -> int:
    """Low bits of an fp32 key that are zero for logits of ``dtype`` (bf16: 16, fp16: 13, fp32: 0)."""
    return 23 - round(-math.log2(torch.finfo(dtype).eps)) if torch.finfo(dtype).bits < 32 else 0


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, seed: torch.Tensor, rows: torch.Tensor,
                 step: torch.Tensor, with_logprobs: bool, chunk_tokens: Optional[int] = None):
    """``(tokens [B] int64, logprobs [B] fp32 or None)``: one nucleus sample per row of ``logits [B, V]``.

    The boundary is searched over the raw logits' keys (``key_shift`` of their dtype): dividing by
    ``temperature`` keeps their order and ties, so bf16 logits need 16-bit keys at any temperature.
    ``seed`` (scalar), ``rows [B]`` and ``step`` (scalar or ``[B]``) are int64 tensors keying the noise, as
    for :func:`rollout.ops.sampling.uniform_noise`. ``chunk_tokens``: tokens of a row per program (None:
    ``CHUNK_TOKENS``; 0: one program per row).
    """
    kernel = _kernel()
    logits, tokens, logprobs, span = _prepared(logits, with_logprobs, chunk_tokens)
    num_rows, vocab = logits.shape
    step = step.reshape(-1)
    chunks = chunk_count(vocab, span)
    if num_rows and chunks > 1:
        _sample_chunked(logits, span, chunks, float(temperature), _tau(top_p), seed=seed.reshape(1), rows=rows,
                        step=step, tokens=tokens, logprobs=logprobs, with_logprobs=with_logprobs)
    elif num_rows:
        kernel[(num_rows,)](
            logits, logits.stride(0), vocab, seed.reshape(1), rows, step, 1 if step.numel() > 1 else 0,
            tokens, logprobs, float(temperature), _tau(top_p),
            SHIFT=key_shift(logits.dtype), SCALE=temperature != 1.0, WITH_LOGPROBS=with_logprobs,
            ARITY=arity(num_rows, logits.device), BLOCK=BLOCK,
            num_warps=NUM_WARPS)
    return tokens, (logprobs if with_logprobs else None)


def _prepared(logits: torch.Tensor, with_logprobs: bool, chunk_tokens: Optional[int]):
    """What both samplers start from: ``(logits with a contiguous last dimension, tokens [B] int64, logprobs [B]
    fp32 (the tokens' buffer when not asked), tokens of a row per program)``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows = logits.shape[0]
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device) if with_logprobs else tokens
    return logits, tokens, logprobs, CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)


def chunk_count(vocab: int, chunk_tokens: Optional[int] = None) -> int:
    """Chunks per row: ``ceil(vocab / chunk_tokens)`` (default ``CHUNK_TOKENS``; 1 when it is 0: one program per
    row)."""
    span = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    return max(1, -(-vocab // span)) if span > 0 else 1


def split_arity(rows: int, chunks: int, device: torch.device) -> int:
    """The chunked form's thresholds per pass, from its programs against the multiprocessors (``SPLIT_ARITY``,
    ``SPLIT_WIDE_ARITY`` beyond 2 programs each, ``SPLIT_WIDEST_ARITY`` beyond 16)."""
    if device.type != "cuda":
        return SPLIT_ARITY
    programs, sms = rows * -(-chunks // CHUNKS_PER_PROGRAM), sm_count(device.index or 0)
    return SPLIT_ARITY if programs <= 2 * sms else SPLIT_WIDE_ARITY if programs <= 16 * sms else SPLIT_WIDEST_ARITY


def search_passes(shift: int, arity: int) -> int:
    """Passes that narrow any key range of ``32 - shift`` bits to one key, ``arity`` thresholds a pass: each pass
    leaves at most ``floor(width / arity)`` of a range ``width`` wide (bf16 logits at arity 16: 4)."""
    bits, per_pass = 32 - shift, int(math.log2(arity))
    return -(-bits // per_pass)


def _sample_chunked(logits, span, chunks, temperature, tau, *, seed, rows, step, tokens, logprobs, with_logprobs):
    k = _split_kernels()
    num_rows, vocab = logits.shape
    shift, arity = key_shift(logits.dtype), split_arity(num_rows, chunks, logits.device)
    passes = search_passes(shift, arity)
    cells = num_rows * chunks
    floats = torch.empty(cells * (5 + passes * arity), dtype=torch.float32, device=logits.device)
    top, total, best, score, kept, below = torch.split(floats, [cells] * 5 + [cells * passes * arity])
    ints = torch.empty(cells * 3, dtype=torch.int32, device=logits.device)
    low, count, index = torch.split(ints, [cells] * 3)
    per_program = min(CHUNKS_PER_PROGRAM, chunks)
    grid, width = (num_rows, -(-chunks // per_program)), pow2_at_least(chunks, 1)
    common = dict(BLOCK=SPLIT_BLOCK, num_warps=SPLIT_WARPS)
    shape = dict(SHIFT=shift, ARITY=arity, CHUNKS=width)
    scale = temperature != 1.0
    k.chunk_stats[grid](logits, logits.stride(0), vocab, span, top, low, chunks, per_program, SHIFT=shift, **common)
    for done in range(passes):
        k.search_pass[grid](logits, logits.stride(0), vocab, span, top, low, below, total, num_rows, chunks,
                            per_program, done, temperature, tau, SCALE=scale, **shape, **common)
    k.tie_members[grid](logits, logits.stride(0), vocab, span, top, low, below, total, count, num_rows, chunks,
                        per_program, passes, tau, **shape, **common)
    k.draw[grid](logits, logits.stride(0), vocab, span, top, low, below, total, count, seed, rows, step,
                 1 if step.numel() > 1 else 0, best, index, score, kept, num_rows, chunks, per_program, passes,
                 temperature, tau, SCALE=scale, WITH_LOGPROBS=with_logprobs, **shape, **common)
    k.finish[(num_rows,)](top, best, index, score, kept, tokens, logprobs, chunks, temperature, SCALE=scale,
                          WITH_LOGPROBS=with_logprobs, CHUNKS=width, num_warps=1)


def arity(rows: int, device: torch.device) -> int:
    """Thresholds per search pass for ``rows`` programs: ``WIDE_ARITY`` once there is a program for every
    multiprocessor (the GPU is full, so each program's work per token counts), else ``ARITY`` (fewer passes: a
    shorter program)."""
    if device.type == "cuda" and rows >= sm_count(device.index or 0):
        return WIDE_ARITY
    return ARITY


def _tau(top_p: float) -> float:
    from rollout.ops.nucleus import _float32  # the fp32 rounding HF's comparison uses
    return _float32(1.0 - top_p)


def _kernel():
    from rollout.ops import nucleus_kernel  # imports triton: only where the kernel runs
    return nucleus_kernel.nucleus_sample


def _split_kernels():
    from rollout.ops import nucleus_split_kernel  # imports triton, as above
    return nucleus_split_kernel
