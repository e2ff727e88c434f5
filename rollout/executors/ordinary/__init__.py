"""The ordinary route: one padded batch, one prefill pass, decode over a static KV cache.
``loop`` (prefill and the decode loop), ``buffers`` (static buffers and the captured step),
``executor`` (``OrdinaryExecutor``, the route's owner)."""
