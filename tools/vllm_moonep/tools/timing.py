"""What the benchmarks share to time a call: barrier-aligned medians across ranks, the median of a call
timed after an L2 flush that leaves L2 clean, a call captured in a CUDA graph (warm-up on a side stream
first, as capture requires), and alternated rounds whose orders follow a Williams design (an A/B of several
candidates on one GPU, fair to each one's place in a round and to the call timed before it)."""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["FLUSH_BYTES", "MIN_TIMED_CALLS", "ROUNDS", "alternated_times", "capture_graph", "flushed_median_ms",
           "on_side_stream", "pooled_ratio", "round_order", "round_orders", "sync_device", "timed_calls",
           "timed_median"]

#: rounds of an alternated A/B by default (``alternated_times``): with four candidates each takes each place once
#: and follows each other candidate once
ROUNDS = 4

#: bytes the L2 flush before each timed call writes and reads back (``flushed_median_ms``; as triton.testing.do_bench's)
FLUSH_BYTES = 256 << 20

#: the fewest timed calls whose median ``flushed_median_ms`` takes, however long a call is: a 5 ms call (Kimi-K2's
#: experts at 4096 tokens a rank) in a 30 ms budget would be six, a median one slow call can move. The spread between
#: timings at such a point (up to 10% on an H100) is another matter, which only rounds pooled resolve
#: (docs/PERFORMANCE.md, "How the figures are taken")
MIN_TIMED_CALLS = 10


