"""Tensor operations with no model: prompt expansion, masks and positions, next-token selection,
post-processing into a ``RolloutBatch``. Any device, no host syncs except where a docstring says so."""
