"""NCCL, one GPU per rank (skipped with fewer than 2 GPUs; ``bash tools/gpu_suite.sh`` runs them):

- the engine's transport, and the MoE step with the replicated layout and the symmetric layout
  on PyTorch symmetric memory, against the same references as on CPU (R = 2, 4, 8 as the GPUs
  allow);
- every heap that runs here, each in fresh rank processes: PyTorch symmetric memory and NVSHMEM
  (skipped, with the reason, where nvshmem4py does not import), per-layer slots with ``B >= E/R``
  and with ``B < E/R`` (overflow reads through peer views), the shared slot pool; NVSHMEM's RMA
  path with every peer treated as not addressable (``force_rma``: what ranks on other nodes
  need), its refusal of overflow, and its row gets through a scratch smaller than a row; each
  heap's allocations against the accounting, and the device memory they take, measured;
- the tools on NCCL ranks: ``moonep-ab`` spawned (one GPU per rank, memory measured per
  configuration in fresh processes) and under torchrun, ``--share-gpus`` only when asked,
  ``moonep-balance`` spawned and under torchrun, the soak.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ranks
from tests.distributed.test_engine import traceable_rows
from tests.moe_fixtures import check_against_dense, global_weights, rank_inputs
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.memory import (MiB, held_tensor_bytes, measured_bytes, release_freed_memory,
                                       resident_bytes)
from vllm_moonep.layouts import build_layouts
from vllm_moonep.testing.reference import dense_moe, relative_error
from vllm_moonep.testing.weights import local_experts

pytestmark = pytest.mark.multi_gpu

NCCL_ENV = {"VLLM_MOONEP_TEST_DEVICE": "cuda", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1", "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": "120"}
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need(n: int) -> None:
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, have {_gpus()}")


def _nvshmem_missing() -> str | None:
    from vllm_moonep.engine.heaps.nvshmem_heap import nvshmem_status

    core, why = nvshmem_status()
    return None if core is not None else why


def _report(name: str, data) -> None:
    """Figures the GPU run should keep: one JSON file in $OUT (tools/gpu_suite.sh sets it), a key per test."""
    out = os.environ.get("OUT")
    if not out:
        return
    path = pathlib.Path(out) / "multi_gpu_figures.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures[name] = data
    path.write_text(json.dumps(figures, indent=1, default=str))


# ---------------------------------------------------------------------------- engine and layouts
def step_both_layouts(layout_kind, B):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, I, K = 8 * R, 256, 512, 4
    w13, w2 = global_weights(E, H, I, 2)
    lw13, lw2 = (t.to(dev) for t in local_experts(w13, w2, r, R))
    layouts = build_layouts(layout_kind, [(lw13, lw2)], E, B, **({} if layout_kind == "replicated" else {"heap_kind": "torch"}))
    layout = layouts.layouts[0]
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev), 512, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="auto")
    slots = 0
    for m in (1, 100, 512):
        x, ids, w = rank_inputs(m, E, K, H, sigma=2.5, seed=m, rank=r)
        out = moe.forward(x.to(dev), ids.to(dev), w.to(dev), num_tokens_across_dp=512)
        check_against_dense(out.cpu(), x, ids, w, w13, w2)
        slots += int((moe.last.experts_to_copy >= 0).sum())
    pool.destroy()
    layouts.destroy()
    return slots


@pytest.mark.parametrize("R", [2, 4, 8])
def test_nccl_dispatch_rows_land_where_the_plan_says(R):
    """NCCL all-to-all dispatch must put every row where the reference plan says."""
    _need(R)
    slots = ranks(R, traceable_rows, 24, 16, 4, 8 * R, 4, 8, 2.5, 7, env=NCCL_ENV, backend="nccl")
    assert slots[0] > 0


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("layout_kind,B", [("replicated", 8), ("symmetric", 8), ("symmetric", 2)])
def test_nccl_moe_step_both_layouts(R, layout_kind, B):
    """The MoE step on NCCL ranks must match the dense reference with either layout."""
    _need(R)
    slots = ranks(R, step_both_layouts, layout_kind, B, env=NCCL_ENV, backend="nccl")
    assert all(s > 0 for s in slots)


# ---------------------------------------------------------------------------- every heap
E_PER_RANK, H, I, K, LAYERS = 8, 256, 512, 4, 2
#: (case, layout, B): per-layer slots with B = E/R (the dense path), B < E/R (overflow reads
#: through peer views), one shared slot pool for both layers (B = E/R, and B < E/R)
CASES = [("slots", "symmetric", 8), ("overflow", "symmetric", 2), ("shared", "symmetric-shared", 8),
         ("shared-overflow", "symmetric-shared", 2)]
#: with every peer treated as not addressable (NVSHMEM RMA): overflow is refused
RMA_CASES = [("rma-slots", "symmetric", 8), ("rma-shared", "symmetric-shared", 8)]
RMA_SCRATCH = 30 * 1024  # smaller than an expert row: prefetch gets rows in chunks


def _run_case(heap, layout, B, dev):
    """Build ``LAYERS`` layers on ``heap`` (measuring the device memory they take), run the MoE step
    on 1, 100 and 512 tokens per rank; figures for the test to check."""
    r, R = dist.get_rank(), dist.get_world_size()
    E = E_PER_RANK * R
    full = [global_weights(E, H, I, 10 + l) for l in range(LAYERS)]
    local = [tuple(t.to(dev) for t in local_experts(w13, w2, r, R)) for w13, w2 in full]
    dist.barrier()
    release_freed_memory(dev)
    before, base = measured_bytes(dev), resident_bytes(dev)
    layouts = build_layouts(layout, local, E, B, heap=heap)
    lays = layouts.layouts
    dist.barrier()
    release_freed_memory(dev)
    grown = resident_bytes(dev) - base
    reserved = measured_bytes(dev).get("reserved", 0) - before.get("reserved", 0)
    held = held_tensor_bytes(*lays, *layouts.slot_pools.values())
    accounted = layouts.memory_report().resident
    bufs = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, device=dev), 512, engine="builtin")
    moes = [MoonEPMoE(bufs, lay, impl="auto") for lay in lays]
    errs, slots = [], 0
    for m in (1, 100, 512):
        for l, moe in enumerate(moes):
            x, ids, w = rank_inputs(m, E, K, H, sigma=2.5, seed=100 * l + m, rank=r)
            out = moe.forward(x.to(dev), ids.to(dev), w.to(dev), num_tokens_across_dp=512)
            errs.append(relative_error(out.cpu(), dense_moe(x, ids, w, *full[l])))
            slots += int((moe.last.experts_to_copy[r] >= 0).sum())
    res = {
        "max_rel_err": max(errs), "slots_used": slots, "accounted": accounted, "heap_bytes": held["heap"],
        "heap_allocations": held["heap_allocations"], "device_growth": grown, "torch_reserved_growth": reserved,
        "peer_tables": [lay._peer_tables is not None for lay in lays],
        "weight_pools": [len(lay._weights.gate) for lay in lays],
        "dense": [lay.dense_weights for lay in lays],
        "peers_addressable": heap.peers_addressable,
    }
    bufs.destroy()
    layouts.destroy()
    release_freed_memory(dev)
    return res


def _rma_rows(heap, dev):
    """``copy_from_peer`` from a peer that is not addressable: rows that share the scratch, and
    rows larger than it (several gets each), against the values the peer wrote."""
    r, R = dist.get_rank(), dist.get_world_size()
    peer = (r + 1) % R
    out = {}
    for name, shape in (("small rows", (6, 3, 1000)), ("rows over the scratch", (3, 2, 20000))):
        n = shape[0]
        h = heap.allocate(shape, torch.float32, f"rma.{name}")
        vals = torch.arange(h.tensor.numel(), dtype=torch.float32, device=dev).view(shape)
        h.tensor.copy_(vals + 1e6 * r)
        heap.barrier()
        rows = torch.tensor([n - 1, 0, n - 2, 1] if n > 3 else [2, 0], device=dev)
        dst = torch.full((rows.numel(),) + shape[1:], -1.0, device=dev)
        heap.copy_from_peer(dst, h, peer, rows)
        torch.cuda.synchronize(dev)
        out[name] = bool(torch.equal(dst, (vals + 1e6 * peer)[rows]))
        heap.barrier()
        heap.free(h)
    return out


def heap_matrix(kind: str):
    """Every case on one heap of ``kind`` (fresh rank processes); for NVSHMEM also the RMA cases
    on a second heap that treats every peer as not addressable."""
    from vllm_moonep.engine.errors import MoonEPInputError
    from vllm_moonep.symmetric import SymmetricWeightLayout, make_heap

    dev = torch.device("cuda", torch.cuda.current_device())
    r, R = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    release_freed_memory(dev)
    base = resident_bytes(dev)
    heap = make_heap(kind, device=dev)
    dist.barrier()
    release_freed_memory(dev)
    res = {"heap_init_growth": resident_bytes(dev) - base, "addressable": heap.peers_addressable}
    for case, layout, B in CASES:
        res[case] = _run_case(heap, layout, B, dev)
    if kind == "nvshmem":
        rma = make_heap("nvshmem", device=dev, force_rma=True, rma_scratch_bytes=RMA_SCRATCH)
        res["rma_addressable"] = [rma.addressable(q) for q in range(R)]
        for case, layout, B in RMA_CASES:
            res[case] = _run_case(rma, layout, B, dev)
        E = E_PER_RANK * R
        w13, w2 = global_weights(E, H, I, 3)
        lw13, lw2 = (t.to(dev) for t in local_experts(w13, w2, r, R))
        try:
            SymmetricWeightLayout(lw13, lw2, E, 2, heap=rma)
            res["rma-overflow"] = "built"
        except MoonEPInputError as exc:
            res["rma-overflow"] = str(exc)
        res["rma-overflow-live"] = len(rma.live())
        res["rma-rows"] = _rma_rows(rma, dev)
        rma.close()
    heap.close()
    return res


@pytest.fixture(scope="module")
def torch_heap():
    _need(2)
    res = ranks(2, heap_matrix, "torch", env=NCCL_ENV, backend="nccl", fresh=True)
    _report("multi_gpu_heap_torch", res)
    return res


@pytest.fixture(scope="module")
def nvshmem_heap():
    _need(2)
    why = _nvshmem_missing()
    if why:
        pytest.skip(f"NVSHMEM heap: {why} (tools/gpu_suite.sh installs the nvshmem4py wheel from a carried .whl/ folder)")
    res = ranks(2, heap_matrix, "nvshmem", env=NCCL_ENV, backend="nccl", fresh=True)
    _report("multi_gpu_heap_nvshmem", res)
    return res


HEAPS = ["torch_heap", "nvshmem_heap"]


@pytest.mark.parametrize("heap", HEAPS)
@pytest.mark.parametrize("case", [c for c, _, _ in CASES])
def test_every_heap_runs_every_layout_against_dense(request, heap, case):
    """The NVSHMEM heap had never run in the suite: each heap, per-layer slots, overflow reads
    through peer views and the shared slot pool must match the dense reference and use slots."""
    for r in request.getfixturevalue(heap):
        c = r[case]
        assert c["max_rel_err"] < 2e-2, (heap, case, c)
        assert c["slots_used"] > 0, (heap, case, c)
        assert r["addressable"] is True and c["peers_addressable"] is True
        # prefetch reads the owners' rows through a device table of peer addresses
        assert all(c["peer_tables"]), c
        if case == "slots":  # B = E/R: the dense [home ; slots] view
            assert all(c["dense"]), c
        if "overflow" in case:  # B < E/R: row tables that include the peers' allocations
            assert not any(c["dense"]) and all(p >= 2 for p in c["weight_pools"]), c


@pytest.mark.parametrize("heap", HEAPS)
def test_heap_allocations_are_the_accounted_bytes_and_measured(request, heap):
    """The accounting was only compared with the formula that produced it: here each heap's live
    allocations are the accounted bytes, and the device memory they take is measured (PyTorch
    symmetric memory: at most the allocation granularity and a signal pad more per allocation)."""
    for r in request.getfixturevalue(heap):
        for case, _, _ in CASES:
            c = r[case]
            assert c["heap_bytes"] == c["accounted"], (heap, case, c)
            if heap == "torch_heap" and case == "slots":  # the first allocations of the process
                assert c["device_growth"] >= 0.9 * c["accounted"], (case, c)
                bound = c["accounted"] + c["heap_allocations"] * (2 * MiB + 64 * 1024) + 8 * MiB
                assert c["device_growth"] <= bound, (case, c, bound)


def test_nvshmem_rma_path_with_peers_not_addressable(nvshmem_heap):
    """The RMA path for peers that are not addressable had never run: with force_rma every peer is
    read by RMA gets (no peer views, no device table), through a scratch smaller than a row, and
    the step still matches the dense reference."""
    R = len(nvshmem_heap)
    for rank, r in enumerate(nvshmem_heap):
        assert r["rma_addressable"] == [q == rank for q in range(R)], r["rma_addressable"]
        for case, _, _ in RMA_CASES:
            c = r[case]
            assert c["peers_addressable"] is False and not any(c["peer_tables"]), c
            # compute reads only this rank's memory (and the shared pool): no peer pool
            assert c["weight_pools"] == [1 if case == "rma-slots" else 2] * LAYERS, c
            assert c["dense"] == [case == "rma-slots"] * LAYERS, c
            assert c["slots_used"] > 0 and c["max_rel_err"] < 2e-2, c
            assert c["heap_bytes"] == c["accounted"], c
        assert r["rma-rows"] == {"small rows": True, "rows over the scratch": True}, r["rma-rows"]


def test_nvshmem_rma_refuses_overflow(nvshmem_heap):
    """Overflow (B < E/R) reads owners' rows in place, which RMA peers cannot serve: refused at
    construction with a sentence, nothing allocated."""
    for r in nvshmem_heap:
        assert "cannot address every peer" in r["rma-overflow"] and "B=2 slots < epn=8" in r["rma-overflow"]
        assert r["rma-overflow-live"] == 0


# ---------------------------------------------------------------------------- the tools
def _torchrun(module: str, *args: str, extra_env: dict | None = None, timeout: int = 300):
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "VLLM_MOONEP_BACKEND")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONUNBUFFERED="1", **{k: v for k, v in NCCL_ENV.items() if k != "VLLM_MOONEP_TEST_DEVICE"},
               **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_ab_spawns_one_nccl_rank_per_gpu_and_measures_each_configuration(tmp_path):
    """moonep-ab --device cuda spawned gloo ranks (timing host staging, not the product) and under
    NCCL all-gathered a CPU tensor; its memory must be measured per configuration in fresh
    processes, on each rank's own GPU."""
    _need(2)
    from vllm_moonep.tools import ab

    cfgs = ["replicated", "symmetric", "symmetric-shared"]
    res = ab.run_ab(device="cuda", ranks=2, configs=cfgs, layers=2, tokens=(16, 128), maxvios=(0.0, 2.0), steps=3,
                    warmup=1, out_dir=str(tmp_path), plots=False, progress=False)
    _report("multi_gpu_ab_nccl", {c: {"memory": e["memory"], "memory_check": e["memory_check"]}
                                  for c, e in res["configs"].items()})
    assert res["failures"] == []
    env = res["environment"]
    assert (env["backend"], env["launched_by_torchrun"], env["ranks_per_gpu"]) == ("nccl", False, 1)
    text = ab.format_table(res)
    assert "on 2 cuda ranks (nccl)" in text and "NOTE:" not in text
    pids = set()
    for c in cfgs:
        entry = res["configs"][c]
        for m, chk in zip(entry["memory"], entry["memory_check"]):
            acc = m["accounted"]["resident"]
            assert chk["fresh_process"] and m["detail"]["pid"] not in pids
            pids.add(m["detail"]["pid"])
            # held beyond the accounted weights: only the device-side prefetch's address tables
            # (2 x R int64 per symmetric layer); an unaccounted expert row would be megabytes
            extra = m["detail"]["tensors_torch"] + m["detail"]["tensors_heap"] - acc
            assert 0 <= extra <= 1024 * res["shape"]["layers"], (c, extra, m)
            assert m["measured_resident"] >= 0.9 * acc, (c, m)  # the rank's own GPU grew by what it holds
            assert (chk["why"] is not None) == (abs(chk["relative"]) > 0.10), chk
        assert any(p["slots_used_per_step"] > 0 for p in entry["points"] if p["maxvio"] == 2.0)


