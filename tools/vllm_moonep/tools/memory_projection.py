"""Per-rank expert memory of full-size models, replicated vs symmetric, from the same accounting
functions the layouts report with (``vllm_moonep.common.memory``).

    moonep-ab project [--slots 8] [--gpu-gb 141] [--ep 8 16 32 64] [--markdown]
    moonep-ab project --config path/to/config.json          # your model, from its Hugging Face config
    moonep-ab project --hidden 7168 --intermediate 2048 --experts 256 --layers 58 [--name MyModel]

Counts routed-expert weights only (bf16): attention, dense layers, shared experts, embeddings,
activations and KV cache come on top, so "fits" is a necessary condition, not a sufficient one.
The built-in models are ``vllm_moonep.testing.models.MODELS`` (the shapes every tool uses).
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_moonep.common.memory import expert_bytes, replicated_accounting, symmetric_accounting
from vllm_moonep.testing.models import MODELS, ModelShape
from vllm_moonep.tools.cli import positive

__all__ = ["model_from_hf_config", "projection_rows", "main"]


def _first(cfg: dict, *keys):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k], k
    return None, None


def model_from_hf_config(path: str, name: str | None = None) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face ``config.json`` (or a folder holding one).

    Experts: ``n_routed_experts`` (DeepSeek, Kimi), ``num_experts`` (Qwen MoE), ``num_local_experts``
    (Mixtral); expert width: ``moe_intermediate_size``, else ``intermediate_size``; MoE layers:
    ``num_hidden_layers`` minus ``first_k_dense_replace`` dense ones, every ``moe_layer_freq``-th
    (DeepSeek), or every ``decoder_sparse_step``-th minus ``mlp_only_layers`` (Qwen). A multimodal
    config's ``text_config`` is read when the top level has no experts. Raises ``ValueError`` naming
    what is missing."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds no JSON object")
    if _first(cfg, "n_routed_experts", "num_experts", "num_local_experts")[0] is None and isinstance(
            cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    E, e_key = _first(cfg, "n_routed_experts", "num_experts", "num_local_experts")
    H, _ = _first(cfg, "hidden_size")
    I, i_key = _first(cfg, "moe_intermediate_size", "intermediate_size")
    L, _ = _first(cfg, "num_hidden_layers")
    missing = [k for k, v in (("n_routed_experts / num_experts / num_local_experts", E), ("hidden_size", H),
                              ("moe_intermediate_size / intermediate_size", I), ("num_hidden_layers", L)) if not v]
    if missing:
        raise ValueError(f"{path} is not a mixture-of-experts config this tool reads: no {', '.join(missing)}")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    moe = [i for i in range(int(L)) if i >= first_dense and (i - first_dense) % freq == 0 and (i + 1) % step == 0
           and i not in mlp_only]
    if not moe:
        raise ValueError(f"{path}: no MoE layer among its {L} layers")
    notes = [f"{e_key} {E}", f"{i_key} {I}", f"num_hidden_layers {L}"]
    if first_dense:
        notes.append(f"first_k_dense_replace {first_dense}")
    if step > 1 or mlp_only:
        notes.append(f"decoder_sparse_step {step}" + (f", mlp_only_layers {sorted(mlp_only)}" if mlp_only else ""))
    default_name = (cfg.get("architectures") or [None])[0] or os.path.basename(os.path.dirname(os.path.abspath(path)))
    K = cfg.get("num_experts_per_tok")
    return ModelShape(name or default_name, len(moe), int(E), int(H), int(I),
                      f"{os.path.basename(path)}: " + ", ".join(notes), K=int(K) if K else None)


def projection_rows(slots: int = 8, eps=(8, 16, 32, 64), gpu_bytes: float = 141e9, models=MODELS):
    """One dict per (model, EP) with EP dividing the model's experts: resident bytes per rank for
    each layout variant."""
    rows = []
    for m in models:
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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Columns: E/R = experts each rank owns; replicated = vLLM 0.33's PoC, [E+B] rows per layer on every "
               "rank plus the E/R parameters it keeps; symmetric = E/R home rows + B slots per layer; symmetric "
               "shared B = E/R home rows per layer + one pool of B slots for all layers; fits = whether each is at "
               "most --gpu-gb. " + __doc__.split("\n\n")[-1].replace("\n", " "))
    ap.add_argument("--slots", type=positive("--slots"), default=8,
                    help="B, prefetch slots per rank and layer (per rank in total with a shared pool) (default: %(default)s)")
    ap.add_argument("--gpu-gb", type=positive("--gpu-gb", float), default=141.0,
                    help="GPU memory for the 'fits' column, GB of 1e9 bytes; an H200 has 141 (default: %(default)s)")
    ap.add_argument("--ep", type=positive("--ep"), nargs="+", default=[8, 16, 32, 64],
                    help="EP sizes (ranks) to project; each must divide the model's expert count "
                         "(default: %(default)s)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    own = ap.add_argument_group("your own model (instead of the built-in ones)")
    own.add_argument("--config", metavar="PATH",
                     help="a Hugging Face config.json, or the model folder holding it")
    own.add_argument("--hidden", type=positive("--hidden"), help="hidden size H")
    own.add_argument("--intermediate", type=positive("--intermediate"),
                     help="one expert's intermediate size I (moe_intermediate_size)")
    own.add_argument("--experts", type=positive("--experts"), help="routed experts E per MoE layer")
    own.add_argument("--layers", type=positive("--layers"), help="MoE layers (dense layers not counted)")
    own.add_argument("--name", help="the model's name in the table (default: from the config, or 'custom')")
    return ap


def main(argv=None, prog: str | None = None) -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("hidden", "intermediate", "experts", "layers")}
    given = [k for k, v in shape.items() if v is not None]
    if args.config and given:
        ap.error(f"give either --config or the shape flags, not both (got --config and --{', --'.join(given)})")
    if given and len(given) != len(shape):
        ap.error(f"a model's shape needs all of --hidden, --intermediate, --experts and --layers (missing: "
                 f"--{', --'.join(k for k in shape if shape[k] is None)})")
    models = MODELS
    if args.config:
        try:
            models = (model_from_hf_config(args.config, args.name),)
        except ValueError as exc:
            ap.error(str(exc))
    elif given:
        models = (ModelShape(args.name or "custom", args.layers, args.experts, args.hidden, args.intermediate,
                        "from the command line"),)
    rows = projection_rows(args.slots, args.ep, args.gpu_gb * 1e9, models)
    skipped = [(m, R) for m in models for R in args.ep if m.E % R]
    if not rows:
        ap.error(f"no projection: no --ep value ({' '.join(map(str, args.ep))}) divides an expert count ("
                 + ", ".join(f"{m.name} {m.E}" for m in models) + "); MoonEP gives every rank E/EP experts, so EP "
                 "must divide E")
    print(f"Routed-expert bytes per rank (bf16), B={args.slots} slots; 1 GB = 1e9 bytes")
    for m in models:
        print(f"  {m.name}: {m.moe_layers} MoE layers, E={m.E}, H={m.H}, I={m.I}, "
              f"{expert_bytes(m.H, m.I) / 1e6:.1f} MB per expert ({m.source})")
    print(render(rows, args.gpu_gb, args.markdown))
    for m, R in skipped:
        print(f"skipped {m.name} at EP {R}: {m.E} experts are not divisible by {R}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
