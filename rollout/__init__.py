"""opsd-rollout: a fast, instrumented rollout core for on-policy (self-)distillation.

Public API (a drop-in for DeepSpeed's ``deepspeed.runtime.rollout``)::

    from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig, RolloutBatch
    ro = Rollout(engine, tokenizer, config=RolloutConfig())
    batch = ro.generate(RolloutRequest(prompt_ids, prompt_attention_mask),
                        SamplingConfig(max_new_tokens=16, temperature=0.0, n_samples_per_prompt=4))

The names are resolved lazily, so light submodules (``rollout.planner``, ``rollout.testing``) import
without pulling in the engine.
"""

__opsd_rollout_package__ = "rollout"

from rollout._packages import require_own_package

require_own_package("instrumentation")

_PUBLIC = {
    "Rollout": "rollout.engine",
    "RolloutConfig": "rollout.config",
    "RoutingConfig": "rollout.config",
    "KernelConfig": "rollout.config",
    "SamplerConfig": "rollout.config",
    "SamplingConfig": "rollout.config",
    "RolloutRequest": "rollout.request",
    "RolloutBatch": "rollout.request",
}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
