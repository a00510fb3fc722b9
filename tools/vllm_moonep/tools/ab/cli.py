"""``moonep-ab``: replicated versus symmetric expert layouts, memory and latency, on R ranks.

    moonep-ab [flags]          build_parser -> checks.check_run (a usage error before any rank
                               starts) -> driver.run_ab -> report.format_table, the projection
    moonep-ab project [flags]  memory_projection.main: full-size models at several EP sizes

Under torchrun every launched process runs ``main``; rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time

from vllm_moonep.common.grouped_gemm import IMPLS
from vllm_moonep.engine import TRANSPORTS
from vllm_moonep.engine.heaps import HEAP_KINDS
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.testing.launch import (add_launch_arguments, finish_launched_group, is_driver, launched_world_size,
                                        shutdown_pools)
from vllm_moonep.tools.ab.checks import check_run, config_choice
from vllm_moonep.tools.ab.configs import CONFIGS, DEVICES, PRESETS
from vllm_moonep.tools.ab.driver import run_ab
from vllm_moonep.tools.ab.report import format_table, legend
from vllm_moonep.tools.memory_projection import render

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """``moonep-ab``'s flags, each with its help and default; the tables' legend as the epilog."""
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
    """``moonep-ab [flags]`` or ``moonep-ab project [flags]``; returns 1 when a configuration failed the
    reference check."""
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
        check_run(**kw, out_dir=a.out, plots=not a.no_plots)  # before anything is spawned
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

