"""The runs of the serving A/B and the command line (``python -m vllm_moonep.tools.serve_ab``).

    run:     for each configuration not yet in --out (matrix order, --configs picks):
               vllm serve (vllm_server.ServerProcess) -> /health -> outputs -> warm-up -> burst -> each rate
               -> stop -> parse its log -> <out>/<config>.json ; then <out>/summary.md over every row there
    summary: summary.md over the rows of one or more result folders (e.g. the folders of several device calls)
    run --dry-run: the configurations and their vllm serve command lines, nothing started

A configuration that does not fit what is left of ``--budget`` is left for the next call (the same
command again: rows already in ``--out`` are kept, ``--rerun`` runs them again); one that fails to
start, or fails during its workload, is a row with its error and its log's first error and tail.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_moonep.tools import vllm_model_check as vmc
from vllm_moonep.tools.serve_ab import client, compare, logs, matrix, report
from vllm_moonep.tools.vllm_server import SERVE_CMD, SERVED_NAME, ServerProcess, free_port, serve_command

__all__ = ["build_parser", "gpus_error", "main", "parse_gpu_memory", "visible_gpus"]

#: what one configuration needs: two GPUs, one per DP rank, each holding the replicated layout's
#: 48 layers of experts (about 90 GB) beside the KV cache
NEEDS = ("2 GPUs, one per data-parallel rank (--data-parallel-size 2 --enable-expert-parallel), each with room "
         "for the replicated layout's experts of the 48-layer model (about 90 GB): two H200s, the nvidia-h200-x2 "
         "device (tools/gpu_vllm.sh serve_ab)")
#: statuses of a row that the next call does not run again (without --rerun)
DONE = ("ok", "failed", "timeout", "not_applicable")
#: seconds kept after a configuration's workload for its server to stop and its row to be written
STOP_RESERVE_S = 45.0


#: the server of the configuration running now (what a SIGTERM to this tool stops first)
_RUNNING: list[ServerProcess] = []


def _on_term(signum: int, frame: Any) -> None:
    """SIGTERM (the device script's time bound): stop the running server's process group, which
    would otherwise keep both GPUs, then leave; its configuration has no row and runs next call."""
    for srv in list(_RUNNING):
        srv.stop(api_grace=2.0, group_grace=5.0)
    raise SystemExit(128 + signum)


def _say(msg: str) -> None:
    print(f"[serve_ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ GPUs
def visible_gpus(gpus: list[str], cuda_visible: str | None) -> list[str]:
    """The GPUs vLLM can use: nvidia-smi's list, cut to ``CUDA_VISIBLE_DEVICES`` where it is set."""
    if cuda_visible is None:
        return list(gpus)
    ids = [x for x in cuda_visible.split(",") if x.strip() != ""]
    return list(gpus)[:len(ids)]


def gpus_error(gpus: list[str]) -> str | None:
    """Why this machine cannot run the A/B (None: it can)."""
    if len(gpus) >= matrix.DP:
        return None
    seen = "no GPU" if not gpus else f"{len(gpus)} GPU ({'; '.join(gpus)})"
    return f"serve_ab needs {NEEDS}; this machine has {seen}"


def parse_gpu_memory(text: str) -> list[dict[str, int]]:
    """``nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`` lines."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            out.append({"index": int(parts[0]), "used_mib": int(parts[1]), "total_mib": int(parts[2])})
    return out


def gpu_memory() -> list[dict[str, int]]:
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_gpu_memory(res.stdout)


# ---------------------------------------------------------------------------------- the workload
@dataclasses.dataclass
class Workload:
    output_prompts: list[list[int]]
    greedy_tokens: int
    bench_prompts: list[list[int]]
    output_len: int
    burst_requests: int
    rate_requests: int
    rates: list[float]
    seed: int

    def describe(self, input_len: int) -> dict[str, Any]:
        return {"output_prompts": len(self.output_prompts), "greedy_tokens": self.greedy_tokens,
                "input_len": input_len, "output_len": self.output_len, "burst_requests": self.burst_requests,
                "rate_requests": self.rate_requests, "rates": self.rates, "seed": self.seed,
                "prompts_digest": compare.prompts_digest(self.output_prompts)}


def _stream_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}


async def _outputs(url: str, w: Workload, deadline: float) -> tuple[dict[str, Any], list[str]]:
    """Teacher-forced prompt logprobs (one request at a time: the same batches every run), then the
    greedy continuations (all at once)."""
    errors: list[str] = []
    lps: list[list[float | None]] = []
    top: list[list[int | None]] = []
    for i, p in enumerate(w.output_prompts):
        body = {"model": SERVED_NAME, "prompt": p, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1,
                "return_token_ids": True}
        try:
            reply = await asyncio.wait_for(client.post_json(url, "/v1/completions", body), max(1.0, deadline - time.monotonic()))
            a, b = compare.prompt_logprobs_of(p, reply["choices"][0])
        except (OSError, ValueError, KeyError, IndexError, asyncio.TimeoutError, client.HTTPStatusError) as exc:
            errors.append(f"prompt logprobs of prompt {i}: {type(exc).__name__}: {exc}"[:400])
            a, b = [], []
        lps.append(a)
        top.append(b)

    async def greedy(p: list[int]) -> dict[str, Any]:
        body = {"model": SERVED_NAME, "prompt": p, "max_tokens": w.greedy_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1, "return_token_ids": True}
        reply = await client.post_json(url, "/v1/completions", body)
        return compare.greedy_of(reply["choices"][0])

    greedy_out: list[dict[str, Any]] = []
    try:
        res = await asyncio.wait_for(asyncio.gather(*(greedy(p) for p in w.output_prompts), return_exceptions=True),
                                     max(1.0, deadline - time.monotonic()))
        for i, g in enumerate(res):
            if isinstance(g, BaseException):
                errors.append(f"greedy continuation of prompt {i}: {type(g).__name__}: {g}"[:400])
                greedy_out.append({"token_ids": [], "logprobs": []})
            else:
                greedy_out.append(g)
    except asyncio.TimeoutError:
        errors.append("greedy continuations: no replies before the deadline")
    out = {"prompts_digest": compare.prompts_digest(w.output_prompts), "prompt_logprobs": lps, "prompt_top1": top,
           "greedy": greedy_out if len(greedy_out) == len(w.output_prompts) else None}
    return out, errors


async def _load(url: str, prompts: list[list[int]], out_len: int, times: list[float], deadline: float) -> dict[str, Any]:
    bodies = [_stream_body(prompts[i % len(prompts)], out_len) for i in range(len(times))]
    results, wall = await client.run_load(url, bodies, times, max(1.0, deadline - time.monotonic()))
    st = client.load_stats(results, wall)
    st["short"] = sum(1 for r in results if r.get("ok") and r.get("output_tokens") != out_len)
    return st


async def workload(url: str, w: Workload, deadline: float) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Outputs, a warm-up, the burst, then each rate; returns (outputs, throughput, errors)."""
    outputs, errors = await _outputs(url, w, deadline)
    n_warm = min(8, w.burst_requests)
    await _load(url, w.bench_prompts, 8, [0.0] * n_warm, deadline)  # this shape's first kernels (Triton JIT)
    tp: dict[str, Any] = {"burst": await _load(url, w.bench_prompts, w.output_len, [0.0] * w.burst_requests, deadline),
                          "rates": {}}
    for k, rate in enumerate(w.rates):
        times = client.arrivals(w.rate_requests, rate, w.seed + 100 + k)
        tp["rates"][str(rate)] = await _load(url, w.bench_prompts, w.output_len, times, deadline)
    for name, st in [("burst", tp["burst"])] + [(f"rate {r}/s", s) for r, s in tp["rates"].items()]:
        if st["failed"] or st["short"]:
            errors.append(f"{name}: {st['failed']} of {st['requests']} requests failed, {st['short']} short "
                          f"(first error: {st['first_error']})")
    return outputs, tp, errors


# --------------------------------------------------------------------------------------- a row
def base_row(cfg: matrix.Config, a: argparse.Namespace, info: dict[str, Any], env_info: dict[str, Any],
             projection: dict[str, Any] | None, w: Workload) -> dict[str, Any]:
    return {"tool": "serve_ab", "schema": 1, "config": cfg.name, "backend": cfg.backend.name,
            "all2all_backend": cfg.backend.all2all, "mode": cfg.mode, "role": cfg.backend.role, "moonep": cfg.moonep,
            "plugin": cfg.backend.plugin, "not_applicable": cfg.not_applicable, "model": info,
            "model_config": vmc.model_config(a.layers), "workload": w.describe(a.input_len), "projection": projection,
            "environment": env_info, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "memory": {}, "checks": []}


def finish_row(row: dict[str, Any], cfg: matrix.Config, log: Path, stop_at: int | None) -> None:
    """The log's figures and checks into ``row`` (see ``logs.py``)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    parsed = logs.parse_log(text, stop_at=stop_at)
    row["log"] = parsed
    for k in ("kv_tokens", "kv_gib", "model_gib", "graph_gib", "expert_memory"):
        row["memory"][k] = parsed[k]
    if row.get("status") == "ok":
        row["checks"] = logs.line_checks(cfg, parsed, matrix.DP)
    else:
        head = text if stop_at is None else text[:stop_at]
        row["first_error"] = vmc.first_error(head) or vmc.first_error(text)
        row["log_tail"] = text.splitlines()[-25:]
    row["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat()


def run_config(cfg: matrix.Config, a: argparse.Namespace, base_env: dict[str, str], site: Path, model_dir: str,
               w: Workload, row: dict[str, Any], logdir: Path, left_s: float) -> dict[str, Any]:
    """One configuration: its server, its workload, its row (``row`` is filled in and returned)."""
    argv = matrix.engine_argv(cfg, model_dir, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                              gpu_mem=a.gpu_mem, seed=a.seed, attention_backend=a.attention_backend,
                              compile_mode=a.compile_mode, graph_mode=a.graph_mode, capture_sizes=a.capture_sizes,
                              extra=shlex.split(a.extra_engine_args))
    cmd = serve_command(a.serve_cmd, argv, free_port())
    extra = {"VLLM_LOG_STATS_INTERVAL": str(a.stats_interval), **dict(kv.split("=", 1) for kv in a.env)}
    env = vmc.child_env(base_env, plugin=cfg.backend.plugin, site_dir=str(site), weights="scaled",
                        weights_seed=a.weights_seed, extra=extra)
    log = logdir / f"{cfg.name}.log"
    row.update({"argv": argv, "cmd": cmd, "log_file": str(log),
                "env_diff": {k: env.get(k) for k in sorted(set(env) | set(base_env)) if env.get(k) != base_env.get(k)}})
    t0 = time.monotonic()
    end = t0 + left_s - STOP_RESERVE_S
    srv = ServerProcess(cmd, env, log, f"# serve_ab {cfg.name}: VLLM_MOONEP_PLUGIN="
                                       f"{'<unset>' if cfg.backend.plugin else '0'}\n# {shlex.join(cmd)}")
    srv.start()
    _RUNNING.append(srv)
    _say(f"{cfg.name}: started (pid {srv.proc.pid if srv.proc else '?'}) on {srv.base}, log {log}")
    try:
        state, why = srv.wait_healthy(max(5.0, min(a.start_timeout, end - time.monotonic())))
        row["ready_s"] = round(time.monotonic() - t0, 1)
        if state != "ok":
            row.update({"status": state, "error": f"the server did not start: {why}"})
        else:
            _say(f"{cfg.name}: ready after {row['ready_s']}s; outputs, warm-up, burst, rates {a.rates}")
            row["memory"]["gpu_ready"] = gpu_memory()
            outputs, tp, errors = asyncio.run(workload(srv.base, w, min(end, time.monotonic() + a.workload_timeout)))
            row.update({"outputs": outputs, "throughput": tp})
            time.sleep(a.stats_interval + 1.5)  # vLLM's stat logger writes the last interval's CUDA-graph table
            row["memory"]["gpu_end"] = gpu_memory()
            row["status"] = "failed" if errors else "ok"
            if errors:
                row["error"] = "; ".join(errors)[:2000]
    except Exception as exc:  # noqa: BLE001 - the row keeps the error; the next configuration still runs
        row.update({"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]})
    finally:
        stopped = srv.stop()
        _RUNNING.remove(srv)
        row.update({"stop": stopped["stop"], "stop_s": stopped["stop_s"]})
    row["wall_s"] = round(time.monotonic() - t0, 1)
    finish_row(row, cfg, log, stopped["log_bytes_at_stop"])
    return row


# ----------------------------------------------------------------------------------- the call
def projection_of(model_dir: str, slots: int) -> dict[str, Any] | None:
    """What ``moonep-ab project --config <model_dir> --ep 2 --slots <slots>`` prints, per layout (bytes)."""
    try:
        from vllm_moonep.tools.memory_projection import model_from_hf_config, projection_rows

        r = projection_rows(slots, (matrix.DP,), models=(model_from_hf_config(model_dir),))[0]
    except (ImportError, ValueError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"slots": slots, "ep": matrix.DP, "replicated": r["replicated"], "symmetric": r["symmetric"],
            "symmetric_shared": r["symmetric_shared"],
            "command": f"moonep-ab project --config {model_dir} --ep {matrix.DP} --slots {slots}"}


def default_slots() -> int:
    """The plugin's ``num_prefetch_slots`` default (defined once, in ``vllm_plugin/options.py``)."""
    from vllm_moonep.vllm_plugin.options import MoonEPOptions

    return MoonEPOptions().num_prefetch_slots


def estimate_s(out: Path, mode: str, default: float) -> float:
    """Seconds a configuration of ``mode`` is expected to take: 1.1x the longest such row in ``out``
    that ran its whole workload (status ok), else ``default``."""
    walls = []
    for f in out.glob("*.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(r, dict) and r.get("tool") == "serve_ab" and r.get("mode") == mode and r.get("status") == "ok"
                and r.get("wall_s")):
            walls.append(float(r["wall_s"]))
    return 1.1 * max(walls) if walls else default


def _row_status(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def write_summary(out: Path, extra_dirs: tuple[Path, ...] = ()) -> str:
    text, verdicts = report.summarize(report.load_rows([out, *extra_dirs]))
    (out / "summary.md").write_text(text + "\n")
    return text


def run(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(a.logs) if a.logs else out / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    slots = a.slots or default_slots()
    try:
        configs = matrix.select(matrix.matrix(slots=a.slots), a.configs)
    except ValueError as exc:
        _say(f"ERROR: {exc}")
        return 2
    model_dir = a.model_dir or vmc._default_dir(a.layers)
    info = vmc.write_model_dir(model_dir, a.layers)
    pre = vmc.preflight(need_serve=True)
    gpus = visible_gpus(pre["gpus"], os.environ.get("CUDA_VISIBLE_DEVICES"))
    refuse = gpus_error(gpus)
    env_info = {k: pre.get(k) for k in ("python", "torch_version", "vllm_version", "transformers_version", "vllm_dir")}
    env_info["gpus"] = gpus
    _say(f"model: {info['path']} ({info['layers']} layers, {info['param_gb']} GB bf16, "
         f"{'reused' if info['reused'] else 'written'}); vLLM {pre.get('vllm_version')}, torch {pre.get('torch_version')}; "
         f"GPUs: {len(gpus)}")
    _say(f"every configuration: DP=2 EP=2, one API server (--api-server-count 1), --cudagraph-metrics, stat log "
         f"every {a.stats_interval}s, scaled dummy weights (seed {a.weights_seed}); vLLM's backends with "
         f"VLLM_MOONEP_PLUGIN=0; moonep num_prefetch_slots={slots}"
         f"{' (the plugin default)' if not a.slots else ''}")
    _say(f"{matrix.NOISE_FLOOR}: vLLM 0.33 runs it as allgather_reducescatter (vllm/config/parallel.py): its row is a "
         "second run of the reference, the noise floor of the output comparison")
    for c in configs:
        if c.not_applicable:
            _say(f"{c.name}: a row without a run: {c.not_applicable}")
    setup_errors = [refuse] if refuse else []
    if pre["missing_llm"] or pre["missing_serve"]:
        setup_errors.append("missing for vllm serve: " + ", ".join(pre["missing_llm"] + pre["missing_serve"]))
    if a.dry_run:
        for c in configs:
            if c.not_applicable:
                continue
            argv = matrix.engine_argv(c, model_dir, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                                      gpu_mem=a.gpu_mem, seed=a.seed, attention_backend=a.attention_backend,
                                      compile_mode=a.compile_mode, graph_mode=a.graph_mode,
                                      capture_sizes=a.capture_sizes, extra=shlex.split(a.extra_engine_args))
            print(f"--- {c.name} (VLLM_MOONEP_PLUGIN={'<unset>' if c.backend.plugin else '0'}):\n    vllm serve "
                  + shlex.join(argv))
        for s in setup_errors:
            _say(f"this machine could not run it: {s}")
        return 0
    if setup_errors:
        for s in setup_errors:
            _say(f"REFUSED: {s}")
        return 2
    signal.signal(signal.SIGTERM, _on_term)
    work = Path(model_dir).parent / (Path(model_dir).name + "-work")
    site = work / "site"
    vmc.write_entry_points(site, with_moonep=not pre["moonep_entry_point"])
    w = Workload(output_prompts=vmc.make_prompts(a.output_prompts, (a.output_prompt_len[0], a.output_prompt_len[1]), a.seed),
                 greedy_tokens=a.greedy_tokens,
                 bench_prompts=vmc.make_prompts(max(a.burst_requests, a.rate_requests), (a.input_len, a.input_len),
                                                a.seed + 1),
                 output_len=a.output_len, burst_requests=a.burst_requests, rate_requests=a.rate_requests,
                 rates=a.rates, seed=a.seed)
    projection = projection_of(model_dir, slots)
    base_env = dict(os.environ)
    left_for_later: list[str] = []
    ran: list[dict[str, Any]] = []
    for c in configs:
        path = out / f"{c.name}.json"
        if not a.rerun and _row_status(path) in DONE:
            _say(f"{c.name}: already in {out} ({_row_status(path)}); --rerun runs it again")
            continue
        row = base_row(c, a, info, env_info, projection, w)
        if c.not_applicable:
            row.update({"status": "not_applicable", "finished": row["started"]})
            _write(path, row)
            continue
        left = a.budget - (time.monotonic() - t_start)
        need = estimate_s(out, c.mode, a.config_estimate_s)
        if left < need:
            left_for_later.append(c.name)
            continue
        _say(f"{c.name}: {left:.0f}s of the budget left (this configuration: about {need:.0f}s)")
        run_config(c, a, base_env, site, model_dir, w, row, logdir, left)
        _write(path, row)
        ran.append(row)
        bad = [x["check"] for x in row.get("checks", []) if not x["ok"] and x.get("strict", True)]
        burst = ((row.get("throughput") or {}).get("burst") or {}).get("output_tok_s")
        _say(f"{c.name}: {row['status']} in {row['wall_s']}s; burst {burst} output tok/s; KV tokens "
             f"{row['memory'].get('kv_tokens')}" + (f"; error: {row.get('error')}" if row.get("error") else "")
             + (f"; FAILED CHECKS: {bad}" if bad else ""))
        write_summary(out)
    text = write_summary(out)
    print(text, flush=True)
    if left_for_later:
        _say(f"left for the next call (budget): {', '.join(left_for_later)}; run the same command again")
    failed = [r["config"] for r in ran if r["status"] != "ok"
              or any(not x["ok"] and x.get("strict", True) for x in r.get("checks", []))]
    if failed:
        _say(f"failed: {', '.join(failed)}")
    _say(f"wrote {out}/<config>.json and {out}/summary.md in {time.monotonic() - t_start:.0f}s")
    return 1 if failed else 3 if left_for_later else 0


# ------------------------------------------------------------------------------ command line
def _rate(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (inf: all at once), got {v}")
    return x


def _pos(v: str) -> int:
    x = int(v)
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return x


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_moonep.tools.serve_ab",
        description="Serving A/B inside vLLM on two GPUs: MoonEP (replicated, symmetric, symmetric with a shared slot "
                    "pool) against vLLM's allgather_reducescatter and naive, eager and with CUDA graphs: outputs, "
                    "throughput and latency, KV-cache capacity, CUDA graphs. See docs/SERVING.md, 'Serving A/B'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the configurations not yet in --out (default command)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s = sub.add_parser("summary", help="summary.md over the rows of one or more result folders")
    s.add_argument("dirs", nargs="+", help="folders holding <config>.json rows (the latest row of each is used)")
    s.add_argument("--write", default=None, help="write the summary here (default: print only)")
    s.add_argument("--json", default=None, help="write the verdicts (distances, gains, targets) here as JSON")
    r.add_argument("--out", required=True, help="rows (<config>.json), summary.md, logs/; a later call continues here")
    r.add_argument("--logs", default=None, help="the servers' logs (default <out>/logs)")
    r.add_argument("--configs", nargs="*", default=None,
                   help=f"configurations, in this order (default all): {', '.join(matrix.config_names())}, "
                        "or a backend name for both modes")
    r.add_argument("--rerun", action="store_true", help="run configurations whose row is already in --out")
    r.add_argument("--dry-run", action="store_true", help="print the configurations' command lines; start nothing")
    r.add_argument("--budget", type=float, default=520.0,
                   help="seconds for this call; a configuration that no longer fits is left for the next")
    r.add_argument("--config-estimate-s", type=float, default=240.0,
                   help="seconds one configuration is expected to take before one of its mode has run here")
    r.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    r.add_argument("--workload-timeout", type=float, default=300.0, help="seconds for one configuration's workload")
    r.add_argument("--slots", type=_pos, default=None, help="num_prefetch_slots of the moonep layouts (default: the "
                                                              "plugin's)")
    w = r.add_argument_group("workload")
    w.add_argument("--output-prompts", type=_pos, default=8, help="prompts whose logprobs and greedy tokens are compared")
    w.add_argument("--output-prompt-len", type=_pos, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    w.add_argument("--greedy-tokens", type=_pos, default=32, help="greedy tokens per compared prompt")
    w.add_argument("--input-len", type=_pos, default=64, help="prompt tokens of the throughput requests")
    w.add_argument("--output-len", type=_pos, default=128,
                   help="output tokens of the throughput requests (twice the input: decode-heavy)")
    w.add_argument("--burst-requests", type=_pos, default=64, help="requests sent at once (offline throughput)")
    w.add_argument("--rate-requests", type=_pos, default=24, help="requests at each rate")
    w.add_argument("--rates", type=_rate, nargs="+", default=[4.0, 16.0], help="request rates (req/s, Poisson)")
    w.add_argument("--seed", type=int, default=0, help="prompts, arrivals and vLLM's --seed")
    w.add_argument("--weights-seed", type=int, default=0, help="seed of the scaled dummy weights")
    e = r.add_argument_group("engine")
    e.add_argument("--layers", type=_pos, default=48, help="decoder layers of Qwen3-30B-A3B's 48")
    e.add_argument("--model-dir", default=None, help="model directory (default /tmp/moonep-qwen3-30b-a3b-L<layers>)")
    e.add_argument("--max-model-len", type=_pos, default=1024)
    e.add_argument("--max-num-seqs", type=_pos, default=64, help="per engine")
    e.add_argument("--gpu-mem", type=float, default=0.85, help="--gpu-memory-utilization")
    e.add_argument("--attention-backend", default="TRITON_ATTN")
    e.add_argument("--compile-mode", choices=tuple(vmc.COMPILE_MODES), default="NONE")
    e.add_argument("--graph-mode", choices=vmc.GRAPH_MODES, default="FULL_DECODE_ONLY")
    e.add_argument("--capture-sizes", type=_pos, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="cudagraph_capture_sizes (those up to --max-num-seqs)")
    e.add_argument("--extra-engine-args", default="", help="more vllm serve arguments (one shell-quoted string)")
    e.add_argument("--env", nargs="*", default=[], metavar="K=V", help="more environment for every server")
    e.add_argument("--stats-interval", type=float, default=2.0,
                   help="VLLM_LOG_STATS_INTERVAL: seconds between vLLM's stat lines and CUDA-graph tables")
    e.add_argument("--serve-cmd", default=SERVE_CMD, help="python arguments that start the server")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "summary", "-h", "--help"):
        argv.insert(0, "run")
    a = build_parser().parse_args(argv)
    if a.cmd == "summary":
        rows = report.load_rows(a.dirs)
        if not rows:
            print(f"serve_ab: no rows (<config>.json of this tool) in {', '.join(a.dirs)}", file=sys.stderr)
            return 2
        text, verdicts = report.summarize(rows)
        print(text)
        if a.write:
            Path(a.write).write_text(text + "\n")
        if a.json:
            Path(a.json).write_text(json.dumps(verdicts, indent=1, default=str))
        return 0
    if a.gpu_mem <= 0 or a.gpu_mem > 1:
        build_parser().error(f"--gpu-mem must be in (0, 1], got {a.gpu_mem}")
    if a.output_prompt_len[0] < 2 or a.output_prompt_len[0] > a.output_prompt_len[1]:
        build_parser().error("--output-prompt-len needs 2 <= MIN <= MAX (position 0 has no logprob)")
    if a.input_len + a.output_len > a.max_model_len or a.output_prompt_len[1] + a.greedy_tokens > a.max_model_len:
        build_parser().error(f"--max-model-len {a.max_model_len} is below a request's length (input + output)")
    bad_env = [kv for kv in a.env if "=" not in kv]
    if bad_env:
        build_parser().error(f"--env takes K=V, got {bad_env}")
    return run(a)
