"""benchmarks.rl (``python -m benchmarks.rl``, ``benchmarks.suites --suite rl``) and benchmarks.suites on the CPU.

Pure parts against hand-computed answers: length statistics, the union of GPU intervals, the nucleus size, the
geometric scale search, cell / candidate selection, twins by dotted setting, the derived columns (the rooflines:
tests/test_roofline.py). End to end through ``benchmarks.suites.main(["--suite", "rl", ...])`` with the tiny model:
the result file parses strictly, has every column, and each row's realised lengths are those of the returned batch.
"""

import dataclasses
import json
import math
import os
import types

import pytest
import torch

from benchmarks import suites
from benchmarks.harness.models import model_geometry
from benchmarks.rl import busy, cli, running, scales
from benchmarks.rl.cells import (CELLS, SAMPLING_SEED, SCALE_DIVISORS, Candidate, cap_gib_for_slots, plan_candidates,
                                 select_cells, slot_variants)
from benchmarks.rl.figures import (busy_percent, length_stats, nucleus_sizes, response_lengths, search_scale,
                                   union_length)
from benchmarks.rl.rows import RlRow, derive, format_table
from benchmarks.harness.rounds import Rounds
from instrumentation.roofline import Rates, call_roofline_s
from rollout.testing import TinyTokenizer, tiny_model

ROW_FIELDS = {f.name for f in dataclasses.fields(RlRow)}


@pytest.mark.parametrize("lengths, expected", [
    (list(range(1, 11)), {"mean": 5.5, "p50": 5, "p90": 9, "max": 10}),
    ([7], {"mean": 7.0, "p50": 7, "p90": 7, "max": 7}),
    ([], {"mean": None, "p50": None, "p90": None, "max": None}),
])
def test_length_stats(lengths, expected):
    assert length_stats(lengths) == expected


@pytest.mark.parametrize("intervals, expected", [
    ([(0, 2), (1, 3), (5, 6)], 4.0),
    ([(0, 10), (2, 3)], 10.0),
    ([(4, 5), (0, 1)], 2.0),
    ([], 0.0),
])
def test_union_length(intervals, expected):
    assert union_length(intervals) == expected
    assert busy_percent(intervals, 20.0) == pytest.approx(100.0 * expected / 20.0)


class _Event:
    def __init__(self, kind, start, dur):
        self.kind, self.start, self.dur = kind, start, dur

    def activity_type(self):
        return self.kind

    def start_ns(self):
        return self.start

    def duration_ns(self):
        return self.dur


class _Prof:
    def __init__(self, events):
        results = type("R", (), {"events": lambda _self: events})()
        self.profiler = type("P", (), {"kineto_results": results})()


def test_gpu_intervals_keep_device_work_and_skip_large_traces():
    events = [_Event("kernel", 0, 5), _Event("cpu_op", 0, 100), _Event("gpu_memcpy", 10, 2),
              _Event("gpu_user_annotation", 0, 50), _Event("gpu_memset", 20, 1)]
    intervals, _ = busy.gpu_intervals(_Prof(events), max_events=10)
    assert intervals == [(0, 5), (10, 12), (20, 21)]
    skipped, why = busy.gpu_intervals(_Prof(events), max_events=3)
    assert skipped is None and "skipped" in why


def test_profile_busy_without_gpu_events_says_na():
    assert busy.profile_busy(lambda: torch.ones(64, 64) @ torch.ones(64, 64), "cpu", busy.BusyOptions(100_000)) == \
        (None, "n/a (no GPU events recorded)")


@pytest.mark.parametrize("logits, top_p, expected", [
    ([[0.0, 0.0, 0.0, 0.0]], 0.5, [2]),   # mass before each token: 0, .25, .5, .75
    ([[0.0, 0.0, 0.0, 0.0]], 0.9, [4]),
    ([[20.0, 0.0, 0.0, 0.0]], 0.9, [1]),
])
def test_nucleus_sizes(logits, top_p, expected):
    assert nucleus_sizes(torch.tensor(logits), top_p) == expected


