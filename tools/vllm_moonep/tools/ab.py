"""``moonep-ab``: replicated versus symmetric expert layouts, memory and latency, on R ranks.

The same MoE workload (layers x tokens per rank x routing skew) runs through each configuration:

- ``replicated``: our ``ReplicatedWeightLayout`` (the PoC's memory model: ``[E+B]`` per layer);
- ``symmetric``: ``SymmetricWeightLayout`` with per-layer slots;
- ``symmetric-shared``: ``SymmetricWeightLayout`` with one ``SharedSlotPool`` for all layers;
- ``vllm-poc``: vLLM 0.33's own in-tree ``MoonEPPrepareAndFinalize``/``MoonEPExperts`` in a
  ``FusedMoEKernel``, running on our built-in engine (needs vLLM; skipped where it is absent).

Every configuration's output is checked against the dense float32 reference on a sample of
steps; a configuration that is wrong fails the run. Each configuration runs in fresh rank
processes, where its memory is measured (RSS on CPU, device memory in use on GPU) next to the
accounting, with the difference explained where it exceeds 10%.

Ranks: CPU processes over gloo, or one GPU per rank over NCCL (``--device cuda``; with fewer GPUs
than ranks only ``--share-gpus`` runs, over gloo), or the processes of a torchrun launch
(``torchrun --nproc-per-node 2 -m vllm_moonep.tools.ab --device cuda``). Results: a terminal table, a JSON file with
every raw figure and the environment, and PNG plots. ``moonep-ab project`` prints per-rank expert
memory of full-size models at EP 8/16/32/64 from the same accounting code the layouts report.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.grouped_gemm import IMPLS, GroupedWeights, available_impls
from vllm_moonep.common.memory import (EXPLAIN_ABOVE, MemoryReport, expert_bytes, explain_difference,
                                       held_tensor_bytes, measured_bytes, peak_rss, release_freed_memory,
                                       replicated_accounting, reset_peak, resident_bytes)
from vllm_moonep.common.timing import PHASES, NullTimer, PhaseTimer
from vllm_moonep.engine import TRANSPORTS, Buffer, current_cuda_device, default_num_slots
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.engine.heaps import HEAP_KINDS, HostHeap, SymmetricHeap
from vllm_moonep.layouts import LAYOUT_KINDS, build_layouts
from vllm_moonep.testing.launch import (add_launch_arguments, comm_device, finish_launched_group, init_launched_group,
                                        is_driver, launched_world_size, resolve_launch, run_on_ranks, shutdown_pools)
from vllm_moonep.testing.reference import dense_moe, random_expert_weights, relative_error
from vllm_moonep.testing.routing import maxvio, route, sigma_for_maxvio
from vllm_moonep.testing.weights import local_experts
from vllm_moonep.tools.bench_dispatch import time_all_to_all
from vllm_moonep.tools.memory_projection import MODELS, projection_rows, render
from vllm_moonep.tools.timing import on_side_stream

GiB = 1024**3


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    intermediate: int
    experts: int
    topk: int
    layers: int  # MoE layers of the full model
    note: str = ""


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


#: run shapes: a tiny default and the full-size models of the memory projection (top-8 routing)
PRESETS = {
    "tiny": Preset("tiny", 256, 256, 32, 4, 4, "a small synthetic model for the embedded default"),
    **{_slug(m.name): Preset(_slug(m.name), m.H, m.I, m.E, 8, m.moe_layers, m.source) for m in MODELS},
}

CONFIGS = (*LAYOUT_KINDS, "vllm-poc")
DEVICES = ("cpu", "cuda")
#: per-rank expert memory the scaled model may use by default, GiB
DEFAULT_BUDGET_GB = {"cpu": 1.0, "cuda": 0.5}  # cuda: a fraction of the GPU's memory (activations, heaps, buffers need the rest)


def default_budget_gb(device: str) -> float:
    """``--budget-gb`` when none is given: 1 GiB per CPU rank; half of a GPU's memory (an H200's
    70 GiB holds one full-width Kimi-K2 layer replicated on 2 ranks, 50 GiB)."""
    if device == "cuda":
        import torch

        return DEFAULT_BUDGET_GB["cuda"] * torch.cuda.get_device_properties(0).total_memory / GiB
    return DEFAULT_BUDGET_GB[device]
#: the reference check's default bound on the relative error of each configuration's output
MAX_REF_ERR = 2e-2


def config_choice(value: str) -> str:
    """One ``--configs`` entry: a known configuration (``ArgumentTypeError`` naming the closest otherwise)."""
    if value in CONFIGS:
        return value
    close = difflib.get_close_matches(value, CONFIGS, n=1)
    raise argparse.ArgumentTypeError(
        f"unknown configuration {value!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; choose from {', '.join(CONFIGS)}")


def kernels_on(device: str) -> list[str]:
    """The grouped-GEMM implementations that run on ``device`` for one dense weight tensor."""
    dev = torch.device(device)
    w = torch.zeros(1, 128, 128, dtype=torch.bfloat16, device=dev)
    return available_impls(torch.zeros(1, 128, dtype=torch.bfloat16, device=dev), GroupedWeights.contiguous(w, w, w))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_run(*, preset, ranks, layers, tokens, maxvios, steps, warmup, check_steps, device, configs, impl, slots,
              budget_gb, max_ref_err=MAX_REF_ERR, backend="auto", share_gpus=False, heap="auto", graphs=False,
              transport="auto", ranks_per_node=None) -> None:
    """Every choice of a run, checked before any rank is spawned; ``ValueError`` names the first problem."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks!r}")
    if p.experts % ranks:
        ok = [d for d in _divisors(p.experts) if 1 < d <= 64]
        raise ValueError(
            f"--ranks {ranks} does not divide the {preset} preset's {p.experts} experts (MoonEP gives every rank "
            f"E/R of them); use one of {', '.join(map(str, ok))}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if not tokens or any(t < 1 for t in tokens):
        raise ValueError(f"--tokens must be positive token counts per rank, got {list(tokens)}")
    if not maxvios or any(not (m >= 0) for m in maxvios):
        raise ValueError(f"--maxvio must be >= 0 (0 is even routing), got {list(maxvios)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps}, warmup={warmup}")
    if check_steps < 1:
        raise ValueError("--check-steps must be >= 1: every configuration is checked against the dense reference")
    if check_steps > steps:
        raise ValueError(f"--check-steps {check_steps} exceeds --steps {steps}")
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    resolve_launch(device, ranks, backend, share_gpus)  # ValueError: how the ranks cannot run here
    check_heap(heap, device)
    if impl not in IMPLS:
        raise ValueError(f"--impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl != "auto":
        avail = kernels_on(device)
        if impl not in avail:
            raise ValueError(f"--impl {impl} cannot run on {device} ranks here (available: {', '.join(avail)}; "
                             "'auto' takes the best of them)")
    for c in configs or ():
        try:
            config_choice(c)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--configs: {exc}") from None
    if impl == "grouped_mm" and "symmetric-shared" in (configs or CONFIGS):
        raise ValueError("--impl grouped_mm cannot read symmetric-shared's shared slot pool (it needs one dense "
                         "weight tensor); leave symmetric-shared out of --configs or use another --impl")
    if slots is not None and slots < 1:
        raise ValueError(f"--slots must be >= 1, got {slots}")
    if budget_gb is not None and not (budget_gb > 0):
        raise ValueError(f"--budget-gb must be > 0, got {budget_gb}")
    if not (max_ref_err > 0):
        raise ValueError(f"max_ref_err must be > 0, got {max_ref_err}")
    if graphs and device != "cuda":
        raise ValueError("--graphs times CUDA-graph replays of the step: it needs --device cuda")
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1
                                       or ranks % ranks_per_node):
        raise ValueError(f"--ranks-per-node {ranks_per_node} must be a positive divisor of --ranks {ranks} "
                         "(simulated nodes are blocks of equal size)")
    several = ranks_per_node is not None and ranks_per_node < ranks
    if several and transport == "symmetric":
        raise ValueError(f"--transport symmetric needs every rank on one node; --ranks-per-node {ranks_per_node} "
                         "makes several: use hybrid, collective or auto")
    if several and graphs:
        raise ValueError("--graphs needs the symmetric transport (one node); --ranks-per-node makes several nodes")
    if graphs and impl not in ("auto", "triton"):
        raise ValueError(f"--graphs needs the Triton expert kernels (--impl auto or triton): --impl {impl} reads "
                         "group sizes on the host, which a CUDA graph cannot capture")


def check_heap(heap: str, device: str) -> None:
    """``--heap``: a kind of ``make_heap`` that runs on ``device`` here (``ValueError`` otherwise)."""
    if heap not in HEAP_KINDS:
        raise ValueError(f"--heap must be one of {', '.join(HEAP_KINDS)}, got {heap!r}")
    if heap == "host" and device != "cpu":
        raise ValueError("--heap host holds host memory: it serves --device cpu only")
    if heap in ("torch", "nvshmem") and device != "cuda":
        raise ValueError(f"--heap {heap} allocates GPU memory: it needs --device cuda")
    if heap == "nvshmem":
        from vllm_moonep.engine.heaps.nvshmem_heap import nvshmem_status

        core, why = nvshmem_status()
        if core is None:
            raise ValueError(f"--heap nvshmem: {why}")


def scaled_shape(p: Preset, ranks: int, layers: int | None, budget_bytes: int, slots: int | None) -> dict:
    """Scale layers, then experts, so the replicated layout (the larger one) fits ``budget_bytes``
    per rank. Layers go first: the expert count shapes routing, plans and slots (what is
    measured), while fewer layers only shorten the step. Experts shrink (keeping a multiple of
    ``ranks`` and at least 2 per rank) only when one layer does not fit."""
    L = min(layers or p.layers, p.layers)
    E = p.experts
    bpe = expert_bytes(p.hidden, p.intermediate)

    def replicated_bytes(E_, L_):
        B_ = slots or max(default_num_slots(E_, ranks), 1)
        return replicated_accounting(E_, ranks, B_, p.hidden, p.intermediate, layers=L_).resident

    while replicated_bytes(E, L) > budget_bytes and L > 1:
        L -= 1
    while replicated_bytes(E, L) > budget_bytes and E > 2 * ranks:
        E = max(2 * ranks, (E // 2) // ranks * ranks)
    E = max(E // ranks, 1) * ranks
    if E < p.topk:
        E = ((p.topk + ranks - 1) // ranks) * ranks
    B = slots or default_num_slots(E, ranks)
    return {
        "hidden": p.hidden, "intermediate": p.intermediate, "experts": E, "topk": p.topk,
        "layers": L, "slots": B, "expert_bytes": bpe,
        "expert_scale": p.experts / E, "layer_scale": p.layers / L,
    }


# ----------------------------------------------------------------------------- rank side
_STATE: dict = {}


def _device(kind: str) -> torch.device:
    """This rank's device: the GPU the launcher bound it to (one per rank, or shared), or the CPU."""
    if kind == "cuda":
        return current_cuda_device()
    return torch.device("cpu")


@dataclass
class Built:
    """One configuration built on this rank: what ``rank_point`` steps and ``rank_teardown`` frees.

    ``moes``: one runner per layer (``forward(hidden, ids, weights)``, ``last``, ``timer``);
    ``pool``: the engine's buffer pool; ``report``: the accounted expert memory; ``held``: the
    objects whose tensors and heap allocations are the configuration's expert weights (what the
    memory check attributes); ``heaps``: the symmetric heaps they live on; ``destroy_layouts``:
    frees the layouts (in the order their heap needs)."""

    moes: list
    pool: Any
    report: MemoryReport
    held: list
    heaps: list[SymmetricHeap]
    destroy_layouts: Callable[[], None]


def build_ours(cfg: str, shape: dict, local: list, device: torch.device, impl: str, heap_kind: str = "auto") -> Built:
    """Our layouts (``cfg`` one of ``LAYOUT_KINDS``) over ``local`` (one ``(w13, w2)`` per layer).

    As the vLLM plugin does, the symmetric layouts adopt the framework's parameters (``local``) as
    their heap's home rows (their own storage is released), so the home experts are held once."""
    R, E, B = dist.get_world_size(), shape["experts"], shape["slots"]
    pool = MoonEPBufferPool(dict(H=shape["hidden"], K=shape["topk"], E=E, num_ep_ranks=R, B=B, token_padding=128,
                                 device=device, transport=shape.get("transport", "auto")),
                            max_tokens_per_rank=shape["max_tokens"], engine="builtin")
    heap_options = {"heap_kind": heap_kind, "adopt_parameters": True} if cfg != "replicated" else {}
    layouts = build_layouts(cfg, local, E, B, **heap_options)
    return Built(moes=[MoonEPMoE(pool, lay, impl=impl) for lay in layouts.layouts], pool=pool,
                 report=layouts.memory_report(), held=[*layouts.layouts, *layouts.slot_pools.values()],
                 heaps=[layouts.heap] if layouts.heap is not None else [], destroy_layouts=layouts.destroy)


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
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sum(1 for o in every if o == mine)


def rank_build(cfg, shape, seed, device_kind, impl, heap_kind="auto"):
    """Build configuration ``cfg`` on this rank and measure what it holds (``measure_build``)."""
    if cfg == "vllm-poc":  # import vLLM before measuring, so its import is not counted as expert memory
        from vllm_moonep.tools.ab_vllm_poc import build_poc, import_poc

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


#: causes of a difference between measured and accounted memory, as the output names them
WHY_TENSORS = "tensors held beyond the accounting"
WHY_STAGING = ("the CPU host heap's private staging copy of every allocation (HostHeap(staging=True) makes "
               "writes visible at barriers; GPU heaps hold one copy)")
WHY_TORCH_CACHE = "torch's CUDA allocator beyond its tensors (block rounding)"
WHY_OUTSIDE = ("device memory outside torch's allocator beyond the heaps' allocations (allocation granularity, "
               "signal pads, NVSHMEM's reserved heap, communication buffers)")


def memory_check(mem: dict, device_kind: str) -> dict:
    """One rank's measured memory against its accounting, with the difference attributed to causes
    (``explain_difference``): tensors the accounting leaves out, the host heap's staging copies,
    and on GPUs the allocators' rounding and memory outside torch's allocator."""
    acc = mem["accounted"]["resident"]
    d = mem.get("detail", {})
    measured = mem["measured_resident"]
    parts = []
    if "tensors_torch" in d:
        parts.append((WHY_TENSORS, d["tensors_torch"] + d["tensors_heap"] - acc))
    if d.get("host_staging"):
        parts.append((WHY_STAGING, d["host_staging"]))
    if device_kind == "cuda" and "torch_reserved_delta" in d:
        reserved = d["torch_reserved_delta"]
        parts.append((WHY_TORCH_CACHE, reserved - d["tensors_torch"]))
        parts.append((WHY_OUTSIDE, measured - reserved - d["tensors_heap"]))
    out = explain_difference(measured, acc, parts)
    out["fresh_process"] = d.get("fresh_process", False)
    return out


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
        ids, w = route(tokens, E, K, sigma=sigma, seed=seed + step, rank=r)
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
        "ref_rel_err": max(errs) if errs else None,
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


# ----------------------------------------------------------------------------- driver
def _percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def environment(device_kind: str, ranks: int, launch=None, heap: str = "auto", transport: str = "auto",
                ranks_per_node: int | None = None) -> dict:
    env = {
        "transport": transport,
        "ranks_per_node": ranks_per_node,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": device_kind,
        "ranks": ranks,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "heap": heap,
    }
    if launch is not None:
        env.update(backend=launch.backend, launched_by_torchrun=launch.launched, ranks_per_gpu=launch.ranks_per_gpu,
                   launch_note=launch.note)
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except Exception:
        env["vllm"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if device_kind == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus_visible"] = torch.cuda.device_count()
    return env


def measure_anchor(device_kind: str) -> dict:
    """A reference rate measured in the same run, so figures from different machines compare:
    matmul throughput (bf16 on GPU, 8192^3; float32 on one CPU thread, 1024^3) and copy bandwidth."""
    if device_kind == "cuda" and torch.cuda.is_available():
        n, dev, dt = 8192, current_cuda_device(), torch.bfloat16
    else:
        n, dev, dt = 1024, torch.device("cpu"), torch.float32
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        src = torch.randn(64 * 2**20 if dev.type == "cuda" else 16 * 2**20, device=dev)
        dst = torch.empty_like(src)

        def timed(fn, reps):
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        mm = timed(lambda: torch.mm(a, b), 10)
        cp = timed(lambda: dst.copy_(src), 10)
    finally:
        torch.set_num_threads(threads)
    return {
        "matmul": f"{'bf16' if dt == torch.bfloat16 else 'fp32, 1 thread'} {n}^3",
        "matmul_tflops": 2 * n**3 / mm / 1e12,
        "copy_gbs": 2 * src.numel() * src.element_size() / cp / 1e9,
    }


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def spawn_options(launch) -> dict:
    """``run_on_ranks`` keywords of the rank processes of ``launch`` (``launch.resolve_launch``): the
    threads per rank, and on CPU glibc's one arena (every thread's allocations in the main arena,
    whose freed pages leave RSS, so the memory measurement sees what is really held)."""
    env = {"VLLM_MOONEP_THREADS_PER_RANK": str(max(1, (os.cpu_count() or 1) // launch.ranks)), **launch.env}
    if launch.device == "cpu":
        env["MALLOC_ARENA_MAX"] = "1"
    return dict(env=env, backend=launch.backend, device=launch.device)


def summarize_point(res: list[dict], *, tokens: int, maxvio: float, sigma: float) -> dict:
    """One point of the table from every rank's ``rank_point`` result: the slowest rank's step
    time (what a DP group waits for), its phases, the balance figures and the worst reference error."""
    ranks = len(res)
    per_step = [max(r["total_s"][i] for r in res) for i in range(len(res[0]["total_s"]))]
    return {
        "tokens": tokens, "maxvio": maxvio, "maxvio_achieved": res[0]["maxvio_achieved"], "sigma": sigma,
        "median_s": statistics.median(per_step), "p90_s": _percentile(per_step, 0.9),
        "phases_median_s": {ph: statistics.median([max(r["phases_s"][ph][i] for r in res) for i in range(len(per_step))])
                            for ph in PHASES},
        "imbalance_without_plan": res[0]["rows_without_plan_max_over_mean"],
        # real rows are S*K on every rank by construction; padding to token_padding
        # is what can still differ, so the plan's balance is measured on padded rows
        "imbalance_with_plan": statistics.median(
            max(r["padded_rows"][i] for r in res) / max(sum(r["padded_rows"][i] for r in res) / ranks, 1)
            for i in range(len(per_step))),
        "slots_used_per_step": statistics.mean(sum(r["slots_used"][i] for r in res) for i in range(len(per_step))),
        "padded_rows_max": max(max(r["padded_rows"]) for r in res),
        "a2a_s": max(r.get("a2a_s", 0.0) for r in res),
        "ref_rel_err": max((r["ref_rel_err"] or 0.0) for r in res),
        "raw": res,
    }


def run_ab(*, preset="tiny", ranks=None, layers=None, tokens=(16, 128), maxvios=(0.0, 1.0, 2.0), steps=3, warmup=1,
           check_steps=1, device="cpu", seed=0, configs=None, impl="auto", slots=None, budget_gb=None,
           out_dir="moonep-ab-out", plots=True, progress=True, max_ref_err=MAX_REF_ERR, backend="auto",
           share_gpus=False, heap="auto", graphs=False, transport="auto", ranks_per_node=None) -> dict:
    """Run the comparison; returns the result dict (also written to ``out_dir/moonep-ab.json``).
    Every argument is checked (``check_run``, ``ValueError``) before any rank is spawned.

    ``ranks``: ``None`` is 4 spawned ranks, or the launched world size under torchrun.
    ``backend``/``share_gpus``: how the ranks run (``launch.resolve_launch``). ``heap``: the
    symmetric configurations' heap kind (``make_heap``). Each configuration runs in fresh rank
    processes (under torchrun: in the launched ones, which every configuration reuses).
    ``graphs``: each timed step is one CUDA-graph replay of every layer (vLLM's captured decode);
    the phases are then not timed and ``vllm-poc`` (vLLM's eager-only classes) is skipped.
    ``transport``: the engine's transport for our configurations (``vllm-poc`` builds its own
    buffers: auto). ``ranks_per_node``: the ranks run as simulated nodes of that many ranks
    (``VLLM_MOONEP_RANKS_PER_NODE`` in every rank; ``None``: the real hosts)."""
    t_start = time.perf_counter()
    if ranks is None:
        ranks = launched_world_size() or 4
    check_run(preset=preset, ranks=ranks, layers=layers, tokens=tokens, maxvios=maxvios, steps=steps, warmup=warmup,
              check_steps=check_steps, device=device, configs=configs, impl=impl, slots=slots, budget_gb=budget_gb,
              max_ref_err=max_ref_err, backend=backend, share_gpus=share_gpus, heap=heap, graphs=graphs,
              transport=transport, ranks_per_node=ranks_per_node)
    launch = resolve_launch(device, ranks, backend, share_gpus)
    if launch.launched:  # bind this process's GPU before the anchor, and make the group
        init_launched_group(launch.backend, launch.device)
    p = PRESETS[preset]
    if budget_gb is None:
        budget_gb = default_budget_gb(device)
    shape = scaled_shape(p, ranks, layers, int(budget_gb * GiB), slots)
    shape["max_tokens"] = max(tokens)
    if layers is not None and shape["layers"] != layers:  # said, not silently honoured in part
        shape["note"] = (f"--layers {layers} asked; {shape['layers']} of the preset's {p.layers} fit --budget-gb "
                         f"{budget_gb:g} per rank (replicated layout)")
    configs = list(configs or CONFIGS)
    if impl == "grouped_mm" and "symmetric" in configs and shape["slots"] < shape["experts"] // ranks:
        raise ValueError(f"--impl grouped_mm cannot run the symmetric configuration with --slots {shape['slots']} < "
                         f"E/R = {shape['experts'] // ranks} (ranks then read overflow rows from their peers' "
                         "memory, which is no dense tensor)")
    skipped = {}
    if "vllm-poc" in configs and not vllm_available():
        configs.remove("vllm-poc")
        skipped["vllm-poc"] = "vLLM is not importable here"
    if "vllm-poc" in configs and graphs:
        configs.remove("vllm-poc")
        skipped["vllm-poc"] = "vLLM 0.33's in-tree MoonEP classes are eager-only (--graphs)"
    ignored = [f"--{k} {v}" for k, v in (("impl", impl), ("heap", heap)) if v != "auto"]
    if "vllm-poc" in configs and ignored:  # said, not silently dropped
        note = (f"vllm-poc runs vLLM 0.33's own classes (its experts, its replicated weights): "
                f"{' and '.join(ignored)} apply to the other configurations only")
        shape["note"] = f"{shape['note']}; {note}" if shape.get("note") else note
    spawn = spawn_options(launch)
    if ranks_per_node is not None:
        spawn["env"][RANKS_PER_NODE_ENV] = str(ranks_per_node)
    shape["transport"] = transport
    sigmas = {mv: sigma_for_maxvio(mv, shape["experts"], shape["topk"], max(tokens) * ranks, seed=seed) for mv in maxvios}
    points = [(c, t, mv) for c in configs for t in tokens for mv in maxvios]
    bar = None
    if progress and is_driver():
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(points), desc="moonep-ab", unit="point", file=sys.stderr)
        except ImportError:
            bar = None
    results = {"preset": preset, "shape": shape, "configs": {}, "skipped": skipped,
               "environment": {**environment(device, ranks, launch, heap, transport, ranks_per_node),
                               "graphs": bool(graphs)},
               "anchor": measure_anchor(device),
               "sigmas": {str(k): v for k, v in sigmas.items()}}
    failures = []
    for cfg in configs:
        tag = f"moonep-ab {cfg}"  # fresh rank processes for each configuration
        try:
            mem = run_on_ranks(ranks, rank_build, cfg, shape, seed, device, impl, heap, tag=tag, **spawn)
        except BaseException:
            shutdown_pools(tag)
            raise
        entry = {"memory": mem, "memory_check": [memory_check(m, device) for m in mem], "points": []}
        try:
            for t in tokens:
                for mv in maxvios:
                    res = run_on_ranks(ranks, rank_point, cfg, t, sigmas[mv], steps, warmup, check_steps, seed,
                                       graphs, tag=tag, **spawn)
                    pt = summarize_point(res, tokens=t, maxvio=mv, sigma=sigmas[mv])
                    entry["points"].append(pt)
                    if not (pt["ref_rel_err"] <= max_ref_err):
                        failures.append(f"{cfg}: tokens={t} maxvio={mv}: relative error {pt['ref_rel_err']:.3e} "
                                        f"> {max_ref_err}")
                    if bar:
                        bar.update(1)
        finally:
            try:
                entry["engine_buffers"] = run_on_ranks(ranks, rank_teardown, cfg, tag=tag, **spawn)[0]
            finally:
                shutdown_pools(tag)
        results["configs"][cfg] = entry
        if any(m.get("detail", {}).get("reference_on_host") for m in mem):
            results["shape"]["reference"] = (
                "the dense reference's full weights were kept in host memory (with the replicated layout they "
                f"would fill more than {REFERENCE_ON_GPU_SHARE:.0%} of the GPU); each check brings the used "
                "experts over, outside the timed region")
    if bar:
        bar.close()
    results["failures"] = failures
    results["max_ref_err"] = max_ref_err
    results["projection"] = projection_rows()
    path = os.path.join(out_dir, "moonep-ab.json")
    if is_driver():  # under torchrun every rank has the results; rank 0 writes them
        os.makedirs(out_dir, exist_ok=True)
        if plots:
            results["plots"] = write_plots(results, out_dir)
        # the whole run: anchor, every rank process, the points, the plots
        results["elapsed_s"] = time.perf_counter() - t_start
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=float)
    results["elapsed_s"] = time.perf_counter() - t_start
    results["json_path"] = path
    return results


def write_plots(results: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cfgs = list(results["configs"])
    # memory by layout (accounted resident, per rank, rank 0)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    kinds = ["home_rows", "replicated_rows", "slots"]
    bottom = [0.0] * len(cfgs)
    for kind in kinds:
        vals = [results["configs"][c]["memory"][0]["accounted"][kind] / 2**20 for c in cfgs]
        ax.bar(cfgs, vals, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    measured = [results["configs"][c]["memory"][0]["measured_resident"] / 2**20 for c in cfgs]
    ax.scatter(cfgs, measured, color="black", marker="x", zorder=3, label="measured (fresh process)")
    ax.set_ylabel("expert weights per rank (MiB)")
    ax.set_title(f"moonep-ab {results['preset']}: memory by layout")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "memory.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # latency versus maxvio (largest token count) and versus tokens (largest maxvio)
    for xkey, fixed_key, fname in (("maxvio", "tokens", "latency_vs_maxvio.png"), ("tokens", "maxvio", "latency_vs_tokens.png")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for c in cfgs:
            pts = results["configs"][c]["points"]
            if not pts:
                continue
            fixed = max(p[fixed_key] for p in pts)
            sel = sorted((p for p in pts if p[fixed_key] == fixed), key=lambda p: p[xkey])
            ax.plot([p[xkey] for p in sel], [p["median_s"] * 1e3 for p in sel], marker="o", label=c)
        ax.set_xlabel(xkey if xkey == "maxvio" else "tokens per rank")
        if xkey == "tokens":
            ax.set_xscale("log", base=2)
        ax.set_ylabel("step latency, median (ms)")
        ax.set_title(f"latency vs {xkey} ({fixed_key} = {fixed})")
        ax.legend()
        fig.tight_layout()
        paths.append(os.path.join(out_dir, fname))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


LEGEND = (
    "memory (per rank, rank 0): resident MiB = expert weights held while serving, from the layouts' own accounting (home = this rank's E/R experts, repl. = the replicated [0,E) copy, slots = the B prefetch slots); load transient = extra held only while the weights are built; measured MiB = how much a fresh rank process grew while building the layers (RSS on CPU; device memory in use on GPU, which counts the symmetric heaps outside torch's allocator), measured after freed memory was released: a check on the accounting; where the two differ by more than 10% the output says why (staging copies of the CPU host heap, allocator rounding, memory outside the expert weights); peak MiB = the most the process held while building (the measured load transient plus the resident).",
    "latency: tokens = tokens per rank per step; maxvio = the requested routing skew, max/mean tokens per expert - 1 over all ranks' tokens of a step (0 = even); got = the skew the routing actually had, mean over the timed steps (random routing is never perfectly even, so a requested 0 comes out above 0); median / p90 ms = step time over all layers of the slowest rank; the phase columns are median ms per step summed over layers, slowest rank: pad = pad the step to the buffer's capacity and count tokens per expert, dispatch = plan and send rows to their ranks, prefetch = fill the slots with the planned experts' weights, experts = the grouped GEMM, combine = send results back and sum each token's top-k (vllm-poc reports its prepare under dispatch); 2xa2a = the anchor of dispatch + combine, measured in the same run on the same group: two plain all_to_all_single of a layer's dispatch payload (tokens x top-k x hidden bf16 per rank, split evenly), slowest rank's median, times the layers; no-plan = max/mean rows per rank without redundancy (all rows of its home experts); plan = max/mean rows per rank under the MoonEP plan, padding included (real rows are exactly S*K everywhere); slots = slots used per step (all ranks, last layer); ref err = max relative error ||out - ref|| / ||ref|| over the checked steps against a dense float32 MoE on the full weights (a configuration above {max_ref_err:g} fails the run).",
)


def legend(max_ref_err: float = MAX_REF_ERR) -> str:
    """The tables' column legend, wrapped for a terminal."""
    return "\n".join(textwrap.fill(p.format(max_ref_err=max_ref_err), 118, subsequent_indent="  ") for p in LEGEND)


def format_table(results: dict) -> str:
    s = results["shape"]
    an = results.get("anchor", {})
    env = results["environment"]
    how = f" ({env['backend']}{', torchrun' if env.get('launched_by_torchrun') else ''})" if env.get("backend") else ""
    lines = [
        f"moonep-ab: preset {results['preset']} on {env['ranks']} {env['device']} ranks{how}; "
        f"H={s['hidden']} I={s['intermediate']} E={s['experts']} (full model / {s['expert_scale']:.1f}) "
        f"K={s['topk']} layers={s['layers']} (full model / {s['layer_scale']:.1f}) B={s['slots']}",
        f"anchor (same run): matmul {an.get('matmul', '?')} {an.get('matmul_tflops', 0) * 1e3:.0f} GFLOP/s, "
        f"copy {an.get('copy_gbs', 0):.0f} GB/s",
    ]
    if env.get("launch_note") and env.get("backend") != "nccl" and env.get("device") == "cuda":
        lines.append(f"NOTE: {env['launch_note']}")
    if env.get("ranks_per_node") or env.get("transport", "auto") != "auto":
        k = env.get("ranks_per_node")
        lines.append(f"transport {env.get('transport', 'auto')}" + (
            f"; {env['ranks'] // k} simulated nodes of {k} ranks ({RANKS_PER_NODE_ENV}={k})" if k else ""))
    for k in ("note", "reference"):
        if s.get(k):
            lines.append(f"NOTE: {s[k]}")
    lines += [
        "",
        f"{'config':<17} {'resident MiB':>12} {'home':>8} {'repl.':>8} {'slots':>8} {'load transient':>14} "
        f"{'measured MiB':>12} {'peak MiB':>8}",
    ]
    notes = []
    for c, e in results["configs"].items():
        a = e["memory"][0]["accounted"]
        mib = 2**20
        lines.append(
            f"{c:<17} {a['resident'] / mib:12.1f} {a['home_rows'] / mib:8.1f} {a['replicated_rows'] / mib:8.1f} "
            f"{a['slots'] / mib:8.1f} {a['transient'] / mib:14.1f} {e['memory'][0]['measured_resident'] / mib:12.1f} "
            f"{e['memory'][0].get('measured_peak', 0) / mib:8.1f}"
        )
        chk = (e.get("memory_check") or [{}])[0]
        if chk.get("why"):
            notes.append(f"  {c}: {chk['why']}")
    fresh = all((e.get("memory_check") or [{}])[0].get("fresh_process", False) for e in results["configs"].values())
    lines.append(
        ("measured: each configuration in fresh rank processes" if fresh else
         "measured: in the launched processes, which every configuration reuses (torchrun), so memory an earlier "
         "configuration freed can hide growth; spawned ranks measure in fresh processes")
        + (", device memory in use on the GPU (torch's allocator and the heaps outside it)" if env.get("device") == "cuda"
           else ", RSS growth") + ", rank 0" + ("; " + str(env["ranks_per_gpu"]) + " ranks per GPU: device growth / "
                                              "ranks on it" if env.get("ranks_per_gpu", 1) > 1 else ""))
    if notes:
        lines.append(f"where measured and accounted differ by more than {EXPLAIN_ABOVE:.0%}, why:")
        lines += notes
    held = {c: e["engine_buffers"] for c, e in results["configs"].items() if e.get("engine_buffers", {}).get("heap_bytes")}
    if held:
        lines.append("engine buffers (not in the columns above): the symmetric transport's receive and landing areas "
                     "on the heap, one set per buffer capacity used, per rank: " + "; ".join(
                         f"{c} {h['heap_bytes'] / 2**20:.1f} MiB for capacities {h['capacities']}" for c, h in held.items()))
    if any(e["memory"][0].get("detail", {}).get("peak_reset") is False for e in results["configs"].values()):
        lines.append("peak MiB here is the measured resident only (a lower bound): this kernel refused "
                     "/proc/self/clear_refs, so the process's peak since the build began is unknown")
    if env.get("graphs"):
        lines += ["", "timing: each step is one CUDA-graph replay of every layer (as vLLM runs a captured step); "
                      "phases are not timed inside a graph (0.00), and plan and slots are the captured step's"]
    lines += ["", f"{'config':<17} {'tokens':>6} {'maxvio':>6} {'got':>5} {'median ms':>9} {'p90 ms':>8} "
              + " ".join(f"{p[:8]:>8}" for p in PHASES) + f" {'2xa2a':>8} {'no-plan':>7} {'plan':>5} {'slots':>5} {'ref err':>8}"]
    for c, e in results["configs"].items():
        for p in e["points"]:
            lines.append(
                f"{c:<17} {p['tokens']:>6} {p['maxvio']:>6.1f} {p.get('maxvio_achieved', float('nan')):5.2f} "
                f"{p['median_s'] * 1e3:9.2f} {p['p90_s'] * 1e3:8.2f} "
                + " ".join(f"{p['phases_median_s'][ph] * 1e3:8.2f}" for ph in PHASES)
                + f" {2 * p.get('a2a_s', float('nan')) * s['layers'] * 1e3:8.2f}"
                + f" {p['imbalance_without_plan']:7.2f} {p['imbalance_with_plan']:5.2f} {p['slots_used_per_step']:5.1f} "
                f"{p['ref_rel_err']:8.1e}"
            )
    lines.append("")
    lines += legend(results.get("max_ref_err", MAX_REF_ERR)).splitlines()
    if results.get("skipped"):
        for c, why in results["skipped"].items():
            lines.append(f"skipped {c}: {why}")
    if results.get("failures"):
        lines.append("REFERENCE CHECK FAILED:")
        lines += ["  " + f for f in results["failures"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moonep-ab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join(textwrap.fill(par, 100) for par in (
            "Replicated versus symmetric expert layouts: memory and latency of the same MoE workload (layers x "
            "tokens per rank x routing skew) on R rank processes, for each configuration: replicated (vLLM's PoC "
            "memory model, [E+B] per layer), symmetric (E/R home experts on a symmetric heap, B slots per layer), "
            "symmetric-shared (one slot pool for all layers), vllm-poc (vLLM 0.33's own in-tree MoonEP classes on "
            "our engine). Every configuration is checked against a dense float32 MoE; a wrong one fails the run. "
            "Writes a table, OUT/moonep-ab.json and plots.",
            "Ranks: spawned CPU processes over gloo, or with --device cuda one GPU per rank over NCCL (fewer GPUs "
            "than ranks: refused unless --share-gpus); or launch it with torchrun (torchrun --nproc-per-node 2 -m "
            "vllm_moonep.tools.ab --device cuda), whose processes are the ranks. Each configuration runs in fresh "
            "rank processes, where its memory is measured next to the accounting (why they differ is printed "
            "where it is more than 10%).",
            "Subcommand: moonep-ab project [...] prints the per-rank expert memory of full-size models at several "
            "EP sizes, or of your own model (--config config.json, or --hidden --intermediate --experts "
            "--layers); see moonep-ab project --help.")),
        epilog="Columns of the tables:\n" + legend())
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS),
                    help="model shape: 'tiny' (H=I=256, E=32, top-4, 4 layers) or a full-size model scaled to "
                         "--budget-gb (default: %(default)s)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="rank processes (EP size); must divide the preset's expert count (default: 4, or the "
                         "launched world size under torchrun)")
    ap.add_argument("--layers", type=int, default=None,
                    help="MoE layers to run, at most the preset's (default: as many as fit --budget-gb)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128],
                    help="tokens per rank per step; several values make a sweep (default: %(default)s)")
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 1.0, 2.0],
                    help="routing skew to request, max/mean tokens per expert - 1 (0 = even); a sweep "
                         "(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default: %(default)s)")
    ap.add_argument("--check-steps", type=int, default=1,
                    help="timed steps per point checked against the dense reference, 1..--steps (default: %(default)s)")
    ap.add_argument("--device", default="cpu", choices=list(DEVICES),
                    help="where the ranks run: cpu (gloo) or cuda (one GPU per rank over NCCL; --share-gpus for "
                         "fewer GPUs than ranks) (default: %(default)s)")
    add_launch_arguments(ap)
    ap.add_argument("--heap", default="auto", choices=list(HEAP_KINDS),
                    help="symmetric heap of the symmetric configurations: auto = host on cpu, torch (PyTorch "
                         "symmetric memory) on cuda; nvshmem needs nvshmem4py (default: %(default)s)")
    ap.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                    help="the engine's transport for our configurations: auto = symmetric on one node of GPUs, "
                         "hybrid across nodes with several ranks each, else collective (gloo on cpu) "
                         "(default: %(default)s)")
    ap.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                    help=f"run the ranks as simulated nodes of K ranks each ({RANKS_PER_NODE_ENV}): peers on other "
                         "blocks are treated as remote (hybrid transport, RMA prefetch) (default: the real hosts)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, tokens and routing (default: %(default)s)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), type=config_choice, metavar="CONFIG",
                    help=f"configurations to compare: any of {', '.join(CONFIGS)} "
                         "(default: all; vllm-poc is skipped where vLLM does not import)")
    ap.add_argument("--impl", default="auto", choices=list(IMPLS),
                    help="grouped GEMM of the experts; 'auto' takes the best that runs on --device (default: %(default)s)")
    ap.add_argument("--slots", type=int, default=None, help="B, prefetch slots per rank (default: E/R)")
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="per-rank expert memory the scaled model may use, GiB (default: 1 on cpu, half of the GPU's memory on cuda)")
    ap.add_argument("--out", default="moonep-ab-out",
                    help="folder for moonep-ab.json and the plots (default: %(default)s)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    ap.add_argument("--graphs", action="store_true",
                    help="time each step as one CUDA-graph replay of every layer, as vLLM runs a captured step "
                         "(cuda only; phases are not timed inside a graph)")
    return ap


def main(argv=None) -> int:
    t0 = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "project":  # the memory projection (tools/vllm_moonep/tools/memory_projection.py)
        from vllm_moonep.tools.memory_projection import main as projection_main

        return projection_main(argv[1:], prog="moonep-ab project")
    ap = build_parser()
    a = ap.parse_args(argv)
    ranks = a.ranks if a.ranks is not None else (launched_world_size() or 4)
    kw = dict(preset=a.preset, ranks=ranks, layers=a.layers, tokens=a.tokens, maxvios=a.maxvio, steps=a.steps,
              warmup=a.warmup, check_steps=a.check_steps, device=a.device, configs=a.configs, impl=a.impl,
              slots=a.slots, budget_gb=a.budget_gb, backend=a.backend, share_gpus=a.share_gpus, heap=a.heap,
              graphs=a.graphs, transport=a.transport, ranks_per_node=a.ranks_per_node)
    try:
        check_run(**kw)  # before anything is spawned
    except ValueError as exc:
        ap.error(str(exc))
    try:
        res = run_ab(seed=a.seed, out_dir=a.out, plots=not a.no_plots, **kw)
    finally:
        shutdown_pools()
        finish_launched_group()
    if is_driver():
        print(format_table(res))
        print()
        print("Projected per-rank expert memory of the full-size models (moonep-ab project for options):")
        print(render(res["projection"], 141.0, markdown=False))
        print(f"\nwrote {res['json_path']}" + (f" and {', '.join(res.get('plots', []))}" if res.get("plots") else "")
              + f"; the whole run took {time.perf_counter() - t0:.0f}s")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
