"""Every choice of a ``moonep-ab`` run, checked before any rank is spawned or any work is done.

    flags --check_run--> ValueError naming the first problem (the CLI prints it as a usage error)
      preset, ranks, layers, tokens, maxvio, steps  -- what can be run at all
      device, launch, heap, impl, transport, nodes  -- what runs here (heaps and kernels probed)
      configs (known, each once), slots (<= the experts the run keeps: the engine's rule)
      out folder (made, a file written and removed) and matplotlib for the plots, on the
        process that writes them: a run that cannot save its results stops before it starts
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import tempfile

import torch

from vllm_moonep.common.grouped_gemm import IMPLS, GroupedWeights, available_impls
from vllm_moonep.engine import TRANSPORTS
from vllm_moonep.engine.defaults import slots_beyond_experts
from vllm_moonep.engine.heaps import HEAP_KINDS
from vllm_moonep.testing.launch import is_driver, resolve_launch
from vllm_moonep.tools.ab.configs import CONFIGS, DEVICES, GiB, MAX_REF_ERR, PRESETS, default_budget_gb, scaled_shape

__all__ = ["check_heap", "check_out_dir", "check_run", "config_choice", "kernels_on"]


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


def check_out_dir(out_dir: str) -> None:
    """``--out``: a folder this process can write, made here if missing. The results are written
    when every configuration has run, so a path that cannot take them (a file, a folder under a
    file, no permission) would lose the whole run; a file is created and removed to be sure."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir} is a file, not a folder: moonep-ab writes moonep-ab.json and its plots "
                         "into a folder; name a new or an existing folder")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out_dir}: cannot write the results there ({exc.strerror or exc}); name a folder "
                         "this user can write") from None


def check_run(*, preset, ranks, layers, tokens, maxvios, steps, warmup, check_steps, device, configs, impl, slots,
              budget_gb, max_ref_err=MAX_REF_ERR, backend="auto", share_gpus=False, heap="auto", graphs=False,
              transport="auto", ranks_per_node=None, out_dir=None, plots=False) -> None:
    """Every choice of a run, checked before any rank is spawned; ``ValueError`` names the first
    problem. ``out_dir``/``plots``: where the results go and whether plots are drawn, checked last
    (the folder is made) and only on the process that writes them (``is_driver``); ``None``: not
    checked."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks!r}")
    if p.E % ranks:
        ok = [d for d in _divisors(p.E) if 1 < d <= 64]
        raise ValueError(
            f"--ranks {ranks} does not divide the {preset} preset's {p.E} experts (MoonEP gives every rank "
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
    twice = sorted({c for c in configs or () if list(configs).count(c) > 1})
    if twice:
        raise ValueError(f"--configs names {', '.join(twice)} more than once: each configuration runs once and has "
                         "one row in the tables")
    if impl == "grouped_mm" and "symmetric-shared" in (configs or CONFIGS):
        raise ValueError("--impl grouped_mm cannot read symmetric-shared's shared slot pool (it needs one dense "
                         "weight tensor); leave symmetric-shared out of --configs or use another --impl")
    if budget_gb is not None and not (budget_gb > 0):
        raise ValueError(f"--budget-gb must be > 0, got {budget_gb}")
    if slots is not None:
        if slots < 1:
            raise ValueError(f"--slots must be >= 1, got {slots}")
        budget = budget_gb if budget_gb is not None else default_budget_gb(device)
        E = scaled_shape(p, ranks, layers, int(budget * GiB), slots)["experts"]  # what the run keeps
        too_many = slots_beyond_experts(slots, E, ranks)
        if too_many:
            scaled = f"; the {preset} preset runs {E} of its {p.E} experts within --budget-gb {budget:g} per rank"
            raise ValueError(f"--slots {slots} {too_many}{scaled if E < p.E else ''}")
        if impl == "grouped_mm" and "symmetric" in (configs or CONFIGS) and slots < E // ranks:
            raise ValueError(f"--impl grouped_mm cannot run the symmetric configuration with --slots {slots} < "
                             f"E/R = {E // ranks} (ranks then read overflow rows from their peers' memory, which is "
                             "no dense tensor)")
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
    if is_driver():
        if plots and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("the plots need matplotlib (pip install 'vllm-moonep[tools]'); or pass --no-plots")
        if out_dir is not None:
            check_out_dir(out_dir)
