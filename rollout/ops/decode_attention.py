"""Decode attention as one Triton kernel per layer (two when the key window is split): one query per row
against its cached keys and values, the query heads of each KV head together.

``attention(q, k, v, keep, scale, gqa)`` has the signature of :func:`sdpa` (PyTorch's SDPA, the step's
default attention), so it can stand in as ``StepFns.attention``:

- ``q [B, Hq, 1, D]``, ``k``/``v [B, Hkv, L, D]`` (any strides with a contiguous last dimension: the views
  of the static cache), ``keep [B, 1, 1, L]`` boolean (True: attend);
- the ``Hq / Hkv`` query heads ``h * G .. h * G + G - 1`` share KV head ``h`` (SDPA's ``enable_gqa``);
- fp32 scores and softmax, the probabilities cast to the values' dtype for the second product (as the flash
  kernels do); a row with no kept column gives zeros (SDPA gives NaN there).

Each key and value is read once per KV head, the columns of a row's left padding (before its first kept
column) not at all (a row's first tile starts there, not at a tile edge), and nothing is materialised besides
the output (and, when the window is split across programs to fill the GPU, fp32 partials of ``[B, Hq, splits, D]``).
Two optional arguments let a caller that knows more read less:

- ``last`` (a scalar tensor): no row attends past this column (inclusive; masked for every row), so the
  columns after it are not read (the ordinary route's length bucket reaches up to 255 columns past it);
- ``shared`` (:class:`SharedPrefix`): rows holding copies of one prompt's keys and values (the ``n`` samples
  of a prompt) read that prompt's columns once for all of them, either in one tile of ``n x Hq / Hkv`` queries,
  while other programs of the same launch read each row's own columns after the prompt
  (``decode_attention_kernel.decode_attention_shared``; their partial softmaxes are merged as the splits' are), or
  (``SharedPrefix.first_row``) each row's program from the first row of its run, whose copy the run's other rows
  read at the same time, so that memory serves it once and the L2 cache the rest: bitwise the result of reading
  every row's own copy, with no pass or merge of its own.

Where the kernel cannot run (no CUDA tensor, no triton, a GPU before compute capability 8.0, a float mask, more than
one query) the call falls back to SDPA, so the function is safe to set anywhere; a kernel that fails to
compile or launch warns once and leaves those inputs to SDPA from then on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rollout.checks import pow2_at_least
from rollout.ops.dot_options import dot_options
from rollout.ops.fallback import launch_or_fall_back

#: Columns per tile of the key window, warps per program and software-pipelining stages (the kernel's
#: launch parameters; ``python -m benchmarks.decode_step`` times others: on the H200, 36 layers over 512
#: columns, 2 stages took 1.52 ms at 256 rows where 3 or 4 took 1.80-1.82, and SDPA 1.88).
BLOCK_L = 64
WARPS = 4
STAGES = 2
#: Mask columns read at once while looking for a row's first kept column.
SCAN = 1024
#: Fewest tiles one split of a key window gets.
MIN_SPLIT_TILES = 2
#: Most queries in one tile of the shared-prefix pass (samples x query heads per KV head); beyond it the rows
#: read their prompt one by one. When the ordinary route shares: ``RolloutConfig.kernels.shared_prefix_columns``.
MAX_SHARED_QUERIES = 128


@dataclass(frozen=True)
class SharedPrefix:
    """Which rows of a decode batch hold copies of the same prompt's keys and values.

    Rows whose sample ids share ``id // samples`` (a prompt's ``samples`` rows, adjacent in the batch: the
    ordinary route's order, kept by its compaction) hold identical keys, values and masks in columns
    ``[0, end)``. Rows of one prompt that are not adjacent are read as separate runs (correct, not shared)."""

    ids: torch.Tensor
    """``[B]`` int64 (contiguous): each row's sample id, ``prompt * samples + sample``."""
    samples: int
    """Rows per prompt (``n_samples_per_prompt``)."""
    end: torch.Tensor
    """A scalar int64 tensor: the column where the prompts end (the first decode column; exclusive), as a column of
    the window, the same for every row."""
    first_row: bool = False
    """How the prompt is read once: False, by a pass of its own whose tile holds the queries of every row of a run
    (then merged with the rows' own columns); True, by each row's own program from its run's first row, so the run's
    rows, launched side by side, read one copy from memory and the L2 cache serves the rest (no pass, no merge)."""

    def __post_init__(self):
        if self.end.dim() != 0:
            raise ValueError(f"SharedPrefix.end must be a scalar tensor (one prompt end for every row), got shape "
                             f"{tuple(self.end.shape)}")