@pytest.mark.parametrize("probe, target", [
    (lambda s: 400.0 / s, 25.0),            # hit exactly while doubling (s = 16)
    (lambda s: 300.0 / s ** 2, 10.0),       # needs the geometric bisection between 4 and 8
    (lambda s: 5.0, 10.0),                  # already short unscaled: s = 1
])
@pytest.mark.parametrize("with_lower", [False, True])
def test_search_scale(probe, target, with_lower):
    full, short = [], []

    def counted(s):
        full.append(s)
        return probe(s)

    def lower(s):  # a smaller budget: never above the full value
        short.append(s)
        return min(probe(s), 3 * target)

    scale, value, seen = search_scale(counted, target, lower=lower if with_lower else None)
    assert value == probe(scale) and (scale, value) in seen
    assert abs(value - target) <= 0.1 * target or (scale == 1.0 and value <= target)
    assert len(full) + len(short) <= 12
    if with_lower:  # the full probe runs only where the cheap one is not clearly above the target
        assert all(probe(s) <= 3.3 * target for s in full)


def test_select_cells():
    assert [c.name for c in select_cells("0,capped")] == ["wide-greedy", "capped"]
    assert [c.name for c in select_cells("3-4")] == ["longtail-64-1024", "longtail-128-1024"]
    assert len(select_cells(None)) == len(CELLS)
    with pytest.raises(ValueError, match="--cells: unknown cell"):
        select_cells("wide")
    with pytest.raises(ValueError, match="out of range"):
        select_cells("99")


@pytest.mark.parametrize("rows, n, cap, expected", [
    (256, 4, None, [(1, 256), (2, 128), (4, 64)]),
    (8, 4, None, [(1, 8), (2, 4)]),          # 8/4 = 2 slots < n: skipped
    (512, 4, 128, [(4, 128)]),               # only what the cap allows
    (4, 4, None, [(1, 4)]),                  # duplicates dropped
])
def test_slot_variants(rows, n, cap, expected):
    assert slot_variants(rows, n, cap) == expected


def _names(cands: list[Candidate]) -> list[str]:
    return [c.name for c in cands]


def test_plan_candidates():
    wide, capped = select_cells("wide-greedy")[0], select_cells("capped")[0]
    assert _names(plan_candidates(wide, None, upstream=True)) == [
        "auto", "ordinary", "continuous-256", "continuous-128", "continuous-64", "deepspeed"]
    assert _names(plan_candidates(wide, {"continuous/2", "auto"})) == ["auto", "continuous-128"]
    under_cap = plan_candidates(capped, None, cap_gib=9.0, upstream=True)  # DeepSpeed has no KV budget: not here
    assert _names(under_cap) == ["auto", "continuous-128"]
    assert all(c.max_cache_gib == 9.0 and "max_cache_gib=9" in c.note for c in under_cap)


def test_sampler_ab_twins_only_top_p_cells():
    """``--sampler-ab``: each candidate of a top-p cell gets a twin with ``sampler.fused=False`` (same route,
    slots and cap), DeepSpeed none; greedy cells get no twins."""
    sampled, greedy = select_cells("wide-sampled")[0], select_cells("wide-greedy")[0]
    cands = plan_candidates(sampled, {"auto", "continuous/1", "deepspeed"}, upstream=True, sampler_ab=True)
    assert _names(cands) == ["auto", "continuous-256", "auto +search", "continuous-256 +search", "deepspeed"]
    assert cands[3].slots == 256 and cands[3].config == (("sampler.fused", False),) and cands[1].config == ()
    assert len(plan_candidates(greedy, None, sampler_ab=True)) == 5


def test_twins_of_any_setting_by_dotted_name():
    greedy = select_cells("wide-greedy")[0]
    twins = ((("kernels.fuse_qkv", False),), (("kernels.decode_attention", "sdpa"), ("kernels.fused_kv_write", False)))
    cands = plan_candidates(greedy, {"auto", "ordinary"}, twins=twins)
    assert _names(cands) == ["auto", "ordinary", "auto kernels.fuse_qkv=False", "ordinary kernels.fuse_qkv=False",
                             "auto kernels.decode_attention=sdpa,kernels.fused_kv_write=False",
                             "ordinary kernels.decode_attention=sdpa,kernels.fused_kv_write=False"]
    assert cands[3].route == "ordinary" and cands[3].config == (("kernels.fuse_qkv", False),)
    args = cli.parse_args(["--twin", "kernels.fuse_qkv=False",
                           "--twin", "kernels.decode_attention='sdpa'; kernels.fused_kv_write=False",
                           "--cells", "wide-greedy"])
    assert args.twins == twins


