"""Command-line number types that refuse out-of-range values as argparse errors naming the flag
(``pdserve scale --decode -1`` was a protobuf ValueError's traceback)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)  # (a ValueError: argparse's own "invalid parse value")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "int"
    return parse


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


positive_float.__name__ = "float"
