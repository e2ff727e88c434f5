"""Layout rules of instrumentation/ and traces/ (measured with ast) and the one do-nothing object."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import instrumentation
from instrumentation.config import ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("instrumentation", "traces")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 300, 50, 8


def layout_figures(packages=PACKAGES):
    """``(kind, value, where)`` for every module (lines), function (lines) and its parameters."""
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            where = str(path.relative_to(ROOT))
            out.append(("module_lines", len(source.splitlines()), where))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                    params = len([n for n in names if n not in ("self", "cls")])
                    out.append(("function_lines", node.end_lineno - node.lineno + 1, f"{where}:{node.name}"))
                    out.append(("parameters", params, f"{where}:{node.name}"))
    return out


@pytest.mark.parametrize("kind,limit", [("module_lines", MAX_MODULE_LINES),
                                        ("function_lines", MAX_FUNCTION_LINES),
                                        ("parameters", MAX_PARAMETERS)])
def test_size_limits(kind, limit):
    figures = [f for f in layout_figures() if f[0] == kind]
    assert figures
    over = [(value, where) for _, value, where in figures if value > limit]
    assert over == [], f"{kind} over {limit}: {over}"


def test_one_do_nothing_object():
    from instrumentation import collect, ranges

    assert instrumentation.NOOP is instrumentation.NOOP_RANGE is ranges.NOOP_RANGE
    instrumentation.configure(instrumentation.ProfileConfig(mode="0"))
    try:
        assert collect.collect_stages() is instrumentation.NOOP
        assert ranges.stage("decode") is instrumentation.NOOP
    finally:
        instrumentation.reset_for_tests()
    with instrumentation.NOOP as value:
        assert value is None
    with pytest.raises(KeyError):  # never swallows an exception
        with instrumentation.NOOP:
            raise KeyError("x")


def test_noop_is_importable_without_torch():
    code = ("import sys; from instrumentation import NOOP, NOOP_RANGE; assert NOOP is NOOP_RANGE; "
            "assert 'torch' not in sys.modules; print(repr(NOOP))")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS.values()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "instrumentation.NOOP"


def test_public_names_still_import():
    from instrumentation import (collect_stages, format_stage_rows, instrument_deepspeed,  # noqa: F401
                                 opsd_profiler, stage, staged, stages, uninstrument_deepspeed)
    from instrumentation.upstream import TARGETS, Target  # noqa: F401

    assert callable(stage) and callable(collect_stages) and stages.DECODE == "decode"


if __name__ == "__main__":  # print the figures (for closing notes)
    for kind in ("module_lines", "function_lines", "parameters"):
        print(kind, max((f for f in layout_figures() if f[0] == kind), key=lambda f: f[1]))