@pytest.mark.parametrize("twin, words", [
    ("fuse_gate_up=False", "it moved to RolloutConfig(kernels=KernelConfig(fuse_gate_up=...)), or with_settings"),
    ("split_k_rows=0", "it was removed in 0.2"),
    ("no_such_field=1", "not a RolloutConfig setting"),
    ("kernels.fuse_qkv", "is not SETTING=VALUE"),
    ("kernels.fuse_qkv=maybe", "must be a Python literal"),
    ("kernels.fuse_qkv=3", "kernels.fuse_qkv: must be a bool"),
])
def test_a_bad_twin_fails_before_any_work_naming_why(twin, words, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--twin", twin])
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("slots, longest, budget, kv, columns", [
    (128, 1024, 1024, 36864, 4096),   # 3B: 2 x 2047 -> 4096 columns, 18.0 GiB
    (128, 64, 64, 512, 256),          # tiny --scale small: 2 x 127 = 254 -> 256
])
def test_cap_gib_allows_the_slots_and_no_more(slots, longest, budget, kv, columns):
    cap_bytes = int(cap_gib_for_slots(slots, longest, budget, kv) * 2 ** 30)
    assert slots * columns * kv <= cap_bytes < (slots + 1) * columns * kv


def test_derive_auto_vs_best_and_deepspeed():
    """Auto / best by wall time and by roofline ratio: here continuous batching finished first but drew
    shorter rows (a lower roofline), so by the ratio the ordinary route is the best."""
    rows = [RlRow("c", "w", name, wall_ms=ms, x_roofline=x) for name, ms, x in
            (("auto", 110.0, 2.0), ("ordinary", 120.0, 1.9), ("continuous-8", 100.0, 2.1), ("deepspeed", 400.0, None))]
    rows.append(RlRow("c", "w", "continuous-4", status="error: boom"))
    derive(rows)
    auto = rows[0]
    assert auto.best_candidate == "continuous-8" and auto.auto_vs_best == pytest.approx(1.1)
    assert auto.best_roofline_candidate == "ordinary" and auto.auto_vs_best_roofline == pytest.approx(2.0 / 1.9)
    assert "by x roof 1.053 (best ordinary)" in format_table(rows)
    assert rows[1].vs_deepspeed == pytest.approx(0.3) and rows[3].vs_deepspeed is None


def test_scaled_weights_restore_exactly():
    model = tiny_model("qwen2", seed=0)
    head = model.get_output_embeddings().weight
    norm = scales.final_norm(model).weight
    before_head, before_norm = head.detach().clone(), norm.detach().clone()
    with scales.scaled_weights(model, 3.7, 1.9):
        assert torch.allclose(head[scales.EOS_ID], before_head[scales.EOS_ID] * 3.7)
        assert torch.equal(head[3], before_head[3])
        assert torch.allclose(norm, before_norm * 1.9)
    assert torch.equal(head, before_head) and torch.equal(norm, before_norm)


def _strict(path) -> dict:
    def refuse(name):
        raise ValueError(f"non-finite constant {name} in {path}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def _run(tmp_path, cell: str, candidates: str, scales_path=None, max_prompts=16, extra=()):
    out = tmp_path / f"{cell}.json"
    argv = ["--suite", "rl", "--model", "tiny", "--device", "cpu", "--scale", "small", "--cells", cell,
            "--candidates", candidates, "--repeats", "1", "--json", str(out), "--commit-label", "test",
            "--max-prompts", str(max_prompts), *extra]
    if scales_path is not None:
        argv += ["--eos-scales", str(scales_path)]
    return suites.main(argv), _strict(out)


def _check_rows(result, data, cell):
    assert data["schema"] == 1
    assert set(data["meta"]) >= {"date", "gpu", "versions", "commit", "copy_gbps", "gemm_tflops", "command",
                                 "settings"}
    assert data["meta"]["command"][:3] == ["python", "-m", "benchmarks.rl"]
    assert data["rows"] and all(set(r) == ROW_FIELDS for r in data["rows"])
    for row in data["rows"]:
        assert row["status"] == "ok", row
        lengths = response_lengths(result.batches[(cell, row["candidate"])])
        stats = length_stats(lengths)
        assert (row["len_mean"], row["len_p50"], row["len_p90"], row["len_max"]) == (
            stats["mean"], stats["p50"], stats["p90"], stats["max"])
        assert row["response_tokens"] == sum(lengths)
        assert row["roofline_ms"] > 0 and math.isfinite(row["x_roofline"])
        assert row["gpu_busy_pct"] is None and row["peak_gib"] is None  # CPU: n/a
        assert row["stats"]["decode.path"] == "fast_eager" and "cache.num_slots" in row["stats"]


def test_the_opsd_longtail_cell_ends_each_row_at_its_own_budget(tmp_path):
    """``opsd-longtail``: EOS off, each row ends at the budget ``row_budgets`` draws for it (benchmarks.step's
    long-tail lengths), so the realised lengths are those budgets, row by row."""
    from benchmarks.rl.cells import CELLS as SPECS, row_budgets

    result, data = _run(tmp_path, "opsd-longtail", "auto", max_prompts=4)
    _check_rows(result, data, "opsd-longtail")
    spec = next(c for c in SPECS if c.name == "opsd-longtail")
    cell = dataclasses.replace(spec.scaled(SCALE_DIVISORS["small"]), num_prompts=4)
    budgets = row_budgets(cell).tolist()
    assert len(budgets) == 16 and len(set(budgets)) > 1 and max(budgets) <= cell.budget
    assert response_lengths(result.batches[("opsd-longtail", "auto")]) == budgets
    assert row_budgets(dataclasses.replace(cell, row_mean=None)) is None


def test_end_to_end_wide_greedy(tmp_path):
    result, data = _run(tmp_path, "wide-greedy", "auto,ordinary,continuous/2")
    _check_rows(result, data, "wide-greedy")
    rows = {r["candidate"]: r for r in data["rows"]}
    assert set(rows) == {"auto", "ordinary", "continuous-32"}  # 16 prompts x n=4: slots 64 / 2
    assert rows["continuous-32"]["route"] == "continuous" and rows["ordinary"]["route"] == "ordinary"
    assert all(r["len_max"] == r["budget"] for r in rows.values())  # EOS off: every row runs to the budget
    assert rows["auto"]["auto_choice"] and rows["auto"]["auto_vs_best"] is not None
    assert all(r["same_tokens"] for r in rows.values())  # fp32 greedy: every route gives the same tokens
    assert "wide-greedy" in format_table([RlRow(**r) for r in data["rows"]])


def test_end_to_end_longtail_uses_cached_eos_scale(tmp_path):
    """A cached scale is used as is (no calibration, the file unchanged); EOS ends rows early.
    ``--sequential``: each candidate alone, released before the next."""
    cell = select_cells("longtail-64-1024")[0].scaled(SCALE_DIVISORS["small"])
    key = scales.eos_key(scales.scale_key_prefix("tiny", torch.float32, "small"), cell)
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({key: {"scale": 64.0}}))
    result, data = _run(tmp_path, "longtail-64-1024", "auto,continuous/4", path, extra=["--sequential"])
    _check_rows(result, data, "longtail-64-1024")
    assert all(r["eos_scale"] == 64.0 and "sequential" in r["note"] for r in data["rows"])
    assert any(r["len_p50"] < r["budget"] for r in data["rows"])
    assert json.loads(path.read_text()) == {key: {"scale": 64.0}}


def test_merge_recomputes_across_shards_of_both_schemas(tmp_path, capsys):
    """A shard of today's schema and one written before it (flat ``decode_path``) merge into one table."""
    new = {"schema": 1, "meta": {"commit": "abc"},
           "rows": [dataclasses.asdict(RlRow("abc", "wide-greedy", "auto", wall_ms=90.0,
                                             stats={"decode.path": "graph"}))]}
    old = {"meta": {"commit": "abc", "torch": "2.11"},
           "rows": [{"source": "abc", "cell": "wide-greedy", "candidate": "ordinary", "wall_ms": 100.0,
                     "decode_path": "graph", "prefill_path": "varlen", "stats": {"num_slots": 256}}]}
    (tmp_path / "a.json").write_text(json.dumps(new))
    (tmp_path / "b.json").write_text(json.dumps(old))
    result = cli.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert result.rows[0].auto_vs_best == pytest.approx(0.9)
    assert result.rows[1].stats == {"decode.path": "graph", "prefill.path": "varlen", "cache.num_slots": 256}
    out = capsys.readouterr().out
    assert "wide-greedy" in out and "- / graph / varlen" in out


def test_seed004_rows_carry_their_roofline():
    """``benchmarks.suites --suite seed004`` with measured rates: each row's roofline is that of its workload
    (one sample per prompt, 16 greedy tokens each) and ``x_roofline`` its time over it."""
    model = tiny_model("qwen2", seed=0, max_position_embeddings=1024)
    rates = Rates(1e9, 1e12)
    tok = TinyTokenizer(pad_token_id=0, eos_token_id=None)
    rows = suites.suite_seed004(model, tok, "cpu", ["1x20+31x1"], repeats=1, rates=rates)
    expected = 1e3 * call_roofline_s([20] + [1] * 31, 1, [16] * 32, model_geometry(model), rates)
    assert {r.candidate for r in rows} >= {"ours_ordinary", "ours_auto", "ours_continuous"}
    for r in rows:
        assert r.extra["roofline_ms"] == pytest.approx(expected)
        assert r.extra["x_roofline"] == pytest.approx(r.e2e_ms / expected)
        assert r.extra["decode.path"] == "fast_eager" and r.extra["route"] in ("ordinary", "continuous")
    without = suites.suite_seed004(model, tok, "cpu", ["1x20+31x1"], repeats=1)
    assert all("x_roofline" not in r.extra for r in without)


def test_seed004_prefill_graph_candidate():
    """``--prefill-graph-tokens N`` adds Auto with ``kernels.prefill_graph_tokens=N`` as a candidate whose rows say
    how many prefill passes ran from a graph (none on the CPU: no variable-length attention)."""
    model = tiny_model("qwen2", seed=0, max_position_embeddings=1024)
    rows = suites.suite_seed004(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), "cpu", ["1x20+31x1"],
                                repeats=1, prefill_graph_tokens=0)
    by_name = {r.candidate: r for r in rows}
    assert by_name["ours_auto_prefill_graph_0"].extra["prefill.graph_passes"] == 0
    assert by_name["ours_auto"].extra["prefill.graph_passes"] == 0
    assert by_name["ours_auto_prefill_graph_0"].extra["same_tokens_as_ordinary"] is True


