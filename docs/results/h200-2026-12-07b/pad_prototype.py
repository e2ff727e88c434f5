# The prototype of the third inline call's A/B (README), run on the device as /tmp/pad.py (written there by the call's command), in the
# tree of 21b8165: PAD=1 allocates each new StaticKVCache storage with its capacity rounded up to an odd multiple
# of 64 columns (1,280 -> 1,344 for the opsd cells), then runs `python -m benchmarks.rl` with the given arguments.
# 1d41922 implements it as rollout.plan.buckets.storage_columns (call 3 times that tree).
import os, sys, runpy, torch
import rollout.cache.static as S
orig = S.StaticKVCache.__init__
def init(self, shape, storage=None):
    if storage is None and os.environ.get("PAD") == "1":
        c = -(-shape.capacity // 64) * 64
        c += 64 if (c // 64) % 2 == 0 else 0
        dims = (shape.num_layers, shape.batch_size, shape.num_kv_heads, c, shape.head_dim)
        storage = tuple(torch.zeros(dims, dtype=shape.dtype, device=shape.device) for _ in range(2))
        print("padded storage", dims, file=sys.stderr)
    orig(self, shape, storage)
S.StaticKVCache.__init__ = init
sys.argv = ["rl"] + sys.argv[1:]
runpy.run_module("benchmarks.rl", run_name="__main__")
