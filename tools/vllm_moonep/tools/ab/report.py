"""The terminal report of ``moonep-ab``: the memory table, the latency table and their legend.

    results --format_table--> header (preset, ranks, shape, anchor, NOTEs)
                              memory table: one row per configuration (accounted, measured, peak),
                                why measured and accounted differ where they do
                              latency table: one row per configuration x tokens x maxvio
                              legend, skipped configurations, reference-check failures
"""

from __future__ import annotations

import textwrap

from vllm_moonep.common.memory import EXPLAIN_ABOVE
from vllm_moonep.common.timing import PHASES
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV
from vllm_moonep.tools.ab.configs import MAX_REF_ERR

__all__ = ["LEGEND", "format_table", "legend"]

#: the tables' columns, one paragraph per table (``legend`` wraps them; ``--help`` prints them too)
LEGEND = (
    "memory (per rank, rank 0): resident MiB = expert weights held while serving, from the layouts' own accounting (home = this rank's E/R experts, repl. = the replicated [0,E) copy, slots = the B prefetch slots); load transient = extra held only while the weights are built; measured MiB = how much a fresh rank process grew while building the layers (RSS on CPU; device memory in use on GPU, which counts the symmetric heaps outside torch's allocator), measured after freed memory was released: a check on the accounting; where the two differ by more than 10% the output says why (staging copies of the CPU host heap, allocator rounding, memory outside the expert weights); peak MiB = the most the process held while building (the measured load transient plus the resident).",
    "latency: tokens = tokens per rank per step; maxvio = the requested routing skew, max/mean tokens per expert - 1 over all ranks' tokens of a step (0 = even); got = the skew the routing actually had, mean over the timed steps (random routing is never perfectly even, so a requested 0 comes out above 0); median / p90 ms = step time over all layers of the slowest rank; the phase columns are median ms per step summed over layers, slowest rank: pad = pad the step to the buffer's capacity and count tokens per expert, dispatch = plan and send rows to their ranks, prefetch = fill the slots with the planned experts' weights, experts = the grouped GEMM, combine = send results back and sum each token's top-k (vllm-poc reports its prepare under dispatch); 2xa2a = the anchor of dispatch + combine, measured in the same run on the same group: two plain all_to_all_single of a layer's dispatch payload (tokens x top-k x hidden bf16 per rank, split evenly), slowest rank's median, times the layers; no-plan = max/mean rows per rank without redundancy (all rows of its home experts); plan = max/mean rows per rank under the MoonEP plan, padding included (real rows are exactly S*K everywhere); slots = slots used per step (all ranks, last layer); ref err = max relative error ||out - ref|| / ||ref|| over the checked steps against a dense float32 MoE on the full weights (a configuration above {max_ref_err:g} fails the run).",
)


def legend(max_ref_err: float = MAX_REF_ERR) -> str:
    """The tables' column legend, wrapped for a terminal."""
    return "\n".join(textwrap.fill(p.format(max_ref_err=max_ref_err), 118, subsequent_indent="  ") for p in LEGEND)


def format_table(results: dict) -> str:
    """The whole report of one run's results (``driver.run_ab``) as terminal text."""
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