def test_trace_file_names():
    assert busy.trace_file(None, "capped", "auto") is None
    assert busy.trace_file("t", "longtail-64-1024", "auto kernels.decode_attention=sdpa,kernels.fused_kv_write=False") \
        == os.path.join("t", "longtail-64-1024--auto_kernels.decode_attention=sdpa_kernels.fused_kv_write=False.json")


def test_profile_busy_writes_the_trace_once(tmp_path):
    """``--trace-dir``: the profiled call's trace is written (a session saves its trace once, so the busy
    figure is read back from that file rather than from a second export) and holds the call's operators."""
    path = tmp_path / "cell--x.json"
    got = busy.profile_busy(lambda: torch.ones(64, 64) @ torch.ones(64, 64), "cpu", busy.BusyOptions(100_000),
                            trace_path=str(path))
    assert got == (None, "n/a (no GPU events recorded)")  # no "Trace is already saved"
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "aten::matmul" in names or "aten::mm" in names


def _fake_run(name, calls, new=8):
    def call(seed):
        calls.append((name, seed))
        mask = torch.ones(2, 3 + new)
        return types.SimpleNamespace(input_ids=mask.long(), attention_mask=mask, response_start_idx=torch.tensor([3]))
    return running.CandidateRun(Candidate(name, "ordinary"), call, None)


