"""The median of several ``bench_experts`` runs, point by point: the figure its points are judged by,
since a point moves by a few percent between calls (power, clocks, the DRAM's state).

    run_1.json ... run_n.json   (bench_experts.json of one GPU, one flush, the same points)
        -> per (shape, tokens, routing): each column's median time over the runs, its ratio to the
           median floor, the Triton times' spread (slowest / fastest - 1)
        -> "auto": the column that ``impl="auto"`` runs at the point on that GPU (``tuning.json``'s
           regimes, where the runs timed that column), its time, ratio and useful TFLOP/s
        -> "pooled": each library column's round timings of every run against the Triton call's and
           its control's (``pooled_ratios``): at a power-bound point one run's few rounds move a
           median by several percent, and the ratio of pooled timings is the steadier figure

``python -m vllm_moonep.tools.bench_median RUN.json RUN.json RUN.json [--common-points] [--capability 9.0]``: a markdown
table on stdout, ``bench_median.json`` to ``$OUT`` if set. ``--capability`` stands in for the GPU's compute
capability where the runs do not record it (a GPU without a section of its own borrows its capability's).
Runs of different GPUs, flushes or points are refused: their medians would mean nothing (``--common-points``
takes runs of other points at the points they share).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from vllm_moonep.common.grouped_gemm.policy import policy_for
from vllm_moonep.testing.models import model
from vllm_moonep.tools.timing import pooled_ratio

__all__ = ["COLUMNS", "POOLED", "auto_column", "left_out", "load_runs", "median_rows", "pooled_ratios"]

#: the timed columns a run may hold (``<name>_us`` in its rows), in the order they are printed
COLUMNS = ("triton", "deepgemm", "deepgemm_down", "quack", "vllm", "poc", "read", "read_phased")
#: the library columns ``pooled_ratios`` sets against the Triton kernels (the other columns are no candidates)
POOLED = ("deepgemm", "deepgemm_down", "quack", "vllm")
#: the runs' fields that must agree
SAME = ("device", "flush")


def _key(row: dict) -> tuple:
    return row["shape"], row["tokens"], row["routing"]


def load_runs(paths: list[str], common: bool = False) -> list[dict]:
    """The runs, once they are of one GPU, one flush and the same points (``ValueError`` naming what
    differs); with ``common``, runs of other points too, each cut to the points every run has (a full
    table and runs of its power-bound points alone, pooled there)."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    if len(runs) < 2:
        raise ValueError(f"bench_median: give two runs or more, got {len(runs)}")
    for field in SAME:
        seen = {r.get(field) for r in runs}
        if len(seen) > 1:
            raise ValueError(f"bench_median: the runs differ in {field}: {sorted(map(str, seen))}")
    if common:
        shared = set.intersection(*({_key(row) for row in r["rows"]} for r in runs))
        if not shared:
            raise ValueError(f"bench_median: the runs share no point: {', '.join(paths)}")
        runs = [{**r, "rows": [row for row in r["rows"] if _key(row) in shared]} for r in runs]
    points = [sorted(_key(row) for row in r["rows"]) for r in runs]
    for p, pts in zip(paths[1:], points[1:], strict=True):
        if pts != points[0]:
            raise ValueError(f"bench_median: {p} has other points than {paths[0]}: "
                             f"{sorted(set(pts) ^ set(points[0]))}")
    return runs


def auto_column(device: str, capability: tuple[int, int] | None, shape: str, tokens: int,
                timed: set[str], known: set[str] | None = None) -> str | None:
    """The column ``impl="auto"`` runs at the point on ``device`` (the first of ``tuning.json``'s regimes
    covering ``tokens`` whose column the runs timed, else ``triton``); ``None`` for a shape the models
    do not know, and where a covering regime's column is not in ``known`` (the columns the runs' rows have,
    timed or not: a run made before the column existed cannot tell whether ``auto`` ran it)."""
    try:
        dims = model(shape).dims()
    except (KeyError, ValueError):
        return None
    for regime in policy_for(device, capability).regimes_at(dims["H"], dims["I"], tokens):
        if regime.impl in timed:
            return regime.impl
        if known is not None and regime.impl not in known:
            return None
    return "triton"


def left_out(run: dict) -> set[str]:
    """The columns a flag left out of a run (``bench_experts --no-deepgemm``: its DeepGEMM columns read ``None``
    with the reason ``left out``): unlike a library that cannot run there, they say nothing of what ``auto`` runs."""
    absent = (run.get("deepgemm") or {}).get("absent") or {}
    return {"deepgemm", "deepgemm_down"} if any(str(v).startswith("left out") for v in absent.values()) else set()


