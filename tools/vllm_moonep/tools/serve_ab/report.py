"""The summary of the serving A/B: one JSON per configuration in, Markdown tables and the targets' verdicts out.

    <out>/<config>.json (one per configuration, from one or several runs)
        --load_rows()--> {config: row}  (the latest row of each)
        --summarize()--> summary.md: runs, outputs against allgather_reducescatter with naive's noise floor,
                         throughput and latency, memory with the symmetric gain against `moonep-ab project`,
                         CUDA graphs, the issue's targets, the rows that did not run
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_moonep.tools.serve_ab.compare import greedy_distance, logprob_distance, within_floor
from vllm_moonep.tools.serve_ab.matrix import BACKENDS, MODES, NOISE_FLOOR, REFERENCE, config_names

__all__ = ["GIB", "kv_bytes_per_token", "load_rows", "memory_gain", "summarize", "table"]

GIB = float(1 << 30)
#: the targets (issue: "every moonep configuration within the noise floor"; "moonep symmetric with CUDA
#: graphs at least equal to allgather_reducescatter, stretch 1.2x"; "extra KV capacity within 10% of
#: the freed expert bytes")
THROUGHPUT_TARGET, THROUGHPUT_STRETCH, KV_TOLERANCE = 1.0, 1.2, 0.10


def load_rows(dirs: list[str | Path]) -> dict[str, dict[str, Any]]:
    """Every ``<config>.json`` row in ``dirs`` (the latest ``finished`` of each configuration).
    Files that are not rows of this tool are ignored."""
    rows: dict[str, dict[str, Any]] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("*.json")):
            try:
                row = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(row, dict) or row.get("tool") != "serve_ab" or "config" not in row:
                continue
            old = rows.get(row["config"])
            if old is None or str(row.get("finished", "")) >= str(old.get("finished", "")):
                rows[row["config"]] = row
    return rows


def table(head: list[str], body: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return "-" if x is None else str(x).replace("|", "/")

    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cell(x) for x in r) + " |" for r in body])


def _f(x: Any, nd: int = 2) -> str | None:
    return None if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _e(x: Any) -> str | None:
    return None if x is None else f"{x:.2e}"


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and row.get("status") == "ok"  # type: ignore[union-attr]


def _per_engine(d: dict[str, Any] | None) -> list[Any]:
    d = d or {}
    eng = {k: v for k, v in d.items() if k.startswith("EngineCore")} or d
    return [eng[k] for k in sorted(eng)]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    """KV-cache bytes of one token on one engine: K and V of every layer (bf16)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def memory_gain(rep: dict[str, Any] | None, sym: dict[str, Any] | None, predicted_bytes: float | None,
                model_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """What the symmetric layout gives back to the KV cache over the replicated one (per engine, the
    mean over engines): measured from vLLM's ``Available KV cache memory`` and from its KV tokens
    (times the bytes of a token), against the expert bytes ``moonep-ab project`` predicts freed;
    ``within`` when the measured GiB are within ``KV_TOLERANCE`` of the prediction."""
    out: dict[str, Any] = {"predicted_gib": None if predicted_bytes is None else predicted_bytes / GIB}
    if not (_ok(rep) and _ok(sym)):
        out["why"] = "the replicated or symmetric row did not run"
        return out
    assert rep is not None and sym is not None
    kv_r, kv_s = _mean(_per_engine(rep["memory"].get("kv_gib"))), _mean(_per_engine(sym["memory"].get("kv_gib")))
    tk_r, tk_s = _mean(_per_engine(rep["memory"].get("kv_tokens"))), _mean(_per_engine(sym["memory"].get("kv_tokens")))
    if kv_r is not None and kv_s is not None:
        out["measured_gib"] = kv_s - kv_r
    if tk_r is not None and tk_s is not None:
        out["extra_tokens"] = tk_s - tk_r
        if model_cfg:
            out["measured_gib_from_tokens"] = (tk_s - tk_r) * kv_bytes_per_token(model_cfg) / GIB
    if out.get("measured_gib") is not None and out["predicted_gib"]:
        out["ratio"] = out["measured_gib"] / out["predicted_gib"]
        out["within"] = abs(out["ratio"] - 1.0) <= KV_TOLERANCE
    return out


def _order(rows: dict[str, dict[str, Any]]) -> list[str]:
    known = [n for n in config_names() if n in rows]
    return known + sorted(n for n in rows if n not in known)


def _itl_p50(row: dict[str, Any] | None, rates: list[str]) -> float | None:
    """A row's inter-token latency p50 (ms) at the first rate, None where it did not run."""
    if not rates or not _ok(row):
        return None
    st = (((row or {}).get("throughput") or {}).get("rates") or {}).get(rates[0]) or {}
    return (st.get("itl_ms") or {}).get("p50")


def _stats_cells(st: dict[str, Any] | None) -> list[Any]:
    if not st:
        return [None] * 5
    return [_f(st.get("output_tok_s"), 1), _f(st["ttft_ms"].get("p50"), 1), _f(st["ttft_ms"].get("p99"), 1),
            _f(st["itl_ms"].get("p50"), 2), _f(st["itl_ms"].get("p99"), 2)]


def summarize(rows: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The Markdown summary and the verdicts (``targets``, the distances and gains) of ``rows``."""
    names = _order(rows)
    any_row = next((rows[n] for n in names if rows[n].get("model")), None) or {}
    model, wl = any_row.get("model") or {}, any_row.get("workload") or {}
    L: list[str] = ["# Serving A/B: MoonEP against vLLM's own EP backends inside vLLM", ""]
    if model:
        L.append(f"Model: Qwen3-30B-A3B architecture, {model.get('layers')} layers ({model.get('param_gb')} GB bf16, "
                 f"dummy weights re-filled at unit scale); DP=2, EP=2, one GPU per rank; vLLM "
                 f"{any_row.get('environment', {}).get('vllm_version')}.")
    if wl:
        L.append(f"Workload: {wl.get('output_prompts')} output prompts ({wl.get('greedy_tokens')} greedy tokens each); "
                 f"burst of {wl.get('burst_requests')} requests and {wl.get('rate_requests')} requests at each rate "
                 f"{wl.get('rates')} req/s, input {wl.get('input_len')} / output {wl.get('output_len')} tokens, "
                 f"seed {wl.get('seed')}.")
    L.append("")

    # -------------------------------------------------------------------------------- runs
    body = []
    for n in names:
        r = rows[n]
        lg = r.get("log") or {}
        kv = _per_engine((r.get("memory") or {}).get("kv_tokens"))
        bad = [c["check"] for c in r.get("checks") or [] if not c["ok"] and c.get("strict", True)]
        body.append([n, r.get("status"), _f(r.get("ready_s"), 0), " / ".join(f"{x:,}" for x in kv) or None,
                     lg.get("captured_graphs") or None, lg.get("cudagraph_steps") or None,
                     "; ".join(bad) or ("none" if r.get("checks") else None)])
    L += ["## Runs", "", table(["config", "status", "ready s", "KV tokens per engine", "graphs captured",
                                "steps by runtime mode", "failed checks"], body), ""]

    # -------------------------------------------------------------------------------- outputs
    verdicts: dict[str, Any] = {"outputs": {}, "floors": {}, "throughput": {}, "memory": {}, "graphs": {}}
    body = []
    for mode in MODES:
        ref = rows.get(f"{REFERENCE}-{mode}")
        floor_row = rows.get(f"{NOISE_FLOOR}-{mode}")
        ok_ref = _ok(ref)
        both = ok_ref and _ok(floor_row)
        floor = logprob_distance(ref["outputs"], floor_row["outputs"]) if both else None  # type: ignore[index]
        gfloor = greedy_distance(ref["outputs"], floor_row["outputs"]) if both else None  # type: ignore[index]
        verdicts["floors"][mode] = {"prompt_logprobs": floor, "greedy": gfloor}
        for b in BACKENDS:
            n = f"{b.name}-{mode}"
            cand = rows.get(n)
            if b.role == "reference" or cand is None:
                continue
            if not (ok_ref and _ok(cand)):
                why = f"{REFERENCE}-{mode} {ref.get('status') if ref else 'absent'}" if not ok_ref else \
                    f"{n} {cand.get('status')}"
                body.append([n, f"not compared ({why})"] + [None] * 7)
                continue
            d = logprob_distance(ref["outputs"], cand["outputs"])  # type: ignore[index]
            g = greedy_distance(ref["outputs"], cand["outputs"])  # type: ignore[index]
            w = within_floor(d, floor) if b.role == "candidate" else None
            wg = within_floor(g, gfloor) if b.role == "candidate" else None
            verdicts["outputs"][n] = {"prompt_logprobs": d, "greedy": g, "within_floor": w, "greedy_within_floor": wg}
            ident = f"{g['identical']}/{g['sequences']}" if g.get("compared") else None
            prefix = _f(_mean(g["common_prefix"]), 1) if g.get("compared") else None
            body.append([n, _e(d.get("max_abs")), _e(d.get("mean_abs")), _f(d.get("top1_agreement"), 4), ident, prefix,
                         _e(g.get("max_abs")), _e(g.get("mean_abs")),
                         "noise floor" if b.role == "noise_floor" else {True: "yes", False: "NO", None: "-"}[w]])
    L += ["## Outputs against allgather_reducescatter (same mode)", "",
          "Teacher-forced prompt logprobs of the fixed prompts (|difference| per token of the prompt's own token) and "
          "greedy continuations (identical sequences, mean common prefix, |difference| of the chosen tokens' logprobs "
          f"over the common prefixes). Noise floor: `{NOISE_FLOOR}`, which vLLM 0.33 runs as allgather_reducescatter "
          "(a second, independent run of the reference).", "",
          table(["config", "prompt lp max", "prompt lp mean", "top-1 agree", "greedy identical", "mean prefix",
                 "greedy lp max", "greedy lp mean", "within floor"], body), ""]

    # -------------------------------------------------------------------------------- throughput
    rates = [str(x) for x in wl.get("rates", [])]
    head = ["config", "burst out tok/s", "vs AG/RS"]
    for rt in rates:
        head += [f"{rt}/s out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    body = []
    for n in names:
        r = rows[n]
        if not _ok(r):
            continue
        tp = r.get("throughput") or {}
        burst = (tp.get("burst") or {}).get("output_tok_s")
        ref = rows.get(f"{REFERENCE}-{r.get('mode')}")
        rb = ((ref or {}).get("throughput") or {}).get("burst", {}).get("output_tok_s") if _ok(ref) else None
        ratio = burst / rb if burst and rb else None
        verdicts["throughput"][n] = {"burst_tok_s": burst, "vs_reference": ratio}
        cells: list[Any] = [n, _f(burst, 1), _f(ratio, 3)]
        for rt in rates:
            cells += _stats_cells((tp.get("rates") or {}).get(rt))
        body.append(cells)
    L += ["## Throughput and latency", "",
          "Burst: every request sent at once to the running server (offline throughput: output tokens over the wall "
          "time from the first send to the last reply). Rates: Poisson arrivals, streamed; ITL = gaps between "
          "token-carrying chunks.", "", table(head, body), ""]

    # -------------------------------------------------------------------------------- memory
    body = []
    for n in names:
        r = rows[n]
        if not _ok(r):
            continue
        m = r.get("memory") or {}
        gpu = m.get("gpu_end") or m.get("gpu_ready") or []
        em = _per_engine(m.get("expert_memory"))
        body.append([n, " / ".join(_f(x) or "-" for x in _per_engine(m.get("model_gib"))) or None,
                     " / ".join(_f(x) or "-" for x in _per_engine(m.get("kv_gib"))) or None,
                     " / ".join(f"{x:,}" for x in _per_engine(m.get("kv_tokens"))) or None,
                     " / ".join(_f(x) or "-" for x in _per_engine(m.get("graph_gib"))) or None,
                     " / ".join(f"{g['used_mib'] / 1024:.1f}" for g in gpu) or None,
                     " / ".join(f"{e['resident_gib']:.2f}" for e in em) or None])
    L += ["## Memory (per engine / GPU)", "", table(["config", "model GiB", "KV cache GiB", "KV tokens", "graphs GiB",
                                                      "GPU used GiB", "plugin: expert GiB resident"], body), ""]
    proj = any_row.get("projection") or {}
    mcfg = any_row.get("model_config")
    for mode in MODES:
        rep = rows.get(f"moonep-replicated-{mode}")
        for layout, key in (("symmetric", "symmetric"), ("symmetric-shared", "symmetric_shared")):
            sym = rows.get(f"moonep-{layout}-{mode}")
            if rep is None and sym is None:
                continue
            pred = proj["replicated"] - proj[key] if proj.get("replicated") is not None and proj.get(key) is not None \
                else None
            g = memory_gain(rep, sym, pred, mcfg)
            verdicts["memory"][f"{layout}-{mode}"] = g
            if "measured_gib" in g:
                L.append(f"- {layout} over replicated ({mode}): KV cache +{g['measured_gib']:.2f} GiB per engine "
                         f"(+{g.get('extra_tokens', 0):,.0f} tokens = {g.get('measured_gib_from_tokens') or 0:.2f} GiB); "
                         f"`moonep-ab project` predicts {g['predicted_gib']:.2f} GiB of expert weights freed "
                         f"(B={proj.get('slots')}): measured/predicted {g.get('ratio', float('nan')):.3f}")
            else:
                L.append(f"- {layout} over replicated ({mode}): not measured ({g.get('why')})")
    L.append("")

    # -------------------------------------------------------------------------------- graphs
    body = []
    for b in BACKENDS:
        grow, erow = rows.get(f"{b.name}-graphs"), rows.get(f"{b.name}-eager")
        if grow is None and erow is None:
            continue
        lg = (grow or {}).get("log") or {}
        plug = (lg.get("plugin") or {})
        says = ("kept: " + plug["plugin_graphs_kept"][0][0] if "plugin_graphs_kept" in plug else
                "off: " + plug["plugin_graphs_off"][0][0][:80] if "plugin_graphs_off" in plug else
                (grow or {}).get("not_applicable") or ("-" if b.moonep is None else None))
        itl_g, itl_e = _itl_p50(grow, rates), _itl_p50(erow, rates)
        verdicts["graphs"][b.name] = {"itl_p50_graphs_ms": itl_g, "itl_p50_eager_ms": itl_e,
                                      "steps": lg.get("cudagraph_steps"), "captured": lg.get("captured_graphs")}
        body.append([b.name, says, " / ".join(sorted(set(_per_engine(lg.get("cudagraph_mode"))))) or None,
                     lg.get("captured_graphs") or None, (lg.get("cudagraph_steps") or {}).get("FULL"),
                     (lg.get("cudagraph_steps") or {}).get("NONE"), _f(itl_g), _f(itl_e),
                     _f(itl_e / itl_g, 2) if itl_g and itl_e else None])
    L += ["## CUDA graphs", "",
          "`--cudagraph-metrics`: vLLM counts each step by the runtime mode it ran in (FULL = replayed a captured "
          "graph, NONE = eager); captured = the capture progress bar's total per mode. ITL at the first rate.", "",
          table(["backend", "plugin says", "vLLM cudagraph_mode", "captured", "graphs run: FULL steps", "NONE steps",
                 f"ITL p50 ms graphs ({rates[0] if rates else '-'}/s)", "ITL p50 ms eager", "eager/graphs"], body), ""]

    # -------------------------------------------------------------------------------- targets
    t: dict[str, Any] = {}
    cands = [f"{b.name}-{m}" for m in MODES for b in BACKENDS if b.role == "candidate"]
    outs = {n: verdicts["outputs"][n]["within_floor"] for n in cands if n in verdicts["outputs"]}
    # NOT met as soon as one row is above the floor; met when every candidate row was compared and is within
    t["outputs_within_noise_floor"] = False if False in outs.values() else \
        True if len(outs) == len(cands) and all(outs.values()) else None
    sym_g = verdicts["throughput"].get("moonep-symmetric-graphs", {}).get("vs_reference")
    t["symmetric_graphs_throughput_vs_agrs"] = sym_g
    t["throughput_target"] = None if sym_g is None else sym_g >= THROUGHPUT_TARGET
    t["throughput_stretch"] = None if sym_g is None else sym_g >= THROUGHPUT_STRETCH
    kv = [v.get("within") for k, v in verdicts["memory"].items() if k.startswith("symmetric-") and "within" in v]
    t["kv_gain_within_10pct"] = None if not kv else all(kv)
    verdicts["targets"] = t
    yn = {True: "met", False: "NOT met", None: "not measured"}
    L += ["## Targets", "",
          f"- outputs: every moonep row within naive's noise floor: {yn[t['outputs_within_noise_floor']]} "
          f"({', '.join(f'{k}: {v}' for k, v in outs.items()) or 'no row compared'})",
          f"- throughput: moonep-symmetric-graphs / allgather_reducescatter-graphs (burst) = "
          f"{_f(sym_g, 3) or '-'}: target >= {THROUGHPUT_TARGET} {yn[t['throughput_target']]}, stretch >= "
          f"{THROUGHPUT_STRETCH} {yn[t['throughput_stretch']]}",
          f"- KV cache: symmetric gain within {KV_TOLERANCE:.0%} of the freed expert bytes: "
          f"{yn[t['kv_gain_within_10pct']]}", ""]

    # -------------------------------------------------------------------------------- not run
    body = [[n, rows[n].get("status"), (rows[n].get("not_applicable") or rows[n].get("error") or rows[n].get("why")
                                        or "")[:300], rows[n].get("first_error")]
            for n in names if rows[n].get("status") != "ok"]
    missing = [n for n in config_names() if n not in rows]
    if body or missing:
        L += ["## Configurations that did not run", "", table(["config", "status", "why", "first error in the log"],
                                                              body + [[n, "not run yet", "", None] for n in missing]), ""]
    return "\n".join(L), verdicts
