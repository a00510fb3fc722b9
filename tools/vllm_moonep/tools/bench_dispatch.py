"""Dispatch and combine of the built-in engine, next to plain transports of the same payload
measured in the same run and process group.

    python -m vllm_moonep.tools.bench_dispatch --device cuda --backend nccl --ranks 2 --preset kimi-k2 \
        --tokens 1 128 1024 4096 --maxvio 0 2 [--transport auto|symmetric|collective|hybrid] [--programs N]
        [--ranks-per-node K]
    python -m vllm_moonep.tools.bench_dispatch --device cuda --ranks 2 --tokens 1 16 128 --maxvio 0 \
        --programs-sweep 0 16 32

Payload per rank as the MoonEP benchmarks define it: ``S*K*H*2`` bytes (every token slot's bf16
row, whichever rank it goes to). Anchors, on that payload split evenly over the ranks:
``all_to_all_single`` on the process group, and (CUDA) plain one-sided copies into every peer's
symmetric buffer followed by a device barrier. Every time is the slowest rank's median over
``--iters`` calls, host-timed (barrier, synchronize, call, synchronize) and device-timed (CUDA
events around the call); ``graph`` is one replay of a CUDA graph holding dispatch + combine
(symmetric transport). Ratios are engine / anchor (host-timed); the "paired" ratios take an
``all_to_all_single`` timed in every iteration right after that iteration's dispatch and combine
(median of the per-iteration ratios), which cancels the machine's drift over a run.
``--ranks-per-node K`` runs the ranks as simulated nodes of ``K`` ranks (``VLLM_MOONEP_RANKS_PER_NODE``):
``auto`` then resolves to the hybrid transport on GPUs (one-sided inside a block, all-to-all
across blocks); ``--transport collective`` gives the all-collective figure of the same layout (the
anchors stay the plain all-to-all and the one-node one-sided copies).
``--profile`` prints the top kernels of one dispatch on rank 0. ``--programs-sweep`` times, instead,
buffers of several row-kernel program counts against each other in one process (``rank_programs_sweep``).
``--sum`` times, instead, the combine's K-sum alone in this process (``sum_bench``): ``sum_entries`` (the
reduce kernel) on bf16 rows (what the collective and hybrid transports pass) and fp32 rows, the same sum as
K-1 torch adds, and one torch reduction over K (order unspecified) as the anchor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from vllm_moonep.engine import TRANSPORTS, Buffer, current_cuda_device, default_num_slots
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV, NodeMap
from vllm_moonep.engine.transports.symmetric import DEFAULT_PROGRAMS_PER_SM, PROGRAMS_PER_SM
from vllm_moonep.testing.launch import (add_launch_arguments, finish_launched_group, is_driver, resolve_launch,
                                        run_on_ranks, shutdown_pools)
from vllm_moonep.testing.models import MODELS
from vllm_moonep.testing.routing import route, sigma_for_maxvio
from vllm_moonep.tools.timing import capture_graph, sync_device, timed_median

#: the model shapes it runs at: hidden size, experts, top-k (vllm_moonep.testing.models)
SHAPES = {m.key: (m.H, m.E, m.dims()["K"]) for m in MODELS}


def _payload(S, K, H, dev):
    """A dispatch's payload on this rank: ``S*K`` bf16 rows of ``H`` and even splits over the ranks."""
    r, R = dist.get_rank(), dist.get_world_size()
    n = S * K
    send = torch.randn(n, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16).to(dev)
    return send, [n // R + (1 if q < n % R else 0) for q in range(R)]


def all_to_all_call(S, K, H, dev):
    """One plain ``all_to_all_single`` of a dispatch's payload, as a call: the anchor every engine
    figure is compared with."""
    send, splits = _payload(S, K, H, dev)
    recv = torch.empty_like(send)
    return lambda: dist.all_to_all_single(recv, send, splits, splits)


def time_all_to_all(S, K, H, dev, iters, warmup):
    """``(host median s, device median s or None)`` of ``all_to_all_call`` (also moonep-ab's anchor)."""
    return timed_median(all_to_all_call(S, K, H, dev), dev, iters, warmup)


def _anchors(S, K, H, dev, iters, warmup):
    """Plain transports of the same payload (``S*K`` bf16 rows of ``H``, split evenly)."""
    r, R = dist.get_rank(), dist.get_world_size()
    send, splits = _payload(S, K, H, dev)
    n = S * K
    out = {}
    out["a2a"] = time_all_to_all(S, K, H, dev, iters, warmup)
    if dev.type == "cuda":
        from vllm_moonep.engine.heaps import make_heap

        # the one-node anchor, whatever nodes the engine simulates (VLLM_MOONEP_RANKS_PER_NODE)
        heap = make_heap("torch", device=dev, nodes=NodeMap.one_node(R))
        h = heap.allocate((n, H), torch.bfloat16, "bench.anchor")
        views = [heap.peer_view(h, q) for q in range(R)]
        lo = [sum(splits[:q]) for q in range(R)]
        # rank r's chunk for peer q lands at rows [lo[r], lo[r] + splits[q]) of q's buffer (sizes
        # differ by at most one row from the all-to-all's)
        chunks = [(views[q][lo[r]: lo[r] + splits[q]], send[lo[q]: lo[q] + splits[q]]) for q in range(R)]

        def copies():
            for dst, src in chunks:
                dst.copy_(src, non_blocking=True)
            heap.device_barrier()

        out["copies"] = timed_median(copies, dev, iters, warmup)
        heap.free(h)
        heap.close()
    return out


def _host_profile(buf, x, w, ids, tpe, dev, calls=50):
    """Host time per dispatch and combine call (back to back, no synchronization between calls:
    what an eager step pays) and per engine kernel launch in them (``Launcher.timings``); every
    rank runs it. A call served by a private graph replay launches no engine kernel."""
    from vllm_moonep.engine.launch import Launcher

    dist.barrier()
    sync_device(dev)
    Launcher.timings = {}
    t_d = t_c = 0.0
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            d = buf.dispatch(x, w, ids, tpe)
            t1 = time.perf_counter()
            buf.combine(d[3], d[0])
            t_c += time.perf_counter() - t1
            t_d += t1 - t0
        sync_device(dev)
    finally:
        timings, Launcher.timings = Launcher.timings, None
    return {"dispatch_us": t_d / calls * 1e6, "combine_us": t_c / calls * 1e6,
            "launch_us": {k: v[1] / v[0] * 1e6 for k, v in timings.items()},
            "launches_per_call": sum(v[0] for v in timings.values()) / calls}


def rank_bench(H, E, K, S, sigma, device, iters, warmup, profile, transport, programs):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = current_cuda_device()
    buf = Buffer(S, H, K, E, R, B=default_num_slots(E, R), device=dev, check_inputs=False, transport=transport, num_sms=programs)
    ids, w = route(S, E, K, sigma=sigma, seed=1, rank=r)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16).to(dev)
    ids, w = ids.to(dev), w.to(dev)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    state = {}

    def dispatch():
        state["d"] = buf.dispatch(x, w, ids, tpe)

    def combine():
        xn, _, _, plan = state["d"]
        buf.combine(plan, xn)

    def both():
        dispatch()
        combine()

    # dispatch then combine, each timed on its own (combine needs the plan of the dispatch before),
    # then one plain all_to_all_single of the same payload: the paired anchor, measured in the same
    # iteration, so that drift of the machine over the run (the separate anchor below read 47-113 us
    # at 1 token between runs) cancels in the per-iteration ratios
    a2a = all_to_all_call(S, K, H, dev)
    d_host, d_dev, c_host, c_dev, a_host, d_ratio, c_ratio = [], [], [], [], [], [], []
    for i in range(warmup + iters):
        hd = timed_median(dispatch, dev, 1, 0)
        hc = timed_median(combine, dev, 1, 0)
        ha = timed_median(a2a, dev, 1, 0)
        if i >= warmup:
            d_host.append(hd[0]), c_host.append(hc[0]), a_host.append(ha[0])
            d_ratio.append(hd[0] / ha[0]), c_ratio.append(hc[0] / ha[0])
            if hd[1] is not None:
                d_dev.append(hd[1]), c_dev.append(hc[1])
    res = {"dispatch": (statistics.median(d_host), statistics.median(d_dev) if d_dev else None),
           "combine": (statistics.median(c_host), statistics.median(c_dev) if c_dev else None),
           "paired": (statistics.median(a_host), statistics.median(d_ratio), statistics.median(c_ratio)),
           "transport": buf.transport_name}
    res["graph"] = None
    if dev.type == "cuda" and buf.transport_name == "symmetric":
        g = capture_graph(both)
        res["graph"] = timed_median(g.replay, dev, iters, warmup)
        del g
    buf.check_errors(sync=True)
    plan = state["d"][3]
    res["slots_used"] = int((plan.experts_to_copy[r] >= 0).sum())
    prof = None
    if profile and r == 0:
        from torch.profiler import ProfilerActivity, profile as tprofile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with tprofile(activities=acts) as p:
            both()
            sync_device(dev)
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        prof = p.key_averages().table(sort_by=key, row_limit=15)
    elif profile:
        both()
    res["profile"] = prof
    res["host_profile"] = _host_profile(buf, x, w, ids, tpe, dev) if profile else None
    buf.destroy()
    res.update(_anchors(S, K, H, dev, iters, warmup))
    return res


