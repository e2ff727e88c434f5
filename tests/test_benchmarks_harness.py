"""benchmarks.harness: the rounds (order, seeds, warm-up before timing; a fake clock, no timing), the result files
(round trip, atomic write, every older file under docs/results/), the table printer, and the layout rules of the
benchmarks (every module runs as ``python -m``)."""

import json
import pathlib
from dataclasses import dataclass, field
from typing import Optional

import pytest

from benchmarks.harness import results
from benchmarks.harness.meta import header, run_meta
from benchmarks.harness.rounds import Rounds, Timer, round_order, run_rounds, schedule, time_rounds
from benchmarks.harness.table import fmt, markdown_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"


# ---- rounds -----------------------------------------------------------------------------------------------------
def test_round_order_alternates():
    assert [round_order("ABC", r) for r in range(4)] == [list("ABC"), list("CBA"), list("ABC"), list("CBA")]


def test_the_schedule_warms_up_every_candidate_then_alternates_rounds():
    calls = [(c.item, c.seed, c.round) for c in schedule(["A", "B", "C"], Rounds(3))]
    assert calls == [("A", None, None), ("B", None, None), ("C", None, None),
                     ("A", None, 0), ("B", None, 0), ("C", None, 0),
                     ("C", None, 1), ("B", None, 1), ("A", None, 1),
                     ("A", None, 2), ("B", None, 2), ("C", None, 2)]


def test_round_r_draws_base_plus_r_mod_k_for_every_candidate_and_the_warm_up_draws_each_seed():
    rounds = Rounds(5, warmup=1, seeds=3, base_seed=100)
    calls = schedule(["A", "B"], rounds)
    warm = [(c.item, c.seed) for c in calls if not c.timed]
    assert warm == [("A", 100), ("A", 101), ("A", 102), ("B", 100), ("B", 101), ("B", 102)]
    timed = [(c.round, c.item, c.seed) for c in calls if c.timed]
    assert timed == [(0, "A", 100), (0, "B", 100), (1, "B", 101), (1, "A", 101), (2, "A", 102), (2, "B", 102),
                     (3, "B", 100), (3, "A", 100), (4, "A", 101), (4, "B", 101)]
    assert [c.seed for c in schedule(["A"], Rounds(2, warmup=2, base_seed=7))] == [7, 7, 7, 7]  # one seed: always it
    assert [c.timed for c in schedule(["A"], Rounds(2, warmup=0))] == [True, True]


@pytest.mark.parametrize("kwargs, words", [
    (dict(rounds=0), "rounds"), (dict(rounds=2, warmup=-1), "warmup"), (dict(rounds=2, seeds=3, base_seed=1), "seeds"),
    (dict(rounds=2, seeds=2), "base_seed"),
])
def test_rounds_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Rounds(**kwargs)


def test_no_clock_is_read_before_the_warm_up_has_run():
    """A fake clock and fake candidates log into one list: every warm-up call comes before the first clock read,
    and each timed call sits between two reads, after a device sync."""
    log = []
    now = iter(range(100))

    def clock():
        log.append("clock")
        return float(next(now))

    timer = Timer(clock=clock, sync=lambda: log.append("sync"))
    candidates = {name: (lambda name=name: log.append(name)) for name in "AB"}
    times = time_rounds(candidates, Rounds(2), timer)
    assert log[:2] == ["A", "B"]
    assert log[2:] == ["sync", "clock", "A", "sync", "clock"] + ["sync", "clock", "B", "sync", "clock"] * 2 + \
        ["sync", "clock", "A", "sync", "clock"]
    assert set(times) == {"A", "B"} and [len(v) for v in times.values()] == [2, 2]


def test_time_rounds_hands_each_candidate_its_round_seed():
    seen = []
    time_rounds({"A": seen.append}, Rounds(3, seeds=2, base_seed=10), Timer(clock=lambda: 0.0, sync=lambda: None))
    assert seen == [10, 11, 10, 11, 10]  # warm-up: both seeds; then rounds 0, 1, 2


