"""Per-kernel time of one MoE step: where a step's microseconds go, kernel by kernel.

    ranks (spawned) ── one layer at a preset's width (home experts, B slots, MoonEPMoE) ──┐
    per token count: warm up eagerly, capture the step in a CUDA graph (GPU), then       │
      host-timed median of graph replays and of eager steps (barrier before each),        │
      torch.profiler over --steps steps of each: device time per kernel per step  ◄───────┘
    rank 0 prints one table per token count and mode

On a GPU (``--device cuda``: NCCL with a GPU per rank, else gloo with the ranks sharing one) the
table lists CUDA kernels; the time of a kernel that waits for a peer includes the wait (skew
between the ranks lands in whichever kernel waits first). On CPU ranks it lists the profiler's
CPU ops of an eager step (no graph; inclusive times: an op's children count in it too). Weights are random (values do not change the time), so full
widths cost only the memory of one layer: ``E/R`` experts plus ``B`` slots per rank. The step is
the product's (``MoonEPMoE`` over the symmetric or replicated layout);
docs/PERFORMANCE.md#the-whole-moe-step quotes its tables.

    python3 -m vllm_moonep.tools.profile_step --device cuda --ranks 2 --preset kimi-k2 --tokens 1 128 4096
"""

from __future__ import annotations

import argparse
import collections
import torch
import torch.distributed as dist

from vllm_moonep.common.layout import WeightLayout
from vllm_moonep.engine.defaults import current_cuda_device, default_num_slots, slots_beyond_experts
from vllm_moonep.testing.launch import run_on_ranks
from vllm_moonep.tools.ab.configs import PRESETS
from vllm_moonep.tools.timing import capture_graph, timed_median

__all__ = ["main", "profile_rank"]

LAYOUTS = ("symmetric", "replicated")


def _kernel_table(fn, steps: int, cuda: bool) -> dict:
    """``{"span_us": device span per step, "ops": {name: (calls per step, us per step)}}``."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in evs:
        a = agg[e.name[:70]]
        a[0] += 1
        a[1] += e.time_range.elapsed_us()
    span = (evs[-1].time_range.end - evs[0].time_range.start) / steps if evs else 0.0
    ops = {k: (v[0] / steps, v[1] / steps) for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}
    return {"span_us": span, "ops": ops}


def profile_rank(preset: str, tokens: list[int], layout_kind: str, device: str, steps: int, iters: int,
                 sigma: float, slots: int | None) -> dict:
    """One rank's side: build the layer, then per token count the timings and kernel tables."""
    from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
    from vllm_moonep.testing.routing import route

    r, R = dist.get_rank(), dist.get_world_size()
    cuda = device == "cuda"
    dev = current_cuda_device() if cuda else torch.device("cpu")
    d = PRESETS[preset].dims()
    H, I, E, K = d["H"], d["I"], d["E"], d["K"]
    epn = E // R
    B = slots or default_num_slots(E, R)
    g = torch.Generator(device=dev).manual_seed(r)
    w13 = torch.randn(epn, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(epn, H, I, device=dev, generator=g, dtype=torch.bfloat16) * I ** -0.5
    layout: WeightLayout
    if layout_kind == "symmetric":
        from vllm_moonep.symmetric import SymmetricWeightLayout

        layout = SymmetricWeightLayout(w13, w2, E, B)
    else:
        from vllm_moonep.replicated import ReplicatedWeightLayout

        layout = ReplicatedWeightLayout(w13, w2, E, B)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev), max(tokens), engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="auto")
    points: dict[int, dict] = {}
    out = {"H": H, "I": I, "E": E, "K": K, "B": B, "points": points}
    try:
        for T in tokens:
            ids, w = route(T, E, K, sigma=sigma, seed=3, rank=r)
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            ids, w = ids.to(dev), w.to(dev)

            def step():
                moe.forward(x, ids, w, num_tokens_across_dp=T)

            for _ in range(3):
                step()
            res = {"eager_us": timed_median(step, dev, iters, 0)[0] * 1e6, "eager": _kernel_table(step, steps, cuda)}
            if cuda:
                graph = capture_graph(step)
                res["graph_us"] = timed_median(graph.replay, dev, iters, 0)[0] * 1e6
                res["graph"] = _kernel_table(graph.replay, steps, cuda)
                del graph
            points[T] = res
    finally:
        pool.destroy()
        layout.destroy()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m vllm_moonep.tools.profile_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model width (one layer of it)")
    ap.add_argument("--ranks", type=int, default=2, help="EP ranks (spawned processes)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128], help="tokens per rank of each profiled step")
    ap.add_argument("--layout", default="symmetric", choices=LAYOUTS, help="weight layout of the layer")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks run")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per table (times are per step)")
    ap.add_argument("--iters", type=int, default=20, help="host-timed steps for the medians")
    ap.add_argument("--sigma", type=float, default=0.0, help="routing skew (testing.routing.route's sigma)")
    ap.add_argument("--slots", type=int, default=None, help="B, prefetch slots per rank (default: E/R)")
    ap.add_argument("--top", type=int, default=16, help="rows of each table (the most expensive first)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    p = PRESETS[a.preset]
    if a.ranks < 1 or p.E % a.ranks:
        ap.error(f"--ranks {a.ranks} must be positive and divide the {a.preset} preset's {p.E} experts")
    if a.slots is not None:  # the engine's rule, as moonep-ab and the plugin apply it
        wrong = "must be >= 1" if a.slots < 1 else slots_beyond_experts(a.slots, p.E, a.ranks)
        if wrong:
            ap.error(f"--slots {a.slots} {wrong}")
    if min(a.tokens) < 1 or a.steps < 1 or a.iters < 1:
        ap.error("--tokens, --steps and --iters must be positive")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    n_gpu = torch.cuda.device_count() if a.device == "cuda" else 0
    backend = "nccl" if a.device == "cuda" and n_gpu >= a.ranks else "gloo"
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"} if a.device == "cuda" and backend == "gloo" else None
    res = run_on_ranks(a.ranks, profile_rank, a.preset, a.tokens, a.layout, a.device, a.steps, a.iters, a.sigma,
                       a.slots, backend=backend, device=a.device, env=env, fresh=True, timeout_s=600)
    r0 = res[0]
    print(f"{a.preset} (H={r0['H']}, I={r0['I']}, E={r0['E']}, K={r0['K']}, B={r0['B']}), one layer, {a.layout} "
          f"layout, {a.ranks} rank(s) on {a.device} over {backend}; rank 0; host-timed medians of {a.iters} steps, "
          f"{'kernel' if a.device == 'cuda' else 'CPU op'} time per step over {a.steps} profiled steps")
    for T, v in r0["points"].items():
        modes = ["graph", "eager"] if "graph" in v else ["eager"]
        print(f"\n### tokens/rank {T}: " + ", ".join(f"{m} step {v[m + '_us']:.0f} us" for m in modes))
        for m in modes:
            t = v[m]
            print(f"{m}: span {t['span_us']:.0f} us per step")
            for name, (calls, us) in list(t["ops"].items())[: a.top]:
                print(f"  {us:9.1f} us  x{calls:g}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
