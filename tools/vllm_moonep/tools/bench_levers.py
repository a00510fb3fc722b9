"""A/B of a Triton expert-kernel lever against the committed tiles, in one run on one GPU.

``python -m vllm_moonep.tools.bench_levers [--shapes kimi-k2,qwen3-30b-a3b] [--tokens 256,1024,4096] [--rep 50]
[--rounds 4]``

The lever: ``"w13i"`` gate/up tiles (``triton_tiles.gate_up_acc``: gate and up interleaved row by row in
one weight, one ``[2BN, BK]`` block and one MMA of ``2BN`` columns per step instead of two of ``BN``).
For each shape, tokens per rank and routing (balanced, skewed) it builds the same rank-0 case as
``bench_experts`` (its ``rank0_case``, ``make_weights``, ``make_inputs``, ``entry_ends``: rank 0 of EP=8,
the real planner's ``cu_seqlens`` over ``E+B`` groups, padding 128) and times, as CUDA-graph replays
(``bench_experts._graphed``, ``_bench``: median, L2 flushed)::

    committed     select_config's tiles for the point (tuning.json, the step's tokens per rank)
    w13i          the same tiles with "w13i": true (gate/up reads prepare_weights' interleaved copy)
    w13i BN/2     where the committed gate/up BN makes 2*BN exceed 256 (the widest warpgroup MMA):
                  the same tiles with BN halved and "w13i" (the same MMA width as committed)
    control       the committed tiles again, as a variant of their own (own graph and buffers): its
                  ratio to committed is the run's noise at the point, the band a lever must clear

each as the whole expert compute, as the layer calls it (``row_ends``, ``zero_tail=False``, ``padded=False``,
as ``bench_experts``), and as the gate/up kernel alone (``_launch_gate_up``: the only kernel the lever
changes). The variants are timed in alternation, ``--rounds`` times, each round starting one variant later
than the last (at the power-bound 4096-token points the same tiles read up to 10% apart by their place in
a round: the control measured it), and each time is the median of the rounds. Each
variant's output (untimed call, every row written) is checked against the committed one: relative
error. Prints the ceilings (``bench_experts.measure_ceilings``) and a markdown table; writes
``bench_levers.json`` to ``$OUT`` if set. A variant that cannot run (compile error, out of shared memory)
reads ``-`` with the reason.

Memory: the interleaved copy is one more copy of gate and up (Kimi-K2: 432 x 2 x 2048 x 7168 bf16 =
25 GB beside the 38 GB of weights), made once per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

from vllm_moonep.engine import default_num_slots
from vllm_moonep.testing.reference import relative_error
from vllm_moonep.tools.bench_experts import (R, SHAPES, SKEW_SIGMA, _bench, _ceiling_line, _graphed, entry_ends,
                                             make_inputs, make_weights, measure_ceilings, rank0_case, tile_text)
from vllm_moonep.tools.timing import ROUNDS, rotated_times

#: the points of the A/B by default: where the gate/up GEMM is compute-bound enough for the MMA to matter
DEFAULT_TOKENS = (256, 1024, 4096)
#: the shapes by default (``bench_experts.SHAPES``)
DEFAULT_SHAPES = ("kimi-k2", "qwen3-30b-a3b")
#: do_bench ``rep`` (ms) per timing by default: 2 shapes x 3 points x 2 routings x 4 variants x 2 scopes x ROUNDS
#: timings (about 40 s of replays, each timing also pays its warm-up and L2 flushes), plus compiles
DEFAULT_REP = 50
#: the widest warpgroup MMA's N on Hopper: a w13i tile of 2*BN above it runs two MMAs per step anyway
MAX_MMA_N = 256


def _positive_ints(text: str) -> list[int]:
    vals = [int(t) for t in text.split(",") if t.strip()]
    if not vals or any(v < 1 for v in vals):
        raise ValueError(text)
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad shapes or tokens are refused with a sentence (exit status 2)."""
    ap = argparse.ArgumentParser(prog="bench_levers", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                    help=f"comma-separated model shapes, of {', '.join(sorted(SHAPES))} (default: %(default)s)")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                    help="comma-separated tokens per rank (default: %(default)s)")
    ap.add_argument("--rep", type=int, default=DEFAULT_REP,
                    help="triton.testing.do_bench rep (ms) per timing (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="alternated rounds of timings per variant, each round's order rotated (default: %(default)s)")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: unknown shape(s) {bad or [args.shapes]}; known: {', '.join(sorted(SHAPES))}")
    try:
        tokens = _positive_ints(args.tokens)
    except ValueError:
        ap.error(f"--tokens must be comma-separated positive integers, got {args.tokens!r}")
    if args.rep < 1:
        ap.error(f"--rep must be a positive number of milliseconds, got {args.rep}")
    if args.rounds < 1:
        ap.error(f"--rounds must be a positive number of rounds, got {args.rounds}")
    args.shapes, args.tokens = shapes, tokens
    return args


def variants(committed: dict) -> dict[str, dict]:
    """The configs one point times: the committed tiles, the same with ``"w13i"``, (where the committed gate/up
    BN makes ``2*BN`` exceed ``MAX_MMA_N``) with BN halved and ``"w13i"``, and the committed tiles again as
    ``control`` (last)."""
    gu = committed["gate_up"]
    out = {"committed": committed, "w13i": {**committed, "gate_up": {**gu, "w13i": True}}}
    if 2 * gu["BN"] > MAX_MMA_N:
        out["w13i_bn_half"] = {**committed, "gate_up": {**gu, "BN": gu["BN"] // 2, "w13i": True}}
    out["control"] = {k: dict(v) for k, v in committed.items()}
    return out


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def point(tk, weights, prep, sname: str, shp: dict, tokens: int, routing: str, sigma: float, dev, rep: int,
          rounds: int = ROUNDS) -> dict:
    """One point's row: its variants (``variants``) checked (untimed call, every row written) and timed
    (whole compute and gate/up kernel, ``rounds`` alternated rounds of ``_graphed`` replays, ``timing.rotated_times``)."""
    H, I = shp["H"], shp["I"]
    G = weights.num_groups
    cu_h, real, nvs, mv = rank0_case(shp, tokens, sigma)
    cu = cu_h.to(dev)
    x, rw = make_inputs(H, cu_h, real, nvs, dev, seed=tokens * 7 + int(sigma * 10))
    ends = entry_ends(cu_h, real).to(dev)
    n = int(cu_h[-1])
    confs = variants(tk.select_config(H, I, nvs, G, tokens=tokens))
    eff = torch.empty(G, dtype=torch.int32, device=dev)
    tk._launch_trim(cu, rw, eff)
    outs, fns, why = {}, {}, {}
    for name, conf in confs.items():
        try:
            o = torch.full_like(x, float("nan"))
            act = torch.empty(nvs, I, device=dev, dtype=x.dtype)
            tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=conf, act=act, padded=False, row_ends=ends)
            outs[name] = o[:n].clone()  # the timed calls write o again (tails left)
            whole = (lambda conf=conf, o=o, act=act:
                     tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=conf, act=act, padded=False,
                                          row_ends=ends, zero_tail=False))
            gu_only = (lambda conf=conf, act=act:
                       tk._launch_gate_up(x, rw, cu, eff, prep, act, conf["gate_up"], False))
            fns[name] = (_graphed(whole), _graphed(gu_only))
        except Exception as e:  # out of resources, compile errors: the column reads "-"
            why[name] = f"{type(e).__name__}: {str(e)[:160]}"
            print(f"#   {sname} t={tokens} {routing} {name}: - ({why[name]})", flush=True)
    def both(name):  # one variant's whole compute, then its gate/up kernel (us)
        (r_whole, _g1), (r_gu, _g2) = fns[name]
        return _bench(r_whole, rep=rep) * 1e3, _bench(r_gu, rep=rep) * 1e3

    # alternated and rotated: drift and place in a round land on every variant alike
    per_round = rotated_times(list(fns), both, rounds)
    times = {k: {"whole": [w for w, _ in v], "gate_up": [g for _, g in v]} for k, v in per_round.items()}
    del fns
    med = {k: {s: statistics.median(v) for s, v in t.items()} for k, t in times.items()}
    base = outs.get("committed")
    row = {"shape": sname, "tokens": tokens, "routing": routing, "maxvio": mv, "NvS": nvs, "rows": n,
           "real_rows": int(real.sum()), "busy_groups": int((real > 0).sum()),
           "configs": confs, "absent": why, "times_us": times}
    for name in confs:
        m = med.get(name)
        row[f"{name}_us"] = None if m is None else m["whole"]
        row[f"{name}_gate_up_us"] = None if m is None else m["gate_up"]
        got = outs.get(name)
        row[f"{name}_unwritten"] = None if got is None else int(torch.isnan(got).sum())
        row[f"{name}_err"] = None if got is None or base is None or name == "committed" else relative_error(got, base)
        if name != "committed" and m is not None and "committed" in med:
            row[f"{name}_ratio"] = m["whole"] / med["committed"]["whole"]
            row[f"{name}_gate_up_ratio"] = m["gate_up"] / med["committed"]["gate_up"]
    return row


def table(rows: list[dict]) -> list[str]:
    """The markdown table of ``point`` rows, then a line naming any variant with wrong outputs (rows left
    unwritten, or relative error >= 1e-2 against the committed tiles) and one per variant that could not run."""
    lines = ["| shape | tokens | routing | committed gate/up tile | committed us | w13i us | ratio | gate/up ratio | err "
             "| w13i BN/2 us | ratio | gate/up ratio | err | control ratio | gate/up ratio |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gu = r["configs"]["committed"]["gate_up"]
        tile = tile_text(gu)
        half = "w13i_bn_half" in r["configs"]
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {tile} | {_fmt(r['committed_us'])} | "
                     f"{_fmt(r['w13i_us'])} | {_fmt(r.get('w13i_ratio'), '.3f')} | "
                     f"{_fmt(r.get('w13i_gate_up_ratio'), '.3f')} | {_fmt(r['w13i_err'], '.1e')} | "
                     + (f"{_fmt(r['w13i_bn_half_us'])} | {_fmt(r.get('w13i_bn_half_ratio'), '.3f')} | "
                        f"{_fmt(r.get('w13i_bn_half_gate_up_ratio'), '.3f')} | {_fmt(r['w13i_bn_half_err'], '.1e')} |"
                        if half else "- | - | - | - |")
                     + f" {_fmt(r.get('control_ratio'), '.3f')} | {_fmt(r.get('control_gate_up_ratio'), '.3f')} |")
    bad = wrong(rows)
    if bad:
        lines.append(f"# WRONG OUTPUTS (unwritten rows, or relative error >= 1e-2 against the committed tiles): {bad}")
    for r in rows:
        for k, why in r["absent"].items():
            lines.append(f"# {r['shape']} t={r['tokens']} {r['routing']} {k}: - ({why})")
    return lines


def wrong(rows: list[dict]) -> list[tuple]:
    """``(shape, tokens, routing, variant)`` of each variant whose check call left rows unwritten or whose output
    is off the committed tiles' by a relative error of 1e-2 or more."""
    return [(r["shape"], r["tokens"], r["routing"], k) for r in rows for k in r["configs"]
            if (r.get(f"{k}_unwritten") or 0) > 0 or not (r.get(f"{k}_err") is None or r[f"{k}_err"] < 1e-2)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_levers: needs a CUDA GPU (it times Triton kernels as CUDA-graph replays); none is visible here",
              file=sys.stderr)
        return 2
    import triton

    from vllm_moonep.common.grouped_gemm import GroupedWeights
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ceil = measure_ceilings(dev, warm_s=1.0, rounds=3)
    print(f"# device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    print("# " + _ceiling_line(ceil, "measured first"), flush=True)
    rows: list[dict] = []
    for sname in args.shapes:
        shp = SHAPES[sname]
        H, I, E = shp["H"], shp["I"], shp["E"]
        G = E + default_num_slots(E, R)
        weights = GroupedWeights.contiguous(*make_weights(H, I, G, dev))
        prep = tk.prepare_weights(weights, dev, w13i=True)  # the interleaved copy, once per shape, before any capture
        for tokens in args.tokens:
            for routing, sigma in (("balanced", 0.0), ("skewed", SKEW_SIGMA)):
                row = point(tk, weights, prep, sname, shp, tokens, routing, sigma, dev, args.rep, args.rounds)
                rows.append(row)
                print(f"# {sname:14s} t={tokens:5d} {routing:8s} committed {_fmt(row['committed_us'])} us "
                      f"(gate/up {_fmt(row['committed_gate_up_us'])})  w13i {_fmt(row['w13i_us'])} us "
                      f"(gate/up {_fmt(row['w13i_gate_up_us'])}) x{_fmt(row.get('w13i_ratio'), '.3f')} "
                      f"err {_fmt(row['w13i_err'], '.1e')}"
                      + (f"  w13i BN/2 {_fmt(row['w13i_bn_half_us'])} us x{_fmt(row.get('w13i_bn_half_ratio'), '.3f')}"
                         if "w13i_bn_half" in row["configs"] else "")
                      + f"  control x{_fmt(row.get('control_ratio'), '.3f')}", flush=True)
        del weights, prep
        tk._CACHE.clear()
        torch.cuda.empty_cache()
    print()
    print("# " + _ceiling_line(ceil, props.name))
    print()
    print("Times: CUDA-graph replay, median of the alternated rounds; whole = the expert compute as the layer runs it, "
          "gate/up = that kernel alone; ratio = variant / committed (below 1: the lever is faster); err = the "
          "variant's output against the committed one (relative); control = the committed tiles timed again as a "
          "variant: a lever ratio no farther from 1 than the control's is noise.")
    print()
    for line in table(rows):
        print(line)
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": props.name,
                  "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                  "python": platform.python_version(), "ceilings": ceil, "rounds": args.rounds, "rep_ms": args.rep,
                  "rows": rows, "argv": sys.argv}
        with open(os.path.join(out_dir, "bench_levers.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 1 if wrong(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
