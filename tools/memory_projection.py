"""Per-rank expert memory of full-size models, replicated vs symmetric, from the same accounting
functions the layouts report with (``vllm_moonep.common.memory``).

    python -m vllm_moonep.tools.memory_projection [--slots 8] [--gpu-gb 141] [--ep 8 16 32 64] [--markdown]

Counts routed-expert weights only (bf16): attention, dense layers, shared experts, embeddings,
activations and KV cache come on top, so "fits" is a necessary condition, not a sufficient one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_moonep.common.memory import expert_bytes, replicated_accounting, symmetric_accounting

__all__ = ["MODELS", "Model", "projection_rows", "main"]


@dataclass(frozen=True)
class Model:
    name: str
    moe_layers: int
    E: int
    H: int
    I: int
    source: str


#: MoE layer counts from the public configs: Qwen3-30B-A3B 48 layers, all MoE; DeepSeek-V3 61
#: layers, first 3 dense; Kimi-K2 61 layers, first 1 dense.
MODELS = (
    Model("Qwen3-30B-A3B", 48, 128, 2048, 768, "config.json: num_hidden_layers 48, decoder_sparse_step 1"),
    Model("DeepSeek-V3", 58, 256, 7168, 2048, "61 layers, n_dense_layers/first_k_dense_replace 3"),
    Model("Kimi-K2", 60, 384, 7168, 2048, "61 layers, first_k_dense_replace 1"),
)


def projection_rows(slots: int = 8, eps=(8, 16, 32, 64), gpu_bytes: float = 141e9):
    """One dict per (model, EP): resident bytes per rank for each layout variant."""
    rows = []
    for m in MODELS:
        for R in eps:
            if m.E % R:
                continue
            rep = replicated_accounting(m.E, R, slots, m.H, m.I, layers=m.moe_layers)
            rep_nolocal = replicated_accounting(m.E, R, slots, m.H, m.I, layers=m.moe_layers, keeps_local_params=False)
            sym = symmetric_accounting(m.E, R, slots, m.H, m.I, layers=m.moe_layers)
            sym_shared = symmetric_accounting(m.E, R, slots, m.H, m.I, layers=m.moe_layers, shared_slot_pool=True)
            rows.append({
                "model": m.name, "layers": m.moe_layers, "E": m.E, "R": R, "epn": m.E // R, "B": slots,
                "expert_MB": expert_bytes(m.H, m.I) / 1e6,
                "replicated": rep.resident, "replicated_no_local": rep_nolocal.resident,
                "symmetric": sym.resident, "symmetric_shared": sym_shared.resident,
                "transient_rep": rep.transient, "transient_sym": sym.transient,
                "fits": {k: v <= gpu_bytes for k, v in (("replicated", rep.resident), ("symmetric", sym.resident),
                                                       ("symmetric_shared", sym_shared.resident))},
            })
    return rows


def _gb(x: int) -> str:
    return f"{x / 1e9:,.1f}"


def render(rows, gpu_gb: float, markdown: bool) -> str:
    head = ["model", "EP", "E/R", "B", "replicated GB (PoC, keeps local)", "symmetric GB (B/layer)",
            "symmetric GB (shared B)", f"fits {gpu_gb:g} GB: rep / sym / sym-shared"]
    yn = {True: "yes", False: "no"}
    body = []
    for r in rows:
        f = r["fits"]
        body.append([r["model"], str(r["R"]), str(r["epn"]), str(r["B"]), _gb(r["replicated"]), _gb(r["symmetric"]),
                     _gb(r["symmetric_shared"]), f"{yn[f['replicated']]} / {yn[f['symmetric']]} / {yn[f['symmetric_shared']]}"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*b) for b in body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8, help="B, prefetch slots per layer (default 8)")
    ap.add_argument("--gpu-gb", type=float, default=141.0, help="GPU memory in GB (1e9 bytes; H200: 141)")
    ap.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows = projection_rows(args.slots, args.ep, args.gpu_gb * 1e9)
    print(f"Routed-expert bytes per rank (bf16), B={args.slots} slots; 1 GB = 1e9 bytes")
    for m in MODELS:
        print(f"  {m.name}: {m.moe_layers} MoE layers, E={m.E}, H={m.H}, I={m.I}, "
              f"{expert_bytes(m.H, m.I) / 1e6:.1f} MB per expert ({m.source})")
    print(render(rows, args.gpu_gb, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
