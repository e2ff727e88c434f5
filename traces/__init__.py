"""Per-stage latency and peak-memory reports from Chrome / TensorBoard profiler traces."""

__opsd_rollout_package__ = "traces"
