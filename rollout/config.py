"""Configuration dataclasses: what to sample (``SamplingConfig``) and how to run (``RolloutConfig`` and its
sections ``RoutingConfig``, ``KernelConfig``, ``SamplerConfig``).

``SamplingConfig`` keeps the field names and defaults of DeepSpeed's ``deepspeed.runtime.rollout``
so users can switch; it is the only source of sampling behaviour (a model's ``generation_config``,
e.g. an Instruct model's default temperature, is ignored).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

from rollout.checks import as_python_numbers, is_int, is_number, require, require_bools

ROUTES = ("ordinary", "continuous", "auto")
#: Seeds key the sampling noise through 32-bit hashes: larger ones would alias smaller ones.
MAX_SEED = 2**32
#: Temperatures in (0, MIN_TEMPERATURE) are raised to it with a warning (vLLM raises them to 1e-2): below it,
#: logits / temperature can overflow float32 to inf and the argmax takes the first inf. At it, every logit under
#: 3.4e32 stays finite and sampling is near-greedy (a token loses to the argmax only by < ~25 x 1e-6 in logit).
MIN_TEMPERATURE = 1e-6
#: ``SamplingConfig.repetition_penalty`` must lie in this range: a penalty divides positive logits and multiplies
#: negative ones in float32, where one below 1e-38 is 0 (a division by zero: inf logits, degenerate tokens) and one
#: above 3.4e38 is inf; within it the penalised logits stay finite for logits of ordinary size.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
#: ``RolloutConfig.max_cache_gib`` must stay below this (1 EiB; its bytes fit an int64).
MAX_CACHE_GIB = 2**30
GATHER_MODES = ("once", "per_forward")
#: ``RolloutConfig.compile_mode`` values: torch.compile modes without inductor CUDA graphs.
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
DECODE_ATTENTIONS = ("triton", "sdpa")  # ``RolloutConfig.decode_attention`` values
#: ``RolloutConfig.blas_library`` values besides None (``rollout.executors.blas``; the tuned one: ``ops.tuned_gemm``).
TUNED_BLAS = "cublaslt-tuned"
BLAS_LIBRARIES = ("cublas", "cublaslt", TUNED_BLAS)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling knobs passed to ``Rollout.generate`` each step."""

    max_new_tokens: int
    """Response budget per row (> 0). Prompt + budget must fit the model's context."""
    temperature: float = 1.0
    """Softmax temperature; ``<= 0`` means greedy (argmax). Values in ``(0, MIN_TEMPERATURE)`` (1e-6) are raised to
    ``MIN_TEMPERATURE`` with a warning (near-greedy sampling), as vLLM does with its floor."""
    top_p: float = 1.0
    """Nucleus filtering in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; ``<= 0`` disables it."""
    n_samples_per_prompt: int = 1
    """Responses per prompt (>= 1); output row i belongs to prompt ``i // n``."""
    continuous_batch_size: Optional[int] = None
    """Slots for continuous batching (ignored by the ordinary route)."""
    repetition_penalty: float = 1.0
    """HF semantics (1 disables), in :data:`REPETITION_PENALTY_RANGE` ([1e-6, 1e6]): applied in fp32 over the history,
    the prompt from its first real token on (left padding not counted: ``rollout.ops.sampling.prompt_history``) and
    the response."""
    seed: Optional[int] = None
    """Same inputs + same seed -> same samples, in ``[0, 2**32)``. None uses torch's global RNG."""
    return_logprobs: bool = False
    """Also return ``RolloutBatch.logprobs``: each sampled token's log-probability under the distribution
    it was drawn from (after repetition penalty, temperature, top-k, top-p). Greedy: the log-softmax of
    the penalised logits at temperature 1, without filtering."""
    return_finish_reasons: bool = False
    """Also return ``RolloutBatch.finish_reasons``: per row, EOS or budget."""

    def __post_init__(self) -> None:
        require(is_int(self.max_new_tokens) and self.max_new_tokens > 0, "max_new_tokens",
                 f"must be a positive int; got {self.max_new_tokens!r}")
        require(is_number(self.temperature), "temperature", f"must be a finite number; got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature: {self.temperature!r} is below the floor {MIN_TEMPERATURE} (logits / "
                          f"temperature would overflow float32); raised to {MIN_TEMPERATURE}", stacklevel=3)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        require(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
                 f"must be in (0, 1]; got {self.top_p!r}")
        require(is_int(self.top_k), "top_k", f"must be an int (<= 0 disables); got {self.top_k!r}")
        require(is_int(self.n_samples_per_prompt) and self.n_samples_per_prompt >= 1,
                 "n_samples_per_prompt", f"must be an int >= 1; got {self.n_samples_per_prompt!r}")
        require(self.continuous_batch_size is None
                 or (is_int(self.continuous_batch_size) and self.continuous_batch_size >= 1),
                 "continuous_batch_size", f"must be None or an int >= 1; got {self.continuous_batch_size!r}")
        low, high = REPETITION_PENALTY_RANGE
        require(is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
                f"must be a finite number in [{low:g}, {high:g}] (outside it the penalised logits overflow float32); "
                f"got {self.repetition_penalty!r}")
        require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
                f"must be None or an int in [0, 2**32); got {self.seed!r}")
        for name in ("return_logprobs", "return_finish_reasons"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool; got {getattr(self, name)!r}")
        as_python_numbers(self, ("max_new_tokens", "top_k", "n_samples_per_prompt", "continuous_batch_size", "seed"),
                          ("temperature", "top_p", "repetition_penalty"))

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class RoutingConfig:
    """How a route plans its prefill and checks for finished rows (``RolloutConfig.routing``)."""

    cost_model: Optional[object] = None
    """Prefill cost model for planning: a ``rollout.plan.planner.CostModel``, the path of a calibration JSON
    (``scripts/calibrate_prefill.py``), or None for the seed PR's default coefficients with this model's geometry.
    The defaults are starting estimates: calibrate for your model, GPU and dtype."""
    max_prefill_tokens: Optional[int] = 65536
    """Padded tokens (rows x length) per planned prefill forward; None removes the limit."""
    eos_check_interval: Optional[int] = None
    """Decode steps between the checks whether rows have finished (one host sync each). Outputs are the same for
    every value. None: the route's default (``rollout.plan.routes.EOS_CHECK_INTERVAL``: 1 ordinary, 4 continuous;
    docs/config.md)."""
    late_eos_count: bool = True
    """The ordinary route's EOS checks (static buffers) read the count of unfinished rows one check late, so the
    host never waits for the step it has just launched; the steps run after the last row ended are cut from the
    output (``CallStats.decode.eos_overrun_steps``). False reads the count at once (docs/config.md)."""

    def __post_init__(self) -> None:
        from rollout.plan.planner import CostModel  # light, pure Python
        require(self.cost_model is None or isinstance(self.cost_model, (CostModel, str)), "routing.cost_model",
                f"must be a CostModel, a calibration file path or None; got {type(self.cost_model).__name__}")
        require(self.max_prefill_tokens is None or (is_int(self.max_prefill_tokens) and self.max_prefill_tokens > 0),
                "routing.max_prefill_tokens", f"must be None or a positive int; got {self.max_prefill_tokens!r}")
        require(self.eos_check_interval is None or (is_int(self.eos_check_interval) and self.eos_check_interval >= 1),
                "routing.eos_check_interval", f"must be None or an int >= 1; got {self.eos_check_interval!r}")
        require_bools(self, "routing", ("late_eos_count",))
        as_python_numbers(self, ("max_prefill_tokens", "eos_check_interval"), ())


@dataclass(frozen=True)
class KernelConfig:
    """Which step runs the prefill and the decode steps, and its kernels (``RolloutConfig.kernels``).

    Every default was chosen by measurement on an H200 (docs/config.md has the figures); the step is
    ``rollout.executors.decode.FastStep``, which receives this section whole."""

    fast_decode: bool = True
    """Decode through our own fused step (Llama-family models); other models, unfused LoRA and ZeRO-3 per-forward
    gathering use the HF forward, with the reason in ``CallStats.decode.fallback_reason``."""
    fast_prefill: bool = True
    """Prefill through our own pass (linear layers over the packed real tokens, attention per planner bucket)
    wherever the fast decode step runs; False keeps the HF forward."""
    cuda_graphs: bool = True
    """On CUDA, capture the fast decode step in CUDA graphs (per batch and length bucket) and replay them."""
    prefill_graph_tokens: int = 2048
    """With ``cuda_graphs`` and the variable-length prefill (CUDA, bf16/fp16), prefill passes of at most this many
    real tokens replay a CUDA graph captured per token, row and length bucket (``rollout.executors.prefill_graph``).
    Keeps a staging buffer of the largest bucket's keys and values between calls. 0: off."""
    compile: bool = True
    """On CUDA, ``torch.compile`` the fast step's fusable pieces (norms, rotary, MLP activation)."""
    compile_mode: Optional[str] = None
    """``torch.compile`` mode of those pieces: None (torch's default) or ``"max-autotune-no-cudagraphs"`` (15-19%
    slower on the H200's 3B step). Modes with inductor's own CUDA graphs are refused: ours capture the whole step."""
    decode_attention: str = "triton"
    """Attention of our decode step: ``"triton"`` (``rollout.ops.decode_attention``; SDPA where it cannot run, and
    ``CallStats.decode.attention`` says so) or ``"sdpa"``."""
    fused_kv_write: bool = True
    """With ``compile`` and ``fuse_qkv`` on CUDA, the compiled q|k|v piece also writes k and v into the cache."""
    blas_library: Optional[str] = "cublaslt"
    """On CUDA, the BLAS backend of the call's products, set for the call and restored after it: ``"cublaslt"``,
    ``"cublas"``, ``"cublaslt-tuned"`` (decode projections on each shape's fastest algorithm), None (the process's)."""
    fuse_qkv: bool = True
    """q, k and v with one GEMM over a concatenated copy of their weights (refreshed at every call)."""
    fuse_gate_up: bool = True
    """The MLP's gate and up projections with one GEMM over a concatenated copy of their weights (refreshed at every
    call; ~58% of the weights for Qwen2.5-3B, counted by the memory budget)."""
    rotary_kernel: bool = True
    """On CUDA with triton (and ``fuse_qkv``): a decode step's rotary and k/v cache writes as one Triton kernel a layer
    (``rollout.ops.rotary_write``)."""
    skinny_rows: int = 32
    """On CUDA with ``rotary_kernel`` and ``fuse_gate_up``: decode steps of at most this many rows (up to 64) compute
    each layer's o projection and residual add as one Triton kernel (``rollout.ops.skinny_linear``). 0: off."""
    shared_prefix_rows: int = 32
    """With the Triton attention on CUDA: ordinary-route decode steps of at least this many rows, in calls with
    several samples per prompt and prompts of at least ``shared_prefix_columns`` columns, read each prompt's keys
    and values once for all of its samples. 0: off."""
    shared_prefix_columns: int = 512
    """The fewest prompt columns (the batch's padded width) for which ``shared_prefix_rows`` shares them in a pass of
    their own (H200, 3B, 256 rows: 768 columns took 1.51 ms instead of 2.06, 256 columns with 128 decoded 1.43 instead
    of 1.23)."""
    shared_prefix_first_row_rows: int = 128
    """Below ``shared_prefix_columns``: decode steps of ``shared_prefix_rows`` up to this many rows read each prompt's
    whole tiles from its run's first row, through the L2 cache (bitwise the same result). 0: off. H200, 3B, 704 columns:
    128 rows 1.15 ms against 1.32, 256 rows 2.29 against 1.92 (an H100 gains at 256 rows: 2.60 against 3.02)."""
    shared_prefix_align: bool = True
    """With ``shared_prefix_first_row_rows``: prompts left-padded (masked) to end at a tile edge: every tile shared."""
    residual_in_place: bool = True
    """Decode steps add each layer's o and down projections into the residual stream in place (the GEMM's own
    beta-add; where gate|up are fused and o has no bias), instead of a GEMM that first copies the residual (on the
    H200's 3B step at 256 rows: 5.30 against 5.41 ms)."""
    fold_norms: bool = True
    """On CUDA with triton: the RMSNorm gains before q|k|v (with ``fuse_qkv`` and ``rotary_kernel``) and before gate|up
    (with ``fuse_gate_up`` and ``residual_in_place``) are multiplied into the fused weight copies, and decode steps
    scale each product by the row's 1/RMS inside the rotary kernel and a SiLU-mul kernel
    (``rollout.ops.rms_scaled``) instead of running a norm kernel before each GEMM (on the H200's 3B step at 256 rows:
    5.13 against 5.37 ms; at 8 rows 2.67 against 2.78). bf16 rounds differently: the weight times its gain is rounded
    once in the copy, the normalized input not at all. float16 models keep their norms (the raw residual's products
    can pass float16's range)."""

    rotary_in_attention_rows: int = 8
    """Where ``fold_norms`` folds the q|k|v norm and the Triton attention runs: in decode steps of at least this many
    rows the attention kernel rotates its own queries and writes the step's k and v into the cache
    (``rollout.ops.rotary_attention``) instead of a rotary kernel a layer before it. 0: off. 8: the fewest rows timed
    (an H100's 3B step 1.5-2.1% faster at 8-256 rows; docs/config.md); smaller steps keep the rotary kernel."""

    def __post_init__(self) -> None:
        require_bools(self, "kernels", ("fast_decode", "fast_prefill", "cuda_graphs", "compile", "fused_kv_write",
                                        "fuse_qkv", "fuse_gate_up", "rotary_kernel", "residual_in_place",
                                        "fold_norms", "shared_prefix_align"))
        for name in ("prefill_graph_tokens", "skinny_rows", "shared_prefix_rows", "shared_prefix_first_row_rows",
                     "rotary_in_attention_rows"):
            value = getattr(self, name)
            require(is_int(value) and value >= 0, f"kernels.{name}", f"must be an int >= 0 (0: off); got {value!r}")
        require(is_int(self.shared_prefix_columns) and self.shared_prefix_columns >= 1, "kernels.shared_prefix_columns",
                f"must be an int >= 1; got {self.shared_prefix_columns!r}")
        require(self.compile_mode in COMPILE_MODES, "kernels.compile_mode",
                f"must be one of {COMPILE_MODES} (modes with inductor CUDA graphs clash with ours); "
                f"got {self.compile_mode!r}")
        require(self.decode_attention in DECODE_ATTENTIONS, "kernels.decode_attention",
                f"must be one of {DECODE_ATTENTIONS}; got {self.decode_attention!r}")
        require(self.blas_library is None or self.blas_library in BLAS_LIBRARIES, "kernels.blas_library",
                f"must be None or one of {BLAS_LIBRARIES}; got {self.blas_library!r}")
        as_python_numbers(self, ("prefill_graph_tokens", "skinny_rows", "shared_prefix_rows", "shared_prefix_columns",
                                 "shared_prefix_first_row_rows", "rotary_in_attention_rows"), ())


@dataclass(frozen=True)
class SamplerConfig:
    """How tokens are drawn on CUDA (``RolloutConfig.sampler``; what to sample is ``SamplingConfig``)."""

    fused: bool = True
    """With ``kernels.compile``: temperature + top-p sampling without top-k or a repetition penalty runs the Triton
    nucleus kernels (``rollout.ops.fused_nucleus``), and plain temperature sampling (top-p 1) their one-pass
    Gumbel-max draw; False keeps the compiled sort-free search. Both draw the same tokens except where a cumulative
    mass lies within rounding of ``1 - top_p``."""
    chunk_tokens: Optional[int] = None
    """Tokens of a row each program of the nucleus kernels reads: None, the kernels' default
    (``rollout.ops.fused_nucleus.CHUNK_TOKENS``); 0, one program per row. Fixed per call, so a row's token does not
    depend on its batch; other values sum masses in another order (tokens may differ at rounding ties)."""

    def __post_init__(self) -> None:
        require_bools(self, "sampler", ("fused",))
        require(self.chunk_tokens is None or (is_int(self.chunk_tokens) and self.chunk_tokens >= 0),
                "sampler.chunk_tokens", f"must be None or an int >= 0 (0: a program per row); "
                f"got {self.chunk_tokens!r}")
        as_python_numbers(self, ("chunk_tokens",), ())


#: The sections of ``RolloutConfig``: field name -> class.
SECTIONS = {"routing": RoutingConfig, "kernels": KernelConfig, "sampler": SamplerConfig}


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout runs (our own; DeepSpeed's ``HybridEngineRolloutConfig`` has no equivalent).

    The common settings are fields of their own (``RolloutConfig(route="auto", max_cache_gib=40)``); the rest
    come in sections, each handed whole to the component it configures::

        RolloutConfig(route="continuous", kernels=KernelConfig(cuda_graphs=False), sampler=SamplerConfig(fused=False))
        config.with_settings({"kernels.fuse_gate_up": False, "routing.eos_check_interval": 2})

    A keyword of the flat API before 0.2 (``RolloutConfig(compile=False)``) raises a ``ValueError`` naming its new
    place (``CHANGELOG.md``)."""

    route: str = "ordinary"
    """``"ordinary"`` (one padded batch over a static KV cache), ``"continuous"`` (aligned-cache continuous batching
    with ``SamplingConfig.continuous_batch_size`` slots) or ``"auto"`` (chosen per call by the cost model)."""
    max_cache_gib: Optional[float] = None
    """Cap on the KV cache of a call (GiB). The continuous route's slots and Auto's choice follow it; a call whose
    smallest feasible cache does not fit is refused with the figures before anything is allocated. None: the memory
    the device has free (a call that could not fit there is refused the same way)."""
    keep_cache: bool = True
    """Keep the KV cache, decode buffers, graphs and fused weight copies between compatible calls, or release them
    after each call."""
    max_context: Optional[int] = None
    """Upper bound on prompt + new tokens; None reads ``max_position_embeddings`` from the model config."""
    gather: str = "once"
    """ZeRO-3 only: ``"once"`` gathers all parameters once per ``generate`` call (fast, needs memory for the full
    model), and an ``OPSDStep`` on the packed path gathers its student once more for the step's training passes;
    ``"per_forward"`` keeps ZeRO-3's own per-forward gathering for both (low memory, slow)."""
    fuse_lora: bool = True
    """Merge peft LoRA adapters into the base weights for generation (restored bit-exactly afterwards)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self) -> None:
        require(self.route in ROUTES, "route", f"must be one of {ROUTES}; got {self.route!r}")
        require(self.gather in GATHER_MODES, "gather", f"must be one of {GATHER_MODES}; got {self.gather!r}")
        require_bools(self, "", ("keep_cache", "fuse_lora"))
        require(self.max_cache_gib is None or (is_number(self.max_cache_gib)
                                                and 0 < self.max_cache_gib < MAX_CACHE_GIB),
                "max_cache_gib", f"must be None or a finite number > 0 and < 2**30; got {self.max_cache_gib!r}")
        require(self.max_context is None or (is_int(self.max_context) and self.max_context > 0),
                "max_context", f"must be None or a positive int; got {self.max_context!r}")
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            require(isinstance(value, cls), name, f"must be a {cls.__name__}; got {type(value).__name__}")
        as_python_numbers(self, ("max_context",), ("max_cache_gib",))

    def with_settings(self, settings: Mapping[str, object]) -> "RolloutConfig":
        """A copy with ``settings`` applied: ``{"route": "auto", "kernels.compile": False}`` (dotted names reach into
        a section; :func:`setting_names` lists them). Unknown names raise ``ValueError`` naming them."""
        require(isinstance(settings, Mapping), "settings",
                f"must be a mapping of setting names to values; got {type(settings).__name__}")
        top: dict = {}
        sections: dict[str, dict] = {}
        for name, value in settings.items():
            require(name in setting_names(), name, f"not a RolloutConfig setting{_moved_hint(name)}")
            section, _, key = name.rpartition(".")
            if section:
                sections.setdefault(section, {})[key] = value
            else:
                top[name] = value
        for section, values in sections.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def settings(self) -> dict[str, object]:
        """Every setting by its dotted name (what a benchmark row records)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS:
                out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(value)})
            else:
                out[f.name] = value
        return out