def test_run_rounds_tells_the_benchmark_which_calls_are_timed():
    got = []
    run_rounds(["x", "y"], Rounds(2, base_seed=5), lambda item, seed, timed: got.append((item, seed, timed)))
    assert got == [("x", 5, False), ("y", 5, False), ("x", 5, True), ("y", 5, True), ("y", 5, True), ("x", 5, True)]


# ---- result files ---------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    name: str
    ms: Optional[float] = None
    stats: dict = field(default_factory=dict)


def test_result_file_round_trip(tmp_path):
    meta = run_meta("demo", ["--rows", "8"], "cpu", rows=8)
    path = tmp_path / "sub" / "r.json"
    rows = [_Row("a", 1.5, {"decode.path": "graph"}), _Row("b", float("nan"))]
    results.write(str(path), meta, rows)
    raw = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-finite {c}"))
    assert raw["schema"] == results.SCHEMA == 1 and set(raw) == {"schema", "meta", "rows"}
    assert raw["meta"]["command"] == ["python", "-m", "benchmarks.demo", "--rows", "8"]
    assert set(raw["meta"]["versions"]) >= {"python", "torch", "cuda", "transformers", "triton", "deepspeed"}
    doc = results.read(str(path))
    assert doc.schema == 1 and doc.meta == raw["meta"]
    assert results.rows_of(_Row, doc) == [_Row("a", 1.5, {"decode.path": "graph"}), _Row("b", None)]
    assert list(tmp_path.glob("sub/*.tmp*")) == []  # the temporary file was renamed over the result
    assert header(doc.meta).startswith("# demo: ")


def test_a_newer_schema_or_a_file_without_rows_is_refused(tmp_path):
    with pytest.raises(ValueError, match="newer"):
        results.parse({"schema": 2, "meta": {}, "rows": []})
    with pytest.raises(ValueError, match="no list of rows"):
        results.read(str(DOCS / "h200-2026-12-01" / "rl-scales-3b.json"))


def test_old_rows_get_todays_call_stats_names():
    row = {"cell": "c", "decode_path": "graph", "prefill_path": "varlen", "route": "ordinary",
           "stats": {"num_slots": 512, "cache_capacity": 2042, "graph_decode_steps": 680, "route_reason": "x"},
           "extra": {"prefill_forwards": 1, "tokens_per_s": 9.0}}
    assert results.upgrade_row(row) == {
        "cell": "c", "route": "ordinary",
        "stats": {"decode.path": "graph", "prefill.path": "varlen", "cache.num_slots": 512, "cache.capacity": 2042,
                  "decode.graph_steps": 680, "route_reason": "x"},
        "extra": {"prefill.forwards": 1, "tokens_per_s": 9.0}}


#: Result files of three dates (two older schemas: the RL suite's ``{meta, rows}``, bench_rollout's bare list).
OLD_FILES = {
    "h200-2026-12-01/rl-base-80a6322.json": ("80a6322", 9),
    "h200-2026-12-02d/rl-auto-seeds-d660b3d.json": ("d660b3d", 3),
    "h200-2026-12-02e/rl-capped-experiments.json": ("9e62fec", 3),
}


@pytest.mark.parametrize("name", sorted(OLD_FILES))
def test_the_rl_files_of_three_dates_merge(name):
    from benchmarks.rl.rows import RlRow, load_rows

    label, count = OLD_FILES[name]
    rows = load_rows([str(DOCS / name)])
    assert len(rows) == count and all(isinstance(r, RlRow) and r.source == label for r in rows)
    ok = [r for r in rows if r.status == "ok"]
    assert ok and all(r.stats["decode.path"] == "graph" and r.stats["prefill.path"] == "varlen" for r in ok)
    assert all("decode_path" not in r.stats and "num_steps" not in r.stats for r in ok)  # renamed: decode.num_steps
    assert all(r.stats["decode.num_steps"] > 0 for r in ok)
    meta = results.read(str(DOCS / name)).meta
    assert meta["versions"]["torch"] == "2.11.0+cu130" and meta["copy_gbps"] > 4000