def _timings(rows: list[dict], name: str) -> list[float] | None:
    """Every round timing of column ``name`` over ``rows`` (one point of each run), or ``None`` where a row
    kept none of it or one that is not a finite number (a column that could not run there)."""
    out: list[float] = []
    for r in rows:
        got = (r.get("times_us") or {}).get(name)
        if not got or not all(isinstance(t, (int, float)) and math.isfinite(t) for t in got):
            return None
        out += got
    return out


def pooled_ratios(rows: list[dict]) -> dict | None:
    """For one point's rows (one per run): the median of each library column's round timings over every run
    against the median of the Triton call's and the control's together (the same kernels timed as two columns),
    and ``control``: the control's pooled median over Triton's, the noise that ratio carries. ``None`` where a
    run kept no round timings of both (runs before alternated rounds)."""
    tri, ctl = _timings(rows, "triton"), _timings(rows, "control")
    if tri is None or ctl is None:
        return None
    out = {"control": statistics.median(ctl) / statistics.median(tri), "timings": len(tri)}
    for c in POOLED:
        got = _timings(rows, c)
        if got is not None:
            out[c] = pooled_ratio(got, tri, ctl)
    return out


def median_rows(runs: list[dict], capability: tuple[int, int] | None = None) -> list[dict]:
    """Per point (in the first run's order): the median of each column every run timed, its ratio to the
    median floor, the Triton times' spread, and the column ``impl="auto"`` runs."""
    device = runs[0]["device"]
    cap = capability or (tuple(runs[0]["capability"]) if runs[0].get("capability") else None)
    by_run = [{_key(row): row for row in r["rows"]} for r in runs]
    skipped = set().union(*(left_out(r) for r in runs))
    out = []
    for row in runs[0]["rows"]:
        same = [b[_key(row)] for b in by_run]
        floor = statistics.median(r["floor_us"] for r in same)
        med = {}
        known = {c for c in COLUMNS if all(f"{c}_us" in r for r in same)} - skipped
        for c in COLUMNS:
            times = [r.get(f"{c}_us") for r in same]
            if all(isinstance(t, (int, float)) for t in times):
                med[c] = statistics.median(times)
        tri = [r["triton_us"] for r in same]
        auto = auto_column(device, cap, row["shape"], row["tokens"], set(med), known)
        entry = {
            "shape": row["shape"], "tokens": row["tokens"], "routing": row["routing"], "runs": len(same),
            "floor_us": floor, "floor_kind": row["floor_kind"], "us": med,
            "x_floor": {c: t / floor for c, t in med.items()},
            "triton_spread": max(tri) / min(tri) - 1, "auto": auto, "pooled": pooled_ratios(same),
        }
        if auto is not None:
            entry["auto_us"] = med[auto]
            entry["auto_tflops_useful"] = row["flop"] / (med[auto] * 1e-6) / 1e12
        out.append(entry)
    return out


def _table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if any(c in r["us"] for r in rows)]
    head = ["shape", "tokens", "routing", "floor us", *cols, "Triton spread", "auto", "auto x floor",
            "auto useful TFLOP/s", "pooled / Triton (control)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]
    for r in rows:
        cells = [r["shape"], str(r["tokens"]), r["routing"], f"{r['floor_us']:.1f} ({r['floor_kind']})"]
        cells += [f"{r['us'][c]:.1f} ({r['x_floor'][c]:.2f})" if c in r["us"] else "-" for c in cols]
        cells.append(f"{100 * r['triton_spread']:.1f}%")
        if r["auto"] is None:
            cells += ["-", "-", "-"]
        else:
            cells += [r["auto"], f"{r['x_floor'][r['auto']]:.2f}", f"{r['auto_tflops_useful']:.0f}"]
        pooled = r.get("pooled")
        cells.append("-" if pooled is None else ", ".join(f"{c} {pooled[c]:.3f}" for c in POOLED if c in pooled)
                     + f" ({pooled['control']:.3f}, {pooled['timings']} timings)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _capability(v: str) -> tuple[int, int]:
    try:
        major, minor = (int(p) for p in v.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--capability must be MAJOR.MINOR (e.g. 9.0), got {v!r}") from None
    return major, minor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_moonep.tools.bench_median", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_experts.json files of one GPU and one flush")
    ap.add_argument("--common-points", action="store_true",
                    help="take runs of other points too, each cut to the points all of them have")
    ap.add_argument("--capability", type=_capability, default=None,
                    help="the GPU's compute capability (MAJOR.MINOR) where the runs do not record it")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs, args.common_points)
    except (OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    rows = median_rows(runs, args.capability)
    print(f"# medians of {len(runs)} runs on {runs[0]['device']} ({runs[0]['flush']} flush): "
          + ", ".join(r.get("date", "?")[:19] for r in runs))
    print(_table(rows))
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_median.json"), "w") as f:
            json.dump({"runs": args.runs, "device": runs[0]["device"], "flush": runs[0]["flush"], "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
