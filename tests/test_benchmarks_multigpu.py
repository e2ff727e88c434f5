"""benchmarks.multigpu (``python -m benchmarks.multigpu``) and the flags of scripts/train_opsd.py it relies on, on the CPU.

In-process: model shape names (``--student qwen25-3b``) and their errors, ``--gather`` /
``--teacher-offload`` / ``--local_rank`` parsing, the bench's variant names and pass-through checks,
and its handling of a failing or hanging variant (stand-in commands). Real runs (subprocesses, gloo,
tiny models, 2 ranks, 2 steps): the bench under ``torchrun`` with ZeRO-0 and ZeRO-3 per-forward
gathering and per-rank traces summarised ``--by-rank``, and under the ``deepspeed`` launcher (which
passes ``--local_rank=N``) with an offloaded ZeRO-3 teacher, whose losses must equal the plain
teacher's.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.opsd.engines import teacher_engine_config
from rollout.testing import MODEL_SHAPES, QWEN25_3B_SHAPE, shape_config, shaped_model, tiny_model

REPO = Path(__file__).resolve().parent.parent
#: Flags of the tiny real runs: 2 steps of 1 prompt x 2 samples x 6 new tokens per rank.
TINY_JOB = ["--steps", "2", "--batch-size", "1", "--samples-per-prompt", "2", "--max-new-tokens", "6",
            "--prompt-len", "8"]
RUN_TIMEOUT_S = 240


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_opsd():
    return load_script("train_opsd")


@pytest.fixture(scope="module")
def bench():
    from benchmarks import multigpu

    return multigpu


# ---- shape names ----------------------------------------------------------------------------------
def test_shape_names_build_the_named_geometry():
    assert MODEL_SHAPES["qwen25-3b"][1] is QWEN25_3B_SHAPE
    config = shape_config("qwen25-3b")
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151936, 2048, 36)
    assert (config.pad_token_id, config.eos_token_id) == (0, 2)
    big = shaped_model("qwen25-3b", dtype=torch.bfloat16, device="meta")  # no memory: geometry only
    assert 3.0e9 < sum(p.numel() for p in big.parameters()) < 3.2e9
    assert {p.dtype for p in big.parameters()} == {torch.bfloat16}
    # On the CPU in float32 the named tiny shapes are the embedded tiny models, weight for weight.
    for name, arch in (("tiny-qwen2", "qwen2"), ("tiny-llama", "llama")):
        built, ref = shaped_model(name, seed=5), tiny_model(arch, seed=5)
        assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), ref.state_dict().values()))
    with pytest.raises(ValueError, match="shape must be one of"):
        shape_config("qwen25-14b")


def test_the_7b_shape_has_qwen25_7b_geometry():
    """Issue 18's larger student: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944,
    vocab 152064, untied embeddings (~7.6e9 parameters), built on the meta device (no memory)."""
    config = shape_config("qwen25-7b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == \
        (3584, 28, 28, 4, 18944, 152064, False)
    big = shaped_model("qwen25-7b", dtype=torch.bfloat16, device="meta")
    assert 7.5e9 < sum(p.numel() for p in big.parameters()) < 7.7e9


def test_train_flags_accept_shape_names_gather_and_offload(train_opsd):
    job, _ = train_opsd.parse_args(["--student", "qwen25-3b", "--teacher", "qwen25-3b", "--gather", "per_forward",
                                    "--teacher-offload", "1", "--json-out", "r.json"])
    assert (job.student, job.teacher, job.rollout.gather, job.teacher_offload, job.json_out) == \
        ("qwen25-3b", "qwen25-3b", "per_forward", 1, "r.json")
    job, _ = train_opsd.parse_args(["--student", "tiny-qwen2", "--teacher", "Qwen/Qwen2.5-7B-Instruct"])
    assert job.teacher == "Qwen/Qwen2.5-7B-Instruct"  # an HF repo id passes; it is loaded later
    job, _ = train_opsd.parse_args(["--rollout", "kernels.prefill_graph_tokens=8192"])
    assert job.rollout.kernels.prefill_graph_tokens == 8192


@pytest.mark.parametrize("argv, flag_field, words", [
    (["--student", "qwen25-14b"], "student:", ["qwen25-3b", "qwen25-7b", "tiny-llama", "tiny-qwen2", "tiny-qwen2-deep"]),
    (["--teacher", "tiny-qwen3"], "teacher:", ["'self'", "qwen25-3b"]),
    (["--student", "qwen25-3b", "--teacher", "tiny-llama"], "teacher:", ["151936", "512"]),
    (["--gather", "sometimes"], "gather:", ["per_forward"]),
    (["--teacher", "self", "--teacher-offload", "1"], "teacher_offload:", ["self"]),
    (["--teacher-offload", "2"], "teacher_offload:", ["0 or 1"]),
    (["--rollout", "kernels.prefill_graph_tokens=-1"], "kernels.prefill_graph_tokens:", ["0: off"]),
    (["--prefill-graph-tokens", "8192"], "--prefill-graph-tokens: moved;", [
        "--rollout kernels.prefill_graph_tokens=8192"]),
])
def test_bad_model_and_mode_flags_name_the_field(train_opsd, capsys, argv, flag_field, words):
    with pytest.raises(SystemExit) as exc:
        train_opsd.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag_field in err and all(word in err for word in words), err


def test_launcher_local_rank_argument_is_accepted_and_ignored(train_opsd):
    job, _ = train_opsd.parse_args(["--local_rank=1", "--steps", "2"])
    assert job.steps == 2 and train_opsd.local_rank_arg == 1
    job, _ = train_opsd.parse_args(["--local-rank", "0"])
    assert job == train_opsd.JobConfig() and train_opsd.local_rank_arg == 0
    train_opsd.parse_args([])
    assert train_opsd.local_rank_arg is None


def test_offloaded_teacher_config_is_inference_only_zero3():
    config = teacher_engine_config({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}, 8)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config["bf16"] == {"enabled": True} and "optimizer" not in config
    assert config["train_micro_batch_size_per_gpu"] == 8


# ---- the bench's arguments -------------------------------------------------------------------------
def test_default_runs_are_the_six_issue_8_variants(bench):
    args, job_args = bench.parse_args(["--student", "tiny-qwen2", "--steps", "3"])
    runs = bench.expand_runs(args.variants, args.nproc, args.launcher)
    assert [f"{r['variant']}/{r['gpus']}gpu" for r in runs] == [
        "zero0/1gpu", "zero3-once/1gpu", "zero3-per_forward/1gpu",
        "zero0/2gpu", "zero3-once/2gpu", "zero3-per_forward/2gpu"]
    assert {r["launcher"] for r in runs} == {"torchrun"} and job_args == ["--student", "tiny-qwen2", "--steps", "3"]
    assert [(r["zero_stage"], r["gather"]) for r in runs[:3]] == [(0, None), (3, "once"), (3, "per_forward")]


def test_variant_names_gpu_pins_and_launchers(bench):
    assert bench.parse_variant("zero3") == {"variant": "zero3-once", "zero_stage": 3, "gather": "once", "gpus": None}
    assert bench.parse_variant("zero2/4gpu")["gpus"] == 4
    runs = bench.expand_runs(["zero3-per_forward/2gpu", "zero0"], [1], ["torchrun", "deepspeed"])
    assert [r["id"] for r in runs] == ["torchrun-zero0-1gpu", "torchrun-zero3-per_forward-2gpu",
                                       "deepspeed-zero0-1gpu", "deepspeed-zero3-per_forward-2gpu"]
    command = bench.launch_command(runs[3], ["--steps", "2"], Path("/x/r.json"))
    assert command[1:5] == ["-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    assert command[-6:] == ["--zero-stage", "3", "--gather", "per_forward", "--json-out", "/x/r.json"]
    command = bench.launch_command(runs[0], [], Path("r.json"))
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    assert "--gather" not in command  # only ZeRO-3 variants set it


@pytest.mark.parametrize("argv, words", [
    (["--variants", "zero4"], ["--variants", "zero4"]),
    (["--variants", "zero0-once"], ["--variants", "ZeRO-3"]),
    (["--zero-stage", "3"], ["--zero-stage", "set by each variant"]),
    (["--json-out=x.json"], ["--json-out"]),
    (["--logit-cache", "gpu"], ["train_opsd.py rejects", "logit_cache_location"]),
    (["--student", "qwen25-14b"], ["train_opsd.py rejects", "student:"]),
    (["--nproc", "0"], ["--nproc"]),
])
def test_bench_rejects_bad_arguments_before_running_anything(bench, capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


# ---- failure handling (stand-in commands, no training) -------------------------------------------
_FAKE_RUN = r"""
import json, sys, time
kind, path, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "fail":
    print("[rank0]: Traceback (most recent call last):")
    print("[rank0]: ValueError: boom from the stand-in")
    sys.exit(1)
