"""The one table formatter (traces.table.render) and its three users: the report's stage rows, the
diff and the live per-stage timer table print in the same style."""

import csv
import io

import pytest

from traces.diff import diff_rows, format_diff
from traces.rows import StageRow, format_table
from traces.table import NULL, Column, fixed, percent, render

COLUMNS = [Column("name", "stage", left=True), Column("count", "count"),
           Column("total_ms", "total ms", fixed(2)), Column("share", "share", percent(1))]
ROWS = [["opsd/step", 2, 10.0, 1.0], ["opsd/decode|x", 40, 1.23456, None]]


def test_aligned_text_table():
    text = render(COLUMNS, ROWS, title="per-stage")
    assert text.endswith("\n")
    lines = text.splitlines()
    assert lines == ["per-stage",
                     "stage          count  total ms   share",
                     "-------------  -----  --------  ------",
                     "opsd/step          2     10.00  100.0%",
                     "opsd/decode|x     40      1.23       " + NULL]


def test_markdown_table_escapes_pipes_and_aligns_numbers_right():
    lines = render(COLUMNS, ROWS, "markdown").splitlines()
    assert lines[0] == "| stage | count | total ms | share |"
    assert lines[1] == "| --- | ---: | ---: | ---: |"
    assert lines[3] == "| opsd/decode\\|x | 40 | 1.23 | - |"


def test_csv_keeps_raw_values_and_empty_nulls():
    rows = list(csv.reader(io.StringIO(render(COLUMNS, ROWS, "csv"))))
    assert rows == [["name", "count", "total_ms", "share"], ["opsd/step", "2", "10.0", "1.0"],
                    ["opsd/decode|x", "40", "1.23456", ""]]


@pytest.mark.parametrize("args,match", [
    ((COLUMNS, ROWS, "html"), "fmt must be one of"),
    ((COLUMNS, [["a", 1]], "table"), "rows must have 4 values"),
])
def test_bad_arguments_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        render(*args)


def test_column_validation():
    with pytest.raises(ValueError, match="key"):
        Column("", "x")


def test_users_share_the_style():
    from instrumentation.collect import format_stage_rows

    live = format_stage_rows([{"stage": "decode", "count": 4, "total_ms": 2.0, "mean_ms": 0.5,
                               "host_total_ms": 2.0, "share_of_step": None, "peak_mib": None}])
    report = format_table([StageRow.from_samples("opsd/decode", [0.5] * 4)])
    diff = format_diff(diff_rows([StageRow.from_samples("opsd/decode", [1.0])],
                                 [StageRow.from_samples("opsd/decode", [2.0])]))
    for text in (live, report, diff):
        head, rule, row = text.splitlines()[:3]
        assert set(rule) <= {"-", " "} and len(rule) == len(head)  # a dashed rule as wide as the header
        assert row.startswith("opsd/decode" if "opsd" in row else "decode")
        assert NULL in row.split()  # null cells print the same everywhere
    # no step ranges on either side: the stages' totals are compared (1 -> 2 ms of CPU), with no noise guard
    assert "+1.000" in diff and "+100.0%" in diff
    assert format_diff([], "markdown").startswith("| stage |")


def test_kernel_names_are_shortened_but_stay_apart():
    """Issue 33: names cut at the same width used to read the same (four ``multi_tensor_apply_kernel<at::native::
    (anonymou...`` rows); now namespaces go, and names that still share their first ``width`` characters skip the
    shared part to show what tells them apart."""
    from traces.format import readable_kernel, short_kernel_names
    template = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
                "TensorListMetadata<{n}>, at::native::(anonymous namespace)::{f}<float, {n}>, float>(float*)")
    names = [template.format(n=4, f="FusedAdamMathFunctor"), template.format(n=4, f="ZeroFunctor"),
             template.format(n=2, f="ScaleFunctor"), "void short_kernel<int>(int)"]
    assert readable_kernel(names[3]) == "short_kernel<int>(int)"
    assert readable_kernel(names[0]).startswith("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor")
    for width in (40, 60, 90):
        short = short_kernel_names(names, width)
        assert len(set(short)) == len(names) and all(len(s) <= width for s in short)
        assert short[3] == "short_kernel<int>(int)"
    assert "FusedAdamMathFunctor" in short_kernel_names(names, 40)[0]  # the distinguishing part is shown


def test_a_headline_over_several_steps_is_per_step():
    """Issue 33: 'wall 11,902.7 ms' for 3 steps read like one step; now ms/step, the total beside it."""
    from traces.format import format_headline
    from traces.headline import Headline, Idle
    head = Headline("opsd/step", 300.0, 150.0, Idle(90.0, 30.0, 30.0), num_ranges=3)
    line = format_headline(head)
    assert line.startswith("opsd/step (3 ranges): wall 100.0 ms/step (300.0 in all), GPU busy 50.0 (50.0%)")
    assert line.rstrip().endswith("queued/other 10.0 (ms/step)")
    one = format_headline(Headline("opsd/step", 300.0, 150.0, Idle(90.0, 30.0, 30.0), num_ranges=1))
    assert one.startswith("opsd/step (1 range): wall 300.0 ms, GPU busy 150.0 (50.0%)") and "ms/step" not in one
