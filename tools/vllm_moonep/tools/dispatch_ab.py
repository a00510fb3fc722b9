"""Engine variants' dispatch and combine against each other: the median over interleaved rounds of
``bench_dispatch`` runs, point by point, each variant's ratio to the first (the anchor variant).

    NAME:run.json ...   (bench_dispatch --json of each variant and round, one GPU, the same points)
        -> per (tokens, maxvio): each variant's median over its rounds of every timed column
           (dispatch + combine as one graph, each alone, eager, device and host time)
        -> ratio of each variant's median to the first variant's (the order given)
        -> the plain all-to-all of the same payload per variant (device time beside device time): the
           anchor, which no variant changes, so its spread is the noise a ratio must stand out of

``python -m vllm_moonep.tools.dispatch_ab old:r1_old.json new:r1_new.json old:r2_old.json ...
[--metric graph_dev_us]``: a markdown table on stdout, ``dispatch_ab.json`` to ``$OUT`` if set.
``tools/gpu_engine_ab.sh`` makes the runs on a GPU machine (the engine folder of each variant in turn).
Runs of different GPUs, presets, world sizes, transports or points are refused: their ratios would mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

__all__ = ["ANCHORS", "METRICS", "anchor_of", "format_table", "load_variants", "main", "median_table"]

#: the timed columns of a ``bench_dispatch`` row, the first the default figure: dispatch + combine replayed as
#: one CUDA graph, device time (what a captured MoE step pays); None in a row where the run did not time it
METRICS = ("graph_dev_us", "dispatch_dev_us", "combine_dev_us", "graph_us", "dispatch_us", "combine_us")
#: the anchors' columns: a plain all-to-all of the same payload, device and host time (the table shows the one of
#: the metric's kind)
ANCHORS = ("a2a_dev_us", "a2a_us")
#: the runs' fields that must agree (and their command lines but for the output path)
SAME = ("device", "gpus", "backend", "preset", "H", "E", "K", "ranks", "ranks_per_node", "transport")


def _point(row: dict) -> tuple:
    return row["tokens"], row["maxvio"]


def _options(argv: list[str]) -> list[str]:
    """A run's command line without the program and its ``--json`` path (which differ per run)."""
    out, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def load_variants(specs: list[str]) -> dict[str, list[dict]]:
    """``NAME:PATH`` specs -> the runs of each variant, in the order the names first appear (``ValueError``
    naming what is wrong: a spec without a name, fewer than two variants, runs that differ in a field of
    ``SAME`` or in their points)."""
    variants: dict[str, list[dict]] = {}
    for spec in specs:
        name, sep, path = spec.partition(":")
        if not sep or not name or not path:
            raise ValueError(f"dispatch_ab: give each run as NAME:PATH, got {spec!r}")
        with open(path) as f:
            variants.setdefault(name, []).append(json.load(f))
    if len(variants) < 2:
        raise ValueError(f"dispatch_ab: give runs of two variants or more, got {sorted(variants)}")
    runs = [r for rs in variants.values() for r in rs]
    for field in SAME:
        seen = {json.dumps(r.get(field)) for r in runs}
        if len(seen) > 1:
            raise ValueError(f"dispatch_ab: the runs differ in {field}: {sorted(seen)}")
    commands = {json.dumps(_options(r.get("argv", []))) for r in runs}
    if len(commands) > 1:
        raise ValueError(f"dispatch_ab: the runs were made with different options: {sorted(commands)}")
    points = {tuple(sorted(_point(row) for row in r["rows"])) for r in runs}
    if not next(iter(points)):
        raise ValueError("dispatch_ab: the runs hold no timed point")
    if len(points) > 1:
        raise ValueError(f"dispatch_ab: the runs time different points (tokens, maxvio): {sorted(points)}")
    return variants


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def median_table(variants: dict[str, list[dict]]) -> list[dict]:
    """One row per point: per variant, the median of each timed column over its runs (``None`` where no run
    timed it), its ratio to the first variant's, and each anchor's median and spread (slowest / fastest - 1)."""
    first = next(iter(variants))
    points = [_point(row) for row in next(iter(variants.values()))[0]["rows"]]
    out = []
    for pt in points:
        row: dict = {"tokens": pt[0], "maxvio": pt[1], "variants": {}}
        for name, runs in variants.items():
            rows = [next(r for r in run["rows"] if _point(r) == pt) for run in runs]
            med = {m: _median([r.get(m) for r in rows]) for m in (*METRICS, *ANCHORS)}
            for a in ANCHORS:
                vals = [r.get(a) for r in rows if r.get(a) is not None]
                med[f"{a}_spread"] = max(vals) / min(vals) - 1 if vals else None
            med["runs"] = len(rows)
            row["variants"][name] = med
        base = row["variants"][first]
        for med in row["variants"].values():
            med["ratio"] = {m: (med[m] / base[m] if med[m] is not None and base[m] else None) for m in METRICS}
        out.append(row)
    return out


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def anchor_of(metric: str) -> str:
    """The anchor column beside ``metric``: device time beside device time, host time beside host time."""
    return ANCHORS[0] if metric.endswith("_dev_us") else ANCHORS[1]


def format_table(table: list[dict], metric: str) -> str:
    names = list(table[0]["variants"]) if table else []
    anchor = anchor_of(metric)
    head = ["tokens", "maxvio"] + [f"{n} {metric} (x {names[0]})" for n in names] + [f"{n} {anchor} (spread)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in table:
        cells = [str(row["tokens"]), _fmt(row["maxvio"], "g")]
        for n in names:
            v = row["variants"][n]
            cells.append(f"{_fmt(v[metric])} ({_fmt(v['ratio'][metric], '.3f')})")
        for n in names:
            v = row["variants"][n]
            spread = "-" if v[f"{anchor}_spread"] is None else f"{100 * v[f'{anchor}_spread']:.0f}%"
            cells.append(f"{_fmt(v[anchor])} ({spread})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_moonep.tools.dispatch_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME:bench_dispatch.json, each variant's runs (the first name is the anchor)")
    ap.add_argument("--metric", default=METRICS[0], choices=METRICS, help="the column the table shows")
    args = ap.parse_args(argv)
    try:
        variants = load_variants(args.runs)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"dispatch_ab: {exc}", file=sys.stderr)
        return 2
    table = median_table(variants)
    runs = {n: len(rs) for n, rs in variants.items()}
    print(f"# {', '.join(f'{n}: {k} run(s)' for n, k in runs.items())}; medians per point, ratio to {next(iter(runs))}")
    print(format_table(table, args.metric))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "dispatch_ab.json"), "w") as f:
            json.dump({"runs": runs, "metric": args.metric, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
