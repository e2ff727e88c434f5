"""rollout.lora.LoraFuser: fused logits equal peft's merged model, unfuse is bit-exact, no leaks.

Adapters have random non-zero weights (``init_lora_weights=False``) so every delta matters. The
DeepSpeed cases (ZeRO-0 and 2-rank ZeRO-3 inside ``gathered(engine, "once")``) run in
subprocess workers (tests/ds_workers/lora_engine.py).
"""

import copy

import pytest
import torch

from rollout.model import lora as lora_module
from rollout.model.lora import LoraFuser
from rollout.testing import tiny_model
from tests.ds_util import run_worker

peft = pytest.importorskip("peft")

LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7], [9, 8, 7, 6, 5, 4, 3]])  # IDS: [2, 7]


def lora_model(arch="qwen2", dtype=torch.float32, targets=LINEAR_TARGETS, seed=1, **lora_kwargs):
    """A tiny peft LoRA model with random non-zero adapter weights."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                             init_lora_weights=False, **lora_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(tiny_model(arch, dtype=dtype), config)


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_weights(model):
    """name -> (data pointer, clone) of every base (non-adapter) parameter."""
    return {n: (p.data_ptr(), p.data.clone()) for n, p in model.named_parameters() if "lora_" not in n}


def same_storage(model, before) -> bool:
    """Every base parameter still points at its original storage (``.data`` was put back)."""
    return all(p.data_ptr() == before[n][0] for n, p in model.named_parameters() if n in before)


def peft_state(model):
    return {n: (id(m.merged_adapters), list(m.merged_adapters)) for n, m in model.named_modules()
            if hasattr(m, "merged_adapters")}


@pytest.mark.parametrize("arch,dtype,targets,path", [
    ("qwen2", torch.float32, LINEAR_TARGETS, "addmm"),
    ("llama", torch.float32, LINEAR_TARGETS, "addmm"),
    ("qwen2", torch.float32, LINEAR_TARGETS + ["embed_tokens"], "addmm+peft-merge"),
    ("qwen2", torch.bfloat16, LINEAR_TARGETS + ["embed_tokens"], "peft-merge (fp32 adapters)"),
])
def test_fused_logits_equal_merge_and_unload(arch, dtype, targets, path):
    model = lora_model(arch, dtype, targets)
    merged = copy.deepcopy(model).merge_and_unload()
    fuser = LoraFuser.for_model(model)
    num_layers = 2 * len(LINEAR_TARGETS) + ("embed_tokens" in targets)  # 2 decoder layers
    assert fuser.num_layers == num_layers
    with fuser.fused() as num_fused:
        assert num_fused == fuser.num_layers
        fused_logits = logits(model)
    expected = logits(merged)
    if dtype == torch.float32:
        torch.testing.assert_close(fused_logits, expected, rtol=1e-5, atol=1e-5)
    else:  # bf16 with fp32 adapters goes through peft's own merge: bit-identical
        assert torch.equal(fused_logits, expected)


def test_peft_merge_path_weights_are_bit_identical_to_merge_and_unload():
    model = lora_model(dtype=torch.bfloat16, targets=LINEAR_TARGETS + ["embed_tokens"])
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    fuser = LoraFuser.for_model(model)
    with fuser.fused():
        for name, layer in model.named_modules():
            if isinstance(layer, peft.tuners.lora.LoraLayer):
                key = name.removeprefix("base_model.model.") + ".weight"
                assert torch.equal(layer.get_base_layer().weight, merged[key]), key


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_base_weights_bit_identical_after_100_cycles_bf16(adapter_dtype):
    model = lora_model(dtype=torch.bfloat16)  # peft keeps adapters in fp32: the peft-merge path
    for param in model.parameters():
        param.data = param.data.to(adapter_dtype if param.requires_grad else torch.bfloat16)
    before, state = base_weights(model), peft_state(model)
    versions = {n: p._version for n, p in model.named_parameters()}
    unfused_logits = logits(model)
    fuser = LoraFuser.for_model(model)
    fused_logits = []
    for cycle in range(100):
        fuser.fuse()
        if cycle in (0, 99):
            fused_logits.append(logits(model))
        fuser.unfuse()
    assert not torch.equal(fused_logits[0], unfused_logits)  # fusing did change the forward
    assert all(torch.equal(x, fused_logits[0]) for x in fused_logits)
    for name, param in model.named_parameters():
        if name in before:
            pointer, copy_ = before[name]
            assert param.data_ptr() == pointer and torch.equal(param.data, copy_), name
        assert param._version == versions[name], name
    assert peft_state(model) == state
    assert torch.equal(logits(model), unfused_logits)


def test_after_unfuse_training_changes_only_adapters():
    model, reference = lora_model(), lora_model()  # same seeds: identical models
    fuser = LoraFuser.for_model(model)
    with fuser.fused():
        logits(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for net in (model, reference):  # the fused-then-unfused model trains exactly like a fresh one
        net.train()
        loss = net(input_ids=IDS, labels=IDS).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items())
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(grads)


def test_fuse_twice_raises_and_unfuse_without_fuse_is_a_noop():
    model = lora_model()
    fuser = LoraFuser.for_model(model)
    before = base_weights(model)
    fuser.unfuse()  # not fused: nothing happens
    assert not fuser.is_fused and fuser.num_fused == 0
    fuser.fuse()
    with pytest.raises(RuntimeError, match="already fused"):
        fuser.fuse()
    assert fuser.is_fused
    fuser.unfuse()
    fuser.unfuse()
    assert same_storage(model, before)


def test_fused_context_unfuses_on_error():
    model = lora_model()
    unfused_logits = logits(model)
    fuser = LoraFuser.for_model(model)
    with pytest.raises(KeyError):
        with fuser.fused():
            raise KeyError("boom")
    assert not fuser.is_fused
    assert torch.equal(logits(model), unfused_logits)


def test_fuse_failure_midway_restores_every_layer(monkeypatch):
    model = lora_model()
    before, state = base_weights(model), peft_state(model)
    calls = []

    def failing_merge(out, weight, layer, adapters):
        calls.append(layer)
        if len(calls) == 3:
            raise RuntimeError("merge failed")
        out.copy_(weight)

    monkeypatch.setattr(lora_module, "_addmm_merge", failing_merge)
    fuser = LoraFuser.for_model(model)
    with pytest.raises(RuntimeError, match="merge failed"):
        fuser.fuse()
    assert not fuser.is_fused
    assert same_storage(model, before)
    assert peft_state(model) == state


@pytest.mark.parametrize("keep_buffers", [True, False])
def test_buffers_reused_or_released(keep_buffers):
    model = lora_model()
    fuser = LoraFuser.for_model(model, keep_buffers=keep_buffers)
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    pointers = []
    for _ in range(2):
        with fuser.fused():
            pointers.append(layer.get_base_layer().weight.data_ptr())
    assert pointers[0] != layer.get_base_layer().weight.data_ptr()  # fused into a separate buffer
    assert (len(fuser._buffers) > 0) is keep_buffers
    if keep_buffers:
        assert pointers[0] == pointers[1]


def test_two_active_adapters_fuse_to_the_unfused_forward():
    model = lora_model()
    second = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "down_proj"],
                             init_lora_weights=False)
    model.add_adapter("second", second)
    model.base_model.set_adapter(["default", "second"])
    model.requires_grad_(False)
    unfused_logits = logits(model)
    fuser = LoraFuser.for_model(model)
    with fuser.fused():
        fused_logits = logits(model)
    torch.testing.assert_close(fused_logits, unfused_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits(lora_model()), unfused_logits)  # the second adapter matters


@pytest.mark.parametrize("case", ["disabled", "dora", "already_merged"])
def test_layers_that_cannot_be_fused_stay_unmerged_and_exact(case):
    model = lora_model(use_dora=(case == "dora"))
    if case == "already_merged":
        model.base_model.merge_adapter()
    state = peft_state(model)
    fuser = LoraFuser.for_model(model)
    if case == "disabled":
        with model.disable_adapter():
            expected = logits(model)
            with fuser.fused() as num_fused:
                got = logits(model)
    else:
        expected = logits(model)
        with fuser.fused() as num_fused:
            got = logits(model)
    assert num_fused == 0
    assert torch.equal(got, expected)
    assert peft_state(model) == state


def test_for_model_without_lora_returns_none():
    assert LoraFuser.for_model(tiny_model()) is None
    with pytest.raises(TypeError, match="module"):
        LoraFuser.for_model(object())
    with pytest.raises(ValueError, match="layers"):
        LoraFuser([])


@pytest.mark.parametrize("stage,world_size", [(0, 1), (3, 2)])
def test_fuse_inside_deepspeed_engine(stage, world_size):
    for obs in (r.result for r in run_worker("lora_engine.py", stage, world_size=world_size)):
        assert obs["num_fused"] == [obs["num_layers"]] * 3 and obs["num_layers"] == 14
        assert max(obs["fused_vs_merged"]) <= 1e-5
        assert obs["unfused_vs_unmerged"] == [0.0, 0.0, 0.0]
        assert obs["can_fuse_inside"] == [True, True, True]
        assert obs["full_identical"] and obs["shards_identical"]
        assert obs["changed_after_train"] == obs["adapter_params"] and obs["adapter_params"]
        if stage == 3:  # partitioned weights cannot be fused outside a gather
            assert obs["num_shards"] > 0 and not obs["can_fuse_outside"]
            assert "not gathered" in obs["outside_error"] and not obs["fused_after_error"]
        else:
            assert obs["can_fuse_outside"] and obs["outside_error"] is None