def rank_programs_sweep(H, E, K, S, sigma, device, iters, warmup, transport, settings):
    """Paired sweep of the row kernels' programs (``--programs-sweep``): one buffer per setting of
    ``num_sms`` (0: the default) in this process, each one's dispatch + combine captured as a CUDA
    graph (eager calls off CUDA), and a plain ``all_to_all_single`` of the payload; every round
    times each once, in an order that rotates from round to round, so that the machine's drift
    between runs (which moved the 1-token anchor 40-73 us between separate runs) falls on every
    setting alike. Returns per entry (settings, then the all-to-all) ``(host median s, device
    median s or None)``, the programs each setting's buffer launches (``None``: no row kernels), and
    the transport the buffers resolved to.
    """
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = current_cuda_device()
    ids, w = route(S, E, K, sigma=sigma, seed=1, rank=r)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16).to(dev)
    ids, w = ids.to(dev), w.to(dev)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    bufs, calls, graphs = [], [], []
    for n in settings:
        buf = Buffer(S, H, K, E, R, B=default_num_slots(E, R), device=dev, check_inputs=False, transport=transport,
                     num_sms=n or None)

        def both(buf=buf):
            d = buf.dispatch(x, w, ids, tpe)
            buf.combine(d[3], d[0])

        if dev.type == "cuda" and buf.transport_name == "symmetric":
            g = capture_graph(both)
            graphs.append(g)
            calls.append(g.replay)
        else:
            calls.append(both)
        bufs.append(buf)
    calls.append(all_to_all_call(S, K, H, dev))
    host = [[] for _ in calls]
    device_t = [[] for _ in calls]
    for i in range(warmup + iters):
        k = i % len(calls)
        for j in list(range(k, len(calls))) + list(range(k)):
            h, d = timed_median(calls[j], dev, 1, 0)
            if i >= warmup:
                host[j].append(h)
                if d is not None:
                    device_t[j].append(d)
    programs = [buf.row_programs for buf in bufs]
    transport_name = bufs[0].transport_name if bufs else transport
    for buf in bufs:
        buf.check_errors(sync=True)
    del graphs
    for buf in bufs:
        buf.destroy()
    times = [(statistics.median(h), statistics.median(d) if d else None) for h, d in zip(host, device_t)]
    return times, programs, transport_name