if kind == "hang":
    time.sleep(60)
ranks = [{"rank": r, "losses": [0.5, 0.25]} for r in range(world)]
json.dump({"world_size": world, "ranks": ranks, "median_step_s": 0.1, "rollout_tokens_per_s": 10.0,
           "peak_memory": "cpu_peak_rss", "peak_gib_per_rank": [1.0] * world, "last_loss": 0.25,
           "launcher": "torchrun", "zero_stage": 3, "device_name": "cpu"}, open(path, "w"))
"""


def test_a_failing_or_hanging_variant_becomes_a_row_and_the_rest_still_run(bench, tmp_path, monkeypatch, capsys):
    kinds = {"zero0": "fail", "zero3-once": "hang", "zero3-per_forward": "ok"}
    monkeypatch.setattr(bench, "launch_command", lambda run, job_args, json_path: [
        sys.executable, "-c", _FAKE_RUN, kinds[run["variant"]], str(json_path), str(run["gpus"])])
    out = tmp_path / "rows.json"
    code = bench.main(["--nproc", "2", "--timeout", "3", "--out", str(out)])
    assert code == 1
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["schema"] == 1 and doc["meta"]["command"][:3] == ["python", "-m", "benchmarks.multigpu"]
    assert [r["status"] for r in rows] == ["failed", "timeout", "ok"]
    assert "ValueError: boom from the stand-in" in rows[0]["error"] and rows[0]["exit_status"] == 1
    assert rows[1]["error"].startswith("timed out after 3 s") and rows[1]["exit_status"] is None
    assert rows[2]["peak_gib_per_rank"] == [1.0, 1.0] and rows[2]["last_loss"] == 0.25
    table = capsys.readouterr().out
    assert "failed: ValueError: boom from the stand-in" in table and "timeout: timed out after 3 s" in table
    merged = tmp_path / "merged.json"
    assert bench.main(["--merge", str(out), str(out), "--out", str(merged)]) == 1
    assert len(json.loads(merged.read_text())["rows"]) == 6


# ---- real runs: 2 gloo ranks per variant -----------------------------------------------------------
def run_bench(tmp: Path, *args) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPSD_", "NVTX_INJECTION"))}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    out = tmp / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multigpu", *args, "--out", str(out)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc.stdout


def check_two_rank_report(row: dict, launcher: str, stage: int, gather) -> dict:
    assert row["status"] == "ok", row.get("error")
    report = row["report"]
    assert report["world_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert (report["launcher"], report["zero_stage"], row["zero_stage"]) == (launcher, stage, stage)
    if gather is not None:
        assert report["gather"] == gather
    for rank in report["ranks"]:
        assert len(rank["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in rank["losses"])
        assert len(rank["step_ms"]) == 2 and rank["peak_gpu_gib"] is None and rank["peak_rss_gib"] > 0
    assert report["peak_memory"] == "cpu_peak_rss" and len(row["peak_gib_per_rank"]) == 2
    assert row["peak_gib_max"] == max(row["peak_gib_per_rank"]) > 0
    assert math.isfinite(row["last_loss"]) and row["median_step_s"] > 0 and row["rollout_tokens_per_s"] > 0
    assert row["last_step_s"] == max(r["step_ms"][-1] for r in report["ranks"]) / 1000.0  # slowest rank, last step
    assert report["ranks"][0]["losses"] != report["ranks"][1]["losses"]  # each rank distils its own rollout
    return report


@pytest.fixture(scope="module")
def torchrun_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_torchrun")
    doc, stdout = run_bench(tmp, "--variants", "zero0", "zero3-per_forward", "--nproc", "2",
                            "--profile", str(tmp / "traces"), *TINY_JOB)
    return tmp, doc["rows"], stdout


def test_torchrun_zero0_and_zero3_per_forward_two_ranks_with_traces(torchrun_rows):
    tmp, rows, stdout = torchrun_rows
    assert [(r["variant"], r["gpus"], r["launcher"]) for r in rows] == [
        ("zero0", 2, "torchrun"), ("zero3-per_forward", 2, "torchrun")]
    for row, stage, gather in zip(rows, (0, 3), (None, "per_forward")):
        check_two_rank_report(row, "torchrun", stage, gather)
        (run_dir,) = row["trace_dirs"]
        assert Path(run_dir).parent == tmp / "traces" / row["id"]
        for rank in (0, 1):
            assert list(Path(run_dir).glob(f"rank{rank}.*.pt.trace.json.gz")), f"no trace of rank {rank}"
        summary = row["trace_summary"]
        assert row["trace_summary_status"] == 0, summary
        assert "ranks: [0, 1]" in summary and "\nrank 0: " in summary and "\nrank 1: " in summary
        assert "opsd/teacher_forward" in summary and "straggler" in summary
    table = stdout[stdout.index("| variant |"):]
    assert "| zero0 | torchrun | 2 | 0 | - |" in table
    assert "| zero3-per_forward | torchrun | 2 | 3 | per_forward |" in table
    assert "summarize_trace.py --by-rank" in stdout


def test_deepspeed_launcher_with_an_offloaded_teacher_matches_torchrun(torchrun_rows, tmp_path):
    doc, stdout = run_bench(tmp_path, "--variants", "zero0/2gpu", "--launcher", "deepspeed",
                            "--teacher-offload", "1", *TINY_JOB)
    (row,) = doc["rows"]
    report = check_two_rank_report(row, "deepspeed", 0, None)
    assert [r["local_rank_arg"] for r in report["ranks"]] == [0, 1]  # the launcher's --local_rank=N
    assert report["teacher_offload"] is True
    placement = report["teacher_params"]
    assert placement["numel"] > 0 and placement["offloaded_numel"] == placement["numel"]
    assert "| zero0 | deepspeed | 2 | 0 | - |" in stdout
    # Same ranks, prompts and samples under either launcher; the ZeRO-3 offloaded teacher scores like the plain
    # one: both take the packed path (the partitioned teacher's head is gathered for the loss, its hidden states
    # cached unrounded as the plain one's), so every rank's losses match the torchrun run's (plain teacher).
    assert [r["breakdown"][0]["train_path"] for r in report["ranks"]] == ["packed", "packed"]
    assert [r["breakdown"][0]["teacher_path"] for r in report["ranks"]] == ["hf", "hf"]  # partitioned: HF's layers
    plain = torchrun_rows[1][0]["report"]["ranks"]
    assert [r["breakdown"][0]["train_path"] for r in plain] == ["packed", "packed"]
    for offloaded, reference in zip(report["ranks"], plain):
        assert offloaded["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_merge_reads_the_files_written_before_the_schema(bench):
    """``--merge`` of two older files (``{"schema": "opsd-bench-multigpu/1", ..., "rows"}``, 2026-11-30 and
    2026-12-01): every row a ``VariantRow``, its figures recomputed from its report."""
    rows = bench.load_rows([str(REPO / "docs/results/h200-2026-11-30/bench8.json"),
                            str(REPO / "docs/results/h200-2026-12-01g/zero-ed277b2-2.json")])
    assert [(r.variant, r.gpus) for r in rows] == [("zero0", 1), ("zero3-once", 1), ("zero3-per_forward", 1),
                                                   ("zero0", 2), ("zero3-once", 2), ("zero0", 1), ("zero3-once", 1)]
    assert all(isinstance(r, bench.VariantRow) and r.status == "ok" for r in rows)
    assert rows[3].peak_gib_per_rank == [pytest.approx(75.21, abs=0.01)] * 2 and rows[3].last_step_s > 0
    assert "| zero3-per_forward | torchrun | 1 | 3 | per_forward | 13.326 |" in bench.format_table(rows)
