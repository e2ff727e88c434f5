"""The one harness every benchmark uses.

- :mod:`~benchmarks.harness.rounds`: warm-up, interleaved rounds in alternating order, seeds cycled per round,
  the wall timer that synchronises the device around a timed call (no torch at import);
- :mod:`~benchmarks.harness.results`: the JSON schema of result files (``{"schema", "meta", "rows"}``), written
  atomically, and the reader of every older file under ``docs/results/``;
- :mod:`~benchmarks.harness.meta`: a run's ``meta`` (date, GPU, versions, commit, command);
- :mod:`~benchmarks.harness.table`: the markdown table printer;
- :mod:`~benchmarks.harness.device`: the measured copy and GEMM rates (the rooflines themselves are
  :mod:`instrumentation.roofline`) and CUDA-graph replay timing;
- :mod:`~benchmarks.harness.models`: ``--model tiny|3b``, prompts, DeepSpeed's rollout for comparisons.
"""
