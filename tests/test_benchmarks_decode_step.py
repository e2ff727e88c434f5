"""benchmarks.decode_step on the CPU: its step variants are ``KernelConfig`` settings (the routes' default step is
``KernelConfig()``, an A/B flips one setting), and the steps it times compute what the routes' step computes."""

import dataclasses
import re

import pytest
import torch

from benchmarks.decode_step import cli
from benchmarks.decode_step.step import BASE, ROUTE_AB, ROUTE_DEFAULT, StepVariant, decode_step_fn, \
    step_variant_list, variant
from rollout.config import KernelConfig
from rollout.testing import tiny_model


def _differences(a: KernelConfig, b: KernelConfig) -> dict:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def test_the_routes_default_step_is_the_default_kernel_config():
    assert ROUTE_DEFAULT.kernels == KernelConfig() and not ROUTE_DEFAULT.additive_mask and not ROUTE_DEFAULT.grouped
    assert ROUTE_DEFAULT.name.endswith("fused gate|up, rotary+write kernel, skinny o projection, o and down added in place, norms folded, "
                                       "rotary in the attention from 8 rows")


@pytest.mark.parametrize("flag", sorted(ROUTE_AB))
def test_an_ab_flag_times_the_default_and_the_default_with_one_setting_off_in_two_rounds(flag):
    args = cli.build_parser().parse_args(["--" + flag.replace("_", "-")])
    steps, rounds = step_variant_list(args)
    setting, off, _ = ROUTE_AB[flag]
    assert rounds == 2 and steps[1] == ROUTE_DEFAULT
    assert _differences(ROUTE_DEFAULT.kernels, steps[0].kernels) == {setting: off}


def test_the_experiments_start_from_the_compiled_fused_qkv_step():
    args = cli.build_parser().parse_args(["--triton-attention", "--kv-write-in-piece", "--additive-mask"])
    steps, rounds = step_variant_list(args)
    assert rounds == 1 and steps[:3] == [variant(compile=False, fuse_qkv=False), variant(fuse_qkv=False), variant()]
    assert [_differences(BASE, s.kernels) for s in steps[3:]] == [
        {}, {"fused_kv_write": True}, {"fused_kv_write": True}, {"decode_attention": "triton"},
        {"decode_attention": "triton", "fused_kv_write": True}]
    assert [s.additive_mask for s in steps[3:]] == [True, False, True, False, False]
    assert "--split-k" not in cli.build_parser().format_help()


def test_the_timed_steps_compute_the_same_logits():
    """On the CPU (eager pieces): the routes' default step, the base step, the additive-mask and grouped-attention
    experiments all give the same logits for one random cache."""
    model = tiny_model("qwen2", seed=0)
    outputs = []
    for step in (ROUTE_DEFAULT, StepVariant(), variant(additive_mask=True), variant(grouped=True)):
        torch.manual_seed(0)
        outputs.append(decode_step_fn(model, 3, 6, step, device="cpu")())
    assert outputs[0].shape == (3, model.config.vocab_size)
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], rtol=1e-4, atol=1e-4)


def test_silu_launches_parse_as_block_and_warps():
    args = cli.build_parser().parse_args(["--parts", "silu", "--silu-launches", "2048,8", "64,1"])
    assert args.parts == ["silu"] and args.silu_launches == [(2048, 8), (64, 1)]
    assert all(len(launch) == 2 for launch in cli.build_parser().parse_args([]).silu_launches)


@pytest.mark.parametrize("value,reason", [
    ("2048", "must be 2 comma-separated ints >= 1"), ("2048,8,2", "must be 2 comma-separated ints >= 1"),
    ("\u0663\u0662,4", "must be 2 comma-separated ints >= 1"), ("0,4", "must be 2 comma-separated ints >= 1"),
    ("64,", "must be 2 comma-separated ints >= 1"), ("48,4", "block: must be None or a power of two >= 16"),
    ("2048,3", "warps: must be None or a power of two in \\[1, 32\\]")])
def test_a_bad_silu_launch_is_refused_by_name_before_any_work(value, reason, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--parts", "silu", "--silu-launches", value])
    assert re.search(f"argument --silu-launches: {reason}.*got '{value}'", capsys.readouterr().err)


@pytest.mark.parametrize("argv,flag", [
    (["--rows", "0"], "--rows"), (["--rows", "\u0663"], "--rows"), (["--live", "-1"], "--live"),
    (["--samples", "0"], "--samples"), (["--prefill-lengths", "1_6"], "--prefill-lengths"),
    (["--prefill-graph-tokens", "0"], "--prefill-graph-tokens"), (["--shared-windows", "256"], "--shared-windows"),
    (["--skinny-launches", "16,256,4"], "--skinny-launches"), (["--skinny-launches", "16,0,4,4"], "--skinny-launches"),
    (["--json", ""], "--json")])
def test_the_benchmarks_flags_are_checked_before_the_model_is_built(argv, flag, capsys, monkeypatch):
    monkeypatch.setattr(cli, "shaped_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert f"argument {flag}:" in capsys.readouterr().err


def test_a_shared_window_outside_the_live_columns_is_refused_before_the_model_is_built(capsys, monkeypatch):
    monkeypatch.setattr(cli, "shaped_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SystemExit):
        cli.main(["--parts", "shared", "--live", "512", "--shared-windows", "256,384", "300,300", "256,600"])
    assert "--shared-windows: each prefix,filled needs prefix < filled <= --live 512; got 300,300 256,600" in \
        capsys.readouterr().err
    args = cli.build_parser().parse_args(["--skinny-launches", "0,64,64,4,4", "16,256,4,4"])
    assert args.skinny_launches == [(0, 64, 64, 4, 4), (16, 256, 4, 4)] and cli.window_problem(args) is None
    assert all(len(launch) in (4, 5) for launch in cli.build_parser().parse_args([]).skinny_launches)


def test_the_silu_table_has_a_row_per_launch_and_checks_each_against_the_reference(monkeypatch):
    """The table's plumbing on the CPU (the PyTorch path stands in for the kernel, a counter for the graph timer):
    the default launch, each asked launch, inductor's compiled reference and the unfolded SiLU·mul, each run over
    every layer's inputs and compared with the reference where the arithmetic is the same."""
    from benchmarks.decode_step import norms

    runs = []
    monkeypatch.setattr(norms, "graph_ms", lambda fn, iters: (runs.append(len(fn())), 2.0)[1])
    rows = norms.silu_variants(4, 64, 96, 3, [(16, 1), (64, 2)], device="cpu")
    names = [r["variant"].split(":")[0] for r in rows]
    assert names == ["kernel, default launch (block 512, warps 4)", "kernel, block 16, warps 1",
                     "kernel, block 64, warps 2", "PyTorch reference, compiled (inductor)",
                     "unfolded step's SiLU·mul, compiled (no RMS"]
    assert runs == [3] * 5 and all(r["ms"] == 2.0 and r["part"] == "silu_mul_rms x3" for r in rows)
    gbs = 3 * 4 * (3 * 96 + 64) * 2 / 1e9 / 2.0 * 1e3
    assert all(f"{gbs:.0f} GB/s" in r["variant"] for r in rows)
    assert [r["variant"].endswith("max |diff| 0") for r in rows] == [True] * 4 + [False]
