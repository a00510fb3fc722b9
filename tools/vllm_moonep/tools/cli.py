"""Argument types shared by the tools' command lines (a bad value is refused before any rank starts)."""

from __future__ import annotations

import argparse

__all__ = ["positive"]


def positive(what: str, kind: type = int):
    """An argparse ``type`` that accepts a number of ``kind`` (int or float) greater than zero (ints:
    at least 1) and names ``what`` in its refusal."""
    noun = "an integer" if kind is int else "a number"

    def parse(v: str):
        try:
            x = kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be {noun}, got {v!r}") from None
        if not x > 0:
            raise argparse.ArgumentTypeError(f"{what} must be {'>= 1' if kind is int else '> 0'}, got {v}")
        return x

    return parse
