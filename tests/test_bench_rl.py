"""scripts/bench_rl.py (``bench_rollout.py --suite rl``) on the CPU.

Pure parts against hand-computed answers: the roofline (decode steps, prefill, one call), length statistics,
the union of GPU intervals, the nucleus size, the geometric scale search, cell / candidate selection, the
derived columns. End to end through ``bench_rollout.main(["--suite", "rl", ...])`` with the tiny model: the
JSON parses strictly, has every column, and each row's realised lengths are those of the returned batch.
"""

import dataclasses
import json
import math

import os
import types

import pytest
import torch

from rollout.testing import tiny_model
from scripts import bench_rl
from scripts.bench_rl import (CELLS, Candidate, ModelGeometry, RlRow, call_roofline_s, decode_roofline_s, derive,
                              length_stats, nucleus_sizes, plan_candidates, prefill_roofline_s, search_scale,
                              select_cells, slot_variants, union_length)

# weights 60 B, KV 10 B per token, 3 non-embedding + 2 lm_head params (10 FLOPs per token), 1 FLOP per key
GEO = ModelGeometry(weight_bytes=60, kv_bytes_per_token=10, nonembedding_params=3, lm_head_params=2,
                    attn_flops_per_key=1)


@pytest.mark.parametrize("prompts, lengths, bw, flops, expected", [
    # steps t=1,2; only row 1 is live (L=3 > t); context 3+1=4 then 5: bytes 100, 110; FLOPs 14, 15
    ([2, 3], [1, 3], 10.0, 1e12, 10.0 + 11.0),     # bandwidth-bound
    ([2, 3], [1, 3], 1e12, 1.0, 14.0 + 15.0),      # compute-bound
    ([3, 2], [3, 1], 10.0, 1e12, 21.0),            # row order does not matter
    # t=1: 3 rows live, context 3*1 + 3 = 6: bytes 120 -> 30 s at 4 B/s, FLOPs 3*10 + 6 = 36 -> 36 s
    # t=2: rows 0, 1 live, context 2*1 + 2*2 = 6: bytes 120 -> 30 s, FLOPs 2*10 + 6 = 26 -> 30 s (the max flips)
    ([1, 1, 1], [3, 3, 2], 4.0, 1.0, 36.0 + 30.0),
    ([5, 5], [1, 1], 1.0, 1.0, 0.0),               # every row ends at the prefill's token: no decode step
])
def test_decode_roofline(prompts, lengths, bw, flops, expected):
    assert decode_roofline_s(prompts, lengths, GEO, bw, flops) == pytest.approx(expected)


def test_decode_roofline_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="prompt_lens/response_lens"):
        decode_roofline_s([1, 2], [3], GEO, 1.0, 1.0)


@pytest.mark.parametrize("bw, flops, expected", [
    # FLOPs: P=2: 2*3*2 + 2*2 + 2*3/2 = 19; P=3: 2*3*3 + 4 + 3*4/2 = 28; total 47. Weight read 60 B.
    (10.0, 1.0, 47.0),   # compute-bound
    (10.0, 10.0, 6.0),   # one weight read (60 / 10) beats 4.7
])
def test_prefill_roofline(bw, flops, expected):
    assert prefill_roofline_s([2, 3], GEO, bw, flops) == pytest.approx(expected)


def test_call_roofline_expands_samples_but_prefills_each_prompt_once():
    # n=2: rows [p0, p0, p1, p1] = prompts [2, 2, 3, 3]; rows 1 and 3 live at t=1, 2: contexts 2+3+2*1 = 7 and
    # 2+3+2*2 = 9 -> bytes 130, 150 -> 13 + 15 s at 10 B/s; prefill: max(60 / 10, ~0) = 6 s
    assert call_roofline_s([2, 3], 2, [1, 3, 1, 3], GEO, 10.0, 1e12) == pytest.approx(13.0 + 15.0 + 6.0)


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
    assert bench_rl.busy_percent(intervals, 20.0) == pytest.approx(100.0 * expected / 20.0)


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
    intervals, _ = bench_rl.gpu_intervals(_Prof(events), max_events=10)
    assert intervals == [(0, 5), (10, 12), (20, 21)]
    skipped, why = bench_rl.gpu_intervals(_Prof(events), max_events=3)
    assert skipped is None and "skipped" in why