def setting_names() -> tuple[str, ...]:
    """Every ``RolloutConfig`` setting by its dotted name (``"route"``, ``"kernels.compile"``, ...)."""
    names = []
    for f in fields(RolloutConfig):
        if f.name in SECTIONS:
            names.extend(f"{f.name}.{g.name}" for g in fields(SECTIONS[f.name]))
        else:
            names.append(f.name)
    return tuple(names)


#: Flat keywords of ``RolloutConfig`` before 0.2 -> their dotted place now.
MOVED = {
    **{name: f"routing.{name}" for name in ("cost_model", "max_prefill_tokens", "eos_check_interval",
                                            "late_eos_count")},
    **{name: f"kernels.{name}" for name in ("fast_decode", "fast_prefill", "cuda_graphs", "prefill_graph_tokens",
                                            "compile", "compile_mode", "decode_attention", "fused_kv_write",
                                            "blas_library", "fuse_qkv", "fuse_gate_up", "rotary_kernel",
                                            "skinny_rows", "shared_prefix_rows")},
    "fused_sampler": "sampler.fused", "sampler_chunk_tokens": "sampler.chunk_tokens",
}
#: Settings removed in 0.2 after measurement (CHANGELOG.md, docs/BENCHMARKS.md) -> why.
REMOVED = {
    "split_k_rows": "split-K GEMMs made the decode step 4.0% faster at 128 rows and 5.9% slower at 512 on the H200, "
                    "the RL cells within their spread",
    "continuous_stop_at_front": "no gain on the capped RL cell over 4 seeds (2.13x its roofline against 2.11x)",
    "continuous_shared_prefix": "slower on the capped RL cell over 4 seeds (2.33x its roofline against 2.11x)",
    "kernels.shared_prefix_first_row": "now kernels.shared_prefix_first_row_rows, a step's most rows (0: off)",
}


def _moved_hint(name: str) -> str:
    if name in MOVED:
        section, _, key = MOVED[name].partition(".")
        return (f"; it moved to RolloutConfig({section}={SECTIONS[section].__name__}({key}=...)), "
                f"or with_settings({{{MOVED[name]!r}: ...}})")
    if name in REMOVED:
        return f"; it was removed in 0.2: {REMOVED[name]}"
    return ""


def _refuse_flat_keywords(cls):
    """Wrap the dataclass ``__init__`` so an old flat keyword names its new place instead of a bare TypeError."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            if name in MOVED or name in REMOVED:
                raise ValueError(f"RolloutConfig({name}=...): not a field{_moved_hint(name)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_refuse_flat_keywords(RolloutConfig)
