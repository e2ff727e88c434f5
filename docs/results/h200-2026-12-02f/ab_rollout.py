"""Old and new commits in alternating processes, on the same harness (issue 31's "behaviour unchanged").

Run from a tree's root with that tree first on PYTHONPATH; only the public API both commits share is used
(``Rollout``, ``RolloutConfig()`` at its defaults, ``RolloutRequest``, ``SamplingConfig``, ``rollout.testing``), so
the harness is the same code for both. Workloads: seed 004's six (32 requests x 16 new tokens, greedy, EOS off, each
prompt one repeated token, route Auto) and the RL suite's wide-greedy cell (64 prompts x 4 samples, prompts of 256
tokens, 256 new tokens, greedy, EOS off). One warm-up call each, then ``--repeats`` timed calls (CUDA-synchronised
wall time). Prints one JSON line: per workload the timed walls (ms) and a checksum of the output tokens.

    python ab_rollout.py --label new --repeats 3
    python ab_rollout.py --label new --repeats 10 --wide-repeats 0 --workloads 1x20+31x1,1x512+31x16
"""

import argparse
import json
import time

import torch

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, shaped_model

FILL_TOKEN = 14990
SEED004 = {
    "short-similar": [20 - (i % 8) for i in range(32)],
    "1x512+31x16": [512] + [16] * 31,
    "1x20+31x1": [20] + [1] * 31,
    "1x128+31x4": [128] + [4] * 31,
    "16..512": [16 * (i + 1) for i in range(32)],
    "1x8192+31x256": [8192] + [256] * 31,
}


def left_padded(lengths, device, token=FILL_TOKEN, pad=0):
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = token
        mask[row, width - n:] = 1
    return ids, mask


def wide_prompts(device, prompts=64, length=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32000, (prompts, length), generator=gen).to(device)
    return ids, torch.ones_like(ids)


def timed(fn, repeats):
    fn()  # warm-up: compile, capture, buckets
    torch.cuda.synchronize()
    walls, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - start))
    checksum = int((out.input_ids.long() * torch.arange(1, out.input_ids.shape[1] + 1, device=out.input_ids.device)
                    ).sum()) % (2**61 - 1)
    return walls, checksum


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wide-repeats", type=int, default=2, help="0: skip the wide-greedy cell")
    parser.add_argument("--workloads", default=",".join(SEED004), help="seed 004 workloads, comma-separated")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = shaped_model("qwen25-3b", seed=0, dtype=torch.bfloat16, device=device)
    ro = Rollout(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), RolloutConfig(route="auto"))
    result = {"label": args.label, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "rows": {}}
    greedy16 = SamplingConfig(max_new_tokens=16, temperature=0.0)
    for name in args.workloads.split(","):
        ids, mask = left_padded(SEED004[name], device)
        walls, checksum = timed(lambda: ro.generate(RolloutRequest(ids, mask), greedy16), args.repeats)
        result["rows"][name] = {"walls_ms": walls, "checksum": checksum}
    if not args.wide_repeats:
        print(json.dumps(result), flush=True)
        return
    ids, mask = wide_prompts(device)
    wide = SamplingConfig(max_new_tokens=256, temperature=0.0, n_samples_per_prompt=4)
    walls, checksum = timed(lambda: ro.generate(RolloutRequest(ids, mask), wide), args.wide_repeats)
    result["rows"]["wide-greedy"] = {"walls_ms": walls, "checksum": checksum}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