def test_profile_busy_without_gpu_events_says_na():
    run = bench_rl.CandidateRun(Candidate("x", "ordinary"), lambda: torch.ones(64, 64) @ torch.ones(64, 64), None,
                                walls_ms=[1.0])
    bench_rl.profile_busy(run, "cpu", max_events=100_000)
    assert run.busy == (None, "n/a (no GPU events recorded)")


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
    assert _names(plan_candidates(wide, None, False, None, upstream=True)) == [
        "auto", "ordinary", "continuous-256", "continuous-128", "continuous-64", "deepspeed"]
    assert _names(plan_candidates(wide, {"continuous/2", "auto"}, False, None, upstream=False)) == [
        "auto", "continuous-128"]
    old = plan_candidates(capped, None, False, 9.0, upstream=True)  # DeepSpeed has no KV budget: not here
    assert _names(old) == ["auto", "continuous-128"]
    assert old[0].slots == 128 and "emulated" in old[0].note and old[0].max_cache_gib is None
    new = plan_candidates(capped, None, True, 9.0, upstream=False)
    assert new[0].slots is None and all(c.max_cache_gib == 9.0 for c in new)


def test_sampler_ab_twins_only_top_p_cells():
    """``--sampler-ab``: each candidate of a top-p cell gets a twin with ``fused_sampler=False`` (same route,
    slots and cap), DeepSpeed none; greedy cells get no twins."""
    sampled, greedy = select_cells("wide-sampled")[0], select_cells("wide-greedy")[0]
    cands = plan_candidates(sampled, {"auto", "continuous/1", "deepspeed"}, True, None, upstream=True, sampler_ab=True)
    assert _names(cands) == ["auto", "continuous-256", "auto +search", "continuous-256 +search", "deepspeed"]
    assert cands[3].slots == 256 and cands[3].config == (("fused_sampler", False),) and cands[1].config == ()
    assert len(plan_candidates(greedy, None, False, None, upstream=False, sampler_ab=True)) == 5


def test_twins_of_any_config_field():
    greedy = select_cells("wide-greedy")[0]
    cands = plan_candidates(greedy, {"auto", "ordinary"}, True, None, upstream=False,
                            twins=((("fuse_qkv", False),), (("decode_attention", "sdpa"), ("fused_kv_write", False))))
    assert _names(cands) == ["auto", "ordinary", "auto fuse_qkv=False", "ordinary fuse_qkv=False",
                             "auto decode_attention=sdpa,fused_kv_write=False",
                             "ordinary decode_attention=sdpa,fused_kv_write=False"]
    assert cands[3].route == "ordinary" and cands[3].config == (("fuse_qkv", False),)
    assert cands[5].config == (("decode_attention", "sdpa"), ("fused_kv_write", False))
    args = bench_rl.parse_args(["--twin", "fuse_qkv=False", "--twin", "decode_attention='sdpa'; fused_kv_write=False",
                                "--cells", "wide-greedy"])
    assert args.twins == ((("fuse_qkv", False),), (("decode_attention", "sdpa"), ("fused_kv_write", False)))
    for bad in ("no_such_field=1", "fuse_qkv", "fuse_qkv=maybe", "fuse_qkv=False;compile"):
        with pytest.raises(SystemExit):
            bench_rl.parse_args(["--twin", bad])


@pytest.mark.parametrize("slots, longest, budget, kv, columns", [
    (128, 1024, 1024, 36864, 4096),   # 3B: 2 x 2047 -> 4096 columns, 18.0 GiB
    (128, 64, 64, 512, 256),          # tiny --scale small: 2 x 127 = 254 -> 256
])
def test_cap_gib_allows_the_slots_and_no_more(slots, longest, budget, kv, columns):
    cap_bytes = int(bench_rl.cap_gib_for_slots(slots, longest, budget, kv) * 2 ** 30)
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
    assert "by x roof 1.053 (best ordinary)" in bench_rl.format_table(rows)
    assert rows[1].vs_deepspeed == pytest.approx(0.3) and rows[3].vs_deepspeed is None


def test_scaled_weights_restore_exactly():
    model = tiny_model("qwen2", seed=0)
    head = model.get_output_embeddings().weight
    norm = bench_rl.final_norm(model).weight
    before_head, before_norm = head.detach().clone(), norm.detach().clone()
    with bench_rl.scaled_weights(model, 3.7, 1.9):
        assert torch.allclose(head[bench_rl.EOS_ID], before_head[bench_rl.EOS_ID] * 3.7)
        assert torch.equal(head[3], before_head[3])
        assert torch.allclose(norm, before_norm * 1.9)
    assert torch.equal(head, before_head) and torch.equal(norm, before_norm)