def sync_device(dev: torch.device) -> None:
    """Wait for ``dev``'s work (no-op on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_median(fn, dev: torch.device, iters: int, warmup: int, barrier: bool = True) -> tuple[float, float | None]:
    """``(host median s, device median s or None)`` of ``fn()``: each call after a barrier of the
    default group (every rank calls it together) and a synchronize; device time from CUDA events."""
    host, device = [], []
    cuda = dev.type == "cuda"
    for i in range(warmup + iters):
        if barrier:
            dist.barrier()
        sync_device(dev)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            e1.record()
        sync_device(dev)
        t1 = time.perf_counter()
        if i >= warmup:
            host.append(t1 - t0)
            if cuda:
                device.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(host), (statistics.median(device) if device else None)


def timed_calls(rep: float, estimate: float) -> int:
    """How many calls ``flushed_median_ms`` times: about ``rep`` ms of calls of ``estimate`` ms each (a flush and a
    call), never fewer than ``MIN_TIMED_CALLS``."""
    if not estimate > 0:
        raise ValueError(f"timed_calls: a call's estimate must be a positive time, got {estimate} ms")
    return max(MIN_TIMED_CALLS, int(rep / estimate))


def flushed_median_ms(fn, warmup: float = 25, rep: float = 100, clean: bool = True) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device, each call between two CUDA events after an L2
    flush; calls for about ``warmup`` ms, then about ``rep`` ms timed (as ``triton.testing.do_bench`` sizes them
    from five flushed calls), at least ``MIN_TIMED_CALLS`` of them (``timed_calls``).

    The flush leaves L2 clean: it writes ``FLUSH_BYTES`` and then reads them back. ``do_bench``'s flush only
    writes, so L2 is left full of dirty lines that the timed call's first misses write back to DRAM: on an
    H100 that charged ``bench_experts``' points about 8-10 us they did not spend (Qwen3-30B-A3B's experts at 1
    token, 66 MB of weights: 42.6 against 35.1 us; docs/PERFORMANCE.md, "How the figures are taken").
    ``clean=False`` flushes as ``do_bench`` does (writes only), for comparison with figures taken that way."""
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    total = torch.empty((), dtype=torch.int64, device="cuda")

    def flush():
        buf.zero_()
        if clean:
            torch.sum(buf, dim=0, out=total)  # the read evicts the dirty lines: written back before the timing

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        flush()
        fn()
    e1.record()
    torch.cuda.synchronize()
    estimate = e0.elapsed_time(e1) / 5
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(timed_calls(rep, estimate))]
    for start, end in events:
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def on_side_stream(fn, calls: int = 1) -> None:
    """Call ``fn`` ``calls`` times on a fresh stream ordered after the current one, then wait for it
    (a capture's warm-up: kernels compiled and memory allocated outside the capture)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    cur.wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(fn, warm_calls: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warm_calls`` calls on a side stream (capture needs
    its kernels compiled and its allocations made outside the capture); replay with ``.replay()``.

    The graph holds ``fn`` (``graph.captured_fn``), and so every buffer ``fn`` closes over, for as long
    as it lives: its kernels keep those addresses, and each capture (``torch.cuda.graph``) empties the
    allocator's cache first, which hands a buffer dropped after an earlier capture back to the driver
    under that earlier graph (an illegal address at its next replay)."""
    on_side_stream(fn, warm_calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    graph.captured_fn = fn  # type: ignore[attr-defined]  # torch's class has a __dict__; mypy sees no such field
    return graph


def _williams_rows(n: int) -> list[tuple[int, ...]]:
    """The rows of a Williams design over ``n`` places, relabelled so that row 0 is ``0, 1, ..., n-1``: the sequence
    ``0, 1, n-1, 2, n-2, ...`` shifted by each ``k`` (a Latin square in which, for an even ``n``, every symbol
    follows every other exactly once), and for an odd ``n`` the same rows reversed as well (no single square
    balances the neighbours then; the pair does)."""
    seq = [0]
    lo, hi = 1, n - 1
    while len(seq) < n:
        seq.append(lo)
        lo += 1
        if len(seq) < n:
            seq.append(hi)
            hi -= 1
    label = {sym: i for i, sym in enumerate(seq)}  # relabel: row 0 becomes the identity
    rows = [tuple(label[(sym + k) % n] for sym in seq) for k in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


@functools.lru_cache(maxsize=256)
def round_orders(n: int, rounds: int) -> tuple[tuple[int, ...], ...]:
    """The order of ``n`` candidates in each of ``rounds`` rounds, as indices: round 0 in the given order, and each
    later round the row of the Williams design (``_williams_rows``) that, against the rounds before it, gives the
    first place to a candidate that has not led yet, then repeats the fewest (predecessor, candidate) pairs, then
    the fewest (place, candidate) pairs; ties to the first row at or after ``r * rows // rounds``, wrapping round
    (the rows spread over the design). For an even ``n`` and up to ``n`` rounds that is the Williams square's rows
    spread evenly: no candidate in the same place twice or after the same one twice. For an odd ``n`` and fewer
    than ``n`` rounds, no candidate after the same one twice nor leading twice, while some places repeat."""
    if n < 0 or rounds < 1:
        raise ValueError(f"round_orders: need n >= 0 candidates and rounds >= 1, got n={n}, rounds={rounds}")
    if n == 0:
        return ((),) * rounds
    rows = _williams_rows(n)
    after: dict = {}  # (predecessor, candidate) -> times seen
    place: dict = {}  # (place, candidate) -> times seen
    chosen: list[tuple[int, ...]] = []
    for r in range(rounds):
        start = r * len(rows) // rounds

        def cost(j: int) -> tuple[int, int, int, int]:
            row = rows[j]
            return (place.get((0, row[0]), 0), sum(after.get((a, b), 0) for a, b in zip(row, row[1:])),
                    sum(place.get((i, c), 0) for i, c in enumerate(row)), (j - start) % len(rows))

        row = rows[min(range(len(rows)), key=cost)]
        chosen.append(row)
        for a, b in zip(row, row[1:]):
            after[(a, b)] = after.get((a, b), 0) + 1
        for i, c in enumerate(row):
            place[(i, c)] = place.get((i, c), 0) + 1
    return tuple(chosen)


def round_order(names: list, r: int, rounds: int | None = None) -> list:
    """Round ``r``'s order of ``names`` among ``rounds`` rounds (``round_orders``; without ``rounds``, as many
    rounds as names; ``r`` past the last round wraps round to the first): no candidate always runs first (right
    after a point's setup, on a cooler GPU) or always right after the same neighbour (after a heavier or a lighter
    kernel: a power-bound GPU's clock carries one call's load into the next). A rotated list kept every candidate
    after the same neighbour in every round but the one it led."""
    if rounds is not None and rounds < 1:
        raise ValueError(f"round_order: rounds must be at least 1, got {rounds}")
    n = len(names)
    if n == 0:
        return []
    total = rounds if rounds is not None else n
    return [names[i] for i in round_orders(n, total)[r % total]]


def pooled_ratio(candidate: list, incumbent: list, control: list) -> float:
    """A candidate's round timings against the incumbent's: the median of the candidate's over the median of the
    incumbent's and its control's together (the same call timed as two columns). At a power-bound point one
    column's few rounds move its median by several percent, the incumbent's as much as the candidate's; pooling
    the incumbent with its control halves what one unlucky column can move the ratio."""
    if not candidate or not incumbent or not control:
        raise ValueError("pooled_ratio: every column needs at least one timing")
    return statistics.median(candidate) / statistics.median(list(incumbent) + list(control))


def alternated_times(names: list, time_one, rounds: int = ROUNDS) -> dict:
    """``{name: [time_one(name) per round]}``: every name timed once per round, ``rounds`` rounds in
    alternation, each round in ``round_order``. At power-bound points an H100 read the same kernel up to 10%
    apart by its place in a round of several, and 3-10% apart where one copy of it always ran right after the
    PoC's column (docs/PERFORMANCE.md, "How the figures are taken"); alternation spreads drift over every name,
    and the rounds' orders spread the place and the call before it."""
    if rounds < 1:
        raise ValueError(f"alternated_times: rounds must be at least 1, got {rounds}")
    out: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(list(names), r, rounds):
            out[name].append(time_one(name))
    return out
