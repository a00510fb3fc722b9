"""The rank side of ``moonep-ab``: what each rank process runs for one configuration.

    rank_build(cfg)    seeded global weights (the reference) -> baseline memory -> this rank's
                       home experts -> build (configs.build_ours | vllm_poc.build_poc) -> memory
                       grown, peak, what the layouts hold: the figures memory.memory_check attributes
    rank_point(cfg, tokens, sigma)   warm-up + timed steps of every layer (eager, per-phase timer;
                       or one CUDA-graph replay per step); outside the timed region each checked
                       step against the dense float32 reference; balance and slots from the plan;
                       the anchor of the same run (two plain all_to_all_single of the payload)
    rank_teardown(cfg) the buffer pool, then the layouts (heap order); the engine buffers it held

What a build keeps between the three calls lives in this process (``_STATE``); the driver
(``driver.run_ab``) runs them in fresh rank processes per configuration.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from vllm_moonep.common.memory import (held_tensor_bytes, measured_bytes, peak_rss, release_freed_memory,
                                       replicated_accounting, reset_peak, resident_bytes)
from vllm_moonep.common.timing import PHASES, NullTimer, PhaseTimer
from vllm_moonep.engine import Buffer, current_cuda_device
from vllm_moonep.engine.heaps import HostHeap
from vllm_moonep.testing.launch import comm_device, launched_world_size
from vllm_moonep.testing.reference import dense_moe, random_expert_weights, relative_error
from vllm_moonep.testing.routing import maxvio, route
from vllm_moonep.testing.weights import local_experts
from vllm_moonep.tools.ab.configs import Built, build_ours
from vllm_moonep.tools.bench_dispatch import time_all_to_all
from vllm_moonep.tools.timing import on_side_stream

__all__ = ["REFERENCE_ON_GPU_SHARE", "measure_build", "rank_build", "rank_point", "rank_teardown", "reference_on_host"]

#: per configuration: what measure_build built and drew (the Built, the reference weights, the device)
_STATE: dict = {}


def _device(kind: str) -> torch.device:
    """This rank's device: the GPU the launcher bound it to (one per rank, or shared), or the CPU."""
    if kind == "cuda":
        return current_cuda_device()
    return torch.device("cpu")


def _warm_up_group(device: torch.device) -> None:
    """Before the baseline: the first collectives make the group's own buffers (NCCL communicators,
    gloo pairs), which belong to no configuration."""
    R = dist.get_world_size()
    t = torch.ones(4096, device=comm_device())
    parts = [torch.empty_like(t) for _ in range(R)]
    dist.all_gather(parts, t)
    if device.type == "cuda" and comm_device().type == "cpu":  # gloo moving CUDA tensors (shared GPUs)
        x = torch.ones(4096, device=device)
        dist.all_gather([torch.empty_like(x) for _ in range(R)], x)
    dist.barrier()


def _ranks_on_my_device(device: torch.device) -> int:
    """How many ranks share this rank's device (GPUs shared with --share-gpus; 1 on CPU)."""
    if device.type != "cuda":
        return 1
    import socket

    mine = (socket.gethostname(), torch.cuda.current_device())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sum(1 for o in every if o == mine)


def rank_build(cfg, shape, seed, device_kind, impl, heap_kind="auto"):
    """Build configuration ``cfg`` on this rank and measure what it holds (``measure_build``)."""
    if cfg == "vllm-poc":  # import vLLM before measuring, so its import is not counted as expert memory
        from vllm_moonep.tools.ab.vllm_poc import build_poc, import_poc

        import_poc()
        return measure_build(cfg, lambda local, device: build_poc(shape, local, device), shape, seed, device_kind)
    return measure_build(cfg, lambda local, device: build_ours(cfg, shape, local, device, impl, heap_kind), shape, seed,
                         device_kind)


#: the dense reference's full weights stay on the GPU only while they and the replicated layout
#: (the larger one) fill at most this share of its memory; beyond it they are kept in host memory
#: and ``dense_moe`` brings each used expert over, so the configurations under test get the GPU
REFERENCE_ON_GPU_SHARE = 0.6


def reference_on_host(shape: dict, ranks: int, device: torch.device, sharing: int = 1) -> bool:
    """Whether this rank keeps the reference weights in host memory (see ``REFERENCE_ON_GPU_SHARE``)."""
    if device.type != "cuda":
        return False
    full = shape["layers"] * shape["experts"] * shape["expert_bytes"]
    repl = replicated_accounting(shape["experts"], ranks, shape["slots"], shape["hidden"], shape["intermediate"],
                                 layers=shape["layers"]).resident
    return sharing * (full + repl) > REFERENCE_ON_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory


def measure_build(key: str, build: Callable[[list, torch.device], Built], shape: dict, seed: int,
                  device_kind: str) -> dict:
    """``build(local, device)`` on this rank, measured; returns memory figures. The result is kept
    under ``key`` for ``rank_point`` and ``rank_teardown``.

    Every rank draws the same seeded global weights of ``shape["layers"]`` layers (the reference)
    and ``build`` gets this rank's copy of its home experts of each (``local``, the framework's
    parameters). Measured: the growth of what the process holds (RSS on CPU; device memory in use
    on CUDA, which counts the heaps outside torch's allocator) from a baseline taken after
    start-up, the reference weights and the group's warm-up, to after the build, each after
    freed memory was released. The local parameters are made after the baseline (the replicated
    layouts keep them, the symmetric ones adopt them). ``moonep-ab`` runs each configuration in
    fresh rank processes, so no memory freed by an earlier configuration hides growth.
    """
    r, R = dist.get_rank(), dist.get_world_size()
    device = _device(device_kind)
    E, H, I, L = shape["experts"], shape["hidden"], shape["intermediate"], shape["layers"]
    sharing = _ranks_on_my_device(device)
    ref_host = reference_on_host(shape, R, device, sharing)
    full = []
    for layer in range(L):  # drawn on the device (fast), kept where reference_on_host says
        full.append(random_expert_weights(E, H, I, seed * 1000 + layer, device,
                                          keep_on=torch.device("cpu") if ref_host else None))
    _warm_up_group(device)
    release_freed_memory(device)
    before = measured_bytes(device)
    base = resident_bytes(device)
    peak_reset = reset_peak(device)
    dist.barrier()  # every rank has its baseline before any rank builds (ranks may share a GPU)
    local = [tuple(t.to(device) for t in local_experts(w13, w2, r, R)) for w13, w2 in full]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    built = build(local, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    dist.barrier()  # every rank built (ranks sharing a GPU see each other's allocations)
    # without a reset VmHWM is the lifetime peak (the reference weights included): not this build's
    peak_cpu = peak_rss() if device.type == "cpu" and peak_reset else None
    release_freed_memory(device)
    after = measured_bytes(device)
    grown = (resident_bytes(device) - base) / sharing
    # the layouts and slot pools hold their heap allocations; heaps' own buffers (scratch) are overhead
    held = held_tensor_bytes(*built.held, local)
    staging = sum(h.local_bytes() for h in built.heaps if isinstance(h, HostHeap) and h.staging)
    detail = {
        "fresh_process": launched_world_size() is None,
        "pid": os.getpid(),
        "ranks_sharing_device": sharing,
        "baseline": base,
        "tensors_torch": held["torch"],
        "tensors_heap": held["heap"],
        "heap_allocations": held["heap_allocations"],
        "host_staging": staging,
        "heap_kinds": sorted({h.kind for h in built.heaps}),
        "reference_on_host": ref_host,
        "peak_reset": peak_reset,
    }
    if device.type == "cuda":
        detail["torch_reserved_delta"] = after["reserved"] - before["reserved"]
        detail["torch_allocated_delta"] = after["allocated"] - before["allocated"]
        outside = grown - detail["torch_reserved_delta"]
        peak = max(after["max_allocated"] - before["allocated"] + max(outside, 0), grown)
    else:
        peak = max(peak_cpu - base, grown) if peak_cpu is not None else grown
    _STATE[key] = dict(built=built, full=full, device=device, K=shape["topk"])
    return {"accounted": built.report.as_dict(), "measured_resident": int(grown), "measured_peak": int(peak),
            "load_s": load_s, "detail": detail}


def _graph_step(moes, x, ids, w, tokens):
    """The whole step (every layer) captured once in a CUDA graph over static inputs, as vLLM
    runs a captured decode step: returns ``(replay, (x_s, ids_s, w_s), seen)`` where ``seen``
    holds each layer's static input and output (valid after each replay)."""
    x_s, ids_s, w_s = x.clone(), ids.clone(), w.clone()

    def step():
        h, seen = x_s, []
        for m in moes:
            out = m.forward(h, ids_s, w_s, num_tokens_across_dp=tokens)
            seen.append((h, out))
            h = out
        return seen

    for _ in range(2):  # buffers of this capacity exist, kernels compiled (eager, collective)
        step()
    on_side_stream(step)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            seen = step()
    except Exception as exc:
        raise RuntimeError(
            f"moonep-ab --graphs: the step could not be captured in a CUDA graph ({type(exc).__name__}: {exc}); "
            "capture needs the built-in engine's symmetric transport (every rank on this node) and no host "
            "synchronization in the step") from exc
    return graph, (x_s, ids_s, w_s), seen


def worst_error(errs) -> float:
    """The largest relative error, NaN where any is (``max`` keeps a finite value met before a NaN: a layer, step
    or rank whose output held NaN passed the check)."""
    errs = [float(e) for e in errs]
    return float("nan") if any(e != e for e in errs) else max(errs)


def rank_point(cfg, tokens, sigma, steps, warmup, check_steps, seed, graphs=False):
    """Run ``warmup + steps`` steps of all layers; returns timings, balance and reference error.
    ``graphs``: each step is one replay of a CUDA graph of the whole step (phases not timed)."""
    st = _STATE[cfg]
    r, R = dist.get_rank(), dist.get_world_size()
    device = st["device"]
    moes = st["built"].moes
    E = st["full"][0][0].shape[0]
    H = st["full"][0][0].shape[2]
    K = st["K"]
    timer = PhaseTimer(device)
    totals, per_phase, errs = [], {p: [] for p in PHASES}, []
    rows_no_plan, slots_used, padded = [], [], []
    graph = None
    for step in range(warmup + steps):
        # fresh tokens every step from the one popularity the driver calibrated sigma on (seed): a popularity
        # drawn anew per step has other hot experts and about a third less skew than the maxvio asked for
        ids, w = route(tokens, E, K, sigma=sigma, seed=seed + step, rank=r, popularity_seed=seed)
        ids, w = ids.to(device), w.to(device)
        g = torch.Generator().manual_seed(seed * 31 + step * 7 + r)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16).to(device)
        timer.reset()
        for m in moes:
            m.timer = NullTimer() if graphs else timer
        check = step >= warmup and (step - warmup) < check_steps
        if graphs and graph is None:
            graph, statics, graph_seen = _graph_step(moes, x, ids, w, tokens)
        if graphs:
            for dst, src in zip(statics, (x, ids, w)):
                dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        seen = []
        if graphs:
            graph.replay()
        else:
            h = x
            for m in moes:
                out = m.forward(h, ids, w)
                if check:
                    seen.append((h, out))
                h = out
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - t0
        if graphs:
            # replays run no host code: a device-side wait that gave up is only on the error board
            for buf in st["built"].pool.buffers.values():
                if isinstance(buf, Buffer):  # the built-in engine's board (graphs need that engine)
                    buf.check_errors(sync=True)
            if check:
                seen = [(h_in.clone(), out.clone()) for h_in, out in graph_seen]
        # the reference check runs outside the timed region
        for layer, (h_in, out) in enumerate(seen):
            w13, w2 = st["full"][layer]
            ref = dense_moe(h_in, ids, w, w13, w2)
            errs.append(relative_error(out, ref))
        res = timer.results()
        if step < warmup:
            continue
        totals.append(total)
        for p in PHASES:
            per_phase[p].append(sum(res.get(p, [0.0])))
        tpe = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)
        rows_no_plan.append(tpe)
        info = moes[-1].last
        slots_used.append(int((info.experts_to_copy[r] >= 0).sum()) if info is not None else 0)
        padded.append(int(info.cu_seqlens[-1]) if info is not None else 0)
    # rows each rank would compute without redundancy: all rows of its home experts
    per_step = torch.stack(rows_no_plan) if rows_no_plan else torch.zeros(1, E, dtype=torch.int64)  # [steps, E]
    # staged where the group moves data: an NCCL group has no CPU backend ("No backend type
    # associated with device type cpu" was moonep-ab's crash under torchrun with NCCL)
    staged = per_step.to(comm_device())
    every = [torch.zeros_like(staged) for _ in range(R)]
    dist.all_gather(every, staged)
    tpe_steps = torch.stack(every).sum(0).cpu()  # [steps, E] over all ranks
    home = tpe_steps.sum(0).view(R, -1).sum(1).double()
    achieved = [maxvio(t) for t in tpe_steps]
    cap = moes[-1].last.capacity if moes[-1].last is not None else tokens
    with_plan = cap * K * len(totals)
    # the communication anchor: a plain all_to_all_single of this layer's dispatch payload, on the
    # device the group moves data on (bench_dispatch's anchor)
    a2a, _ = time_all_to_all(tokens, K, H, device if device.type == "cuda" else comm_device(), max(steps, 3), 1)
    return {
        "total_s": totals,
        "phases_s": per_phase,
        "ref_rel_err": worst_error(errs) if errs else None,
        "rows_without_plan": float(home[r]),
        "rows_without_plan_max_over_mean": float(home.max() / home.mean()) if home.mean() > 0 else 1.0,
        "maxvio_achieved": statistics.mean(achieved),
        "rows_with_plan": with_plan,
        "slots_used": slots_used,
        "padded_rows": padded,
        "capacity": cap,
        "a2a_s": a2a,
        "graphs": bool(graphs),
    }


def rank_teardown(cfg):
    """Free what ``measure_build`` kept under ``cfg``: the buffer pool, then the layouts
    (docs/VALIDATION.md, "Teardown order")."""
    st = _STATE.pop(cfg, None)
    if st is None:
        return {}
    built = st["built"]
    # what the engine's buffers held on the heap at the end (one buffer per capacity the run used;
    # vLLM's own pool, vllm-poc's, keeps its buffers its own way: not reported)
    bufs = getattr(built.pool, "buffers", None)
    held = {} if not isinstance(bufs, dict) else {
        "capacities": sorted(bufs), "heap_bytes": sum(getattr(b, "heap_bytes", 0) for b in bufs.values())}
    built.pool.destroy()
    built.destroy_layouts()
    return held
