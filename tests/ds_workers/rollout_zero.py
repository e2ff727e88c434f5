"""Worker: ``Rollout`` on a DeepSpeed engine (ZeRO stage and gather mode from argv) vs the plain model.

Each rank builds the same seeded tiny model, keeps an unwrapped copy as the oracle (HF ``generate``
per prompt alone), and rolls out its own prompts. Rank 0 picks EOS ids that end its rows by their second
token; the other ranks pick EOS ids their rows never produce, so they run the full budget: under
per-forward gathering every rank must still run the same number of forwards (lockstep).
"""

import copy
import sys

import torch
from common import emit, make_engine, rank

from rollout import Rollout, RolloutConfig, RolloutRequest, SamplingConfig
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

STAGE, GATHER = int(sys.argv[1]), sys.argv[2]
ROUTE = sys.argv[3] if len(sys.argv) > 3 else "ordinary"
SLOTS = int(sys.argv[4]) if len(sys.argv) > 4 else None
MAX_NEW = 8


def hf_rows(model, ids, mask, eos):
    rows = []
    for i in range(ids.shape[0]):
        out = model.generate(ids[i:i + 1], attention_mask=mask[i:i + 1], max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=eos, temperature=None, top_p=None, top_k=None)
        tokens = out[0, ids.shape[1]:].tolist()
        stops = [k + 1 for k, t in enumerate(tokens) if eos is not None and t in eos]
        cut = stops[0] if stops else len(tokens)
        rows.append(tokens[:cut])
    return rows


def main() -> None:
    model = tiny_model("qwen2", seed=0)
    oracle = copy.deepcopy(model)
    ids, mask = random_prompts(2, 7, min_len=3, seed=100 + rank())
    free = hf_rows(oracle, ids, mask, eos=None)
    if rank() == 0:  # every row ends by its second token
        eos = [free[0][1], free[1][1]]
    else:  # no row ever ends
        eos = [t for t in range(3, 512) if all(t not in row for row in free)][:2]
    expected = hf_rows(oracle, ids, mask, eos)

    engine = make_engine(model, STAGE)
    engine.train()  # as in a training loop: the rollout must restore it
    rollout = Rollout(engine, TinyTokenizer(pad_token_id=0, eos_token_id=eos), RolloutConfig(gather=GATHER, route=ROUTE))
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0,
                                                                           continuous_batch_size=SLOTS))
    stats = rollout.last_stats
    decoder = rollout.runner.fast_step
    signature = decoder.last_weight_signature
    again = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0,
                                                                       continuous_batch_size=SLOTS))
    stable = signature is not None and decoder.last_weight_signature == signature
    got = []
    for row in range(batch.batch_size):
        keep = batch.attention_mask[row, 7:].bool()
        got.append(batch.input_ids[row, 7:][keep].tolist())
    partitioned = None
    if STAGE == 3:  # outside the rollout the parameters are partitioned again
        partitioned = all(p.numel() == 0 for p in engine.module.parameters())
    emit({"rank": rank(), "expected": expected, "got": got,
          "num_forwards": stats.prefill.forwards + stats.decode.forwards,
          "decode_fallback_reason": stats.decode.fallback_reason,
          "fast_decode": stats.decode.eager_steps + stats.decode.graph_steps > 0,
          "stable_weight_addresses": stable, "repeat_equal": torch.equal(again.input_ids, batch.input_ids),
          "is_zero3": rollout.is_zero3, "route": stats.route, "partitioned_after": partitioned,
          "training_after": engine.module.training})


if __name__ == "__main__":
    with torch.no_grad():
        main()
