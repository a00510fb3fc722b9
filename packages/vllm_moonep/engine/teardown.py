"""Teardown that finishes: every object is released even when one of them fails.

After a failed step a peer may be gone, and the first error of a teardown must not leave the rest
held (buffers, heap allocations and the arrival board's thread)::

    each(lambda o: o.destroy(), newest_first)   # tries every item, then raises the first error

Buffer pools, heaps (``free_all``), layout sets and the vLLM plugin's manager tear down this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["each"]

T = TypeVar("T")


def each(fn: Callable[[T], object], items: Iterable[T]) -> None:
    """``fn(item)`` for every item in order, also after one raised; then the first error, if any."""
    first: BaseException | None = None
    for item in items:
        try:
            fn(item)
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
