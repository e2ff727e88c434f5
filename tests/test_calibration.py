"""Calibration: the NNLS fit recovers known coefficients, files round-trip, mismatched metadata is refused,
and the calibration script runs end to end on the tiny model (calibrate, then the held-out sweep)."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rollout.model.costs import calibration_metadata, load_cost_model
from rollout.plan.calibration import (FINGERPRINT_SOURCES, CopySample, DecodeSample, GroupSample, PrefillSample,
                                      fit_cost_model, save_calibration, source_fingerprint)
from rollout.plan.planner import CostModel
from rollout.testing import tiny_model

ROOT = Path(__file__).resolve().parent.parent
GRID = [(b, n) for b in (1, 2, 4, 8, 16) for n in (8, 32, 128, 512, 1024)]
TRUE = {
    "all_terms": dict(prefill_fixed_cost_ms=3.0, prefill_token_cost_ms=0.002, prefill_attention_cost_ms=0.5,
                      prefill_kv_cost_ms=0.07, continuous_decode_cost_ms=1.5, prefill_group_cost_ms=0.8),
    "no_attention_term": dict(prefill_fixed_cost_ms=12.0, prefill_token_cost_ms=0.01, prefill_attention_cost_ms=0.0,
                              prefill_kv_cost_ms=0.0, continuous_decode_cost_ms=0.25, prefill_group_cost_ms=0.0),
}
GEOMETRY = CostModel(num_layers=4, num_query_heads=8, num_kv_heads=2, head_dim=32, element_bytes=2)


def synthetic(truth: CostModel, noise: float = 0.0, seed: int = 0):
    """Timings the true model would produce, times (1 + uniform(-noise, noise))."""
    rng = random.Random(seed)

    def jitter(ms):
        return ms * (1.0 + rng.uniform(-noise, noise))

    prefill = [PrefillSample(b, n, jitter(truth.ordinary_prefill_cost_ms(b, n))) for b, n in GRID]
    copies = [CopySample(b, n, jitter(truth.prefill_kv_cost_ms * truth.kv_mib(b, n))) for b, n in GRID]
    decode = [DecodeSample(k, jitter(truth.continuous_decode_cost_ms * k)) for k in (8, 16, 32)]
    groups = [GroupSample(k, jitter(truth.prefill_group_cost_ms * (k - 1))) for k in (4, 8)]
    return prefill, copies, decode, groups


@pytest.mark.parametrize("name", list(TRUE))
def test_fit_recovers_known_coefficients_from_exact_timings(name):
    truth = CostModel.from_dict({**GEOMETRY.to_dict(), **TRUE[name]})
    fitted = fit_cost_model(GEOMETRY, *synthetic(truth))
    for key, value in TRUE[name].items():
        assert getattr(fitted, key) == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert {k: getattr(fitted, k) for k in ("num_layers", "head_dim")} == {"num_layers": 4, "head_dim": 32}


def test_fit_under_noise_stays_close_and_non_negative():
    truth = CostModel.from_dict({**GEOMETRY.to_dict(), **TRUE["no_attention_term"]})
    fitted = fit_cost_model(GEOMETRY, *synthetic(truth, noise=0.02, seed=3))
    assert fitted.prefill_attention_cost_ms >= 0 and fitted.prefill_kv_cost_ms >= 0  # true values are 0
    assert fitted.prefill_fixed_cost_ms == pytest.approx(12.0, rel=0.1)
    assert fitted.prefill_token_cost_ms == pytest.approx(0.01, rel=0.1)
    assert fitted.continuous_decode_cost_ms == pytest.approx(0.25, rel=0.05)


def test_fit_keeps_terms_without_samples_and_needs_three_prefill_samples():
    prefill = synthetic(CostModel.from_dict({**GEOMETRY.to_dict(), **TRUE["all_terms"]}))[0]
    fitted = fit_cost_model(GEOMETRY, prefill)
    assert fitted.prefill_kv_cost_ms == GEOMETRY.prefill_kv_cost_ms
    assert fitted.continuous_decode_cost_ms == GEOMETRY.continuous_decode_cost_ms
    assert fitted.prefill_group_cost_ms == GEOMETRY.prefill_group_cost_ms
    with pytest.raises(ValueError, match="prefill"):
        fit_cost_model(GEOMETRY, prefill[:2])


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


def _saved(tmp_path, model, metadata_change=None):
    fitted = CostModel.from_model(model, prefill_fixed_cost_ms=1.25, continuous_decode_cost_ms=0.5)
    metadata = calibration_metadata(model, "cpu", torch.float32)
    metadata.update(metadata_change or {})
    path = tmp_path / "calibration.json"
    save_calibration(path, fitted, metadata, {"prefill": [PrefillSample(1, 8, 1.0)]})
    return path, fitted


def test_save_load_round_trip(tmp_path, model):
    path, fitted = _saved(tmp_path, model)
    assert load_cost_model(path, model, "cpu", torch.float32) == fitted
    record = json.loads(path.read_text())
    assert record["samples"]["prefill"] == [{"batch_size": 1, "length": 8, "forward_ms": 1.0}]
    assert record["metadata"]["geometry"]["num_kv_heads"] == 2
    assert record["metadata"]["source_sha256"] == source_fingerprint()


@pytest.mark.parametrize("change, current, match", [
    ({}, dict(dtype=torch.bfloat16), r"metadata\.dtype"),
    ({"device_name": "NVIDIA H200"}, {}, r"metadata\.device_name"),
    ({"attention_implementation": "eager"}, {}, r"metadata\.attention_implementation"),
    ({"torch_version": "0.0.1"}, {}, r"metadata\.torch_version"),
    ({"transformers_version": "4.57.1"}, {}, r"metadata\.transformers_version"),
    ({"source_sha256": "0" * 64}, {}, r"metadata\.source_sha256"),
    ({}, dict(num_hidden_layers=3), r"metadata\.geometry\.num_layers"),
])
def test_mismatched_metadata_is_refused_naming_the_key(tmp_path, model, change, current, match):
    path, _ = _saved(tmp_path, model, change)
    if "num_hidden_layers" in current:
        model = tiny_model("qwen2", seed=0, num_hidden_layers=current["num_hidden_layers"])
    with pytest.raises(ValueError, match=match):
        load_cost_model(path, model, "cpu", current.get("dtype", torch.float32))


def test_ignored_keys_and_bad_files(tmp_path, model):
    path, fitted = _saved(tmp_path, model, {"source_sha256": "0" * 64})
    assert load_cost_model(path, model, "cpu", torch.float32, ignore=("source_sha256",)) == fitted
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="path"):
        load_cost_model(path, model, "cpu", torch.float32)


def test_source_fingerprint_follows_the_sources(tmp_path):
    for name in FINGERPRINT_SOURCES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert source_fingerprint(tmp_path) == source_fingerprint()
    with open(tmp_path / "rollout/executors/continuous/loop.py", "a") as f:
        f.write("\n# edited\n")
    assert source_fingerprint(tmp_path) != source_fingerprint()


@pytest.mark.parametrize("name", FINGERPRINT_SOURCES)
def test_every_fingerprinted_source_exists(name):
    assert (ROOT / name).is_file(), f"FINGERPRINT_SOURCES lists {name}, which does not exist"


def test_a_missing_fingerprinted_source_is_an_error_not_a_constant(tmp_path):
    """A listed file that moved must not hash to a constant (the old code hashed b"<missing>")."""
    for name in FINGERPRINT_SOURCES[1:]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match="FINGERPRINT_SOURCES"):
        source_fingerprint(tmp_path)


def _script():
    spec = importlib.util.spec_from_file_location("calibrate_prefill", ROOT / "scripts/calibrate_prefill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_calibrate_then_sweep_end_to_end_on_the_tiny_model(tmp_path, model, capsys):
    script, out = _script(), tmp_path / "calib.json"
    threads = torch.get_num_threads()
    try:
        result, rows = _calibrate_and_sweep(script, out)
    finally:
        torch.set_num_threads(threads)  # the script pins CPU threads for stable timings
    assert [(s.batch_size, s.length) for s in result["prefill"]] == [(b, n) for b in (1, 2, 4) for n in (4, 16)]
    assert load_cost_model(out, model, "cpu", torch.float32) == result["cost_model"]
    # the tiny Qwen2 model prefills through the packed path: one group-overhead sample, 4 rows in 4 groups
    assert [g.num_groups for g in result["groups"]] == [4]
    assert result["cost_model"].prefill_group_cost_ms >= 0.0
    names = list(script.WORKLOADS["small"])
    assert [r.workload for r in rows[:-1]] == names
    assert rows[-1].workload.startswith(names[0]) and rows[-1].workload.endswith("slots)")
    assert all(r.tokens_match for r in rows)  # every route returned the ordinary route's tokens
    assert all(r.auto_route.split("+")[0] in ("ordinary", "continuous") for r in rows)
    assert rows[-1].auto_route == "continuous"  # fewer slots than rows
    assert "worst regression" in capsys.readouterr().out


def _calibrate_and_sweep(script, out):
    result = script.main(["--output", str(out), "--batches", "1,2,4", "--lengths", "4,16", "--decode-shapes", "2x8",
                          "--decode-steps", "2", "--repeats", "1"])
    rows = script.main(["--sweep", "--cost-config", str(out), "--repeats", "1", "--max-new-tokens", "2"])
    return result, rows
