"""Dispatch and combine of the built-in engine alone: time per call and bytes moved per rank.

    python -m vllm_moonep.tools.bench_dispatch --device cuda --ranks 8 --preset kimi-k2 \
        --tokens 128 1024 4096 --maxvio 0 1 2 [--backend nccl] [--profile]

Payload per rank as the MoonEP benchmarks define it: ``S*K*H*2`` bytes (every token slot's bf16
row, whichever rank it goes to); "moved" counts only rows that leave the rank. Rates are payload
over the median time, to compare with the interconnect (NVLink: 450 GB/s per direction on
H100/H200). ``--profile`` prints the top kernels of one dispatch on rank 0 (where the time goes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from vllm_moonep.common.routing import route, sigma_for_maxvio
from vllm_moonep.engine import Buffer
from vllm_moonep.tools.launch import run_on_ranks, shutdown_pools

SHAPES = {  # hidden size, experts, top-k
    "qwen3-30b-a3b": (2048, 128, 8),
    "deepseek-v3": (7168, 256, 8),
    "kimi-k2": (7168, 384, 8),
}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rank_bench(H, E, K, S, sigma, device, iters, warmup, profile):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(S, H, K, E, R, B=E // R, device=dev, check_inputs=False)
    ids, w = route(S, E, K, sigma=sigma, seed=1, rank=r)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16).to(dev)
    ids, w = ids.to(dev), w.to(dev)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    t_d, t_c = [], []
    plan = None
    for i in range(warmup + iters):
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
        _sync(dev)
        t1 = time.perf_counter()
        buf.combine(plan, xn)
        _sync(dev)
        t2 = time.perf_counter()
        if i >= warmup:
            t_d.append(t1 - t0)
            t_c.append(t2 - t1)
    prof = None
    if profile and r == 0:
        from torch.profiler import ProfilerActivity, profile as tprofile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with tprofile(activities=acts) as p:
            buf.dispatch(x, w, ids, tpe)
            _sync(dev)
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        prof = p.key_averages().table(sort_by=key, row_limit=15)
    elif profile:
        buf.dispatch(x, w, ids, tpe)
    sent = sum(plan.send_splits) - plan.send_splits[r]
    buf.destroy()
    return {"dispatch_s": statistics.median(t_d), "combine_s": statistics.median(t_c),
            "rows_out": sent, "slots_used": int((plan.experts_to_copy[r] >= 0).sum()), "profile": prof}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_dispatch", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2", choices=list(SHAPES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    H, E, K = SHAPES[a.preset]
    env = {"VLLM_MOONEP_THREADS_PER_RANK": "1"}
    rows = []
    try:
        for S in a.tokens:
            for mv in a.maxvio:
                sigma = sigma_for_maxvio(mv, E, K, S * a.ranks)
                res = run_on_ranks(a.ranks, rank_bench, H, E, K, S, sigma, a.device, a.iters, a.warmup,
                                   a.profile, env=env, backend=a.backend)
                d = max(x["dispatch_s"] for x in res)
                c = max(x["combine_s"] for x in res)
                payload = S * K * H * 2
                rows.append({"tokens": S, "maxvio": mv, "dispatch_us": d * 1e6, "combine_us": c * 1e6,
                             "payload_MB": payload / 1e6, "moved_MB_max": max(x["rows_out"] for x in res) * H * 2 / 1e6,
                             "dispatch_GBs": payload / d / 1e9, "combine_GBs": payload / c / 1e9,
                             "slots_used": sum(x["slots_used"] for x in res)})
                if a.profile and res[0]["profile"]:
                    print(f"--- one dispatch, rank 0, tokens {S}, maxvio {mv} ---\n{res[0]['profile']}")
    finally:
        shutdown_pools()
    print(f"built-in engine, {a.preset} (H={H}, E={E}, K={K}), {a.ranks} ranks on {a.device} over {a.backend}")
    print("| tokens/rank | maxvio | dispatch us | combine us | payload MB/rank | moved MB (max rank) | dispatch GB/s | combine GB/s | slots used |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['maxvio']:.1f} | {r['dispatch_us']:.0f} | {r['combine_us']:.0f} | {r['payload_MB']:.1f} | "
              f"{r['moved_MB_max']:.1f} | {r['dispatch_GBs']:.1f} | {r['combine_GBs']:.1f} | {r['slots_used']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