def _result_files() -> list[str]:
    found = []
    for path in sorted(DOCS.rglob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, list) or (isinstance(data, dict) and isinstance(data.get("rows"), list)):
            found.append(str(path.relative_to(DOCS)))
    return found


@pytest.mark.parametrize("name", _result_files())
def test_every_result_file_under_docs_results_reads(name):
    """Files written before the schema read as schema 0, today's as :data:`results.SCHEMA`; either way no row keeps a
    ``CallStats`` name from before 0.2."""
    doc = results.read(str(DOCS / name))
    written = json.loads((DOCS / name).read_text())
    ours = isinstance(written, dict) and written.get("schema") == results.SCHEMA  # an int: today's harness wrote it
    assert doc.schema == (results.SCHEMA if ours else 0)
    assert doc.rows and all(isinstance(r, dict) for r in doc.rows)
    flat = [k for r in doc.rows for part in (r, r.get("stats") or {}, r.get("extra") or {}) for k in part
            if k in ("decode_path", "prefill_path", "num_slots", "prefill_forwards", "graph_decode_steps")]
    assert flat == []


# ---- table ----------------------------------------------------------------------------------------------------------
def test_the_table_printer():
    """Markdown through the project's one formatter (instrumentation.table): label columns left, number columns
    right, a missing figure as ``-``, ``|`` escaped."""
    table = markdown_table(["variant", "rows", "ms", "note"],
                           [["eager", 32, fmt(1.23456), None], ["graph | compiled", 256, None, "ok\nfine"]])
    assert table.splitlines() == [
        "| variant | rows | ms | note |",
        "| --- | ---: | ---: | --- |",
        "| eager | 32 | 1.235 | - |",
        "| graph \\| compiled | 256 | - | ok fine |",
    ]
    assert (fmt(True), fmt(float("nan")), fmt(2.0, ".0f"), fmt("x")) == ("yes", "-", "2", "x")
    with pytest.raises(ValueError, match="one per column"):
        markdown_table(["a"], [[1, 2]])