def _points(a, launch, env, rank_fn, H, E, K, *extra) -> list:
    """``(tokens, maxvio, per-rank results of rank_fn)`` for every point of the command line, each on
    the spawned ranks (``rank_fn(H, E, K, S, sigma, device, iters, warmup, *extra)``); the ranks'
    buffer pools and launched group are closed after the last, or on an error."""
    out = []
    try:
        for S in a.tokens:
            for mv in a.maxvio:
                sigma = sigma_for_maxvio(mv, E, K, S * a.ranks)
                out.append((S, mv, run_on_ranks(a.ranks, rank_fn, H, E, K, S, sigma, a.device, a.iters, a.warmup,
                                                *extra, env=env, backend=launch.backend, device=launch.device)))
    finally:
        shutdown_pools()
        finish_launched_group()
    return out


def sum_bench(a, argv, H: int, K: int) -> int:
    """``--sum``: the combine's K-sum of ``S*K`` rows into ``S`` bf16 rows on this GPU, for bf16 rows (what the
    collective and hybrid transports pass: their outputs gathered in the buffer's dtype) and fp32 rows,
    device-timed after an L2 flush (``flushed_median_ms``): ``sum_entries`` (the reduce kernel),
    ``sum_entries_torch`` (K-1 adds, the same order) and one ``sum(dim=1)`` (order unspecified) as the anchor.
    The first two must give the same bits (else the run fails)."""
    from vllm_moonep.engine.transports.base import sum_entries, sum_entries_torch
    from vllm_moonep.tools.timing import flushed_median_ms

    rep = max(5.0, float(a.iters))  # ms of timed calls per figure
    bf16 = torch.bfloat16
    rows = []
    for dtype in (bf16, torch.float32):
        for S in a.tokens:
            acc = torch.randn(S * K, H, generator=torch.Generator().manual_seed(S)).to(dtype).cuda()
            if not torch.equal(sum_entries(acc, S, K, bf16), sum_entries_torch(acc, S, K, bf16)):
                raise SystemExit(f"bench_dispatch --sum: the reduce kernel and the torch adds differ at {S} tokens "
                                 f"of {dtype} rows")
            t = {name: flushed_median_ms(fn, rep=rep) * 1e3 for name, fn in (
                ("kernel", lambda: sum_entries(acc, S, K, bf16)),
                ("adds", lambda: sum_entries_torch(acc, S, K, bf16)),
                ("one_sum", lambda: acc.view(S, K, H).sum(dim=1).to(bf16)))}
            size = acc.element_size()
            rows.append({"tokens": S, "rows_dtype": str(dtype).removeprefix("torch."),
                         "read_MB": S * K * H * size / 1e6, "moved_bytes": S * H * (size * K + 2),
                         **{f"{k}_us": v for k, v in t.items()}})
    print(f"the combine's K-sum, {a.preset} (H={H}, K={K}), to bf16 on {torch.cuda.get_device_name()}: "
          "device-timed medians after an L2 flush")
    print("| rows | tokens/rank | rows MB | reduce kernel us | K-1 torch adds us | one torch sum us | kernel/sum | "
          "adds/sum | kernel GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rows_dtype']} | {r['tokens']} | {r['read_MB']:.1f} | {r['kernel_us']:.1f} | {r['adds_us']:.1f} | "
              f"{r['one_sum_us']:.1f} | {r['kernel_us'] / r['one_sum_us']:.2f} | {r['adds_us'] / r['one_sum_us']:.2f} | "
              f"{r['moved_bytes'] / (r['kernel_us'] * 1e3):.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**_run_record(a, argv, "-", "-", H, 0, K, rows), "ranks": 1}, f, indent=1)
    return 0


def _programs_sweep(a, argv, launch, env, H, E, K) -> int:
    """``--programs-sweep``: the paired table, slowest rank's median per entry."""
    rows = []
    transport = a.transport
    for S, mv, res in _points(a, launch, env, rank_programs_sweep, H, E, K, a.transport, a.programs_sweep):
        times = [t for t, _, _ in res]
        worst = [(max(x[j][0] for x in times), None if times[0][j][1] is None else max(x[j][1] for x in times))
                 for j in range(len(a.programs_sweep) + 1)]
        rows.append({"tokens": S, "maxvio": mv,
                     "a2a_us": worst[-1][0] * 1e6,
                     "a2a_dev_us": None if worst[-1][1] is None else worst[-1][1] * 1e6,
                     "settings": [{"num_sms": n, "programs": p, "us": h * 1e6, "dev_us": None if d is None else d * 1e6}
                                  for n, p, (h, d) in zip(a.programs_sweep, res[0][1], worst[:-1])]})
        transport = res[0][2]
    if not is_driver():
        return 0
    if launch.note:
        print(launch.note)
    progs = rows[0]["settings"] if rows else []
    names = [f"{c['programs']} programs" if c["programs"] else f"num_sms={c['num_sms']}" for c in progs]
    print(f"paired sweep of the row kernels' programs (a Buffer's num_sms x {PROGRAMS_PER_SM} programs; default: "
          f"{DEFAULT_PROGRAMS_PER_SM} per SM), {a.preset} (H={H}, E={E}, K={K}), {a.ranks} ranks on {a.device} over "
          f"{launch.backend}: dispatch + combine (one CUDA-graph replay on GPUs), slowest rank's median, device-timed "
          "where there is a device (else host), and its ratio to the all_to_all_single timed in the same rounds")
    print("| tokens/rank | maxvio | all_to_all us | " + " | ".join(f"{n} us (x a2a)" for n in names) + " |")
    print("|---:|---:|---:|" + "---:|" * len(names))

    def pick(d):
        return d["dev_us"] if d["dev_us"] is not None else d["us"]

    for r in rows:
        a2a = r["a2a_dev_us"] if r["a2a_dev_us"] is not None else r["a2a_us"]
        cells = " | ".join(f"{pick(c):.0f} ({pick(c) / a2a:.2f})" for c in r["settings"])
        print(f"| {r['tokens']} | {r['maxvio']:.1f} | {a2a:.0f} | {cells} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(_run_record(a, argv, launch.backend, transport, H, E, K, rows), f, indent=1)
    return 0


def _us(v):
    return "-" if v is None else f"{v * 1e6:.0f}"


def _worst(res, key, i):
    vals = [x[key][i] for x in res if x.get(key) is not None and x[key][i] is not None]
    return max(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_dispatch", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2", choices=list(SHAPES), help="model shape (hidden, experts, top-k)")
    ap.add_argument("--ranks", type=int, default=2, help="EP ranks (spawned processes)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024], help="tokens per rank (the buffer's S)")
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 1.0, 2.0],
                    help="routing skew: max/mean - 1 of the tokens per expert (0: balanced)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_launch_arguments(ap)
    ap.add_argument("--transport", default="auto", choices=list(TRANSPORTS), help="the engine's transport")
    ap.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                    help=f"simulated nodes of K ranks each ({RANKS_PER_NODE_ENV}); with --transport auto the "
                         "engine then takes the hybrid transport on GPUs (default: the real hosts)")
    ap.add_argument("--programs", type=int, default=None,
                    help="programs of the symmetric transport's row kernels (the Buffer's num_sms)")
    ap.add_argument("--programs-sweep", type=int, nargs="+", default=None, metavar="N",
                    help="instead of the table: a paired sweep of the row kernels' programs, one buffer per num_sms "
                         "N (0: the default) in each rank's process, timed in rotating rounds with the all_to_all")
    ap.add_argument("--sum", action="store_true",
                    help="instead of the table: the combine's K-sum alone in this process (--device cuda; --iters "
                         "is then ms of timed calls per figure)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="print the top kernels of one dispatch+combine on rank 0 (device time) and the host time "
                         "per call and per engine launch over 50 back-to-back calls")
    ap.add_argument("--json", default=None,
                    help="write the run here: its rows, and what they were measured on (date, command, machine)")
    a = ap.parse_args(argv)
    if a.ranks < 1:
        ap.error("--ranks must be >= 1")
    if any(t < 1 for t in a.tokens):
        ap.error("--tokens must be >= 1")
    if a.programs_sweep and any(n < 0 for n in a.programs_sweep):
        ap.error("--programs-sweep values must be >= 0 (0: the default)")
    H, E, K = SHAPES[a.preset]
    if a.sum:
        from vllm_moonep.engine.transports.base import reduce_launcher

        if a.device != "cuda" or not torch.cuda.is_available() or reduce_launcher() is None:
            ap.error("--sum times the reduce kernel: it needs --device cuda, a GPU and Triton (not its interpreter)")
        return sum_bench(a, argv, H, K)
    if E % a.ranks:
        ap.error(f"{a.preset} has {E} experts, not divisible by --ranks {a.ranks}")
    if a.ranks_per_node is not None and (a.ranks_per_node < 1 or a.ranks % a.ranks_per_node):
        ap.error(f"--ranks-per-node {a.ranks_per_node} must be a positive divisor of --ranks {a.ranks}")
    try:
        launch = resolve_launch(a.device, a.ranks, a.backend, a.share_gpus)
    except ValueError as exc:
        ap.error(str(exc))
    env = {"VLLM_MOONEP_THREADS_PER_RANK": "1", **launch.env}
    if launch.ranks_per_gpu > 1:  # processes sharing a GPU map each other's symmetric memory
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    if a.ranks_per_node is not None:
        env[RANKS_PER_NODE_ENV] = str(a.ranks_per_node)
    if a.programs_sweep:
        return _programs_sweep(a, argv, launch, env, H, E, K)
    rows = []
    transport = None
    for S, mv, res in _points(a, launch, env, rank_bench, H, E, K, a.profile, a.transport, a.programs):
        transport = res[0]["transport"]
        payload = S * K * H * 2
        row = {"tokens": S, "maxvio": mv, "payload_MB": payload / 1e6,
               "slots_used": sum(x["slots_used"] for x in res)}
        for key in ("dispatch", "combine", "graph", "a2a", "copies"):
            row[f"{key}_us"] = None if _worst(res, key, 0) is None else _worst(res, key, 0) * 1e6
            row[f"{key}_dev_us"] = None if _worst(res, key, 1) is None else _worst(res, key, 1) * 1e6
        # paired anchor: the slowest rank's median a2a of the same iterations, and the largest
        # over ranks of each rank's median per-iteration ratio
        row["a2a_paired_us"] = _worst(res, "paired", 0) * 1e6
        row["dispatch_over_a2a_paired"] = _worst(res, "paired", 1)
        row["combine_over_a2a_paired"] = _worst(res, "paired", 2)
        rows.append(row)
        if a.profile and is_driver():
            if res[0]["profile"]:
                print(f"--- one dispatch + combine, rank 0, tokens {S}, maxvio {mv} ---\n{res[0]['profile']}")
            hp = res[0]["host_profile"]
            per = ", ".join(f"{k} {v:.1f}" for k, v in sorted(hp["launch_us"].items(), key=lambda kv: -kv[1]))
            print(f"--- host time, rank 0, tokens {S}, maxvio {mv}: dispatch {hp['dispatch_us']:.1f} us, combine "
                  f"{hp['combine_us']:.1f} us per call; {hp['launches_per_call']:.1f} engine launches per "
                  f"dispatch+combine, us each: {per or '-'}")
    if not is_driver():
        return 0
    if launch.note:
        print(launch.note)
    from vllm_moonep.engine.transports.eager_graphs import EAGER_GRAPH_MAX_TOKENS, EAGER_GRAPHS
    from vllm_moonep.engine.launch import FAST_LAUNCH

    how = (f"eager calls replay private CUDA graphs up to {EAGER_GRAPH_MAX_TOKENS} tokens" if EAGER_GRAPHS
           else "eager calls launch each kernel") + (", fast launch" if FAST_LAUNCH else ", Triton's ordinary launch")
    nodes = (f" as {a.ranks // a.ranks_per_node} simulated nodes of {a.ranks_per_node}"
             if a.ranks_per_node is not None else "")
    print(f"built-in engine ({transport} transport; on GPUs {how}), {a.preset} (H={H}, E={E}, K={K}), {a.ranks} "
          f"ranks{nodes} on {a.device} over {launch.backend}; us = slowest rank's median, host-timed (device-timed)")
    print("paired = an all_to_all_single timed in each iteration right after dispatch and combine: median of "
          "the per-iteration ratios (largest over ranks) and of the paired a2a times")
    print("| tokens/rank | maxvio | payload MB | dispatch us | combine us | graph d+c us | all_to_all us | "
          "one-sided copies us | dispatch/a2a | combine/a2a | paired a2a us | dispatch/a2a paired | "
          "combine/a2a paired | dispatch GB/s | slots used |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(r, k):
        h, d = r[f"{k}_us"], r[f"{k}_dev_us"]
        if h is None:
            return "-"
        return f"{h:.0f}" + (f" ({d:.0f})" if d is not None else "")

    for r in rows:
        a2a = r["a2a_us"]
        print(f"| {r['tokens']} | {r['maxvio']:.1f} | {r['payload_MB']:.1f} | {cell(r, 'dispatch')} | {cell(r, 'combine')} | "
              f"{cell(r, 'graph')} | {cell(r, 'a2a')} | {cell(r, 'copies')} | {r['dispatch_us'] / a2a:.2f} | "
              f"{r['combine_us'] / a2a:.2f} | {r['a2a_paired_us']:.0f} | {r['dispatch_over_a2a_paired']:.2f} | "
              f"{r['combine_over_a2a_paired']:.2f} | {r['payload_MB'] * 1e6 / (r['dispatch_us'] * 1e-6) / 1e9:.1f} | "
              f"{r['slots_used']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(_run_record(a, argv, launch.backend, transport, H, E, K, rows), f, indent=1)
    return 0


def _run_record(a, argv, backend: str, transport, H: int, E: int, K: int, rows: list) -> dict:
    """The JSON a run writes: its rows with the command, date and machine they were measured on (a
    figure without them cannot be put beside another run's)."""
    import datetime
    import platform
    import sys

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if a.device == "cuda" and torch.cuda.is_available() else [])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": list(sys.argv if argv is None else ["bench_dispatch", *argv]),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "device": a.device, "gpus": gpus, "backend": backend, "transport": transport,
        "preset": a.preset, "H": H, "E": E, "K": K, "ranks": a.ranks,
        "ranks_per_node": getattr(a, "ranks_per_node", None),
        "rows": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
