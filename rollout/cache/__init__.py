"""KV storage we own, with fixed addresses (so decode stays capturable in CUDA graphs): the static cache of
the ordinary route (``static``), the aligned cache of continuous batching (``aligned``), and the pool and
scratch arena that keep storage across calls (``pool``)."""