@dataclass(frozen=True)
class RotaryInputs:
    """What lets the attention kernel compute its own queries from a layer's q|k|v product and write the step's
    cache column (:func:`rollout.ops.rotary_attention.rotary_attention`): the arguments of
    :func:`rollout.ops.rms_scaled.rotary_write_rms` besides the product and the cache."""

    h: torch.Tensor
    """``[B, hidden]``: the raw residual rows whose 1/RMS scales the product."""
    bias: Optional[torch.Tensor]
    """``[(Hq + 2 Hkv) D]`` or None."""
    cos: torch.Tensor
    """``[B, D]`` (the rows' rotary)."""
    sin: torch.Tensor
    cols: torch.Tensor
    """``[1]`` int64 on the device: the cache column written (of the whole layer, not the window)."""
    start: int
    """The window's first cache column."""
    eps: float


_FAILED: dict = {}
"""(device, dtype, head dim, group) -> why the kernel failed there: SDPA runs for those inputs from then on."""


def sdpa(q, k, v, keep, scale: float, gqa: bool, *, last: Optional[torch.Tensor] = None,
         shared: Optional[SharedPrefix] = None):
    """One query per row: ``q [B, Hq, 1, D]`` against ``k/v [B, Hkv, L, D]``; ``keep [B, 1, 1, L]`` is a
    boolean mask (True: attend) or an additive one. PyTorch's SDPA (cuDNN on an H200); what :func:`attention`
    falls back to. ``last`` and ``shared`` (what the kernel may skip or share) change nothing here: the mask
    says it all."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when the kernels can run; else why not (no triton)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: use SDPA
        return f"triton unavailable: {exc!r:.200}"
    return None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                       interpret: bool = False) -> Optional[str]:
    """None when :func:`attention` runs the kernel on these inputs; else why it falls back to SDPA."""
    if available() is not None:
        return available()
    if not interpret and not q.is_cuda:
        return "not a CUDA tensor"
    if q.is_cuda and _capability(q.device.index or 0) < (8, 0):
        return f"compute capability {_capability(q.device.index or 0)} < (8, 0)"
    if q.dim() != 4 or q.shape[2] != 1:
        return f"q must be [B, Hq, 1, D], got {tuple(q.shape)}"
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        return f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
    if keep.dtype != torch.bool or keep.shape[-1] != k.shape[2] or keep.numel() != q.shape[0] * k.shape[2]:
        return f"keep must be a boolean [B, 1, 1, L] mask, got {keep.dtype} {tuple(keep.shape)}"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return "the head dimension must be contiguous"
    return _FAILED.get(_key(q, k))


def failure(device: torch.device) -> Optional[str]:
    """Why the kernel failed on ``device`` (the first recorded failure), or None."""
    return next((why for key, why in _FAILED.items() if key[0] == str(device)), None)


def _key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    return (str(q.device), q.dtype, q.shape[-1], q.shape[1] // max(1, k.shape[1]))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def split_count(rows: int, kv_heads: int, length: int, sms: int, block: int = BLOCK_L) -> int:
    """How many programs share one (row, KV head)'s key window: enough for ~2 programs per SM, each with at
    least ``MIN_SPLIT_TILES`` tiles. A program walks its tiles one after another, so a long window left to one
    program is latency-bound: in the H200 traces of the long-tail cells (a few rows over ~1k columns) a
    call took 22-35 us per layer."""
    tiles = max(1, -(-length // block))
    want = -(-2 * sms // max(1, rows * kv_heads))
    return max(1, min(-(-tiles // MIN_SPLIT_TILES), want))


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (read once per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float, gqa: bool, *,
              splits: Optional[int] = None, interpret: bool = False, block: int = BLOCK_L, warps: int = WARPS,
              stages: int = STAGES, last: Optional[torch.Tensor] = None,
              shared: Optional[SharedPrefix] = None, prefix_splits: Optional[int] = None,
              align: bool = False) -> torch.Tensor:
    """Decode attention ``[B, Hq, 1, D]`` (module docstring); SDPA where the kernel cannot run. ``splits``:
    programs per (row, KV head) (default :func:`split_count`); ``interpret``: allow CPU tensors (tests, under
    ``TRITON_INTERPRET=1``); ``block``, ``warps``, ``stages``: launch parameters (module constants); ``last``:
    the last column any row attends (a scalar tensor; the columns after it are not read); ``shared``: rows
    sharing a prompt read it once (:class:`SharedPrefix`; used where ``samples x Hq / Hkv`` is at most
    ``MAX_SHARED_QUERIES``); ``prefix_splits``: programs per run of rows over its prompt (default
    :func:`split_count` of the runs); ``align``: each row's window starts at the tile edge before its first kept
    column, reading the padding columns in that tile (the kernel before 2026-12-07; what the first-row reads always
    do), for benchmarks."""
    if unsupported_reason(q, k, v, keep, interpret) is not None:
        return sdpa(q, k, v, keep, scale, gqa)
    key = _key(q, k)
    return launch_or_fall_back(_FAILED, key, "decode attention kernel", f"SDPA runs instead for {key}",
                               lambda: _launch(q, k, v, keep, scale, splits=splits, block=block, warps=warps,
                                               stages=stages, last=last, shared=shared,
                                               prefix_splits=prefix_splits, align=align),
                               lambda: sdpa(q, k, v, keep, scale, gqa))


def launch(q, k, v, keep, scale: float, *, splits: Optional[int] = None, last: Optional[torch.Tensor] = None,
           shared: Optional[SharedPrefix] = None, rotary: Optional[RotaryInputs] = None) -> torch.Tensor:
    """The kernel on inputs :func:`unsupported_reason` accepts, with the module's launch constants and no fallback
    (:func:`attention`'s launch). ``rotary``: ``q`` is a view of the layer's q|k|v product, from which the kernel
    rotates its queries and writes the step's cache column (:mod:`rollout.ops.rotary_attention`; not with a prompt
    read in a pass of its own)."""
    if rotary is not None and shares_prefix(shared, q.shape[1], k.shape[1]) and not shared.first_row:
        raise ValueError("rotary: the prompt's own pass (SharedPrefix without first_row) computes no queries")
    return _launch(q, k, v, keep, scale, splits=splits, block=BLOCK_L, warps=WARPS, stages=STAGES, last=last,
                   shared=shared, rotary=rotary)


def one_tile(samples: int, heads: int, kv_heads: int) -> bool:
    """Whether ``samples`` rows' query heads of one KV head fit one tile of the shared-prompt programs."""
    return samples > 1 and samples * (heads // kv_heads) <= MAX_SHARED_QUERIES


def shares_prefix(shared: Optional[SharedPrefix], heads: int, kv_heads: int) -> bool:
    """Whether :func:`attention` reads the prompts of ``shared`` once per run of rows for these heads."""
    if shared is None:
        return False
    return shared.samples > 1 if shared.first_row else one_tile(shared.samples, heads, kv_heads)


def _launch(q, k, v, keep, scale, *, splits, block, warps, stages, last=None, shared=None,
            prefix_splits=None, rotary: Optional[RotaryInputs] = None, align: bool = False) -> torch.Tensor:
    # rotary: q is a [B, Hq, 1, D] view of the q|k|v product (RotaryInputs); never with the prompt's own pass.
    from rollout.ops import decode_attention_kernel as kernels

    rows, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    sms = sm_count(q.device.index or 0) if q.is_cuda else 1
    tiles = max(1, -(-length // block))
    if splits is None:
        splits = split_count(rows, kv_heads, length, sms, block)
    splits = max(1, min(int(splits), tiles))
    sharing = shares_prefix(shared, heads, kv_heads)
    first_row, prefix = sharing and shared.first_row, sharing and not shared.first_row
    # The prompt's shares: its programs that do work are one per run of rows, not one per row.
    if prefix_splits is None and prefix:
        prefix_splits = split_count(-(-rows // shared.samples), kv_heads, length, sms, block)
    prefix_splits = max(1, min(int(prefix_splits), tiles)) if prefix else 0
    slots = prefix_splits + splits
    out = torch.empty(rows, heads, 1, dim, dtype=q.dtype, device=q.device)
    dim_pad = pow2_at_least(dim, 16)
    single = slots == 1
    part = out if single else torch.empty(rows * heads * slots * dim_pad, dtype=torch.float32, device=q.device)
    stat = out if single else torch.empty(rows * heads * slots * 2, dtype=torch.float32, device=q.device)
    keep_sb, keep_sl = keep.stride(0), keep.stride(-1)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
               keep_sb, keep_sl)
    common = dict(GROUP=group, GROUP_PAD=pow2_at_least(group, 16), DIM=dim, DIM_PAD=dim_pad, EVEN_D=dim == dim_pad,
                  BLOCK_L=block, SCAN=SCAN, LAST=last is not None, ALIGN=align, **dot_options(q.dtype, q.is_cuda),
                  num_warps=warps, num_stages=stages)
    last_ptr = out if last is None else last
    if prefix:
        kernels.decode_attention_shared[(rows, kv_heads, slots)](
            q, k, v, keep, shared.ids, shared.end, last_ptr, part, stat, *strides, rows, length, prefix_splits, splits,
            float(scale), SAMPLES=shared.samples, M_PAD=pow2_at_least(shared.samples * group, 16), **common)
    else:
        ids, end, samples = (shared.ids, shared.end, shared.samples) if first_row else (out, out, 1)
        kernels.decode_attention_split[(rows, kv_heads, splits)](
            q, k, v, keep, out, part, stat, last_ptr, ids, end, *strides, out.stride(0), out.stride(1), length, splits,
            float(scale), *_rotary_args(rotary, out), SINGLE=single, SAMPLES=samples,
            SAMPLES_PAD=pow2_at_least(samples, 1), **_rotary_constants(rotary, heads, kv_heads), **common)
    if not single:
        kernels.decode_attention_merge[(rows, heads)](
            part, stat, out, out.stride(0), out.stride(1), heads, slots,
            DIM=dim, DIM_PAD=dim_pad, SPLITS_PAD=pow2_at_least(slots, 1))
    return out


def _rotary_args(rotary: Optional[RotaryInputs], dummy: torch.Tensor) -> tuple:
    """The split kernel's arguments h_ptr ... eps (``dummy`` pointers and zeros without ``rotary``)."""
    if rotary is None:
        return (dummy,) * 5 + (0, 0, 0, 0, 0.0)
    r = rotary
    bias = r.bias if r.bias is not None else dummy
    return (r.h, bias, r.cos, r.sin, r.cols, r.h.stride(0), r.cos.stride(0), r.sin.stride(0), int(r.start),
            float(r.eps))


def _rotary_constants(rotary: Optional[RotaryInputs], heads: int, kv_heads: int) -> dict:
    if rotary is None:
        return {}
    hidden = rotary.h.shape[1]
    return dict(ROTARY=True, HIDDEN=hidden, BLOCK_H=pow2_at_least(hidden, 1), HEADS=heads, KV_HEADS=kv_heads,
                HAS_BIAS=rotary.bias is not None)