def _strict(path) -> dict:
    def refuse(name):
        raise ValueError(f"non-finite constant {name} in {path}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def _run(tmp_path, cell: str, candidates: str, scales=None, max_prompts=16, extra=()):
    from scripts.bench_rollout import main as rollout_main

    out = tmp_path / f"{cell}.json"
    argv = ["--suite", "rl", "--model", "tiny", "--device", "cpu", "--scale", "small", "--cells", cell,
            "--candidates", candidates, "--repeats", "1", "--json", str(out), "--commit-label", "test",
            "--max-prompts", str(max_prompts), *extra]
    if scales is not None:
        argv += ["--eos-scales", str(scales)]
    return rollout_main(argv), _strict(out)


def _check_rows(result, data, cell):
    assert set(data["meta"]) >= {"date", "gpu", "torch", "transformers", "commit", "bw_gbps", "gemm_tflops",
                                 "command"}
    assert data["rows"] and all(set(r) == set(bench_rl.ROW_FIELDS) for r in data["rows"])
    for row in data["rows"]:
        assert row["status"] == "ok", row
        lengths = bench_rl.response_lengths(result.batches[(cell, row["candidate"])])
        stats = length_stats(lengths)
        assert (row["len_mean"], row["len_p50"], row["len_p90"], row["len_max"]) == (
            stats["mean"], stats["p50"], stats["p90"], stats["max"])
        assert row["response_tokens"] == sum(lengths)
        assert row["roofline_ms"] > 0 and math.isfinite(row["x_roofline"])
        assert row["gpu_busy_pct"] is None and row["peak_gib"] is None  # CPU: n/a


def test_end_to_end_wide_greedy(tmp_path):
    result, data = _run(tmp_path, "wide-greedy", "auto,ordinary,continuous/2")
    _check_rows(result, data, "wide-greedy")
    rows = {r["candidate"]: r for r in data["rows"]}
    assert set(rows) == {"auto", "ordinary", "continuous-32"}  # 16 prompts x n=4: slots 64 / 2
    assert rows["continuous-32"]["route"] == "continuous" and rows["ordinary"]["route"] == "ordinary"
    assert all(r["len_max"] == r["budget"] for r in rows.values())  # EOS off: every row runs to the budget
    assert rows["auto"]["auto_choice"] and rows["auto"]["auto_vs_best"] is not None
    assert all(r["same_tokens"] for r in rows.values())  # fp32 greedy: every route gives the same tokens
    assert "wide-greedy" in bench_rl.format_table([RlRow(**r) for r in data["rows"]])


def test_end_to_end_longtail_uses_cached_eos_scale(tmp_path):
    """A cached scale is used as is (no calibration, the file unchanged); EOS ends rows early.
    ``--sequential``: each candidate alone, released before the next."""
    cell = select_cells("longtail-64-1024")[0].scaled(bench_rl.SCALE_DIVISORS["small"])
    prefix = bench_rl.scale_key_prefix("tiny", torch.float32, "small")
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({bench_rl.eos_key(prefix, cell): {"scale": 64.0}}))
    result, data = _run(tmp_path, "longtail-64-1024", "auto,continuous/4", scales, extra=["--sequential"])
    _check_rows(result, data, "longtail-64-1024")
    assert all(r["eos_scale"] == 64.0 and "sequential" in r["note"] for r in data["rows"])
    assert any(r["len_p50"] < r["budget"] for r in data["rows"])
    assert json.loads(scales.read_text()) == {bench_rl.eos_key(prefix, cell): {"scale": 64.0}}


def test_merge_recomputes_across_shards(tmp_path, capsys):
    shard = {"meta": {"commit": "abc"}, "rows": []}
    for name, ms in (("auto", 90.0), ("ordinary", 100.0)):
        shard["rows"].append(dataclasses.asdict(RlRow("abc", "wide-greedy", name, wall_ms=ms)))
    (tmp_path / "a.json").write_text(json.dumps({**shard, "rows": shard["rows"][:1]}))
    (tmp_path / "b.json").write_text(json.dumps({**shard, "rows": shard["rows"][1:]}))
    result = bench_rl.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert result.rows[0].auto_vs_best == pytest.approx(0.9)
    assert "wide-greedy" in capsys.readouterr().out


