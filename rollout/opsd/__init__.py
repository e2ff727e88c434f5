"""The OPSD training step: rollout -> teacher forward + logit cache -> student forward -> loss -> update.

``step`` (``OPSDStep``), ``config`` (``OPSDConfig``, ``StepResult``), ``breakdown`` (``StepBreakdown``:
per-phase times and peaks), ``micro_batches`` (which rows go together), ``sizing`` (how many fit),
``inputs`` (token columns and the loss mask), ``student`` (engine / module + optimizer, gradient
accumulation), ``teacher`` (privileged prompts, token alignment, the stream of cached logits),
``ranks`` (what data-parallel ranks agree on), ``logit_cache``, ``losses`` (``generalized_jsd_loss``).

The main job (``scripts/train_opsd.py``): ``job`` (``JobConfig``: its settings, one ``RolloutConfig``
among them), ``flags`` (its command line), ``engines`` (process group, DeepSpeed engines), ``report``
(MFU, peak memory, the JSON report), ``console`` (banner, progress bar, closing line), ``preflight`` and
``ds_config_checks`` (the checks before anything is built); what needs the model names and loaders above this layer
(prompts, the step builder) is ``rollout.job``.
"""

from rollout.opsd.breakdown import PhaseTimes, StepBreakdown
from rollout.opsd.config import OPSDConfig, StepResult
from rollout.opsd.losses import generalized_jsd_loss
from rollout.opsd.step import OPSDStep

__all__ = ["OPSDConfig", "OPSDStep", "PhaseTimes", "StepBreakdown", "StepResult", "generalized_jsd_loss"]
