"""Where a wide decode step's time goes (3B shape, bf16, CUDA): attention variants, the sampler, whole steps, the
GEMMs and the skinny kernel, the folded norms' SiLU·mul kernel, the packed prefill (``python -m benchmarks.decode_step``; was
``scripts/profile_decode_step.py``).

Each variant is captured in a CUDA graph and replayed (no launch gaps), median of its replays timed with CUDA events
(``benchmarks.harness.device.graph_ms``). Whole steps are built from ``KernelConfig`` the way the routes build theirs
(``rollout.executors.decode.FastStep``): ``KernelConfig()`` is the routes' default step, :data:`step.BASE` the
compiled + fused q|k|v step the experiments start from; two experiments are not settings (an additive mask, the
batched-GEMM attention). One table; ``--json`` writes the result file.

  python -m benchmarks.decode_step --rows 256 --live 512
  python -m benchmarks.decode_step --rows 32 256 --gate-up              # the routes' step with / without gate|up
  python -m benchmarks.decode_step --parts step --blas cublas cublaslt  # the BLAS A/B
  python -m benchmarks.decode_step --parts shared --rows 128 --live 1024
  python -m benchmarks.decode_step --parts padding --rows 256 --live 704   # left padding read or skipped
  python -m benchmarks.decode_step --parts skinny --rows 8 32 --kernels
  python -m benchmarks.decode_step --parts silu --rows 64 256 --silu-launches 2048,8 4096,8

Modules: ``attention`` (attention, shared-prefix, left-padding and sampler pieces), ``step`` (whole steps from
``KernelConfig``, BLAS, the step's kernels, one profiled call), ``kernels`` (GEMMs, the skinny kernel, the prefill),
``norms`` (the SiLU·mul kernel's launches), ``cli``.
"""
