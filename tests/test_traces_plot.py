"""--plot: a distinct colour per stage, CPU and GPU side by side, 1 rank and 8 ranks."""

import pytest

from instrumentation import stages as S
from tests.test_traces_gpu import graph_step_events
from traces.cli import main
from traces.synth import write_events

matplotlib = pytest.importorskip("matplotlib")


def test_every_stage_has_its_own_colour():
    from traces.plot import stage_colors

    names = [S.range_name(s) for s in S.ALL_STAGES] + ["foreign/a", "foreign/b"]
    colors = stage_colors(names)
    assert len({str(c) for c in colors.values()}) == len(names)
    assert colors[S.range_name(S.DECODE)] == f"#{S.STAGE_COLORS[S.DECODE] & 0xFFFFFF:06x}"  # as in Nsight


def write_ranks(tmp_path, num_ranks: int) -> str:
    for rank in range(num_ranks):
        events = graph_step_events(step=3)
        for e in events:  # rank r's host is (1 + r/10)x slower: a visible straggler pattern
            if e["cat"] in ("user_annotation", "cuda_runtime"):
                e["ts"] *= 1 + rank / 10
                e["dur"] *= 1 + rank / 10
        write_events(str(tmp_path / f"rank{rank}.pt.trace.json"), events, rank=rank)
    return str(tmp_path)


@pytest.mark.parametrize("num_ranks,flags", [(1, []), (8, []), (8, ["--by-step"])])
def test_plot_png_for_one_and_eight_ranks(tmp_path, capsys, num_ranks, flags):
    png = tmp_path / f"plot{num_ranks}.png"
    assert main([write_ranks(tmp_path, num_ranks), "--plot", str(png)] + flags) == 0
    capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    height, width = imread(str(png)).shape[:2]
    assert width >= (1500 if num_ranks > 1 else 1000) and height >= 400  # the heat map panel with ranks


def test_small_stages_fold_into_one_bar_and_the_title_has_the_headline(tmp_path):
    """Issue 33: stages under 1% of the step (CPU and GPU) become one bar; the title carries the step's time per
    step and GPU busy share; a legend names CPU and GPU (and the baseline with --diff). The H200 trace: 10 of its
    18 stages fold."""
    from pathlib import Path

    from traces.load import load
    from traces.plot import FOLD_SHARE, _title, fold, per_step
    from traces.report import build_report
    path = str(Path(__file__).parent / "data" / "traces" / "h200_opsd_3b_graphs.pt.trace.json.gz")
    report = build_report(load([path]), S.PREFIX)
    shown, folded = fold(report.stages, 1)
    step_ms = per_step(next(r for r in report.stages if r.parent is None), 1)[0]
    assert len(folded) == 10 and len(shown) == 8 and shown[0].name == S.range_name(S.STEP)
    assert all(max(per_step(r, 1)[0], per_step(r, 1)[1] or 0) < FOLD_SHARE * step_ms for r in folded)
    assert S.range_name(S.OPTIMIZER_STEP) in {r.name for r in folded}
    assert _title(report, False) == "opsd/step: 776 ms per step, GPU busy 55.4%"
    png = tmp_path / "p.png"
    assert main([path, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_title_carries_the_x_roofline_of_the_stages_with_work_and_small_stages_fold_into_other(tmp_path):
    """Issue 33: with work records the headline adds each stage's x roofline (largest first) and their sum's
    (GPU ms over roofline ms, weighted by roofline ms); the folded bar is labelled "other"."""
    from dataclasses import replace
    from pathlib import Path

    from traces.load import load
    from traces.plot import FOLD_SHARE, _title, fold, folded_label, plot_report, roofline_line
    from traces.records import WorkFigures
    from traces.report import build_report
    path = str(Path(__file__).parent / "data" / "traces" / "h200_opsd_3b_graphs.pt.trace.json.gz")
    report = build_report(load([path]), S.PREFIX)
    assert roofline_line(report.stages) is None  # a trace without work records: the title as before
    work = {S.range_name(S.BACKWARD): WorkFigures(1e12, 1e9, 10.0, 4.0, "compute"),
            S.range_name(S.TEACHER_FORWARD): WorkFigures(5e11, 1e9, 30.0, 2.0, "compute")}
    report.stages = [replace(r, work=work.get(r.name)) for r in report.stages]
    assert roofline_line(report.stages) == "x roofline 2.5 over 2 stages (backward 4.0, teacher_forward 2.0)"
    assert _title(report, False) == ("opsd/step: 776 ms per step, GPU busy 55.4%\n"
                                     "x roofline 2.5 over 2 stages (backward 4.0, teacher_forward 2.0)")
    _, folded = fold(report.stages, 1)
    assert folded_label(folded) == f"other: 10 stages < {FOLD_SHARE:.0%} each"
    png = tmp_path / "roofline.png"
    plot_report(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
