"""The device planner against the host planner it replaces: time per call, same run, same inputs.

    python -m vllm_moonep.tools.bench_planner --device cuda --ranks 8 --experts 384 \
        --tokens 1 128 1024 8192 --maxvio 0 2
    TRITON_INTERPRET=1 python -m vllm_moonep.tools.bench_planner --device cpu --tokens 4 --ranks 4 --experts 32

Columns (microseconds, median over ``--iters`` calls after ``--warmup``, CUDA events on the GPU):
``host`` is the anchor the engine pays today: the device->host copy of ``tpe [R, E]`` plus
``plan_global`` on the CPU copy. ``plan`` and ``place`` are ``DevicePlanner.plan`` and
``.place`` (rank 0) called eagerly; ``graph`` is one replay of a CUDA graph holding plan+place.
Every configuration is first checked bit for bit against the host planner. ``--device cpu``
(with ``TRITON_INTERPRET=1`` set before start) is a smoke check of the same code path: its times
are the interpreter's and mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import fields

import torch

from vllm_moonep.engine import default_num_slots
from vllm_moonep.engine.planning.planner import place_entries, plan_global
from vllm_moonep.testing.routing import route, sigma_for_maxvio


def _timer(dev: torch.device):
    """``measure(fn) -> seconds`` for one call: CUDA events on the GPU, wall clock on the CPU."""
    if dev.type == "cuda":
        def measure(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
    else:
        def measure(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return measure


def _median(measure, fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(measure(fn) for _ in range(iters))


def bench_one(R, E, K, S, B, tp, maxvio, dev, iters, warmup, plan_warps=None, rule4_chunk=None, rule4=None, wide=None):
    """Times of one configuration (seconds) after an exactness check against the host planner."""
    from vllm_moonep.engine.planning.device_planner import DevicePlanner

    sigma = sigma_for_maxvio(maxvio, E, K, S * R)
    ids = [route(S, E, K, sigma=sigma, seed=1, rank=r)[0] for r in range(R)]
    tpe_cpu = torch.stack([torch.bincount(i.reshape(-1).long(), minlength=E) for i in ids])
    tpe = tpe_cpu.to(torch.int32).to(dev)
    ids0 = ids[0].to(dev)
    dp = DevicePlanner(R, E, S, K, B, tp, dev, plan_warps=plan_warps, rule4_chunk=rule4_chunk, rule4=rule4, wide=wide)

    gp = dp.plan(tpe)
    dest, row = dp.place(gp, 0, ids0)
    ref = plan_global(tpe_cpu, S, K, B, tp)
    ok = all(torch.equal(getattr(gp, f.name).cpu(), getattr(ref, f.name)) for f in fields(ref))
    rd, rr = place_entries(ref, 0, ids[0])
    ok = ok and torch.equal(dest.cpu(), rd) and torch.equal(row.cpu(), rr)

    measure = _timer(dev)
    out = {"match": ok, "slots": int((gp.experts_to_copy >= 0).sum()), "arith": dp.arithmetic}
    out["host"] = _median(measure, lambda: plan_global(tpe.cpu(), S, K, B, tp), iters, warmup)
    out["plan"] = _median(measure, lambda: dp.plan(tpe), iters, warmup)
    out["place"] = _median(measure, lambda: dp.place(gp, 0, ids0), iters, warmup)
    out["graph"] = float("nan")
    if dev.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dp.place(dp.plan(tpe), 0, ids0)
        out["graph"] = _median(measure, graph.replay, iters, warmup)
        out["kernels"] = _kernel_times(lambda: dp.place(dp.plan(tpe), 0, ids0))
    return out


def _kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Device time of each kernel of ``fn`` (us per call, CUDA profiler): where plan+place goes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in p.key_averages() if e.device_time_total > 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_planner", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024, 8192])
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 2.0])
    ap.add_argument("--slots", type=int, default=None, help="B (default E // R)")
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default 200 on cuda, 3 on cpu)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--plan-warps", type=int, default=None)
    ap.add_argument("--rule4", choices=["sort", "pairwise"], default=None,
                    help="how rule 4 orders the slots (default: the planner's own, a sort above "
                         "RULE4_SORT_ABOVE experts per rank)")
    ap.add_argument("--rule4-chunk", type=int, default=None,
                    help="columns per step of the pairwise slot-order count when E/R > 64 (a power of two; default: "
                         "the planner's own, 2048 / padded E/R)")
    ap.add_argument("--wide", choices=["yes", "no"], default=None,
                    help="the plan kernel's arithmetic in int64 (yes) or int32 (no); default: the planner's own "
                         "(int32 where device_planner.narrow_fits)")
    a = ap.parse_args(argv)
    wide = None if a.wide is None else a.wide == "yes"
    dev = torch.device(a.device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        ap.error("--device cpu runs the Triton interpreter: start with TRITON_INTERPRET=1")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device")
    iters = a.iters or (200 if dev.type == "cuda" else 3)
    warmup = a.warmup if a.warmup is not None else (20 if dev.type == "cuda" else 1)
    R, E, K = a.ranks, a.experts, a.topk
    B = a.slots or default_num_slots(E, R)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    print(f"planner, R={R} E={E} K={K} B={B} tp={a.token_padding} on {name}; us per call, median of {iters}")
    print("| tokens/rank | maxvio | slots used | match | plan arithmetic | host (D2H + plan_global) | plan | place "
          "| graph plan+place | host/plan | host/graph |")
    print("|---:|---:|---:|:---:|:---:|---:|---:|---:|---:|---:|---:|")
    kernels = []
    for S in a.tokens:
        for mv in a.maxvio:
            try:
                r = bench_one(R, E, K, S, B, a.token_padding, mv, dev, iters, warmup, a.plan_warps, a.rule4_chunk, a.rule4,
                              wide)
            except ValueError as exc:  # a choice the planner refuses (--rule4-chunk, --plan-warps)
                ap.error(str(exc))
            us = {k: r[k] * 1e6 for k in ("host", "plan", "place", "graph")}
            print(f"| {S} | {mv:.1f} | {r['slots']} | {'yes' if r['match'] else 'NO'} | {r['arith']} | {us['host']:.1f} | "
                  f"{us['plan']:.1f} | {us['place']:.1f} | {us['graph']:.1f} | {us['host'] / us['plan']:.1f}x | "
                  f"{us['host'] / us['graph']:.1f}x |", flush=True)
            kernels.append((S, mv, r.get("kernels")))
    if any(k for _, _, k in kernels):
        print("device time per kernel, us per plan+place (CUDA profiler):")
        for S, mv, k in kernels:
            print(f"  tokens {S}, maxvio {mv:.1f}: " + ", ".join(f"{n} {v:.1f}" for n, v in (k or {}).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
