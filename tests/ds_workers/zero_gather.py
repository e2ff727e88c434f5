"""Worker: ZeRO-3 partitioning, rollout.zero.gathered in both modes, hooks restored, lockstep flag.

Every rank builds the same seeded tiny model and keeps an unwrapped copy as the oracle. Emits a
dict of observations; tests/test_zero.py asserts on them.
"""

import copy
import math

import torch
from common import emit, make_engine, rank, world_size

from rollout.testing import tiny_model
from rollout.model.zero import any_rank_busy, gathered, is_zero3


def partition_state(params) -> dict:
    """How many parameters hold full data, and whether every shard has the expected size."""
    world = world_size()
    return {
        "num_full": sum(p.numel() == p.ds_numel for p in params),
        "num_empty": sum(p.numel() == 0 for p in params),
        "shards_ok": all(p.ds_tensor.numel() == math.ceil(p.ds_numel / world) for p in params),
    }


def num_module_hooks(module: torch.nn.Module) -> int:
    """Forward (pre-)hooks registered on all submodules (ZeRO-3 puts its fetch/release here)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def main() -> None:
    model = tiny_model("qwen2", seed=0)
    oracle = copy.deepcopy(model)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])  # ids: [1, 6]
    with torch.no_grad():
        expected = oracle(ids).logits
    engine = make_engine(model, 3)
    common = {"is_zero3": [is_zero3(engine), is_zero3(engine.module), is_zero3(oracle)],
              "busy": {"only_rank0": any_rank_busy(rank() == 0, "cpu"),
                       "none": any_rank_busy(False, "cpu"), "all": any_rank_busy(True, "cpu")}}
    # gathered() gets the engine, then the bare module, on the same engine one after the other.
    observed = {target: observe(engine, target, ids, expected) for target in ("engine", "module")}
    common["train_loss_finite"] = train_step_ok(engine, ids)  # last: it changes the weights
    emit({target: {**obs, **common} for target, obs in observed.items()})


def observe(engine, target: str, ids: torch.Tensor, expected: torch.Tensor) -> dict:
    """Partition state, hook counts and logits around gathered(target, mode) for both modes."""
    module = engine.module
    params = list(module.parameters())
    handle = engine if target == "engine" else module
    out = {"num_params": len(params), "outside_before": partition_state(params),
           "hooks_outside": num_module_hooks(module)}
    with torch.no_grad():
        for _ in range(2):  # hooks suspended and restored twice
            with gathered(handle, "once"):
                out["inside_once"] = partition_state(params)
                out["hooks_inside_once"] = num_module_hooks(module)
                out["once_diffs"] = [max_abs_diff(module(ids).logits, expected) for _ in range(3)]
                out["once_engine_forward_diff"] = max_abs_diff(engine(input_ids=ids).logits, expected)
                out["inside_once_after_forwards"] = partition_state(params)
            out["outside_after"] = partition_state(params)
            out["hooks_after_once"] = num_module_hooks(module)
            out["hooked_diff_between"] = max_abs_diff(module(ids).logits, expected)
        with gathered(handle, "per_forward"):
            out["inside_per_forward"] = partition_state(params)
            out["per_forward_diff"] = max_abs_diff(module(ids).logits, expected)
        out["outside_end"] = partition_state(params)
    return out


def train_step_ok(engine, ids: torch.Tensor) -> bool:
    """One forward/backward/step through the engine (ZeRO-3 hooks must be back in place)."""
    engine.train()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    return bool(torch.isfinite(loss).item())


if __name__ == "__main__":
    main()
