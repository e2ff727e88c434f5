"""Worker: OPSD training steps through DeepSpeed engines (ZeRO stage and student kinds from argv).

argv: ``ZERO_STAGE KINDS [self] [micro]``; KINDS is a comma list of ``full`` (every weight trains) and
``lora`` (a peft LoRA student: only adapters train), run one after the other in this process. For
each kind every rank builds the same seeded student and a separate teacher (a different tiny
model), keeps an unwrapped copy of the student as the oracle, and runs ``NUM_STEPS`` steps on its
own prompts. Emits ``{kind: observations}``: the losses, the oracle's loss recomputed with
``generalized_jsd_loss`` on the first step's rollout, which student weights changed (gathered under
ZeRO-3), whether the teacher changed or got gradients, the data-parallel loss weight of token
counts 10 + 20 * rank. With ``self``: two more self-distillation steps (teacher = the student
engine), on the same prompt and with a different teacher prompt. With ``micro``: two engines built
from the same seeded student with a plain SGD optimizer train on the same two rollouts (6 rows on
rank 0, 4 on rank 1), one all rows at once with ``gradient_accumulation_steps`` 1, the other in
micro-batches of at most 2 rows (teacher forwards of at most 3) with ``gradient_accumulation_steps``
3, the latter once with ZeRO-3's gradients coalesced (the default) and once reduced by its hooks after every
micro-batch; emits the losses, the largest differences of the first updates and of both steps' updates against
one-shot, and the largest updates.
"""

import copy
import sys

import deepspeed
import torch
from common import ds_config, emit, init_deepspeed_cpu, make_engine, rank

from rollout import Rollout, RolloutRequest
from rollout.config import RolloutConfig, SamplingConfig
from rollout.opsd.losses import generalized_jsd_loss, response_logit_positions
from rollout.opsd import OPSDConfig, OPSDStep
from rollout.opsd.ranks import RankFigures, gather_figures, rank_weight
from rollout.testing import TinyTokenizer, random_prompts, tiny_model

STAGE, KINDS = int(sys.argv[1]), sys.argv[2].split(",")
WITH_SELF, WITH_MICRO = "self" in sys.argv[3:], "micro" in sys.argv[3:]
NUM_STEPS = 3
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, n_samples_per_prompt=2, seed=7)
CONFIG = OPSDConfig(beta=0.5, temperature=1.0)
MICRO_LR = 10.0  # SGD: the update is -lr * gradient, large enough to stand above fp32 rounding


def make_student(kind: str):
    model = tiny_model("qwen2", seed=0)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def gathered_weights(module) -> dict:
    """Full copies of every parameter (gathered when ZeRO-3 partitioned)."""
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone() for name, p in params.items()}


def reference_loss(oracle, teacher, batch, path: str) -> float:
    """The step's loss recomputed from full logits (no logits_to_keep, no cache, one chunk); the padded path's cache
    rounds the teacher's logits to bf16, the packed path's keeps the teacher's hidden states unrounded."""
    mask = batch.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        student = oracle(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions).logits
        target = teacher(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions).logits
    loss_mask = response_logit_positions(mask, batch.response_start_idx)
    target = target[:, :-1]
    if path == "padded":
        target = target.to(CONFIG.logit_cache_dtype).float()  # the cache stores bf16
    return generalized_jsd_loss(student[:, :-1], target, loss_mask, CONFIG.beta, CONFIG.temperature,
                                chunk_size=1 << 20).item()


def self_distillation(engine, tokenizer) -> dict:
    """Teacher = the student engine: 0 on identical inputs, > 0 with a different teacher prompt."""
    # one row per micro-batch: each teacher forward (the engine's own weights) runs between student
    # micro-batches whose gradients are accumulating, and still sees the weights of the step's start
    step = OPSDStep(engine, engine, tokenizer, OPSDConfig(logit_cache_dtype=torch.float32, max_student_rows=1))
    ids, mask = random_prompts(2, 6, min_len=2, seed=300 + rank())
    same = step.step(ids, mask, SAMPLING)
    teacher_ids, teacher_mask = random_prompts(2, 9, min_len=4, seed=400 + rank())
    other = step.step(ids, mask, SAMPLING, teacher_prompt_ids=teacher_ids, teacher_prompt_attention_mask=teacher_mask)
    return {"same_prompt_loss": same.loss, "teacher_prompt_loss": other.loss, "is_self": step.is_self_distillation,
            "micro_batches": [same.breakdown.num_micro_batches, other.breakdown.num_micro_batches]}


