"""Teardown that finishes: every object is released even when one of them fails.

After a failed step a peer may be gone, and the first error of a teardown must not leave the rest
held (buffers, heap allocations and the arrival board's thread)::

    each(lambda o: o.destroy(), newest_first, MoonEPCollectiveTimeout)
        # tries every item after a collective failed (the rest then free locally), raises the first

Any other error (a mistake on a healthy group: an out-of-order free, frees that differ across
ranks) stops at once, as a single call would: going on would issue more collectives that the
peers are not making. Buffer pools, heaps (``free_all``), layout sets and the vLLM plugin's
manager tear down this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["each"]

T = TypeVar("T")


def each(fn: Callable[[T], object], items: Iterable[T],
         keep_going: type[Exception] | tuple[type[Exception], ...]) -> None:
    """``fn(item)`` for every item in order, also after one raised ``keep_going``; then the first
    error. Another error (or a ``KeyboardInterrupt``) is raised at once."""
    first: Exception | None = None
    for item in items:
        try:
            fn(item)
        except keep_going as exc:
            first = first or exc
    if first is not None:
        raise first
