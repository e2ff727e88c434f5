"""The student side of the OPSD step: one interface over a DeepSpeed engine and a module + optimizer.

Gradient accumulation. A step runs forward + loss + backward once per micro-batch and the optimizer
once. Each micro-batch's loss is already its share of the batch mean (see
:func:`rollout.opsd.losses.generalized_jsd_loss`'s ``num_positions_total``), so gradients are summed
as they are:

* module + torch optimizer: ``loss.backward()`` accumulates into ``.grad``; ``step`` runs the
  optimizer and clears the gradients.
* DeepSpeed engine: ``engine.backward(loss, scale_wrt_gas=False)`` (the config's
  ``gradient_accumulation_steps`` does not rescale the loss), with the accumulation boundary set by
  hand before each micro-batch (``set_gradient_accumulation_boundary``: False, ..., False, True), so
  gradients are reduced (ZeRO-0/1) or finalised (ZeRO-2/3) after the last micro-batch and
  ``engine.step()`` applies exactly one update per OPSD step, whatever the config's
  ``gradient_accumulation_steps``. Engines configured with ``managed_gradient_accumulation=false``
  own no boundary flag: there ``engine.step()`` is the boundary already.
"""

from __future__ import annotations

import contextlib

import torch


def is_training_engine(obj) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (it has ``zero_optimization_stage`` and ``backward``)."""
    return callable(getattr(obj, "zero_optimization_stage", None)) and callable(getattr(obj, "backward", None))


class PlainStudent:
    """A plain module + torch optimizer behind the student interface."""

    data_parallel_group = None

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer

    def __call__(self, **inputs):
        return self.module(**inputs)

    def begin_micro_batch(self, is_last: bool) -> None:
        """Nothing to do: ``.grad`` accumulates across backward calls."""

    can_coalesce = False  # nothing to coalesce: .grad accumulates, the optimizer reads it

    def coalesced(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        """Drop what a failed step accumulated."""
        self.optimizer.zero_grad(set_to_none=True)


class EngineStudent:
    """A DeepSpeed engine behind the student interface (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        managed = getattr(engine, "managed_gradient_accumulation", None)
        self._sets_boundary = not callable(managed) or bool(managed())

    @property
    def data_parallel_group(self):
        return getattr(self.engine, "data_parallel_group", None)

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def begin_micro_batch(self, is_last: bool) -> None:
        """Mark whether the next forward/backward closes the accumulation (before the forward)."""
        if self._sets_boundary:
            self.engine.set_gradient_accumulation_boundary(is_last)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    @property
    def can_coalesce(self) -> bool:
        """Whether :meth:`coalesced` reduces once: a ZeRO-3 engine with DeepSpeed's ``coalesce_grad_reduction``
        (0.19.8 on) over its own ZeRO optimizer, managing its accumulation boundary, without pipeline parallelism."""
        engine = self.engine
        return (self._sets_boundary and callable(getattr(engine, "coalesce_grad_reduction", None))
                and engine.zero_optimization_stage() == 3 and not getattr(engine, "pipeline_parallelism", False)
                and hasattr(getattr(engine, "optimizer", None), "_coalesce_grad_reduction"))

    @contextlib.contextmanager
    def coalesced(self):
        """A context whose backward calls leave their gradients on the parameters; its exit reduces them once into the
        optimizer's partitions and marks the accumulation boundary for :meth:`step` (DeepSpeed restores the flag it
        found on entry, the previous step's). A null context where :attr:`can_coalesce` is False."""
        if not self.can_coalesce:
            yield
            return
        with self.engine.coalesce_grad_reduction():
            yield
            optimizer = self.engine.optimizer
            if isinstance(getattr(optimizer, "micro_step_id", None), int):  # the step's one reduction: it must copy
                optimizer.micro_step_id = 0  # into the partitions (engine forwards made it count micro-batches)
        self.engine.set_gradient_accumulation_boundary(True)

    def step(self) -> None:
        self.engine.step()

    def discard_gradients(self) -> None:
        """Drop what a failed step accumulated (the optimizer's buffers under ZeRO)."""
        optimizer = getattr(self.engine, "optimizer", None)
        if callable(getattr(optimizer, "zero_grad", None)):
            optimizer.zero_grad()
        else:
            self.engine.zero_grad()
