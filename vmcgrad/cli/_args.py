"""Argument types and the parser class shared by the ``vmcgrad`` commands.

Each type raises :class:`argparse.ArgumentTypeError`, which argparse turns into one line naming the option:
``vmcgrad vmc: error: argument --L: must be a positive integer; got 0``.
"""

from __future__ import annotations

import argparse
import math


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows the defaults, with room for the option names."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


def positive_int(text: str) -> int:
    """An integer ≥ 1.

    Examples:
        >>> positive_int("12")
        12
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def chunk_size(text: str) -> int | str:
    """A positive integer, or ``auto`` (the largest power of two whose compiled program fits memory).

    Examples:
        >>> chunk_size("256"), chunk_size("auto")
        (256, 'auto')
    """
    if text.strip().lower() == "auto":
        return "auto"
    return positive_int(text)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float(text, lambda v: v > 0, "a positive number")


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0."""
    return _float(text, lambda v: v >= 0, "a non-negative number")


def _float(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {what}; got {text}")
    return value


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def byte_size(text: str) -> int:
    """A positive number of bytes, with an optional binary unit (KiB, MiB, GiB; K, M, G).

    Examples:
        >>> byte_size("64MiB"), byte_size("1g"), byte_size("1e6")
        (67108864, 1073741824, 1000000)
    """
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("kmgib")
    unit = stripped[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a number of bytes such as 64MiB, 1GiB or 1e9; got {text!r}"
        ) from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be at least 1 byte; got {text}")
    return int(value)