def test_seed004_rows_carry_their_roofline():
    """``bench_rollout --suite seed004`` with measured rates: each row's roofline is that of its workload
    (one sample per prompt, 16 greedy tokens each) and ``x_roofline`` its time over it."""
    from rollout.testing import TinyTokenizer, tiny_model
    from scripts import bench_rollout

    model = tiny_model("qwen2", seed=0, max_position_embeddings=1024)
    geo = bench_rl.model_geometry(model)
    rates = (1e9, 1e12)
    rows = bench_rollout.suite_seed004(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), "cpu", 1, False,
                                       ["1x20+31x1"], rates=rates)
    expected = 1e3 * bench_rl.call_roofline_s([20] + [1] * 31, 1, [16] * 32, geo, *rates)
    assert {r.candidate for r in rows} >= {"ours_ordinary", "ours_auto", "ours_continuous"}
    for r in rows:
        assert r.extra["roofline_ms"] == pytest.approx(expected)
        assert r.extra["x_roofline"] == pytest.approx(r.e2e_ms / expected)
    without = bench_rollout.suite_seed004(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), "cpu", 1, False,
                                          ["1x20+31x1"])
    assert all("x_roofline" not in r.extra for r in without)


def test_seed004_prefill_graph_candidate():
    """``--prefill-graph-tokens N`` adds Auto with ``RolloutConfig.kernels.prefill_graph_tokens=N`` as a candidate whose
    rows say how many prefill passes ran from a graph (none on the CPU: no variable-length attention)."""
    from rollout.testing import TinyTokenizer, tiny_model
    from scripts import bench_rollout

    model = tiny_model("qwen2", seed=0, max_position_embeddings=1024)
    rows = bench_rollout.suite_seed004(model, TinyTokenizer(pad_token_id=0, eos_token_id=None), "cpu", 1, False,
                                       ["1x20+31x1"], prefill_graph_tokens=0)
    by_name = {r.candidate: r for r in rows}
    assert by_name["ours_auto_prefill_graph_0"].extra["prefill_graph_passes"] == 0
    assert by_name["ours_auto"].extra["prefill_graph_passes"] == 0
    assert by_name["ours_auto_prefill_graph_0"].extra["same_tokens_as_ordinary"] is True


def test_trace_file_names():
    assert bench_rl.trace_file(None, "capped", "auto") is None
    assert bench_rl.trace_file("t", "longtail-64-1024", "auto decode_attention=sdpa,fused_kv_write=False") == \
        os.path.join("t", "longtail-64-1024--auto_decode_attention=sdpa_fused_kv_write=False.json")


def test_profile_busy_writes_the_trace_once(tmp_path):
    """``--trace-dir``: the profiled call's trace is written (a session saves its trace once, so the busy
    figure is read back from that file rather than from a second export) and holds the call's operators."""
    run = bench_rl.CandidateRun(Candidate("x", "ordinary"), lambda: torch.ones(64, 64) @ torch.ones(64, 64), None,
                                walls_ms=[1.0])
    path = tmp_path / "cell--x.json"
    bench_rl.profile_busy(run, "cpu", max_events=100_000, trace_path=str(path))
    assert "profiler" not in run.busy[1], run.busy  # no "Trace is already saved"
    assert run.busy == (None, "n/a (no GPU events recorded)")
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "aten::matmul" in names or "aten::mm" in names


def test_timed_rounds_alternate_their_order(monkeypatch):
    """Rounds run A B C, then C B A, ...: no candidate always follows the same one (bench_rollout.interleave
    and bench_rl.run_interleaved); the warm-up runs each once first."""
    from scripts import bench_rollout
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    means = bench_rollout.interleave(candidates, "cpu", repeats=3)
    assert "".join(calls) == "ABC" + "ABC" + "CBA" + "ABC"
    assert set(means) == set("ABC")

    order = []
    monkeypatch.setattr(bench_rl, "measure",
                        lambda run, others, device, record, seed=None: order.append((run.name, record, seed)))
    runs = [types.SimpleNamespace(name=name) for name in "xy"]
    bench_rl.run_interleaved(runs, "cpu", repeats=2, busy=False, max_events=0)
    assert order == [("x", False, None), ("y", False, None), ("x", True, None), ("y", True, None),
                     ("y", True, None), ("x", True, None)]
    order.clear()  # --seeds 2: every candidate of a round draws with that round's seed
    bench_rl.run_interleaved(runs, "cpu", repeats=3, busy=False, max_events=0, seeds=2)
    base = bench_rl.SAMPLING_SEED
    assert [(name, seed) for name, record, seed in order if record] == [
        ("x", base), ("y", base), ("y", base + 1), ("x", base + 1), ("x", base), ("y", base)]
    # the warm-up draws every seed of the rounds once per candidate, before any timed call
    assert order[:4] == [("x", False, base), ("x", False, base + 1), ("y", False, base), ("y", False, base + 1)]


