"""Issue 33's targets on a real GPU trace with work records: the 3B small step on an H200, recorded with this code.

``tests/data/traces/h200_small_step/`` holds one step (step 3) of
``OPSD_PROFILE=1 OPSD_PROFILE_STEPS=2-3 scripts/train_opsd.py --student qwen25-3b --teacher qwen25-3b --batch-size 4
--samples-per-prompt 4 --max-new-tokens 64 --prompt-len 64 --steps 5`` (2026-12-03, H200, torch 2.11, the packed
path), cut by ``scripts/trim_trace.py --step 3``, and the run's work sidecar ``rank0.work.jsonl`` (rates measured on
the device). The step met a new token count: a compiled piece of the student recompiled in it (442 ms of host time in
one call), which the report must name by itself.

The rooflines are recomputed here from the model's shape (``rollout.testing.QWEN25_3B_SHAPE``, counted by hand)
and the sidecar's token counts, independently of ``instrumentation.work``; the headline against a plain union of
the GPU ops and against HTA (``tests/test_traces_h200.py``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.testing import QWEN25_3B_SHAPE
from tests.test_traces_h200 import check_against_hta, read_raw, union

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "data" / "traces" / "h200_small_step"
(TRACE,) = sorted(RUN.glob("*.pt.trace.json.gz")) or (RUN / "missing.pt.trace.json.gz",)
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE.name} not recorded yet")
STEP = 3


def shape_figures() -> dict:
    """Parameters and bytes of the 3B shape counted from its config (bf16; q, k, v with biases; tied head)."""
    s = QWEN25_3B_SHAPE
    h, inter, layers, heads, kv = (s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"],
                                   s["num_attention_heads"], s["num_key_value_heads"])
    head_dim = h // heads
    per_layer = (h * h + h) + 2 * (h * kv * head_dim + kv * head_dim) + h * h + 3 * h * inter + 2 * h
    nonembedding = layers * per_layer + h
    embedding = s["vocab_size"] * h
    return {"nonembedding": nonembedding, "head": embedding, "weight_bytes": 2 * (nonembedding + embedding),
            "kv_bytes_per_token": 2 * layers * kv * head_dim * 2, "attn_per_key": 4 * layers * heads * head_dim}


@pytest.fixture(scope="module")
def work() -> dict:
    lines = [json.loads(line) for line in (RUN / "rank0.work.jsonl").read_text().splitlines()]
    return {w["stage"]: w for w in lines if w["step"] == STEP}


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize_trace.py"), str(RUN),
                           "--format", "json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    return doc, {s["name"]: s for s in doc["stages"]}


def test_the_trace_is_small_and_its_rates_were_measured(work):
    assert TRACE.stat().st_size <= 5 * 1024 * 1024
    assert {w["peak_flops_source"] for w in work.values()} == {"measured"}
    assert {w["copy_bytes_source"] for w in work.values()} == {"measured"}


def test_the_weights_recorded_are_the_shapes(work):
    assert work["teacher_forward"]["bytes"] == shape_figures()["weight_bytes"]


def _roofline_ms(flops: float, num_bytes: float, w: dict) -> float:
    return 1e3 * max(flops / w["peak_flops_s"], num_bytes / w["copy_bytes_s"])


@pytest.mark.parametrize("stage", ["teacher_forward", "student_forward"])
def test_the_passes_x_roofline_equals_the_shapes_within_5_percent(work, report, stage):
    """A packed pass (its head runs in the loss): 2 x non-embedding parameters per real token; attention is the
    rest (< 1% at these lengths), so leaving it out must stay within 5%."""
    w, row = work[stage], report[1][f"opsd/{stage}"]
    expected = _roofline_ms(2 * shape_figures()["nonembedding"] * w["tokens"], shape_figures()["weight_bytes"], w)
    assert row["work"]["roofline_ms"] == pytest.approx(expected, rel=0.05)
    assert row["work"]["x_roofline"] == pytest.approx(row["gpu_ms"]["total"] / expected, rel=0.05)
    assert row["work"]["limit"] == "compute"


def test_decodes_x_roofline_equals_the_shapes_within_5_percent(work, report):
    """Every row ran to the budget (tokens = rows x 63 steps): at step t each of the 16 rows reads its prompt and t
    tokens of keys and values, and every step reads the weights once."""
    f, w, prefill = shape_figures(), work["decode"], work["prefill"]
    rows, steps = w["rows"], w["tokens"] // w["rows"]
    assert rows * steps == w["tokens"]
    prompt_tokens = prefill["tokens"] * rows // prefill["rows"]  # 4 samples of each unique prompt
    expected = 0.0
    for t in range(1, steps + 1):
        context = prompt_tokens + rows * t
        expected += _roofline_ms(rows * 2 * (f["nonembedding"] + f["head"]) + f["attn_per_key"] * context,
                                 f["weight_bytes"] + f["kv_bytes_per_token"] * context, w)
    row = report[1]["opsd/decode"]
    assert row["work"]["roofline_ms"] == pytest.approx(expected, rel=0.05)
    assert row["work"]["x_roofline"] == pytest.approx(row["gpu_ms"]["total"] / expected, rel=0.05)
    assert row["work"]["limit"] == "memory" and row["bound"] == "memory"


def test_the_findings_name_the_stages_holding_80_percent_of_the_time_above_the_limits(report):
    """Time above the limit of an innermost stage: its host or GPU time, the larger, less its roofline (0 without
    work); the findings' stages must hold >= 80% of the step's."""
    doc, stages = report
    parents = {s["parent"] for s in doc["stages"] if s["parent"]}
    above = {}
    for name, s in stages.items():
        if name in parents:
            continue
        roofline = (s.get("work") or {}).get("roofline_ms") or 0.0
        above[name] = max(0.0, max(s["cpu_ms"]["total"], s["gpu_ms"]["total"]) - roofline)
    named = {f["stage"] for f in doc["findings"]}
    assert sum(above[n] for n in named) >= 0.8 * sum(above.values())
    assert {"opsd/student_forward", "opsd/optimizer_step", "opsd/decode"} <= named


def test_the_recompile_is_named_as_a_slow_operator(report):
    doc, _ = report
    slow = [f for f in doc["findings"] if f["kind"] == "slow operator"]
    assert slow and slow[0]["stage"] == "opsd/student_forward" and "CompiledFxGraph" in slow[0]["operator"]
    assert slow[0]["recoverable_ms"] > 400


def test_the_optimizers_launches_are_a_finding(report):
    doc, _ = report
    (finding,) = [f for f in doc["findings"] if f["stage"] == "opsd/optimizer_step"]
    assert finding["kind"] == "host-bound" and "10,628 launches" in finding["evidence"]


def test_headline_busy_against_a_plain_union(report):
    raw = read_raw(TRACE)
    (step,) = raw["ranges"]["opsd/step"]
    _, lo, hi = step
    busy = union((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in raw["gpu"]
                 if e["ts"] < hi and e["ts"] + e["dur"] > lo)
    assert report[0]["headline"]["gpu_busy_ms"] == pytest.approx(busy / 1e3, rel=1e-9)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore:.*inplace")
def test_headline_against_hta(report, tmp_path, monkeypatch):
    """Busy time within 1 us of HTA's on 374 ms (0.29 us apart when recorded; the issue asks for 0.1%: 374 us);
    the plain union above agrees to 1e-9."""
    check_against_hta(TRACE, read_raw(TRACE), report[0]["headline"], tmp_path, monkeypatch, busy_us=1.0)