def test_ab_under_torchrun_with_nccl(tmp_path):
    """`VLLM_MOONEP_BACKEND=nccl torchrun --nproc-per-node 2 -m vllm_moonep.tools.ab --device cuda
    --ranks 2` crashed before the first point: 'No backend type associated with device type cpu'."""
    _need(2)
    p = _torchrun("vllm_moonep.tools.ab", "--device", "cuda", "--ranks", "2", "--configs", "replicated", "symmetric",
                  "--layers", "1", "--tokens", "16", "128", "--maxvio", "0", "2", "--steps", "2", "--no-plots",
                  "--out", str(tmp_path), extra_env={"VLLM_MOONEP_BACKEND": "nccl"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.count("on 2 cuda ranks (nccl, torchrun)") == 1, p.stdout
    data = json.loads((tmp_path / "moonep-ab.json").read_text())
    assert data["failures"] == [] and data["environment"]["backend"] == "nccl"


def test_ab_shares_gpus_only_when_asked(tmp_path):
    """With fewer GPUs than ranks the tools shared GPUs silently; now only --share-gpus does, over gloo, and says so."""
    n = _gpus()
    _need(2)
    from vllm_moonep.testing.launch import resolve_launch
    from vllm_moonep.tools import ab

    R = 2 * n if 32 % (2 * n) == 0 else None
    if R is None:
        pytest.skip(f"2 x {n} ranks do not divide the tiny preset's 32 experts")
    with pytest.raises(ValueError, match="--share-gpus"):
        resolve_launch("cuda", R)
    res = ab.run_ab(device="cuda", ranks=R, share_gpus=True, configs=["replicated", "symmetric"], layers=1,
                    tokens=(32,), maxvios=(2.0,), steps=1, warmup=1, out_dir=str(tmp_path), plots=False,
                    progress=False)
    assert res["failures"] == []
    env = res["environment"]
    assert (env["backend"], env["ranks_per_gpu"]) == ("gloo", 2)
    assert "NOTE:" in ab.format_table(res) and "not the product's" in ab.format_table(res)


def test_balance_on_nccl_spawned_and_under_torchrun():
    """moonep-balance ran on CPU ranks only."""
    _need(2)
    from tests.distributed.test_balance import check_rows_independently
    from vllm_moonep.tools import balance

    rows = balance.report(2, 256, 16, 4, 256, [0.0, 2.0], 0, device="cuda")
    check_rows_independently(rows, 2, 256, 16, 4, 0)
    assert rows[-1]["imbalance_without_plan"] > 1.1 and rows[-1]["slots_used"] > 0
    assert rows[-1]["impl"] in ("triton", "grouped_mm")  # the GPU's grouped GEMM was timed
    p = _torchrun("vllm_moonep.tools.balance", "--device", "cuda", "--experts", "16", "--tokens", "128",
                  "--maxvio", "0", "2")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.count("MoonEP balance: 2 GPU ranks (nccl)") == 1, p.stdout


def test_soak_on_nccl_ranks():
    """The soak ran on CPU ranks only: on NCCL ranks every step must still match the dense reference,
    bitwise on repeats, with a bounded pool and flat device memory."""
    _need(2)
    from vllm_moonep.tools import soak

    s = soak.run(dict(steps=150, ranks=2, layers=2, device="cuda", warmup=60, mem_every=15, timeout_s=120.0))
    _report("multi_gpu_soak", s)
    assert s["errors"] == 0, s["error_samples"]
    assert s["steps"] == 150 and not s["ranks_lost"] and s["capacities_seen"] == s["capacities"]
    assert s["dense_checks"] >= 150 * 2 * 2 and s["slots_used"] > 0
    for m in s["per_rank_mib"]:
        assert m["device_allocated_end"] - m["device_allocated_warm"] < 8.0, m