def test_run_interleaved_warms_every_seed_then_alternates_rounds():
    """The RL cell's calls go through the harness's rounds: each candidate's warm-up draws every seed of the rounds
    once, then rounds x y, y x, ... each drawing that round's seed; only the timed calls are recorded."""
    calls = []
    runs = [_fake_run("x", calls), _fake_run("y", calls)]
    running.run_interleaved(runs, "cpu", Rounds(3, seeds=2, base_seed=SAMPLING_SEED))
    base = SAMPLING_SEED
    assert calls == [("x", base), ("x", base + 1), ("y", base), ("y", base + 1),
                     ("x", base), ("y", base), ("y", base + 1), ("x", base + 1), ("x", base), ("y", base)]
    assert [len(r.walls_ms) for r in runs] == [3, 3] and runs[0].lengths == [[8, 8]] * 3


def test_a_candidate_with_its_own_warm_up_call():
    """DeepSpeed's warm-up is a short call (``UPSTREAM_WARMUP_TOKENS`` new tokens; it runs every row to the budget):
    a run's ``warm`` serves the warm-up only, its ``call`` every timed round."""
    calls = []
    run = _fake_run("full", calls)
    run.warm = _fake_run("warm", calls, new=2).call
    running.run_interleaved([run], "cpu", Rounds(2, base_seed=SAMPLING_SEED))
    assert [name for name, _ in calls] == ["warm", "full", "full"] and run.lengths == [[8, 8], [8, 8]]
    assert 0 < running.UPSTREAM_WARMUP_TOKENS < min(c.budget for c in CELLS)