# ---- layout ----------------------------------------------------------------------------------------------------------
BENCHMARKS = ["ab", "call_memory", "decode_step", "gemm_algos", "gemm_layouts", "jsd", "keep_cache", "multigpu", "optimizer",
              "overhead", "planner", "postprocess", "profiler_cost", "rl", "sampler", "step", "suites", "trace_summary"]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_as_a_module(name):
    """``python -m benchmarks.<name>``: a module (or package with ``__main__``) whose ``main(argv=None)`` runs under
    a ``__main__`` guard."""
    import ast

    path = ROOT / "benchmarks" / name
    source = (path / "__main__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    tree = ast.parse(source)
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards and "main(" in ast.unparse(guards[0])


def test_gemm_layouts_table_pairs_each_layout_with_its_kept_copy():
    """``benchmarks.gemm_layouts``' table: one line per projection, rows and backend, today's ms over the kept copy's."""
    from benchmarks import gemm_layouts as g

    rows = [{"projection": "down", "rows": 256, "backend": b, "layout": layout, "ms": ms, "max_diff": 0.0}
            for b, layout, ms in (("cublaslt", g.TODAY, 0.9), ("cublaslt", g.KEPT, 1.0), ("cublas", g.KEPT, 0.5),
                                  ("cublas", g.TODAY, 1.0))]
    lines = g.table(rows).splitlines()
    assert len(lines) == 4 and "today / kept" in lines[0]
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["cublaslt", "cublas"]
    assert [line.split("|")[6].strip() for line in lines[2:]] == ["0.900", "2.000"]


def test_gemm_algos_table_picks_the_fastest_candidate_within_tolerance():
    """``benchmarks.gemm_algos``' table: per projection and rows, PyTorch's ms, the heuristic's first choice, and the
    fastest candidate whose product stays within the tolerance of PyTorch's (a faster wrong one is skipped)."""
    from benchmarks import gemm_algos as g

    cfg = {"algo": 66, "tile": 20, "stages": 8, "splitk": 1, "reduction": 0, "swizzle": 0, "cluster": 2, "custom": 0}
    rows = [{"projection": "down", "rows": 256, "source": source, "ms": ms, "torch_ms": 0.9, "max_diff": diff,
             **cfg, "splitk": splitk}
            for source, ms, diff, splitk in (("heuristic 0", 0.91, 0.0, 1), ("heuristic 3", 0.5, 1.0, 1),
                                             ("heuristic 1, split-K 4 reduction 2", 0.72, 0.01, 4))]
    rows[0]["tuned_pick"] = "heuristic 1, split-K 4 reduction 2"
    rows.append({**rows[0], "projection": "o", "ms": 0.3, "torch_ms": 0.25, "tuned_pick": "heuristic 0"})
    lines = g.table(rows, tolerance=0.05).splitlines()
    assert len(lines) == 4 and "best / torch" in lines[0]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert [c[0] for c in cells] == ["o", "down"]
    assert cells[1][3:7] == ["0.910", "0.720", "0.800", "heuristic 1, split-K 4 reduction 2"]
    assert "split-K 4" in cells[1][7] and cells[1][8] == "3"
    assert cells[1][9:] == ["heuristic 1, split-K 4 reduction 2", "0.720"] and cells[0][9:] == ["heuristic 0", "0.300"]
    assert cells[0][5] == "1.200"


def test_scripts_keep_only_what_users_run():
    assert sorted(p.name for p in (ROOT / "scripts").glob("*.py")) == [
        "__init__.py", "calibrate_prefill.py", "check_kernels.py", "demo_rollout.py", "summarize_trace.py",
        "train_opsd.py", "trim_trace.py"]
    assert [p for p in (ROOT / "scripts").glob("*.py") if "sys.path.insert" in p.read_text()
            and p.name not in ("train_opsd.py", "check_kernels.py")] == []
    assert [p for p in (ROOT / "benchmarks").rglob("*.py") if "sys.path.insert" in p.read_text()] == []


_AB_COMMAND = ("import json, os, sys; json.dump([{'suite': 's', 'cell': 'c', 'candidate': os.path.basename(os.getcwd()),"
               " 'e2e_ms': 2.0 if 'new' in os.getcwd() else 1.0}], open(sys.argv[2], 'w'))")


def test_ab_runs_the_command_in_each_tree_in_alternating_rounds(tmp_path, capsys):
    from benchmarks import ab

    for name in ("old", "new"):
        (tmp_path / name).mkdir()
    rows = ab.main(["--tree", f"old={tmp_path / 'old'}", "--tree", f"new={tmp_path / 'new'}", "--rounds", "3",
                    "--out", str(tmp_path / "ab"), "--", "-c", _AB_COMMAND])
    out = capsys.readouterr().out
    rounds = [line.split(":")[0] for line in out.splitlines() if line.startswith("# ")]
    assert rounds == ["# old round 0", "# new round 0", "# new round 1", "# old round 1", "# old round 2",
                      "# new round 2"]
    assert [(r.candidate, r.ms) for r in rows] == [("old", {"old": [1.0] * 3}), ("new", {"new": [2.0] * 3})]
    doc = results.read(str(tmp_path / "ab" / "ab.json"))
    assert doc.meta["rounds"] == 3 and len(doc.rows) == 2
    assert "| s | c | old | 1.00 (1.00-1.00; n=3) | - | - |" in out
