"""Route executors: each owns its static buffers, CUDA graphs and their memory pool, and runs one route
(``ordinary``, ``continuous``) over the KV storage the engine lends it. ``decode`` makes the decode-path
choice (CUDA graph / fast eager / HF layers) once for both; ``graphs`` captures and replays."""
