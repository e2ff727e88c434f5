"""Argument types the benchmarks share: a count below its least value is refused by argparse, naming the flag."""

from __future__ import annotations

import argparse
import ast
import math

from instrumentation.cli_values import output_problem, parse_int_text
from rollout.config import RolloutConfig


def int_at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum`` (argparse names the flag: ``argument --pairs: must be an int >=
    2; got '0'``)."""

    def parse(text: str) -> int:
        value = parse_int_text(text)  # ASCII digits: int() also reads '٣' as 3
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}; got {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def int_in(minimum: int, maximum: int):
    """An argparse ``type``: an int in ``[minimum, maximum]`` (a port, a seed)."""

    def parse(text: str) -> int:
        value = int_at_least(minimum)(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be an int in [{minimum}, {maximum}]; got {text!r}")
        return value

    parse.__name__ = f"int in [{minimum}, {maximum}]"
    return parse


def int_tuple(*lengths: int, minimum: int = 1, sep: str = ","):
    """An argparse ``type``: ints >= ``minimum`` in ASCII digits separated by ``sep``, as many as one of ``lengths``,
    as a tuple (a launch shape, a window: each was read with ``int()`` only when the table using it ran)."""
    counts = " or ".join(str(n) for n in lengths)
    words = "comma-separated" if sep == "," else f"{sep!r}-separated"

    def parse(text: str) -> tuple:
        values = tuple(parse_int_text(v) for v in text.split(sep))
        if len(values) not in lengths or any(v is None or v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"must be {counts} {words} ints >= {minimum}; got {text!r}")
        return values

    parse.__name__ = f"{counts} ints"
    return parse


def finite_number(low: float = -math.inf, *, above: bool = False, high: float = math.inf):
    """An argparse ``type``: a finite number >= ``low`` (``above``: > ``low``) and <= ``high``; ``nan``, ``inf`` are
    refused (they ran a whole benchmark before)."""
    relation = ">" if above else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            bounds = [f"{relation} {low:g}"] if low > -math.inf else []
            if high < math.inf:
                bounds.append(f"<= {high:g}")
            bound = f" {' and '.join(bounds)}" if bounds else ""
            raise argparse.ArgumentTypeError(f"must be a finite number{bound}; got {text!r}")
        return value

    parse.__name__ = "finite number"
    return parse


def out_path(text: str) -> str:
    """An argparse ``type``: a file path to write, checked before any model is built
    (:func:`instrumentation.cli_values.output_problem`: an empty ``--out`` ran the benchmark and then wrote nowhere)."""
    why = output_problem(text)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r} {why}; give a file path")
    return text


def names_among(choices):
    """An argparse ``type``: a comma list of at least one name among ``choices`` (spaces around names allowed)."""

    def parse(text: str) -> tuple:
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{unknown or text!r} not among {tuple(choices)}")
        return names

    parse.__name__ = "names"
    return parse


def parse_settings(parser, spec: str) -> tuple:
    """``"kernels.fuse_qkv=False;kernels.compile=False"`` -> ``(("kernels.fuse_qkv", False), ("kernels.compile",
    False))``: dotted ``RolloutConfig`` settings, each value a Python literal, checked by
    ``RolloutConfig.with_settings`` (an old flat name fails naming its new one)."""
    out = []
    for part in spec.split(";"):
        name, sep, text = part.strip().partition("=")
        if not sep:
            parser.error(f"--twin: {part!r} is not SETTING=VALUE")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            parser.error(f"--twin: {part!r}: the value must be a Python literal (True, 0.5, 'sdpa')")
        out.append((name.strip(), value))
    try:
        RolloutConfig().with_settings(dict(out))
    except ValueError as exc:
        parser.error(f"--twin: {exc}")
    return tuple(out)
