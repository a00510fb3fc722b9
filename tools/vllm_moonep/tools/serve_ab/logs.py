"""What a configuration's server log says: KV-cache capacity, memory, CUDA graphs captured and
replayed, the all2all manager, and the plugin's own lines; then the checks each configuration's log
must pass.

    server log --parse_log()--> {per DP engine: kv tokens, kv GiB, model GiB, graph GiB, cudagraph_mode;
                                 captured graphs; steps by runtime mode; plugin lines}
               --line_checks(config, parsed)--> [{check, ok, detail}]

Each pattern is vLLM 0.33's format string, from the file named beside it (tests/unit/test_serve_ab.py
renders each format string as vLLM does and checks the pattern reads it back, and that the string is
still in the installed vLLM). vLLM prefixes every record with ``(<process> pid=<pid>)`` and repeats
the prefix on each continuation line of a multi-line record (vllm/logging_utils/formatter.py), so a
line's engine is its prefix: ``EngineCore_DP0``, ``EngineCore_DP1`` (vllm/v1/engine/core.py) or
``APIServer``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FORMATS", "PATTERNS", "line_checks", "parse_log", "process_of"]

#: vLLM's format strings (what the tests render), by the name of the pattern that reads them
FORMATS: dict[str, tuple[str, str]] = {
    "kv_capacity": ("vllm/v1/core/kv_cache_utils.py",
                    "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"),
    "kv_memory": ("vllm/v1/worker/gpu_worker.py", "Available KV cache memory: %s GiB"),
    "model_loading": ("vllm/v1/worker/gpu/model_runner.py", "Model loading took %s GiB memory and %.6f seconds"),
    "graph_capture": ("vllm/v1/worker/gpu/model_runner.py", "Graph capturing finished in %.0f secs, took %.2f GiB"),
    "all2all_manager": ("vllm/distributed/device_communicators/cuda_communicator.py", "Using %s all2all manager."),
    "naive_removed": ("vllm/config/parallel.py",
                      "The '%s' all2all backend has been removed. Falling back to 'allgather_reducescatter'."),
    "engine_config": ("vllm/v1/engine/core.py", "Initializing a V1 LLM engine (v%s) with config: %s"),
}

PATTERNS: dict[str, str] = {
    "kv_capacity": r"(\w[\w +]*?) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                   r"([\d.]+)x",
    "kv_memory": r"Available KV cache memory: (-?[\d.]+) GiB",
    "model_loading": r"Model loading took (-?[\d.]+) GiB memory and ([\d.]+) seconds",
    "graph_capture": r"Graph capturing finished in (\d+) secs, took (-?[\d.]+) GiB",
    "all2all_manager": r"Using (\w+) all2all manager\.",
    "naive_removed": r"The '(\w+)' all2all backend has been removed\. Falling back to 'allgather_reducescatter'\.",
    # the engine config's compilation_config repr: {'cudagraph_mode': <CUDAGraphMode.FULL_DECODE_ONLY: (2, 0)>, ...}
    "cudagraph_mode": r"Initializing a V1 LLM engine \(v[^)]*\) with config: .*?'cudagraph_mode': <CUDAGraphMode\.(\w+)",
    # tqdm over the capture descriptors, global first rank only (vllm/v1/worker/gpu/cudagraph_utils.py:
    # tqdm(descs, desc=f"{progress_bar_desc} ({mode.name})"), progress_bar_desc "Capturing CUDA graphs")
    "capture_bar": r"Capturing CUDA graphs[^:\r\n]*\((FULL|PIECEWISE)\): *100%\|[^|\r\n]*\| *(\d+)/(\d+)",
    # --cudagraph-metrics: CUDAGraphLogging's table (vllm/compilation/cuda_graph.py), one row per
    # (Unpadded Tokens, Padded Tokens, Num Paddings, Runtime Mode) with its Count in the interval
    "cudagraph_row": r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(NONE|PIECEWISE|FULL)\s*\|\s*(\d+)\s*\|\s*$",
    # the plugin's start-up line per worker (vllm_plugin/runtime.py summary_line)
    "expert_memory": r"vllm-moonep: weight_layout=(\w+), .*?per-rank expert memory ([\d.]+) GiB resident over (\d+) "
                     r"MoE layer\(s\) \(home ([\d.]+), replicated ([\d.]+), slots ([\d.]+); load-time transient ([\d.]+)\)",
}
_RX = {k: re.compile(v) for k, v in PATTERNS.items()}
_PROC = re.compile(r"^(?:\x1b\[[\d;]*m)*\((?P<proc>[A-Za-z_][\w.-]*) pid=(?P<pid>\d+)\)")
#: the plugin's lines (``vllm_model_check.LOG_PATTERNS``) a configuration is checked for
PLUGIN_LINES = ("plugin_load", "plugin_seam_error", "plugin_inactive", "plugin_active", "plugin_worker",
                "plugin_graphs_kept", "plugin_graphs_off", "vllm_moonep_eager_switch", "unknown_moonep_env",
                "scaled_weights", "traceback", "import_error")


def process_of(line: str) -> str | None:
    """The vLLM process a log line came from (``EngineCore_DP0``, ``APIServer``, ...), None when the
    line has no vLLM prefix (tqdm, prints)."""
    m = _PROC.match(line)
    return m.group("proc") if m else None


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def parse_log(text: str, stop_at: int | None = None) -> dict[str, Any]:
    """The figures and lines of one server log (see the module doc). Per-engine figures are keyed
    by process (the last value each process logged: vLLM logs a profiling capture before the real
    one); ``cudagraph_steps`` sums the metric tables' counts by runtime mode; ``captured_graphs``
    is the last capture bar's total per mode. The plugin's lines come from
    ``vllm_model_check.scan_log`` (tracebacks only before ``stop_at``)."""
    from vllm_moonep.tools.vllm_model_check import scan_log

    out: dict[str, Any] = {"kv_tokens": {}, "kv_max_concurrency": {}, "kv_gib": {}, "model_gib": {}, "graph_gib": {},
                           "graph_capture_s": {}, "cudagraph_mode": {}, "all2all_manager": {}, "expert_memory": {},
                           "captured_graphs": {}, "cudagraph_steps": {}, "cudagraph_rows": {}, "naive_removed": False}
    rows: dict[tuple[int, int, str], int] = {}
    for line in re.split(r"\r\n|\n|\r", text):
        if not line:
            continue
        proc = process_of(line) or "?"
        if m := _RX["kv_capacity"].search(line):
            out["kv_tokens"][proc] = int(_num(m.group(2)))
            out["kv_max_concurrency"][proc] = _num(m.group(4))
        elif m := _RX["kv_memory"].search(line):
            out["kv_gib"][proc] = _num(m.group(1))
        elif m := _RX["model_loading"].search(line):
            out["model_gib"][proc] = _num(m.group(1))
        elif m := _RX["graph_capture"].search(line):
            out["graph_capture_s"][proc] = int(m.group(1))
            out["graph_gib"][proc] = _num(m.group(2))
        elif m := _RX["all2all_manager"].search(line):
            out["all2all_manager"][proc] = m.group(1)
        elif _RX["naive_removed"].search(line):
            out["naive_removed"] = True
        elif m := _RX["cudagraph_mode"].search(line):
            out["cudagraph_mode"][proc] = m.group(1)
        elif m := _RX["capture_bar"].search(line):
            out["captured_graphs"][m.group(1)] = int(m.group(3))
        elif m := _RX["cudagraph_row"].search(line):
            key = (int(m.group(1)), int(m.group(2)), m.group(4))
            rows[key] = rows.get(key, 0) + int(m.group(5))
        elif m := _RX["expert_memory"].search(line):
            out["expert_memory"][proc] = {"weight_layout": m.group(1), "resident_gib": float(m.group(2)),
                                          "layers": int(m.group(3)), "home_gib": float(m.group(4)),
                                          "replicated_gib": float(m.group(5)), "slots_gib": float(m.group(6)),
                                          "transient_gib": float(m.group(7))}
    steps: dict[str, int] = {}
    for (_, _, mode), n in rows.items():
        steps[mode] = steps.get(mode, 0) + n
    out["cudagraph_steps"] = steps
    # by runtime mode: {padded tokens: steps}, the shapes the steps ran at
    by_mode: dict[str, dict[str, int]] = {}
    for (_, padded, mode), n in sorted(rows.items()):
        by_mode.setdefault(mode, {})
        by_mode[mode][str(padded)] = by_mode[mode].get(str(padded), 0) + n
    out["cudagraph_rows"] = by_mode
    found = scan_log(text, stop_at=stop_at)
    out["plugin"] = {k: found[k] for k in PLUGIN_LINES if k in found}
    return out


def _engines(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k.startswith("EngineCore")} or d


def line_checks(cfg: Any, parsed: dict[str, Any], dp: int) -> list[dict[str, Any]]:
    """What the log of a configuration that served must show (``cfg``: ``matrix.Config``). Each
    check: ``check``, ``ok``, ``detail``; ``strict`` False for what only warns."""
    p = parsed.get("plugin", {})
    moonep = cfg.moonep is not None
    graphs = cfg.mode == "graphs"
    checks: list[dict[str, Any]] = []

    def add(name: str, ok: bool, detail: Any = None, strict: bool = True) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail, "strict": strict})

    kv = _engines(parsed.get("kv_tokens", {}))
    add(f"vLLM reported the KV-cache capacity of each of the {dp} engines", len(kv) >= dp, kv)
    add("the scaled dummy weights were loaded", "scaled_weights" in p, p.get("scaled_weights"))
    add("no seam error of the plugin", "plugin_seam_error" not in p, p.get("plugin_seam_error"))
    add("no traceback before the stop", "traceback" not in p, None, strict=False)
    modes = set(_engines(parsed.get("cudagraph_mode", {})).values())
    steps = parsed.get("cudagraph_steps", {})
    if graphs:
        add("vLLM's engine config keeps CUDA graphs", bool(modes) and "NONE" not in modes, sorted(modes))
        add("vLLM captured CUDA graphs", bool(parsed.get("graph_gib")) or bool(parsed.get("captured_graphs")),
            parsed.get("captured_graphs"))
        add("decode steps replayed captured graphs (vLLM's CUDA-graph metrics: runtime mode FULL)",
            steps.get("FULL", 0) > 0, steps)
    else:
        add("vLLM's engine config is eager (cudagraph_mode NONE)", modes == {"NONE"}, sorted(modes))
        add("no step ran from a captured graph", steps.get("FULL", 0) == 0 and steps.get("PIECEWISE", 0) == 0, steps)
    if moonep:
        add("the plugin hooked vLLM", "plugin_load" in p, p.get("plugin_load"))
        add("the plugin says MoonEP runs", "plugin_active" in p and "plugin_inactive" not in p,
            p.get("plugin_active") or p.get("plugin_inactive"))
        layouts = {v["weight_layout"] for v in _engines(parsed.get("expert_memory", {})).values()}
        want = cfg.moonep.get("weight_layout", "replicated")
        add(f"every worker built the {want} layout", layouts == {want}, sorted(layouts) or p.get("plugin_worker"))
        if graphs:
            add("the plugin kept the CUDA graphs (graph-safe) after vLLM's eager switch",
                "plugin_graphs_kept" in p and "vllm_moonep_eager_switch" in p,
                p.get("plugin_graphs_kept") or p.get("plugin_graphs_off"))
    else:
        add("the moonep plugin is off (VLLM_MOONEP_PLUGIN=0)", "plugin_load" not in p, p.get("plugin_load"))
        managers = set(parsed.get("all2all_manager", {}).values())
        add("vLLM ran AgRsAll2AllManager", managers <= {"AgRsAll2AllManager"}, sorted(managers), strict=False)
        if cfg.backend.all2all == "naive":
            add("vLLM 0.33 fell back from 'naive' to 'allgather_reducescatter'", parsed.get("naive_removed", False),
                None, strict=False)
    return checks
