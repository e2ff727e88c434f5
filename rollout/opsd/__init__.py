"""The OPSD training step: rollout -> teacher forward + logit cache -> student forward -> loss -> update.

``step`` (``OPSDStep``), ``config`` (``OPSDConfig``, ``StepResult``), ``teacher`` (privileged prompts,
token alignment, cached logits), ``logit_cache``, ``losses`` (``generalized_jsd_loss``).
"""

from rollout.opsd.config import OPSDConfig, StepResult
from rollout.opsd.losses import generalized_jsd_loss
from rollout.opsd.step import OPSDStep

__all__ = ["OPSDConfig", "OPSDStep", "StepResult", "generalized_jsd_loss"]
