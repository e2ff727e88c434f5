"""Worker: LoraFuser on a peft model inside a DeepSpeed engine (argv[1]: ZeRO stage, 0 or 3).

Fuse/unfuse cycles inside ``gathered(engine, "once")`` must give the merged model's logits, leave
every partition and every gathered weight bit-identical, and let training update only adapters.
Emits observations; tests/test_lora.py asserts on them.
"""

import copy
import sys

import torch
from common import emit, make_engine

from rollout.model.lora import LoraFuser
from rollout.testing import tiny_model
from rollout.model.zero import gathered

STAGE = int(sys.argv[1])
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_CYCLES = 3


def peft_model():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # same adapter weights on every rank
        return get_peft_model(tiny_model("qwen2", seed=0), config)


def full_params(engine) -> dict[str, torch.Tensor]:
    """A clone of every parameter at full size (gathered under ZeRO-3)."""
    with gathered(engine, "once"):
        return {name: p.data.clone() for name, p in engine.module.named_parameters()}


def shards(engine) -> dict[str, torch.Tensor]:
    """A clone of every ZeRO-3 partition (empty for other stages)."""
    return {name: p.ds_tensor.clone() for name, p in engine.module.named_parameters() if hasattr(p, "ds_tensor")}


def all_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def fuse_outside_gather(fuser) -> dict:
    """Under ZeRO-3 fusing without a gather must fail before touching anything."""
    out = {"can_fuse_outside": fuser.can_fuse(), "outside_error": None}
    try:
        fuser.fuse()
    except RuntimeError as err:
        out["outside_error"] = str(err)
    out["fused_after_error"] = fuser.is_fused
    fuser.unfuse()
    return out


def cycles(engine, fuser, ids, merged_logits, unmerged_logits) -> dict:
    out = {"num_fused": [], "fused_vs_merged": [], "unfused_vs_unmerged": [], "can_fuse_inside": []}
    module = engine.module
    with torch.no_grad():
        for _ in range(NUM_CYCLES):
            with gathered(engine, "once"):
                out["can_fuse_inside"].append(fuser.can_fuse())
                out["num_fused"].append(fuser.fuse())
                out["fused_vs_merged"].append(max_abs_diff(module(input_ids=ids).logits, merged_logits))
                fuser.unfuse()
                out["unfused_vs_unmerged"].append(max_abs_diff(module(input_ids=ids).logits, unmerged_logits))
    return out


def train_step(engine, ids) -> float:
    engine.train()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    return loss.item()


def main() -> None:
    model = peft_model()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])  # ids: [1, 7]
    with torch.no_grad():
        unmerged_logits = model(input_ids=ids).logits
        merged_logits = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
    engine = make_engine(model, STAGE)
    fuser = LoraFuser.for_model(engine)
    out = {"num_layers": fuser.num_layers}
    shards_before, full_before = shards(engine), full_params(engine)
    out.update(fuse_outside_gather(fuser))
    out.update(cycles(engine, fuser, ids, merged_logits, unmerged_logits))
    out["shards_identical"] = all_equal(shards(engine), shards_before)
    out["num_shards"] = len(shards_before)
    out["full_identical"] = all_equal(full_params(engine), full_before)
    out["train_loss"] = train_step(engine, ids)
    full_after = full_params(engine)
    out["changed_after_train"] = sorted(k for k in full_before if not torch.equal(full_before[k], full_after[k]))
    out["adapter_params"] = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    emit(out)


if __name__ == "__main__":
    main()
