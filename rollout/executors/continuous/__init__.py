"""The continuous route: aligned-cache continuous batching with FIFO refills.
``loop`` (``generate_continuous``: scheduler-driven steps), ``prefill`` (admission waves), ``state``
(per-call state and per-row ops), ``buffers`` (static buffers and the captured step), ``executor``
(``ContinuousExecutor``, the route's owner)."""
