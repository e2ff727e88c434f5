"""The optimizer benchmark's pure parts: its DeepSpeed configs, the update comparison and the table."""

import torch

from benchmarks import optimizer


def test_the_variants_configure_the_wrappers_they_name():
    zero0, zero1 = optimizer._config("zero0", True), optimizer._config("zero1", True)
    accum = optimizer._config("zero1-fp32-accum", True)
    assert zero0["zero_optimization"]["stage"] == 0 and zero0["bf16"]["enabled"]
    assert zero1["zero_optimization"]["stage"] == 1 and "data_types" not in zero1
    assert accum["zero_optimization"]["stage"] == 1 and accum["data_types"] == {"grad_accum_dtype": "fp32"}
    assert not optimizer._config("zero0", False)["bf16"]["enabled"]  # the CPU runs float32


def test_updates_are_compared_per_parameter_and_the_worst_is_named():
    base = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
    other = {"a": torch.ones(4), "b": torch.full((4,), 3.0)}
    same = optimizer._rel_l2(base, base)
    assert same["median"] == 0.0 and same["max"] == 0.0
    diff = optimizer._rel_l2(other, base)
    assert diff["max_param"] == "b" and abs(diff["max"] - 0.5) < 1e-6 and abs(diff["median"] - 0.25) < 1e-6


def test_the_table_gives_medians_per_variant():
    row = dict(optimizer="FP16_UnfusedOptimizer", build_s=3.0, step_gpu_ms=200.0, step_wall_ms=201.0,
               first_step_wall_ms=250.0, kernels_per_step=10629, peak_gib=69.3)
    rows = [dict(row, variant="zero0", rel_l2_vs_zero0=None),
            dict(row, variant="zero1-fp32-accum", optimizer="BF16_Optimizer", step_gpu_ms=90.0, step_wall_ms=91.0,
                 kernels_per_step=1924, rel_l2_vs_zero0={"median": 0.01, "max": 0.02, "max_param": "w"}),
            dict(row, variant="zero1-fp32-accum", optimizer="BF16_Optimizer", step_gpu_ms=100.0, step_wall_ms=101.0,
                 kernels_per_step=1924, rel_l2_vs_zero0={"median": 0.03, "max": 0.05, "max_param": "v"})]
    text = optimizer.table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| zero1-fp32-accum"))
    assert "BF16_Optimizer" in line and "95.000" in line and "0.05 (v)" in line and "0.030" in line
