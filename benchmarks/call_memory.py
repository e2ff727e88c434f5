"""What a rollout call leaves allocated on the GPU (a check, not a test; needs CUDA).

Two views, both from ``torch.cuda.memory_allocated`` after a synchronize:

- default: one ``Rollout`` per setting, five calls of varying shapes in a row; prints the memory
  allocated after each call and after ``shutdown()``, over the allocation at the start (the model
  itself excluded; what one setting leaves behind also shows in the later settings' rows). With ``keep_cache=False`` the row must stay flat (nothing grows per call);
  with ``keep_cache=True`` it grows only when a call needs a larger cache and falls back after
  ``shutdown()``.
- ``--snapshot``: one ``Rollout`` per setting, one call each; prints the memory after the call,
  after ``gc.collect()``, after ``shutdown()`` and after ``torch.cuda.empty_cache()``, then records
  the allocator's history during one more ``keep_cache=False`` call and lists what is still allocated
  after it by the Python stack that allocated it ("?" = allocated before recording, i.e. the model).

  python -m benchmarks.call_memory                # 3B shape, bf16
  python -m benchmarks.call_memory --snapshot
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys

import torch

from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.models import MODELS, build_model
from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts

MiB = 2**20
TOKENIZER = TinyTokenizer(pad_token_id=0, eos_token_id=None)
CALLS = [(4, 512, 512), (4, 512, 512), (2, 256, 300), (8, 512, 700), (4, 512, 512)]  # prompts, length, new


def allocated_mib(collect: bool = True) -> float:
    torch.cuda.synchronize()
    if collect:
        gc.collect()
    return torch.cuda.memory_allocated() / MiB


def calls_in_a_row(model, cfg: dict, base: float) -> str:
    ro = Rollout(model, TOKENIZER, RolloutConfig().with_settings(cfg))
    after = []
    for call, (rows, length, new) in enumerate(CALLS):
        ids, mask = random_prompts(rows, length, min_len=length // 2, vocab_size=model.config.vocab_size,
                                   device="cuda", seed=call)
        ro.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=new, temperature=1.0, seed=0,
                                                              n_samples_per_prompt=4))
        after.append(f"{allocated_mib() - base:7.1f}")
    ro.shutdown()
    del ro
    return (f"{str(cfg):45s} after each call (MiB over the start): {' '.join(after)}; "
            f"after shutdown {allocated_mib() - base:7.1f}")


def one_call(model, cfg: dict, record: bool = False) -> str:
    ids, mask = random_prompts(4, 512, min_len=256, vocab_size=model.config.vocab_size, device="cuda")
    sampling = SamplingConfig(max_new_tokens=512, temperature=1.0, seed=0, n_samples_per_prompt=4)
    gc.collect()
    torch.cuda.empty_cache()
    a0 = allocated_mib(collect=False)
    if record:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    ro = Rollout(model, TOKENIZER, RolloutConfig().with_settings(cfg))
    batch = ro.generate(RolloutRequest(ids, mask), sampling)
    a1 = allocated_mib(collect=False)
    a2 = allocated_mib()
    lines = []
    if record:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        sites = collections.Counter()
        for segment in snapshot["segments"]:
            for block in segment["blocks"]:
                if block["state"] != "active_allocated":
                    continue
                frames = [f for f in block.get("frames", []) if f["filename"].endswith(".py")][:4]
                key = " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames) or "?"
                sites[key] += block["size"]
        lines = [f"     {size / MiB:9.1f} MiB  {key}" for key, size in sites.most_common(8)]
    held = ro.held_bytes / MiB
    ro.shutdown()
    del ro, batch
    a3 = allocated_mib(collect=False)
    a4 = allocated_mib()
    torch.cuda.empty_cache()
    a5 = allocated_mib(collect=False)
    lines.append(f"{str(cfg):55s} held {held:6.1f} after call {a1 - a0:6.1f} after gc {a2 - a0:6.1f} after shutdown "
                 f"{a3 - a0:6.1f} after gc {a4 - a0:6.1f} after empty_cache {a5 - a0:6.1f} MiB")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="3b")
    parser.add_argument("--snapshot", action="store_true", help="per-stage view and the allocations left, by stack")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.call_memory needs a CUDA device (it reads the CUDA caching allocator)")
    model = build_model(args.model, torch.bfloat16, "cuda")
    print(f"{header(run_meta('call_memory', argv, 'cuda'))}; model {args.model} bf16")
    if args.snapshot:
        for cfg in (dict(keep_cache=True), dict(keep_cache=False), {'keep_cache': False, 'kernels.cuda_graphs': False},
                    dict(keep_cache=True), dict(keep_cache=False), dict(keep_cache=False, route="continuous")):
            print(one_call(model, cfg))
        print(one_call(model, dict(keep_cache=False), record=True))
        return
    gc.collect()
    torch.cuda.empty_cache()
    base = allocated_mib()  # the start: whatever a setting leaves behind shows in the next one's row too
    for cfg in (dict(keep_cache=False), dict(keep_cache=True), {'keep_cache': False, 'kernels.compile': False}):
        print(calls_in_a_row(model, cfg, base))


if __name__ == "__main__":
    main()
