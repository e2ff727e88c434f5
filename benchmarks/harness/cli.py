"""Argument types the benchmarks share: a count below its least value is refused by argparse, naming the flag."""

from __future__ import annotations

import argparse


def int_at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum`` (argparse names the flag: ``argument --pairs: must be an int >=
    2; got '0'``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}; got {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse
