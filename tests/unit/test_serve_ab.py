"""``serve_ab`` (the serving A/B inside vLLM on two GPUs) where no GPU is needed: the configuration
matrix and each configuration's ``vllm serve`` arguments, the refusal without two GPUs, the log
parsing on vLLM 0.33's own format strings, the distances on synthetic logprobs, the loopback client
against a streaming stand-in, failed starts as rows, the summary tables and targets, and whole calls
against a stand-in server (budget left for the next call, rows kept). One ``vllm`` case builds
vLLM 0.33's engine config from each configuration's exact arguments on its CPU platform."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vllm_moonep.tools import vllm_model_check as vmc
from vllm_moonep.tools.serve_ab import client, compare, logs, matrix, report, run

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------- matrix
def test_matrix_has_every_backend_in_both_modes_graphs_first():
    """A configuration of the issue missing from the matrix (or the reference not first) left a row out of the A/B."""
    cfgs = matrix.matrix()
    assert [c.name for c in cfgs] == matrix.config_names() == [
        "allgather_reducescatter-graphs", "naive-graphs", "moonep-replicated-graphs", "moonep-symmetric-graphs",
        "moonep-symmetric-shared-graphs", "allgather_reducescatter-eager", "naive-eager", "moonep-replicated-eager",
        "moonep-symmetric-eager", "moonep-symmetric-shared-eager"]
    by = {c.name: c for c in cfgs}
    assert by["naive-eager"].backend.all2all == "naive" and not by["naive-eager"].backend.plugin
    assert by["allgather_reducescatter-graphs"].moonep is None and not by["allgather_reducescatter-graphs"].backend.plugin
    assert by["moonep-symmetric-shared-eager"].moonep == {"weight_layout": "symmetric", "shared_slot_pool": True}
    assert by["moonep-replicated-graphs"].backend.plugin and by["moonep-replicated-graphs"].moonep == {
        "weight_layout": "replicated"}


def test_graphs_rows_follow_the_plugins_graph_rule():
    """A graphs row for the shared slot pool would have measured eager steps under a 'graphs' label (the plugin keeps it eager)."""
    by = {c.name: c for c in matrix.matrix()}
    na = {n for n, c in by.items() if c.not_applicable}
    assert na == {"moonep-symmetric-shared-graphs"}, na
    assert "shared_slot_pool" in by["moonep-symmetric-shared-graphs"].not_applicable
    assert matrix.graphs_not_allowed(None) is None
    assert "cuda_graphs='off'" in matrix.graphs_not_allowed({"cuda_graphs": "off"})


def test_slots_and_selection():
    """--slots must reach every moonep block (and no vLLM backend); a typo in --configs must be refused by name."""
    cfgs = matrix.matrix(slots=16)
    assert all(c.moonep["num_prefetch_slots"] == 16 for c in cfgs if c.moonep is not None)
    assert all(c.moonep is None for c in cfgs if c.backend.role != "candidate")
    got = matrix.select(cfgs, ["moonep-symmetric", "allgather_reducescatter-graphs", "moonep-symmetric-graphs"])
    assert [c.name for c in got] == ["moonep-symmetric-graphs", "moonep-symmetric-eager", "allgather_reducescatter-graphs"]
    assert matrix.select(cfgs, ["all"]) == cfgs == matrix.select(cfgs, None)
    with pytest.raises(ValueError, match="unknown configuration 'moonep-sym'.*valid: allgather_reducescatter-graphs"):
        matrix.select(cfgs, ["moonep-sym"])


def _argv(cfg, **kw):
    args = dict(max_model_len=1024, max_num_seqs=64, gpu_mem=0.85, seed=0, attention_backend="TRITON_ATTN",
                compile_mode="NONE", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128])
    args.update(kw)
    return matrix.engine_argv(cfg, "/m", **args)


def test_engine_argv_of_each_configuration():
    """A run without DP=2 + EP, with another backend than its row says, without the moonep block, with more than
    one API server (the CUDA-graph table split over processes) or without vLLM's CUDA-graph metrics measures
    something else than its row claims."""
    for c in matrix.matrix():
        a = _argv(c)
        assert a[a.index("--data-parallel-size") + 1] == "2" and "--enable-expert-parallel" in a
        assert a[a.index("--all2all-backend") + 1] == c.backend.all2all
        assert a[a.index("--api-server-count") + 1] == "1" and "--cudagraph-metrics" in a
        assert a[a.index("--load-format") + 1] == "dummy" and "--no-enable-prefix-caching" in a
        if c.moonep is None:
            assert "--additional-config" not in a
        else:
            assert json.loads(a[a.index("--additional-config") + 1]) == {"moonep": c.moonep}
        if c.mode == "eager":
            assert "--enforce-eager" in a and "--compilation-config" not in a
        else:
            cc = json.loads(a[a.index("--compilation-config") + 1])
            assert "--enforce-eager" not in a and cc["cudagraph_mode"] == "FULL_DECODE_ONLY" and cc["mode"] == 0
            assert cc["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32, 64], "sizes above --max-num-seqs are not captured"


# ------------------------------------------------------------------------------------- GPUs
def test_refuses_without_two_gpus_and_names_what_it_needs(tmp_path, capsys):
    """On a machine without two GPUs the tool must stop before any server, saying what it needs."""
    assert run.gpus_error(["H200", "H200"]) is None
    msg = run.gpus_error([])
    assert "2 GPUs" in msg and "nvidia-h200-x2" in msg and "no GPU" in msg
    assert "1 GPU (NVIDIA H200, 143771 MiB)" in run.gpus_error(["NVIDIA H200, 143771 MiB"])
    assert run.visible_gpus(["a", "b"], "1") == ["a"] and run.visible_gpus(["a", "b"], None) == ["a", "b"]
    assert run.visible_gpus(["a", "b"], "") == []
    rc = run.main(["run", "--out", str(tmp_path / "out"), "--layers", "1", "--model-dir", str(tmp_path / "m")])
    text = capsys.readouterr().out
    if len(run.visible_gpus(vmc.preflight(need_serve=False)["gpus"], os.environ.get("CUDA_VISIBLE_DEVICES"))) >= 2:
        pytest.skip("this machine has two GPUs")
    assert rc == 2 and "REFUSED: serve_ab needs 2 GPUs" in text, text
    assert not list((tmp_path / "out").glob("*.json")), "no row without a run"


def test_parse_gpu_memory():
    """nvidia-smi's CSV misread gave each configuration's GPU memory as nothing."""
    assert run.parse_gpu_memory("0, 120345, 143771\n1, 99, 143771\n\nNo devices\n") == [
        {"index": 0, "used_mib": 120345, "total_mib": 143771}, {"index": 1, "used_mib": 99, "total_mib": 143771}]


# ----------------------------------------------------------------------------------- log lines
def _rec(proc: str, pid: int, fileinfo: str, msg: str) -> str:
    """A record as vLLM 0.33's NewLineFormatter writes it (vllm/logger.py _FORMAT, vllm/logging_utils/formatter.py:
    the prefix repeated after every newline of a multi-line message, as "\\r\\n" + prefix)."""
    prefix = f"({proc} pid={pid}) INFO 12-02 10:00:00 [{fileinfo}] "
    return prefix + msg.replace("\n", "\r\n" + prefix) + "\n"


def _fmt(name: str, *args) -> str:
    return logs.FORMATS[name][1] % args


#: vllm/compilation/cuda_graph.py CUDAGraphLogging.generate_metric_table's output for two intervals' stats
def _cudagraph_table(rows: list[tuple[int, int, int, str, int]], mode="FULL_DECODE_ONLY", sizes="[1, 2, 4]") -> str:
    head = ["Unpadded Tokens", "Padded Tokens", "Num Paddings", "Runtime Mode", "Count"]  # COLUMN_HEADERS
    cells = [[str(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    out = (f"**CUDAGraph Config Settings:**\n\n- Mode: {mode}\n- Capture sizes: {sizes}\n\n**CUDAGraph Stats:**\n\n"
           + "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |\n"
           + "|" + "|".join("-" * (w + 2) for w in widths) + "|\n"
           + "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells) + "\n")
    return out


def _plugin_lines(layout: str, graphs: bool) -> str:
    """The plugin's own messages (vllm_model_check.LOG_PATTERNS' wording) and its start-up line's format."""
    t = ("INFO vllm-moonep 0.1.0 hooked vLLM 0.33.0 (12 seams: a, b); --all2all-backend moonep builds vllm-moonep's classes\n"
         "INFO vllm-moonep: --all2all-backend moonep for Qwen3MoeForCausalLM (E=128, EP=2); options: weight_layout=...\n")
    if graphs:
        t += ("WARNING MoonEP: Disabling CUDA Graphs since the MoonEP integration is currently eager-only\n"
              "INFO MoonEP: CUDA graphs kept (symmetric transport, one node): cudagraph_mode=FULL_DECODE_ONLY, 7 capture "
              "sizes up to 64; vLLM's 'Disabling CUDA Graphs' above is undone\n")
    for dp in (0, 1):
        t += _rec(f"EngineCore_DP{dp}", 10 + dp, "startup.py:120",
                  f"vllm-moonep: weight_layout={layout}, engine=builtin (x), transport=symmetric (auto), kernel=triton "
                  f"(impl=auto), slots=4 per layer, token_padding=128; per-rank expert memory 28.125 GiB resident over "
                  f"48 MoE layer(s) (home 27.000, replicated 0.000, slots 1.125; load-time transient 0.563)")
    return t


def _server_log(layout: str = "symmetric", graphs: bool = True, kv_tokens=(1234567, 1234560), steps_full=57,
                naive: bool = False, plugin: bool = True) -> str:
    t = "# serve_ab header\n"
    if naive:
        t += _rec("APIServer", 1, "parallel.py:538", _fmt("naive_removed", "naive"))
    if plugin:
        t += _plugin_lines(layout, graphs)
    t += "vllm_model_check: scaled dummy weights: 290 tensors (96 expert tensors, per global expert id), ...\n"
    mode = "FULL_DECODE_ONLY" if graphs else "NONE"
    t += _rec("EngineCore_DP0", 10, "core.py:140", _fmt("engine_config", "0.33.0",
              "model='/m', compilation_config={'mode': <CompilationMode.NONE: 0>, 'cudagraph_mode': "
              f"<CUDAGraphMode.{mode}: (2, 0)>, 'cudagraph_num_of_warmups': 1}}"))
    for dp, tok in enumerate(kv_tokens):
        p = f"EngineCore_DP{dp}"
        t += _rec(p, 10 + dp, "cuda_communicator.py:280", _fmt("all2all_manager", "AgRsAll2AllManager" if not plugin else
                                                               "MoonEPAll2AllManager"))
        t += _rec(p, 10 + dp, "model_runner.py:429", _fmt("model_loading", "28.52", 3.123456))
        t += _rec(p, 10 + dp, "gpu_worker.py:773", _fmt("kv_memory", "60.25" if dp == 0 else "60.24"))
        t += _rec(p, 10 + dp, "kv_cache_utils.py:1148", _fmt("kv_capacity", "GPU", f"{tok:,}", f"{1024:,}", tok / 1024))
        if graphs:
            t += _rec(p, 10 + dp, "model_runner.py:1164", _fmt("graph_capture", 1.0, 0.05))  # profiling capture
            t += _rec(p, 10 + dp, "model_runner.py:1164", _fmt("graph_capture", 3.0, 0.52))
    if graphs:  # tqdm on the global first rank: "\r"-separated updates, the profiling bar, then the real one
        t += ("Capturing CUDA graphs (FULL):   0%|          | 0/2 [00:00<?, ?it/s]\rCapturing CUDA graphs (FULL): 100%|"
              "██████████| 2/2 [00:00<00:00, 9.1it/s]\n")
        t += ("Capturing CUDA graphs (FULL):   0%|          | 0/7 [00:00<?, ?it/s]\rCapturing CUDA graphs (FULL):  57%|"
              "█████▋    | 4/7 [00:01<00:00,  3.9it/s]\rCapturing CUDA graphs (FULL): 100%|██████████| 7/7 "
              "[00:01<00:00,  4.0it/s]\n")
    rm = "FULL" if graphs else "NONE"
    t += _rec("APIServer", 1, "loggers.py:344", _cudagraph_table([(1, 1, 0, rm, steps_full), (3, 4, 1, rm, 5),
                                                                   (128, 128, 0, "NONE", 4)], mode=mode))
    t += _rec("APIServer", 1, "loggers.py:344", _cudagraph_table([(1, 1, 0, rm, 10)], mode=mode))
    return t


def test_log_parsing_reads_vllms_own_lines():
    """A misread of vLLM's KV-cache, memory, capture or CUDA-graph-table lines (thousands separators, the
    profiling capture logged before the real one, the prefix repeated on a table's rows, tqdm's carriage returns)
    gave wrong KV capacities or graph counts."""
    p = logs.parse_log(_server_log())
    assert p["kv_tokens"] == {"EngineCore_DP0": 1234567, "EngineCore_DP1": 1234560}
    assert p["kv_max_concurrency"]["EngineCore_DP0"] == pytest.approx(1205.63, abs=0.01)
    assert p["kv_gib"] == {"EngineCore_DP0": 60.25, "EngineCore_DP1": 60.24}
    assert p["model_gib"] == {"EngineCore_DP0": 28.52, "EngineCore_DP1": 28.52}
    assert p["graph_gib"] == {"EngineCore_DP0": 0.52, "EngineCore_DP1": 0.52}, "the last capture, not the profiling one"
    assert p["captured_graphs"] == {"FULL": 7}
    assert p["cudagraph_steps"] == {"FULL": 57 + 5 + 10, "NONE": 4}
    assert p["cudagraph_rows"] == {"FULL": {"1": 67, "4": 5}, "NONE": {"128": 4}}
    assert p["cudagraph_mode"] == {"EngineCore_DP0": "FULL_DECODE_ONLY"}
    assert p["all2all_manager"] == {"EngineCore_DP0": "MoonEPAll2AllManager", "EngineCore_DP1": "MoonEPAll2AllManager"}
    assert p["expert_memory"]["EngineCore_DP1"] == {"weight_layout": "symmetric", "resident_gib": 28.125, "layers": 48,
                                                    "home_gib": 27.0, "replicated_gib": 0.0, "slots_gib": 1.125,
                                                    "transient_gib": 0.563}
    assert {"plugin_load", "plugin_active", "plugin_graphs_kept", "vllm_moonep_eager_switch", "scaled_weights"} <= \
        set(p["plugin"])
    n = logs.parse_log(_server_log(graphs=False, naive=True, plugin=False))
    assert n["naive_removed"] and n["cudagraph_mode"] == {"EngineCore_DP0": "NONE"} and not n["captured_graphs"]
    assert n["cudagraph_steps"] == {"NONE": 76} and "plugin_load" not in n["plugin"]
    assert logs.process_of("\x1b[0;36m(EngineCore_DP1 pid=7)\x1b[0;0m INFO x") == "EngineCore_DP1"
    assert logs.process_of("Capturing CUDA graphs (FULL): 100%") is None


def _vllm_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


def test_the_format_strings_are_vllms():
    """vLLM rewording a line this tool reads would silently empty a column of the A/B (read from the installed
    vLLM's source files, adjacent string literals joined)."""
    vdir = _vllm_dir()
    if vdir is None:
        pytest.skip("vLLM is not installed")
    for name, (rel, fmt) in logs.FORMATS.items():
        src = (vdir.parent / rel).read_text()
        joined = re.sub(r'"\s*\n\s*(?:f)?"', "", src)
        assert fmt in joined, f"{name}: {fmt!r} is not in {rel}"
    cg = (vdir / "compilation" / "cuda_graph.py").read_text()
    assert '"Unpadded Tokens",\n        "Padded Tokens",\n        "Num Paddings",\n        "Runtime Mode",' in cg
    cu = (vdir / "v1" / "worker" / "gpu" / "cudagraph_utils.py").read_text()
    assert 'progress_bar_desc: str = "Capturing CUDA graphs"' in cu and 'desc=f"{progress_bar_desc} ({mode.name})"' in cu
    assert "cudagraph_metrics: bool" in (vdir / "config" / "observability.py").read_text()


@pytest.mark.vllm  # the start-up line asks vLLM's platform for the worker's device
def test_expert_memory_pattern_reads_the_plugins_start_up_line():
    """The plugin's start-up line reworded made every moonep row's 'every worker built the layout' check fail."""
    from vllm_moonep.vllm_plugin.options import MoonEPOptions
    from vllm_moonep.vllm_plugin.startup import summary_line

    for layout in ("replicated", "symmetric"):
        line = summary_line(MoonEPOptions(weight_layout=layout))
        p = logs.parse_log(_rec("EngineCore_DP0", 5, "startup.py:1", line))
        assert p["expert_memory"]["EngineCore_DP0"]["weight_layout"] == layout, line


def _cfg(name):
    return {c.name: c for c in matrix.matrix()}[name]


def test_line_checks_by_configuration():
    """A moonep graphs row whose decode steps never replayed a graph, a vLLM row with the plugin loaded, or a
    moonep row that built another layout must fail its checks instead of being reported as measured."""
    def failed(name, text):
        return [c["check"] for c in logs.line_checks(_cfg(name), logs.parse_log(text), 2) if not c["ok"] and c["strict"]]

    assert failed("moonep-symmetric-graphs", _server_log()) == []
    assert failed("moonep-symmetric-graphs", _server_log().replace("| FULL ", "| NONE ")) == [
        "decode steps replayed captured graphs (vLLM's CUDA-graph metrics: runtime mode FULL)"]
    assert failed("moonep-replicated-graphs", _server_log()) == ["every worker built the replicated layout"]
    assert failed("moonep-symmetric-eager", _server_log(graphs=False)) == []
    assert failed("naive-eager", _server_log(graphs=False, naive=True, plugin=False)) == []
    assert failed("allgather_reducescatter-eager", _server_log(graphs=False)) == [
        "the moonep plugin is off (VLLM_MOONEP_PLUGIN=0)"]
    assert failed("allgather_reducescatter-graphs", _server_log(kv_tokens=(5,), plugin=False)) == [
        "vLLM reported the KV-cache capacity of each of the 2 engines"]
    warn = [c for c in logs.line_checks(_cfg("naive-graphs"), logs.parse_log(_server_log(plugin=False)), 2) if not c["ok"]]
    assert [c["check"] for c in warn] == ["vLLM 0.33 fell back from 'naive' to 'allgather_reducescatter'"]
    assert not warn[0]["strict"]


# ----------------------------------------------------------------------------------- distances
def _outputs(lps, top=None, greedy=None, digest="d"):
    return {"prompts_digest": digest, "prompt_logprobs": lps, "prompt_top1": top or [[None] * len(x) for x in lps],
            "greedy": greedy}


def test_logprob_distance_on_synthetic_logprobs():
    """The distance must be per token over every position (position 0 has none), and refuse different prompts."""
    ref = _outputs([[None, -1.0, -2.0], [None, -0.5]], [[None, 5, 6], [None, 7]])
    got = _outputs([[None, -1.1, -2.0], [None, -0.25]], [[None, 5, 9], [None, 7]])
    d = compare.logprob_distance(ref, got)
    assert d["compared"] and d["tokens"] == 3 and d["worst"] == [1, 1]
    assert d["max_abs"] == pytest.approx(0.25) and d["mean_abs"] == pytest.approx((0.1 + 0.0 + 0.25) / 3)
    assert d["top1_agreement"] == pytest.approx(2 / 3)
    same = compare.logprob_distance(ref, ref)
    assert same["max_abs"] == 0.0 and same["mean_abs"] == 0.0 and same["top1_agreement"] == 1.0
    assert not compare.logprob_distance(ref, _outputs(got["prompt_logprobs"], digest="other"))["compared"]
    assert not compare.logprob_distance(ref, _outputs([[None, -1.0], [None, -0.5]]))["compared"]
    assert not compare.logprob_distance(ref, {})["compared"]


def test_greedy_distance_compares_only_the_common_prefixes():
    """Logprobs of different tokens (after greedy paths part) are not a distance; identical sequences and the
    first mismatch must be reported."""
    g_ref = [{"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]}, {"token_ids": [4, 5], "logprobs": [-1.0, -1.0]}]
    g_got = [{"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.25, -0.3]}, {"token_ids": [4, 6], "logprobs": [-1.5, -9.0]}]
    d = compare.greedy_distance(_outputs([], greedy=g_ref), _outputs([], greedy=g_got))
    assert d["identical"] == 1 and d["common_prefix"] == [3, 1] and d["first_mismatch"] == [1, 1, 5, 6]
    assert d["tokens_compared"] == 4 and d["max_abs"] == pytest.approx(0.5)
    assert d["mean_abs"] == pytest.approx((0 + 0.05 + 0 + 0.5) / 4)
    assert not compare.greedy_distance(_outputs([], greedy=g_ref), _outputs([], greedy=g_got[:1]))["compared"]


def test_within_the_noise_floor():
    """A moonep row farther from the reference than naive is (in max or in mean) must not pass the outputs target."""
    floor = {"compared": True, "max_abs": 0.2, "mean_abs": 0.01}
    assert compare.within_floor({"compared": True, "max_abs": 0.2, "mean_abs": 0.01}, floor) is True
    assert compare.within_floor({"compared": True, "max_abs": 0.21, "mean_abs": 0.001}, floor) is False
    assert compare.within_floor({"compared": True, "max_abs": 0.1, "mean_abs": 0.02}, floor) is False
    zero = {"compared": True, "max_abs": 0.0, "mean_abs": 0.0}
    assert compare.within_floor(zero, zero) is True
    assert compare.within_floor({"compared": False}, floor) is None and compare.within_floor(zero, None) is None


def test_prompt_logprobs_of_a_vllm_reply():
    """vLLM serializes prompt_logprobs as {token id as a string: {logprob, rank, decoded_token}} with None first;
    a misread took another token's logprob."""
    prompt = [11, 12, 13]
    choice = {"prompt_logprobs": [None, {"12": {"logprob": -3.5, "rank": 4, "decoded_token": "w12"},
                                         "99": {"logprob": -0.1, "rank": 1, "decoded_token": "w99"}},
                                  {"13": {"logprob": -0.2, "rank": 1, "decoded_token": "w13"}}]}
    assert compare.prompt_logprobs_of(prompt, choice) == ([None, -3.5, -0.2], [None, 99, 13])
    with pytest.raises(ValueError, match="cover 2 positions of a 3-token prompt"):
        compare.prompt_logprobs_of(prompt, {"prompt_logprobs": choice["prompt_logprobs"][:2]})
    with pytest.raises(ValueError, match="prompt token 13 is not among"):
        compare.prompt_logprobs_of([11, 12, 13], {"prompt_logprobs": [None, choice["prompt_logprobs"][1],
                                                                      {"7": {"logprob": -1, "rank": 1}}]})
    assert compare.greedy_of({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -0.25]}}) == {
        "token_ids": [5, 6], "logprobs": [-0.5, -0.25]}
    with pytest.raises(ValueError):
        compare.greedy_of({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5]}})


# ------------------------------------------------------------------------------------- client
def test_arrivals_and_percentiles():
    """Poisson arrivals must be reproducible from the seed (the same load for every configuration) and p99 the
    interpolated order statistic."""
    a = client.arrivals(2000, 10.0, 3)
    assert a == client.arrivals(2000, 10.0, 3) != client.arrivals(2000, 10.0, 4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    assert client.arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        client.arrivals(3, 0.0, 0)
    import numpy as np

    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.5]
    for q in (0, 50, 90, 99, 100):
        assert client.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert client.percentile([], 50) is None


class _Stream(BaseHTTPRequestHandler):
    """A completions endpoint that streams one token per server-sent event, chunked, 20 ms apart."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status: int, data: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        try:
            self._post()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
            pass

    def _post(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == [0]:
            return self._send(500, b'{"error": "bad prompt"}')
        if not body.get("stream"):
            return self._send(200, json.dumps({"choices": [{"token_ids": [1, 2]}]}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(b: bytes):
            self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            self.wfile.flush()

        first = {"choices": [{"text": "", "token_ids": [], "prompt_token_ids": body["prompt"]}]}
        chunk(b"data: " + json.dumps(first).encode() + b"\n\n")  # no token yet: not the first token
        n = body["max_tokens"] if body["prompt"] != [1] else body["max_tokens"] - 1
        for i in range(n):
            time.sleep(0.02)
            chunk(b"data: " + json.dumps({"choices": [{"text": f" w{i}", "token_ids": [i]}]}).encode() + b"\n\n")
        chunk(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode() + b"\n\n")
        if body["prompt"] != [2]:
            chunk(b"data: [DONE]\n\n")
        chunk(b"")


@pytest.fixture
def stream_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_client_times_a_streamed_load(stream_server):
    """TTFT counted from a chunk without tokens, ITLs not one per token, a failed request or a stream cut before
    [DONE] counted as served: each misstated the latency columns."""
    bodies = [run._stream_body([7, 8], 5), run._stream_body([9], 5), run._stream_body([0], 5),
              run._stream_body([1], 5), run._stream_body([2], 5)]
    results, wall = asyncio.run(client.run_load(stream_server, bodies, [0.0, 0.05, 0.0, 0.0, 0.0], 30.0))
    ok = results[:2]
    assert all(r["ok"] and r["output_tokens"] == 5 and len(r["itl"]) == 4 for r in ok), ok
    assert all(r["ttft"] >= 0.018 and min(r["itl"]) >= 0.015 for r in ok)
    assert not results[2]["ok"] and "HTTP 500" in results[2]["error"] and "bad prompt" in results[2]["error"]
    assert results[3]["ok"] and results[3]["output_tokens"] == 4
    assert not results[4]["ok"] and "without [DONE]" in results[4]["error"]
    st = client.load_stats(results, wall)
    assert st["requests"] == 5 and st["completed"] == 3 and st["failed"] == 2 and st["output_tokens"] == 5 + 5 + 4 + 5
    assert st["itl_ms"]["p50"] >= 15 and st["ttft_ms"]["p99"] >= st["ttft_ms"]["p50"] and st["output_tok_s"] > 0
    assert asyncio.run(client.post_json(stream_server, "/v1/completions", {"prompt": [3], "max_tokens": 2})) == {
        "choices": [{"token_ids": [1, 2]}]}
    with pytest.raises(client.HTTPStatusError, match="HTTP 500"):
        asyncio.run(client.post_json(stream_server, "/v1/completions", {"prompt": [0]}))
    cut, _ = asyncio.run(client.run_load(stream_server, [run._stream_body([7], 200)], [0.0], 0.3))
    assert not cut[0]["ok"] and "no reply within" in cut[0]["error"]


# ------------------------------------------------------------------------------------- summary
def _row(name, status="ok", burst=1000.0, kv_gib=(60.0, 60.0), kv_tok=(1_000_000, 1_000_000), lp=None, greedy=None,
         itl=10.0, steps=None):
    b, mode = name.rsplit("-", 1)
    lp = lp if lp is not None else [[None, -1.0, -2.0]]
    greedy = greedy if greedy is not None else [{"token_ids": [1, 2], "logprobs": [-0.5, -0.5]}]
    st = {"output_tok_s": burst, "ttft_ms": {"p50": 50.0, "p99": 90.0}, "itl_ms": {"p50": itl, "p99": 2 * itl}}
    return {"tool": "serve_ab", "config": name, "backend": b, "mode": mode, "status": status, "finished": "2026",
            "model": {"layers": 48, "param_gb": 61.06}, "model_config": vmc.model_config(48),
            "workload": {"rates": [4.0, 16.0], "output_prompts": 1}, "error": None if status == "ok" else "boom",
            "projection": {"slots": 4, "replicated": 90 * 2**30, "symmetric": 30 * 2**30, "symmetric_shared": 28 * 2**30},
            "outputs": _outputs(lp, greedy=greedy), "throughput": {"burst": st, "rates": {"4.0": st, "16.0": st}},
            "memory": {"kv_gib": {"EngineCore_DP0": kv_gib[0], "EngineCore_DP1": kv_gib[1]},
                       "kv_tokens": {"EngineCore_DP0": kv_tok[0], "EngineCore_DP1": kv_tok[1]}},
            "log": {"cudagraph_steps": steps or {"FULL" if mode == "graphs" else "NONE": 100}}, "checks": []}


def test_summary_tables_and_targets():
    """The summary must judge each moonep row against naive's noise floor of the same mode, compare the
    symmetric KV gain with moonep-ab project's prediction, apply the throughput target to symmetric with graphs,
    and list a row that failed with its error."""
    rows = {n: _row(n) for n in matrix.config_names()}
    rows["naive-graphs"] = _row("naive-graphs", lp=[[None, -1.1, -2.0]])  # floor: max 0.1, mean 0.05
    rows["moonep-symmetric-graphs"] = _row("moonep-symmetric-graphs", burst=1100.0, kv_gib=(120.0, 119.0),
                                           kv_tok=(2_000_000, 2_000_000), lp=[[None, -1.05, -2.0]])
    rows["moonep-replicated-graphs"] = _row("moonep-replicated-graphs", lp=[[None, -1.2, -2.0]])
    rows["moonep-symmetric-shared-graphs"] = {**_row("moonep-symmetric-shared-graphs", status="not_applicable"),
                                              "not_applicable": "the plugin keeps this configuration eager (x)"}
    rows["naive-eager"] = _row("naive-eager", status="failed")
    rows["allgather_reducescatter-eager"] = _row("allgather_reducescatter-eager", itl=40.0)
    text, v = report.summarize(rows)
    assert v["floors"]["graphs"]["prompt_logprobs"]["max_abs"] == pytest.approx(0.1)
    assert v["outputs"]["moonep-symmetric-graphs"]["within_floor"] is True
    assert v["outputs"]["moonep-replicated-graphs"]["within_floor"] is False
    assert v["outputs"]["moonep-symmetric-eager"]["within_floor"] is None, "no floor: naive-eager failed"
    assert v["targets"]["outputs_within_noise_floor"] is False
    assert v["throughput"]["moonep-symmetric-graphs"]["vs_reference"] == pytest.approx(1.1)
    assert v["targets"]["throughput_target"] is True and v["targets"]["throughput_stretch"] is False
    g = v["memory"]["symmetric-graphs"]
    assert g["measured_gib"] == pytest.approx(59.5) and g["predicted_gib"] == pytest.approx(60.0)
    assert g["within"] is True and g["extra_tokens"] == 1_000_000
    assert g["measured_gib_from_tokens"] == pytest.approx(1e6 * report.kv_bytes_per_token(vmc.model_config(48)) / 2**30)
    assert report.kv_bytes_per_token(vmc.model_config(48)) == 2 * 48 * 4 * 128 * 2
    assert v["memory"]["symmetric-shared-graphs"]["why"] == "the replicated or symmetric row did not run"
    assert v["graphs"]["allgather_reducescatter"]["itl_p50_eager_ms"] == 40.0
    assert "| moonep-replicated-graphs | 2.00e-01 | 1.00e-01 |" in text and "| NO |" in text
    assert "| naive-eager | failed | boom |" in text
    assert "| moonep-symmetric-shared-graphs | not_applicable | the plugin keeps this configuration eager (x) |" in text
    assert "| allgather_reducescatter | - | FULL" not in text  # no cudagraph_mode line in these rows
    assert "measured/predicted 0.992" in text


def test_summary_command_reads_rows_of_several_folders(tmp_path, capsys):
    """The rows of several device calls (one folder each) must merge, the latest row of a configuration winning."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    old = {**_row("allgather_reducescatter-graphs", status="failed"), "finished": "2026-01-01"}
    new = {**_row("allgather_reducescatter-graphs"), "finished": "2026-01-02"}
    (a / "allgather_reducescatter-graphs.json").write_text(json.dumps(old))
    (b / "allgather_reducescatter-graphs.json").write_text(json.dumps(new))
    (b / "moonep-symmetric-graphs.json").write_text(json.dumps(_row("moonep-symmetric-graphs")))
    (b / "other.json").write_text(json.dumps({"tool": "moonep-ab"}))
    assert set(report.load_rows([a, b])) == {"allgather_reducescatter-graphs", "moonep-symmetric-graphs"}
    assert report.load_rows([a, b])["allgather_reducescatter-graphs"]["status"] == "ok"
    rc = run.main(["summary", str(a), str(b), "--write", str(tmp_path / "s.md"), "--json", str(tmp_path / "v.json")])
    assert rc == 0 and "## Throughput and latency" in (tmp_path / "s.md").read_text()
    assert json.loads((tmp_path / "v.json").read_text())["throughput"]["moonep-symmetric-graphs"]["vs_reference"] == 1.0
    assert run.main(["summary", str(tmp_path / "none")]) == 2