def test_seeds_vary_the_drawn_tokens(tmp_path, monkeypatch):
    """``--seeds 2`` on a sampled cell (tiny model, CPU): the two timed calls of one candidate draw different tokens
    (seeds 1234 and 1235) and the rows record it; ``--seeds`` above ``--repeats`` is refused before any work."""
    drawn = []
    lengths_of = running.response_lengths
    monkeypatch.setattr(running, "response_lengths", lambda batch: drawn.append(batch.input_ids) or lengths_of(batch))
    out = tmp_path / "rows.json"
    cli.main(["--cells", "longtail-64-1024", "--scale", "small", "--max-prompts", "4", "--candidates", "ordinary",
              "--repeats", "2", "--seeds", "2", "--busy", "off", "--json", str(out),
              "--eos-scales", str(tmp_path / "scales.json")])
    data = json.loads(out.read_text())
    assert data["meta"]["seeds"] == 2
    (row,) = [r for r in data["rows"] if r["candidate"] == "ordinary"]
    assert row["seeds"] == 2 and row["status"] == "ok"
    assert len(row["walls_ms"]) == 2 and min(row["walls_ms"]) == pytest.approx(row["wall_ms_min"], abs=0.01)
    assert not torch.equal(drawn[-2], drawn[-1])  # the two timed calls (before them: the warm-up's)
    with pytest.raises(SystemExit):
        cli.main(["--cells", "wide-greedy", "--repeats", "1", "--seeds", "2"])


def test_the_top_p_long_tail_cell_reuses_the_long_tail_eos_scale():
    """Cell 9 is cell 3 with top-p 0.9: same prompts (family), and the same EOS-scale key, so the scales file of
    the earlier runs serves it without a calibration."""
    (plain,) = select_cells("longtail-64-1024")
    (top_p,) = select_cells("9")
    assert top_p.name == "longtail-64-1024-top-p" and top_p.top_p == 0.9 and plain.top_p == 1.0
    assert (top_p.family, top_p.prompt_lens, top_p.budget) == (plain.family, plain.prompt_lens, plain.budget)
    assert scales.eos_key("p", top_p) == scales.eos_key("p", plain)
