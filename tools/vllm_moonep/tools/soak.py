"""Soak: thousands of MoonEP MoE steps on real ranks, every one checked, memory tracked.

``python -m vllm_moonep.tools.soak --steps 3000 --ranks 2``

Each step draws (from a seed shared by every rank, so all ranks agree without communicating):
the largest token count across the DP ranks (cycling through every capacity of the buffer pool,
with 1 token and the maximum forced regularly), each rank's own count (some ranks get fewer
tokens, or none), and the routing skew ``sigma`` (a new value every step). The step runs
through ``--layers`` MoE layers (the output of one, RMS-normalised, is the input of the next)
on the replicated and the symmetric layout (``--layouts``; ``auto`` = both), all sharing one
buffer pool.

Checks, every step: each layer's output against the dense float32 reference on that layer's
input (``--check-every``); bitwise against the first run of the same inputs (inputs repeat with
period ``--period``); replicated against symmetric bitwise (reported). Memory: the pool never
holds more than ``pool.max_buffers`` buffers; process RSS is sampled every ``--mem-every`` steps
and compared between the end of warm-up (every capacity visited) and the end.

Ranks: CPU processes over gloo (default); ``--device cuda``: one GPU per rank over NCCL (the
symmetric layout on PyTorch symmetric memory, ``--heap`` to choose), ``--share-gpus`` for fewer
GPUs than ranks (gloo); or the processes of a torchrun launch. On GPUs the device memory torch
holds is tracked beside RSS.

Prints a summary (steps, duration, memory at start/end, errors) and writes it as JSON with
``--json``; exits 1 when any error was found. The functions here also serve the short soak in
``tests/distributed/test_soak.py``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.memory import measured_bytes
from vllm_moonep.engine import current_cuda_device
from vllm_moonep.engine.heaps import HEAP_KINDS
from vllm_moonep.layouts import build_layouts
from vllm_moonep.testing.launch import (BACKENDS, finish_launched_group, is_driver, launched_world_size, resolve_launch,
                                        run_on_ranks)
from vllm_moonep.testing.reference import dense_moe, random_expert_weights, relative_error
from vllm_moonep.testing.routing import route
from vllm_moonep.testing.weights import local_experts

__all__ = ["DEFAULTS", "main", "pool_capacities", "soak_rank", "step_schedule", "summarize"]

DEFAULTS = dict(
    steps=3000, ranks=2, layers=3, experts=8, hidden=128, intermediate=128, topk=2, slots=2,
    token_padding=8, max_tokens=256, min_capacity=8, seed=0, period=97, check_every=1,
    mem_every=25, warmup=None, tol=2e-2, layouts="auto", impl="reference", timeout_s=60.0,
    max_errors=20, device="cpu", backend="auto", share_gpus=False, heap="auto",
)


def pool_capacities(max_tokens: int, min_capacity: int) -> list[int]:
    caps, c = [], min_capacity
    while c < max_tokens:
        caps.append(c)
        c *= 2
    caps.append(max_tokens)
    return caps


def step_schedule(cfg: dict, step: int) -> tuple[int, list[int], float, int]:
    """``(n_max, per-rank counts, sigma, recipe)`` of ``step``; the same on every rank.

    Inputs depend on ``recipe = step % period`` only, so they repeat (the bitwise check); the
    capacity cycles through every pool capacity; ``n_max`` is 1 or the maximum regularly.
    """
    recipe = step % cfg["period"]
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + recipe)
    caps = pool_capacities(cfg["max_tokens"], cfg["min_capacity"])
    R = cfg["ranks"]
    if recipe % 7 == 0:
        n_max = 1
    elif recipe % 11 == 0:
        n_max = cfg["max_tokens"]
    else:
        i = recipe % len(caps)
        lo = caps[i - 1] + 1 if i > 0 else 1
        n_max = int(torch.randint(lo, caps[i] + 1, (1,), generator=g))
    counts = [int(torch.randint(0, n_max + 1, (1,), generator=g)) for _ in range(R)]
    counts[int(torch.randint(0, R, (1,), generator=g))] = n_max  # some rank has the max
    sigma = float(torch.rand(1, generator=g)) * 3.0
    return n_max, counts, sigma, recipe


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.blake2b(t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16
                           else t.numpy().tobytes(), digest_size=16).hexdigest()


def _device_allocated(dev: torch.device) -> int | None:
    """Bytes torch's allocator holds for tensors on ``dev`` (CUDA), else ``None``."""
    return int(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None


def _rss() -> int:
    return int(measured_bytes("cpu").get("rss", 0))


def soak_rank(cfg: dict) -> dict:
    """One rank's soak (run on every rank of the default group); returns its figures."""
    r, R = dist.get_rank(), dist.get_world_size()
    cfg = {**DEFAULTS, **cfg, "ranks": R}
    E, H, I, K, B, L = (cfg[k] for k in ("experts", "hidden", "intermediate", "topk", "slots", "layers"))
    dev = current_cuda_device() if cfg["device"] == "cuda" else torch.device("cpu")
    kinds = {"auto": ["replicated", "symmetric"], "both": ["replicated", "symmetric"],
             "replicated": ["replicated"], "symmetric": ["symmetric"]}[cfg["layouts"]]
    t_setup = time.monotonic()
    rss_start = _rss()
    weights = [random_expert_weights(E, H, I, cfg["seed"] * 7919 + l, dev) for l in range(L)]
    local = [local_experts(w13, w2, r, R) for w13, w2 in weights]
    pool = MoonEPBufferPool(
        dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=cfg["token_padding"], device=dev,
             timeout_s=cfg["timeout_s"]),
        max_tokens_per_rank=cfg["max_tokens"], engine="builtin", min_capacity=cfg["min_capacity"],
    )
    # the symmetric set's heap: cfg["heap"] (auto: host on CPU, PyTorch symmetric memory on CUDA)
    # the load-time all-gathers of the replicated set are bounded by timeout_s; the heap's
    # collectives by VLLM_MOONEP_COLLECTIVE_TIMEOUT_S, which the ranks get from cfg["timeout_s"]
    options = {"replicated": {"timeout_s": cfg["timeout_s"]}}
    layouts = {kind: build_layouts(kind, local, E, B, **options.get(kind, {"heap_kind": cfg["heap"]})) for kind in kinds}
    moes = {k: [MoonEPMoE(pool, lay, impl=cfg["impl"]) for lay in layouts[k].layouts] for k in kinds}
    caps = pool_capacities(cfg["max_tokens"], cfg["min_capacity"])
    warmup = cfg["warmup"] if cfg["warmup"] is not None else max(50, cfg["steps"] // 10)
    first_seen: dict[tuple, str] = {}
    errors: list[str] = []
    n_err = 0
    stats = dict(dense_checks=0, bitwise_checks=0, bitwise_mismatches=0, layout_compares=0, layout_mismatches=0,
                 max_rel_err=0.0, slots_used=0, tokens=0, capacities_seen=set(), max_buffers_seen=0, n1_steps=0,
                 nmax_steps=0)
    rss_samples: list[tuple[int, int]] = []
    dev_warm = None
    rss_warm = None
    objs_warm = None
    setup_s = time.monotonic() - t_setup
    rss_after_setup = _rss()
    t0 = time.monotonic()
    steps_done = 0
    fatal = None

    def err(step, what):
        nonlocal n_err
        n_err += 1
        if len(errors) < cfg["max_errors"]:
            errors.append(f"rank {r} step {step}: {what}")

    for step in range(cfg["steps"]):
        n_max, counts, sigma, recipe = step_schedule(cfg, step)
        n = counts[r]
        gx = torch.Generator().manual_seed(cfg["seed"] * 31 + recipe * 7 + r)
        x0 = torch.randn(n, H, generator=gx).to(torch.bfloat16).to(dev)
        stats["n1_steps"] += n_max == 1
        stats["nmax_steps"] += n_max == cfg["max_tokens"]
        try:
            for kind in kinds:
                x = x0
                for l in range(L):
                    ids, w = route(n, E, K, sigma=sigma, seed=cfg["seed"] * 1009 + recipe * L + l, rank=r)
                    ids, w = ids.to(dev), w.to(dev)
                    out = moes[kind][l].forward(x, ids, w, num_tokens_across_dp=n_max)
                    info = moes[kind][l].last
                    stats["capacities_seen"].add(info.capacity)
                    stats["slots_used"] += int((info.experts_to_copy[r] >= 0).sum())
                    stats["tokens"] += n
                    if out.shape != (n, H) or out.dtype != torch.bfloat16:
                        err(step, f"{kind} layer {l}: output {tuple(out.shape)} {out.dtype}")
                    if cfg["check_every"] and step % cfg["check_every"] == 0:
                        ref = dense_moe(x, ids, w, *weights[l])
                        e = relative_error(out, ref)
                        stats["dense_checks"] += 1
                        stats["max_rel_err"] = max(stats["max_rel_err"], e)
                        if not e < cfg["tol"] or not bool(torch.isfinite(out.float()).all()):
                            err(step, f"{kind} layer {l}: relative error {e:.3e} vs dense (n={n}, cap={info.capacity})")
                    d = _digest(out)
                    key = (recipe, l)
                    if kind == kinds[0]:
                        prev = first_seen.setdefault(key, d)
                        if prev is not d:
                            stats["bitwise_checks"] += 1
                            if prev != d:
                                stats["bitwise_mismatches"] += 1
                                err(step, f"{kind} layer {l}: output differs bitwise from the first run of recipe {recipe}")
                    else:
                        stats["layout_compares"] += 1
                        if (recipe, l, "cur") in first_seen and first_seen[(recipe, l, "cur")] != d:
                            stats["layout_mismatches"] += 1
                    if kind == kinds[0]:
                        first_seen[(recipe, l, "cur")] = d
                    ms = out.float().pow(2).mean(dim=1, keepdim=True).add(1e-6).rsqrt()
                    x = (out.float() * ms).to(torch.bfloat16)
        except Exception as exc:  # a collective failure ends the soak (the group is unusable)
            fatal = f"rank {r} step {step}: {type(exc).__name__}: {exc}"
            errors.append(fatal)
            n_err += 1
            break
        nb = len(pool.buffers)
        stats["max_buffers_seen"] = max(stats["max_buffers_seen"], nb)
        if nb > pool.max_buffers:
            err(step, f"the pool holds {nb} buffers > max_buffers={pool.max_buffers}")
        steps_done = step + 1
        if rss_warm is None and steps_done >= warmup and stats["capacities_seen"] >= set(caps):
            gc.collect()
            rss_warm, objs_warm, warm_step = _rss(), len(gc.get_objects()), steps_done
            dev_warm = _device_allocated(dev)
        if step % cfg["mem_every"] == 0 or step == cfg["steps"] - 1:
            rss_samples.append((step, _rss()))
    duration = time.monotonic() - t0
    gc.collect()
    rss_end, objs_end = _rss(), len(gc.get_objects())
    dev_end = _device_allocated(dev)
    # teardown, newest first, before the process group
    pool.destroy()
    for kind in reversed(kinds):
        layouts[kind].destroy()
    post = [rs for st, rs in rss_samples if rss_warm is not None and st >= warm_step]
    slope = 0.0
    if len(post) >= 4:
        xs = torch.tensor([st for st, _ in rss_samples if st >= warm_step], dtype=torch.float64)
        ys = torch.tensor(post, dtype=torch.float64)
        xm, ym = xs.mean(), ys.mean()
        slope = float(((xs - xm) * (ys - ym)).sum() / ((xs - xm) ** 2).sum().clamp_min(1e-9)) * 1000 / 2**20
    stats["capacities_seen"] = sorted(stats["capacities_seen"])
    return {
        "rank": r,
        "layouts": kinds,
        "steps": steps_done,
        "duration_s": duration,
        "setup_s": setup_s,
        "errors": n_err,
        "error_samples": errors,
        "fatal": fatal,
        "capacities": caps,
        "max_buffers": pool.max_buffers,
        "warmup_steps": warmup,
        "rss_start": rss_start,
        "rss_after_setup": rss_after_setup,
        "rss_warm": rss_warm,
        "rss_end": rss_end,
        "rss_max": max([rs for _, rs in rss_samples] + [rss_end]),
        "rss_growth_after_warmup": (rss_end - rss_warm) if rss_warm is not None else None,
        "rss_slope_mib_per_1k_steps": slope,
        "rss_samples_mib": [(st, round(rs / 2**20, 1)) for st, rs in rss_samples[:: max(1, len(rss_samples) // 20)]],
        "py_objects_warm": objs_warm,
        "py_objects_end": objs_end,
        "device": str(dev),
        "device_allocated_warm": dev_warm,
        "device_allocated_end": dev_end,
        **stats,
    }


def _mib(v):
    return round(v / 2**20, 1) if v is not None else None


def summarize(results: list, cfg: dict) -> dict:
    """Aggregate the per-rank figures (ranks that did not return count as errors)."""
    ok = [x for x in results if isinstance(x, dict)]
    lost = [repr(x) for x in results if not isinstance(x, dict)]
    mib = 2**20
    s = {
        "config": {k: v for k, v in cfg.items()},
        "ranks": len(results),
        "ranks_lost": lost,
        "layouts": ok[0]["layouts"] if ok else [],
        "steps": min((x["steps"] for x in ok), default=0),
        "duration_s": max((x["duration_s"] for x in ok), default=0.0),
        "errors": sum(x["errors"] for x in ok) + len(lost),
        "error_samples": [e for x in ok for e in x["error_samples"]][:20],
        "dense_checks": sum(x["dense_checks"] for x in ok),
        "bitwise_checks": sum(x["bitwise_checks"] for x in ok),
        "layout_mismatches": sum(x["layout_mismatches"] for x in ok),
        "layout_compares": sum(x["layout_compares"] for x in ok),
        "max_rel_err": max((x["max_rel_err"] for x in ok), default=0.0),
        "slots_used": sum(x["slots_used"] for x in ok),
        "capacities": ok[0]["capacities"] if ok else [],
        "capacities_seen": sorted(set().union(*[set(x["capacities_seen"]) for x in ok])) if ok else [],
        "n1_steps": ok[0]["n1_steps"] if ok else 0,
        "nmax_steps": ok[0]["nmax_steps"] if ok else 0,
        "max_buffers_seen": max((x["max_buffers_seen"] for x in ok), default=0),
        "max_buffers": ok[0]["max_buffers"] if ok else 0,
        "per_rank_mib": [
            {k: (round(x[k] / mib, 1) if x[k] is not None else None)
             for k in ("rss_start", "rss_after_setup", "rss_warm", "rss_end", "rss_max", "rss_growth_after_warmup")}
            | {"slope_mib_per_1k_steps": round(x["rss_slope_mib_per_1k_steps"], 3),
               "py_objects_warm": x["py_objects_warm"], "py_objects_end": x["py_objects_end"],
               "device_allocated_warm": _mib(x.get("device_allocated_warm")),
               "device_allocated_end": _mib(x.get("device_allocated_end"))}
            for x in ok
        ],
    }
    s["steps_per_s"] = s["steps"] / s["duration_s"] if s["duration_s"] else 0.0
    return s


def format_summary(s: dict) -> str:
    where = s["config"].get("device", "cpu")
    lines = [
        f"MoonEP soak: {s['steps']} steps on {s['ranks']} {where} ranks ({s['config'].get('backend_used', 'gloo')}), "
        f"layouts {s['layouts']}, "
        f"{s['config'].get('layers')} layers, in {s['duration_s']:.1f}s ({s['steps_per_s']:.1f} steps/s)",
        f"  capacities {s['capacities']} (seen {s['capacities_seen']}); steps with 1 token max: {s['n1_steps']}, "
        f"with the maximum: {s['nmax_steps']}; pool buffers <= {s['max_buffers_seen']} (bound {s['max_buffers']})",
        f"  checks: {s['dense_checks']} vs dense (max rel err {s['max_rel_err']:.2e}), {s['bitwise_checks']} bitwise "
        f"repeats, {s['layout_compares']} replicated-vs-symmetric ({s['layout_mismatches']} differ); "
        f"prefetch slots used {s['slots_used']}",
    ]
    for r, m in enumerate(s["per_rank_mib"]):
        lines.append(
            f"  rank {r} RSS MiB: start {m['rss_start']}, after setup {m['rss_after_setup']}, after warm-up "
            f"{m['rss_warm']}, end {m['rss_end']}, max {m['rss_max']}; growth after warm-up "
            f"{m['rss_growth_after_warmup']} MiB, slope {m['slope_mib_per_1k_steps']} MiB/1k steps; "
            f"python objects {m['py_objects_warm']} -> {m['py_objects_end']}"
            + (f"; torch device memory MiB after warm-up {m['device_allocated_warm']}, end {m['device_allocated_end']}"
               if m.get("device_allocated_end") is not None else "")
        )
    lines.append(f"  errors: {s['errors']}" + ("".join(f"\n    {e}" for e in s["error_samples"]) if s["errors"] else ""))
    if s["ranks_lost"]:
        lines.append(f"  ranks lost: {s['ranks_lost']}")
    return "\n".join(lines)


def run(cfg: dict) -> dict:
    """The soak on ``cfg["ranks"]`` ranks (spawned, or the launched ones under torchrun); the
    summary. ``ValueError`` when the ranks cannot run as asked (``launch.resolve_launch``)."""
    cfg = {**DEFAULTS, **cfg}
    launch = resolve_launch(cfg["device"], cfg["ranks"], cfg["backend"], cfg["share_gpus"])
    cfg["backend_used"] = launch.backend
    env = {"VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": str(cfg["timeout_s"]), **launch.env}
    spawn = dict(env=env, backend=launch.backend, device=launch.device)
    if launch.launched:  # the launched processes are the ranks; a lost rank ends the launch
        res = run_on_ranks(cfg["ranks"], soak_rank, cfg, **spawn)
    else:
        res = run_on_ranks(cfg["ranks"], soak_rank, cfg, fresh=True, allow_failures=True,
                           timeout_s=max(600.0, cfg["steps"] * 2.0), **spawn)
    return summarize(res, cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_moonep.tools.soak", description=__doc__.split("\n\n")[0])
    for k, v in DEFAULTS.items():
        flag = "--" + k.replace("_", "-")
        if k == "warmup":
            p.add_argument(flag, type=int, default=None, help="steps before the memory baseline (default: max(50, steps/10))")
        elif k in ("layouts", "impl"):
            choices = ["auto", "replicated", "symmetric", "both"] if k == "layouts" else None
            p.add_argument(flag, default=v, choices=choices)
        elif k == "device":
            p.add_argument(flag, default=v, choices=["cpu", "cuda"],
                           help="cpu (gloo) or cuda (one GPU per rank over NCCL) (default: %(default)s)")
        elif k == "backend":
            p.add_argument(flag, default=v, choices=list(BACKENDS),
                           help="auto = NCCL on cuda with a GPU per rank, gloo on cpu (default: %(default)s)")
        elif k == "share_gpus":
            p.add_argument(flag, action="store_true",
                           help="--device cuda with fewer GPUs than ranks: several rank processes per GPU over gloo")
        elif k == "heap":
            p.add_argument(flag, default=v, choices=list(HEAP_KINDS),
                           help="heap of the symmetric layout: auto = host on cpu, torch on cuda (default: %(default)s)")
        elif k == "ranks":
            p.add_argument(flag, type=int, default=None,
                           help=f"rank processes (default: {v}, or the launched world size under torchrun)")
        else:
            p.add_argument(flag, type=type(v), default=v)
    p.add_argument("--json", default=None, help="write the summary here")
    a = p.parse_args(argv)
    cfg = {k: getattr(a, k) for k in DEFAULTS}
    if cfg["ranks"] is None:
        cfg["ranks"] = launched_world_size() or DEFAULTS["ranks"]
    if cfg["experts"] % cfg["ranks"]:
        p.error("--experts must be divisible by --ranks")
    try:
        resolve_launch(cfg["device"], cfg["ranks"], cfg["backend"], cfg["share_gpus"])
    except ValueError as exc:
        p.error(str(exc))
    try:
        s = run(cfg)
    finally:
        finish_launched_group()
    if is_driver():
        print(format_summary(s))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(s, f, indent=2, default=str)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