def run(kind: str) -> dict:
    student = make_student(kind)
    oracle = copy.deepcopy(student)
    teacher = tiny_model("llama", seed=1)
    teacher_before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    tokenizer = TinyTokenizer(pad_token_id=0, eos_token_id=2)
    engine = make_engine(student, STAGE, lr=1e-2)
    engine.train()
    module = engine.module
    before = gathered_weights(module)
    step = OPSDStep(engine, teacher, tokenizer, CONFIG)
    results = []
    for index in range(NUM_STEPS):
        ids, mask = random_prompts(2, 6, min_len=2, seed=100 + 10 * rank() + index)
        results.append(step.step(ids, mask, SAMPLING))
    after = gathered_weights(module)
    out = {
        "is_zero3": step.rollout.is_zero3, "losses": [r.loss for r in results],
        "reference_loss": reference_loss(oracle, teacher, results[0].batch, step.train_path),
        "train_path": step.train_path, "student_path": step.student_path, "coalesced": step.coalesces_gradients,
        "rollout_path": results[-1].breakdown.rollout_path,
        "num_params": len(before), "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "teacher_changed": [n for n, p in teacher.named_parameters() if not torch.equal(p, teacher_before[n])],
        "teacher_grads": [n for n, p in teacher.named_parameters() if p.grad is not None],
        "tokens0": results[0].batch.input_ids.tolist(),
        "rank_weight": figures_weight(10 + 20 * rank()),
    }
    if STAGE == 3:  # the student's path when the rollout (and so the step) gathers per module
        other = OPSDStep(engine, teacher, tokenizer, CONFIG, rollout_config=RolloutConfig(gather="per_forward"))
        out["per_forward_path"] = [other.student_path, other.student_path_reason]
    if WITH_SELF:
        out["self"] = self_distillation(engine, tokenizer)
    if torch.distributed.get_world_size() == 2:
        out["refusal"] = refusal_on_one_rank(step, results[-1].batch)
    return out


def refusal_on_one_rank(step, batch) -> str:
    """Rank 1 passes teacher prompts of another row count, rank 0 its good batch: each must raise (its message is
    returned), and neither may wait for the other (rank 1 raised before the step's collectives, and rank 0 hung in
    them, before the refusal joined them)."""
    kwargs = {}
    if rank() == 1:
        ids = batch.input_ids[:1, :3]
        kwargs = dict(teacher_prompt_ids=ids, teacher_prompt_attention_mask=torch.ones_like(ids))
    try:
        step.train_on_batch(batch, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def figures_weight(num_positions: int) -> float:
    """This rank's data-parallel loss weight for ``num_positions`` (every rank's counts gathered)."""
    local = RankFigures(num_positions, 1, 1, 1, 0)
    return rank_weight(gather_figures(local), local)


def sgd_engine(model, gradient_accumulation_steps: int):
    init_deepspeed_cpu()
    config = {**ds_config(STAGE), "gradient_accumulation_steps": gradient_accumulation_steps}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=MICRO_LR),
                                      config=config)
    engine.train()
    return engine


def micro_vs_one_shot() -> dict:
    """One-shot and micro-batched steps on the same rollouts (see the module docstring)."""
    tokenizer = TinyTokenizer(pad_token_id=0, eos_token_id=2)
    teacher = tiny_model("llama", seed=1)
    roller = tiny_model("qwen2", seed=5)  # rollouts from another model: the batches are fixed inputs
    batches = []
    for index in range(2):
        ids, mask = random_prompts(3 - rank(), 6, min_len=2, seed=500 + 10 * rank() + index)
        batches.append(Rollout(roller, tokenizer).generate(RolloutRequest(ids, mask), SAMPLING))
    configs = {"one_shot": (OPSDConfig(max_student_rows=None, max_teacher_rows=None), 1),
               "micro": (OPSDConfig(max_student_rows=2, max_teacher_rows=3), 3),
               "micro_hooks": (OPSDConfig(max_student_rows=2, max_teacher_rows=3, coalesce_gradients=False), 3)}
    out, weights, totals = {}, {}, {}
    for name, (config, accumulation) in configs.items():
        engine = sgd_engine(tiny_model("qwen2", seed=0).train(), accumulation)
        before = gathered_weights(engine.module)
        step = OPSDStep(engine, teacher, tokenizer, config)
        results = [step.train_on_batch(batches[0])]
        after = gathered_weights(engine.module)
        weights[name] = {n: after[n] - before[n] for n in before}  # the first step's update
        results.append(step.train_on_batch(batches[1]))
        final = gathered_weights(engine.module)
        totals[name] = {n: final[n] - before[n] for n in before}  # both steps' updates
        out[name] = {"losses": [r.loss for r in results], "global_steps": engine.global_steps,
                     "micro_batches": [r.breakdown.num_micro_batches for r in results],
                     "teacher_forwards": [r.breakdown.num_teacher_forwards for r in results],
                     "coalesced": step.coalesces_gradients}
    deltas = weights["one_shot"]
    out["max_update"] = max(float(d.abs().max()) for d in deltas.values())
    for name in ("micro", "micro_hooks"):  # the first update, and both steps' (the second starts from the first's)
        out[name]["max_update_diff"] = max(float((deltas[n] - weights[name][n]).abs().max()) for n in deltas)
        out[name]["max_total_diff"] = max(float((totals["one_shot"][n] - totals[name][n]).abs().max())
                                          for n in deltas)
    out["max_total"] = max(float(d.abs().max()) for d in totals["one_shot"].values())
    return out


def main() -> None:
    out = {kind: run(kind) for kind in KINDS}
    if WITH_MICRO:
        out["micro"] = micro_vs_one_shot()
    emit(out)


if __name__ == "__main__":
    main()