def test_seeds_vary_the_drawn_tokens(tmp_path, monkeypatch):
    """``--seeds 2`` on a sampled cell (tiny model, CPU): the two timed calls of one candidate draw different tokens
    (seeds 1234 and 1235) and the rows record it; ``--seeds`` above ``--repeats`` is refused before any work."""
    drawn = []
    lengths_of = bench_rl.response_lengths
    monkeypatch.setattr(bench_rl, "response_lengths", lambda batch: drawn.append(batch.input_ids) or lengths_of(batch))
    out = tmp_path / "rows.json"
    bench_rl.main(["--cells", "longtail-64-1024", "--scale", "small", "--max-prompts", "4", "--candidates", "ordinary",
                   "--repeats", "2", "--seeds", "2", "--busy", "off", "--json", str(out),
                   "--eos-scales", str(tmp_path / "scales.json")])
    data = json.loads(out.read_text())
    assert data["meta"]["seeds"] == 2
    (row,) = [r for r in data["rows"] if r["candidate"] == "ordinary"]
    assert row["seeds"] == 2 and row["status"] == "ok"
    assert len(row["walls_ms"]) == 2 and min(row["walls_ms"]) == pytest.approx(row["wall_ms_min"], abs=0.01)
    assert not torch.equal(drawn[-2], drawn[-1])  # the two timed calls (before them: the EOS calibration's)
    with pytest.raises(SystemExit):
        bench_rl.main(["--cells", "wide-greedy", "--repeats", "1", "--seeds", "2"])


def test_the_top_p_long_tail_cell_reuses_the_long_tail_eos_scale():
    """Cell 9 is cell 3 with top-p 0.9: same prompts (family), and the same EOS-scale key, so the scales file of
    the earlier runs serves it without a calibration."""
    (plain,) = select_cells("longtail-64-1024")
    (top_p,) = select_cells("9")
    assert top_p.name == "longtail-64-1024-top-p" and top_p.top_p == 0.9 and plain.top_p == 1.0
    assert (top_p.family, top_p.prompt_lens, top_p.budget) == (plain.family, plain.prompt_lens, plain.budget)
    assert bench_rl.eos_key("p", top_p) == bench_rl.eos_key("p", plain)


def test_a_candidate_with_its_own_warm_up_call():
    """DeepSpeed's warm-up is a short call (``UPSTREAM_WARMUP_TOKENS`` new tokens; it runs every row to the budget):
    a run's ``warm`` serves the warm-up only, its ``call`` every timed round."""
    calls = []

    def batch(kind, new):
        def call(seed=bench_rl.SAMPLING_SEED):
            calls.append(kind)
            mask = torch.ones(2, 3 + new)
            return types.SimpleNamespace(input_ids=mask.long(), attention_mask=mask, response_start_idx=torch.tensor([3]))
        return call

    run = bench_rl.CandidateRun(Candidate("deepspeed", "deepspeed"), batch("full", 8), None, warm=batch("warm", 2))
    bench_rl.run_interleaved([run], "cpu", repeats=2, busy=False, max_events=0)
    assert calls == ["warm", "full", "full"] and run.lengths == [[8, 8], [8, 8]]
    assert 0 < bench_rl.UPSTREAM_WARMUP_TOKENS < min(c.budget for c in CELLS)


def test_a_seeded_call_draws_with_its_seed():
    calls = []
    run = bench_rl.CandidateRun(Candidate("x", "ordinary"), lambda seed=bench_rl.SAMPLING_SEED: calls.append(seed),
                                None)
    bench_rl.measure(run, [], "cpu", record=False, seed=77)
    bench_rl.measure(run, [], "cpu", record=False)
    assert calls == [77, bench_rl.SAMPLING_SEED]
