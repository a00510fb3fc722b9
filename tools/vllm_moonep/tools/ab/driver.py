"""The driver of ``moonep-ab``: one comparison from checked flags to the results dict and its files.

    run_ab(flags)
      checks.check_run            every flag, the output folder, before any rank starts
      configs.run_shape           the preset scaled to --budget-gb, with what it could not honour
      measure_anchor              matmul and copy rates of this machine, in the same run
      per configuration, in fresh rank processes (run_on_ranks, tag "moonep-ab <config>"):
        measure.rank_build  ->  memory.memory_check      memory measured and attributed
        per tokens x maxvio: measure.rank_point -> summarize_point   (the slowest rank's figures)
        measure.rank_teardown                           engine buffers held, then freed
      plots.write_plots, OUT/moonep-ab.json             on the driver (rank 0 under torchrun)
    -> results (report.format_table prints it)
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import torch

from vllm_moonep.common.timing import PHASES
from vllm_moonep.engine import current_cuda_device
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.testing.launch import (init_launched_group, is_driver, launched_world_size, resolve_launch,
                                        run_on_ranks, shutdown_pools)
from vllm_moonep.testing.routing import sigma_for_maxvio
from vllm_moonep.tools.ab.checks import check_run
from vllm_moonep.tools.ab.configs import CONFIGS, MAX_REF_ERR, default_budget_gb, run_shape
from vllm_moonep.tools.ab.measure import REFERENCE_ON_GPU_SHARE, rank_build, rank_point, rank_teardown, worst_error
from vllm_moonep.tools.ab.memory import memory_check
from vllm_moonep.tools.ab.plots import write_plots
from vllm_moonep.tools.memory_projection import projection_rows

__all__ = ["environment", "measure_anchor", "run_ab", "spawn_options", "summarize_point", "vllm_available"]


def _percentile(xs, q):
    """The ``q`` quantile of ``xs``, linearly interpolated (``nan`` for none)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def environment(device_kind: str, ranks: int, launch=None, heap: str = "auto", transport: str = "auto",
                ranks_per_node: int | None = None) -> dict:
    """What the figures were measured on (versions, machine, launch, heap, transport, date), kept in
    the JSON so a figure is only compared with others of the same setting."""
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
    """Whether vLLM can be imported here (the ``vllm-poc`` configuration is skipped, and said, if not)."""
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
        "ref_rel_err": worst_error((r["ref_rel_err"] or 0.0) for r in res),
        "raw": res,
    }


def run_ab(*, preset="tiny", ranks=None, layers=None, tokens=(16, 128), maxvios=(0.0, 1.0, 2.0), steps=3, warmup=1,
           check_steps=1, device="cpu", seed=0, configs=None, impl="auto", slots=None, budget_gb=None,
           out_dir="moonep-ab-out", plots=True, progress=True, max_ref_err=MAX_REF_ERR, backend="auto",
           share_gpus=False, heap="auto", graphs=False, transport="auto", ranks_per_node=None) -> dict:
    """Run the comparison; returns the result dict (also written to ``out_dir/moonep-ab.json``).
    Every argument is checked (``check_run``, ``ValueError``) before any rank is spawned, ``out_dir``
    (made if missing) and matplotlib for ``plots`` included, so a run that could not save its
    results does not start.

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
              transport=transport, ranks_per_node=ranks_per_node, out_dir=out_dir, plots=plots)
    launch = resolve_launch(device, ranks, backend, share_gpus)
    if launch.launched:  # bind this process's GPU before the anchor, and make the group
        init_launched_group(launch.backend, launch.device)
    if budget_gb is None:
        budget_gb = default_budget_gb(device)
    shape = run_shape(preset, ranks, layers, budget_gb, slots, tokens, maxvios)
    configs = list(configs or CONFIGS)
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