def test_bad_flags_are_refused(tmp_path):
    for bad in (["--rates", "0"], ["--output-prompt-len", "1", "5"], ["--gpu-mem", "1.5"], ["--greedy-tokens", "0"],
                ["--input-len", "900", "--output-len", "200"], ["--env", "NOEQUALS"]):
        with pytest.raises(SystemExit):
            run.main(["run", "--out", str(tmp_path), *bad])
    assert run.main(["run", "--out", str(tmp_path), "--configs", "moonep-sym", "--model-dir", str(tmp_path / "m"),
                     "--layers", "1"]) == 2


# ------------------------------------------------------------------------------ whole calls
_FAKE_SERVE = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
opt = lambda k, d=None: argv[argv.index(k) + 1] if k in argv else d
port, backend = int(opt("--port")), opt("--all2all-backend")
moonep = json.loads(opt("--additional-config", '{"moonep": null}'))["moonep"]
graphs, plugin = "--enforce-eager" not in argv, os.environ.get("VLLM_MOONEP_PLUGIN", "1") != "0"
if os.environ.get("FAKE_PID_FILE"):
    open(os.environ["FAKE_PID_FILE"], "w").write(str(os.getpid()))
if os.environ.get("FAKE_HANG_START"):  # an engine core that never gets ready
    import subprocess
    subprocess.Popen(["sleep", "120"])
    time.sleep(120)
if os.environ.get("FAKE_FAIL_START") and backend == "moonep":
    print("Traceback (most recent call last):\n  File x\nRuntimeError: symmetric heap: out of memory", flush=True)
    sys.exit(1)
layout = (moonep or {}).get("weight_layout", "replicated")
def rec(proc, msg):
    p = f"({proc} pid=1) INFO 12-02 10:00:00 [x.py:1] "
    print(p + msg.replace("\n", "\r\n" + p), flush=True)
if backend == "naive":
    rec("APIServer", "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.")
if plugin:
    print("vllm-moonep 0.1.0 hooked vLLM 0.33.0 (12 seams: a); --all2all-backend moonep builds vllm-moonep's classes")
    print("vllm-moonep: --all2all-backend moonep for Qwen3MoeForCausalLM; options: x")
    if graphs:
        print("MoonEP: Disabling CUDA Graphs since the MoonEP integration is currently eager-only")
        print("MoonEP: CUDA graphs kept (symmetric transport, one node): cudagraph_mode=FULL_DECODE_ONLY, 7 capture")
print("vllm_model_check: scaled dummy weights: 5 tensors (2 expert tensors, per global expert id)")
rec("EngineCore_DP0", "Initializing a V1 LLM engine (v0.33.0) with config: compilation_config={'cudagraph_mode': "
    f"<CUDAGraphMode.{'FULL_DECODE_ONLY' if graphs else 'NONE'}: (2, 0)>}}")
kv = {"replicated": 30.0, "symmetric": 90.0}.get(layout, 60.0) if moonep else 60.0
for dp in (0, 1):
    e = f"EngineCore_DP{dp}"
    if plugin:
        rec(e, f"vllm-moonep: weight_layout={layout}, engine=builtin (x), slots=4 per layer; per-rank expert memory "
               "28.125 GiB resident over 48 MoE layer(s) (home 27.000, replicated 0.000, slots 1.125; load-time "
               "transient 0.563)")
    rec(e, "Available KV cache memory: %s GiB" % kv)
    rec(e, "GPU KV cache size: %s tokens, Maximum concurrency for 1,024 tokens per request: 10.00x" % f"{int(kv * 10000):,}")
    if graphs:
        rec(e, "Graph capturing finished in 2 secs, took 0.10 GiB")
if graphs:
    print("Capturing CUDA graphs (FULL): 100%|##########| 7/7 [00:01<00:00,  4.0it/s]", flush=True)
shift = {"naive": 0.01, "moonep": 0.02}.get(backend, 0.0)
steps = {"n": 0}
lock = threading.Lock()
def table():
    while True:
        time.sleep(0.2)
        with lock:
            n, steps["n"] = steps["n"], 0
        if n:
            mode = "FULL" if graphs else "NONE"
            rec("APIServer", "**CUDAGraph Stats:**\n\n| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | "
                f"Count |\n|---|---|---|---|---|\n| 1 | 1 | 0 | {mode} | {n} |")
threading.Thread(target=table, daemon=True).start()
time.sleep(0.3)

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        p, n = body["prompt"], body["max_tokens"]
        assert body["model"] == "moonep-check" and body["temperature"] == 0.0
        with lock:
            steps["n"] += n
        ids = [(sum(p) * 7 + i) % 151643 for i in range(n)]
        if body.get("stream"):
            self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            for i in ids + ["[DONE]"]:
                ev = b"data: " + (b"[DONE]" if i == "[DONE]" else json.dumps({"choices": [{"text": f" w{i}", "token_ids": [i]}]}).encode()) + b"\n\n"
                self.wfile.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n"); self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()
            return
        ch = {"text": " ".join(f"w{i}" for i in ids), "token_ids": ids}
        if body.get("prompt_logprobs") is not None:
            ch["prompt_logprobs"] = [None] + [{str(t): {"logprob": -((t % 97) / 10.0) - shift, "rank": 2},
                                              str(t + 1): {"logprob": -0.01, "rank": 1}} for t in p[1:]]
        if body.get("logprobs") is not None:
            ch["logprobs"] = {"token_logprobs": [-0.5 - shift] * n, "tokens": [f"w{i}" for i in ids], "top_logprobs": []}
        data = json.dumps({"choices": [ch], "usage": {"completion_tokens": n}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

_SMALL = ["--layers", "1", "--output-prompts", "2", "--output-prompt-len", "4", "6", "--greedy-tokens", "3",
          "--input-len", "8", "--output-len", "4", "--burst-requests", "3", "--rate-requests", "3", "--rates", "40", "80",
          "--stats-interval", "0.3", "--start-timeout", "30", "--workload-timeout", "60"]


@pytest.fixture
def fake_call(tmp_path, monkeypatch):
    fake = tmp_path / "fake_serve.py"
    fake.write_text(_FAKE_SERVE)
    monkeypatch.setattr(vmc, "preflight", lambda need_serve: {
        "python": "3.12", "missing_llm": [], "missing_serve": [], "vllm_version": "0.33.0", "torch_version": "2.11",
        "gpus": ["NVIDIA H200, 143771 MiB", "NVIDIA H200, 143771 MiB"], "moonep_entry_point": True})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "out"

    def call(*extra: str) -> int:
        return run.main(["run", "--out", str(out), "--model-dir", str(tmp_path / "m"), "--serve-cmd", str(fake),
                         *_SMALL, *extra])

    return call, out


def test_a_call_against_a_stand_in_server(fake_call, capsys):
    """The whole call (servers started and stopped, outputs, burst, rates, log figures, rows, summary) against a
    stand-in for vllm serve: a row per configuration, the naive floor, moonep's distance above it, the symmetric
    KV gain, every check passing."""
    call, out = fake_call
    rc = call("--configs", "allgather_reducescatter-graphs", "naive-graphs", "moonep-replicated-graphs",
              "moonep-symmetric-graphs", "moonep-symmetric-shared-graphs")
    text = capsys.readouterr().out
    rows = report.load_rows([out])
    assert set(rows) == {"allgather_reducescatter-graphs", "naive-graphs", "moonep-replicated-graphs",
                         "moonep-symmetric-graphs", "moonep-symmetric-shared-graphs"}
    ran = {n: r for n, r in rows.items() if r["status"] != "not_applicable"}
    assert all(r["status"] == "ok" for r in ran.values()), {n: (r["status"], r.get("error")) for n, r in ran.items()}
    bad = {n: [c["check"] for c in r["checks"] if not c["ok"] and c["strict"]] for n, r in ran.items()}
    assert not any(bad.values()), bad
    assert rc == 0, text[-3000:]
    sym = rows["moonep-symmetric-graphs"]
    assert sym["memory"]["kv_gib"] == {"EngineCore_DP0": 90.0, "EngineCore_DP1": 90.0}
    assert sym["log"]["captured_graphs"] == {"FULL": 7} and sym["log"]["cudagraph_steps"]["FULL"] > 0
    assert sym["throughput"]["burst"]["completed"] == 3 and set(sym["throughput"]["rates"]) == {"40.0", "80.0"}
    assert sym["env_diff"].get("VLLM_MOONEP_PLUGIN") is None and rows["naive-graphs"]["env_diff"]["VLLM_MOONEP_PLUGIN"] == "0"
    assert sym["projection"]["replicated"] > sym["projection"]["symmetric"] > 0
    _, v = report.summarize(rows)
    assert v["floors"]["graphs"]["prompt_logprobs"]["max_abs"] == pytest.approx(0.01)
    assert v["outputs"]["moonep-symmetric-graphs"]["prompt_logprobs"]["max_abs"] == pytest.approx(0.02)
    assert v["outputs"]["moonep-symmetric-graphs"]["within_floor"] is False
    assert v["memory"]["symmetric-graphs"]["measured_gib"] == pytest.approx(60.0)
    assert (out / "summary.md").read_text().startswith("# Serving A/B")
    assert sorted(p.name for p in (out / "logs").iterdir()) == sorted(f"{n}.log" for n in ran)


def test_failed_start_is_a_row_and_the_budget_leaves_the_rest_for_the_next_call(fake_call, monkeypatch, capsys):
    """A configuration that fails to start must be a row with its error (not a missing row); one that does not fit
    the budget must be left for the next call (exit 3), which must not run the rows already there again."""
    call, out = fake_call
    monkeypatch.setenv("FAKE_FAIL_START", "1")
    assert call("--configs", "moonep-symmetric-eager") == 1
    f = report.load_rows([out])["moonep-symmetric-eager"]
    assert f["status"] == "failed" and f["error"].startswith("the server did not start: no /health 200 (server exited")
    assert f["first_error"] == "RuntimeError: symmetric heap: out of memory" and f["log_tail"]
    monkeypatch.delenv("FAKE_FAIL_START")
    configs = ["--configs", "moonep-symmetric-eager", "allgather_reducescatter-eager", "naive-eager"]
    capsys.readouterr()
    assert call(*configs, "--budget", "20", "--config-estimate-s", "100") == 3
    text = capsys.readouterr().out
    assert "moonep-symmetric-eager: already in" in text
    assert "left for the next call (budget): allgather_reducescatter-eager, naive-eager" in text
    assert set(report.load_rows([out])) == {"moonep-symmetric-eager"}
    summary = (out / "summary.md").read_text()
    assert "| moonep-symmetric-eager | failed | the server did not start" in summary
    assert "| naive-eager | not run yet |" in summary
    assert call(*configs) == 0
    rows = report.load_rows([out])
    assert rows["moonep-symmetric-eager"]["status"] == "failed", "a finished row is not run again without --rerun"
    assert rows["allgather_reducescatter-eager"]["status"] == "ok" and rows["naive-eager"]["status"] == "ok"


def test_sigterm_stops_the_running_server_before_leaving(fake_call, tmp_path, monkeypatch):
    """The device script's time bound (SIGTERM to the tool) left a vLLM server and its engine cores holding both
    GPUs for the next call."""
    from vllm_moonep.tools.vllm_server import _group_alive

    call, out = fake_call
    pid_file = tmp_path / "server.pid"
    monkeypatch.setenv("FAKE_PID_FILE", str(pid_file))
    monkeypatch.setenv("FAKE_HANG_START", "1")
    old = signal.getsignal(signal.SIGTERM)

    def term_once_started():
        end = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    th = threading.Thread(target=term_once_started, daemon=True)
    th.start()
    try:
        with pytest.raises(SystemExit) as e:
            call("--configs", "allgather_reducescatter-graphs")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert e.value.code == 128 + signal.SIGTERM
    pid = int(pid_file.read_text())
    assert not _group_alive(pid), "the server's process group (with its child) must be gone"
    assert not list(out.glob("*.json")), "an interrupted configuration has no row: the next call runs it"


def test_dry_run_prints_every_command(fake_call, capsys):
    call, out = fake_call
    assert call("--dry-run") == 0
    text = capsys.readouterr().out
    assert text.count("vllm serve ") == 9 and "moonep-symmetric-shared-graphs: a row without a run" in text
    assert not list(out.glob("*.json"))


# ----------------------------------------------------------------------- through vLLM's own code
_CONFIG_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["REPO_ROOT"])
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser  # what `vllm serve` parses with
from vllm.utils.argparse_utils import FlexibleArgumentParser
from tests.vllm.workers import graph_capable_platform
out = {}
with graph_capable_platform():
    for name, (argv, plugin) in json.loads(os.environ["ARGVS"]).items():
        os.environ["VLLM_MOONEP_PLUGIN"] = "1" if plugin else "0"
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        cfg = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
        pc, cc = cfg.parallel_config, cfg.compilation_config
        out[name] = {"all2all": pc.all2all_backend, "dp": pc.data_parallel_size, "ep": pc.enable_expert_parallel,
                     "mode": cc.cudagraph_mode.name, "metrics": cfg.observability_config.cudagraph_metrics,
                     "api_servers": ns.api_server_count, "extra": cfg.additional_config}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
def test_vllm_builds_every_configurations_engine_config(tmp_path):
    """Each configuration's exact `vllm serve` arguments through vLLM 0.33's serve parser and config build: an
    argument vLLM does not take, naive not resolving to allgather_reducescatter, or a moonep graphs row that vLLM
    would run eager would each have cost a two-GPU run to find out."""
    model = tmp_path / "m"
    vmc.write_model_dir(model, layers=1)
    argvs = {c.name: ([x if x != "/m" else str(model) for x in _argv(c, max_num_seqs=8)], c.backend.plugin)
             for c in matrix.matrix() if not c.not_applicable}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "ARGVS": json.dumps(argvs), "REPO_ROOT": str(ROOT),
           "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", _CONFIG_PROBE], capture_output=True, text=True, env=env, timeout=900)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    for name, r in got.items():
        c = _cfg(name)
        assert r["dp"] == 2 and r["ep"] and r["metrics"] and r["api_servers"] == 1, (name, r)
        assert r["all2all"] == ("allgather_reducescatter" if c.backend.all2all == "naive" else c.backend.all2all), (name, r)
        assert (r["mode"] == "NONE") == (c.mode == "eager"), (name, r)
        assert (r["extra"] or {}).get("moonep") == c.moonep, (name, r)
