"""The plots of ``moonep-ab``, drawn from the results dict (matplotlib, Agg; ``--no-plots`` skips them).

    results --write_plots(out)--> memory.png              accounted expert memory per rank by kind,
                                                          stacked, the measured resident beside it
                                  latency_vs_maxvio.png   median step time at the largest token count
                                  latency_vs_tokens.png   median step time at the largest maxvio
"""

from __future__ import annotations

import os

__all__ = ["write_plots"]


def write_plots(results: dict, out_dir: str) -> list[str]:
    """Draw the three plots into ``out_dir``; returns their paths."""
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
