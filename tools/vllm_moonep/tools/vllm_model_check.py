"""A real MoE model through vLLM with the plugin installed: ``vllm.LLM`` and ``vllm serve``, eager and
with CUDA graphs, each with the plugin and with ``VLLM_MOONEP_PLUGIN=0``; same greedy tokens, the
plugin's log lines, tokens/s.

The model is Qwen3-30B-A3B's architecture with its public config values (``--layers N`` keeps the
first N of its 48 layers), ``load_format="dummy"`` weights, and a local word-level tokenizer that
covers all 151936 ids (token ``i`` is the word ``w<i>``; Qwen's three special tokens keep their ids),
so every id the model emits decodes to a word and a text maps back to its ids.

Every engine start is a fresh subprocess (its own process group, killed at the end) with a timeout;
a total ``--budget`` bounds the whole run (a run that no longer fits is skipped, and the check then
fails as incomplete; after a run that failed at an import the others are skipped). Each run's
combined stdout/stderr goes to ``<logs>/<run>.log`` (``--logs``, default ``--out``);
``<out>/results.json`` (``--json``) holds everything (engine arguments, environment, tokens, timings,
the log lines found, a failed run's first error and log tail, every check) and ``<out>/summary.txt``
the printed summary. Exit status: 0 when every check passed, 1 when one failed (a token mismatch, a
missing or forbidden log line, a run that failed, timed out or was skipped), 2 for a set-up error
found before any engine started (a module missing). ``check`` is the default command:
``python -m vllm_moonep.tools.vllm_model_check --out DIR`` runs everything; ``write`` only writes
the model directory.

Weights (``--weights``): vLLM's dummy loader fills every tensor with U(-1e-3, 1e-3) from the same seed
(1234), so all layers are equal, the attention branch adds about 1e-3 of the residual stream (near
bf16's resolution) and the MoE branch about 1e-8 (its two 1e-3-scale matmuls after a 1e-3-scale
norm): in bf16 the MoE's output rounds away, the logits follow the current token's embedding, and
greedy tokens would say nothing about the MoE. ``scaled`` (the default) keeps ``load_format="dummy"``
but, through a second general plugin this tool registers for its own runs
(``register_check_plugin``), re-fills each floating parameter after vLLM's dummy fill with
U(-a, a), a = sqrt(3 / fan_in) (fan_in = the last dimension), seeded by the parameter's full name
(and, for expert weights, the global expert id, so an EP rank holds the same expert rows as one GPU
does); 1-D parameters (norm weights) become 1. Every branch then contributes at O(1) and the
logits (std about 1) follow the MoE. ``vllm`` keeps vLLM's fill.

What runs (defaults; every run with ``--enable-expert-parallel --all2all-backend moonep`` at
``--dp 1``, where vLLM uses no all2all backend and the plugin says why MoonEP is inactive):

- ``llm-eager-noplugin``, ``llm-eager-plugin``, ``llm-graphs-noplugin``, ``llm-graphs-plugin``:
  ``vllm.LLM`` (``LLM.from_engine_args`` over vLLM's own CLI parser, the same arguments as serve),
  greedy tokens of ``--prompts`` prompts given as token ids, then tokens/s at each ``--bench-batch``;
- ``serve-graphs-plugin``: ``python -m vllm.entrypoints.cli.main serve`` (what the ``vllm`` console
  script runs) on 127.0.0.1, ``/health`` polled, one ``POST /v1/completions`` with token ids, its
  tokens compared with the batch-1 offline run of the same mode, then the server's process group
  is terminated;
- ``llm-<mode>-noplugin-2`` (after the others, only where needed): the baseline below.

Baseline of vLLM's own run-to-run spread (``--baseline-runs``, default 1): with unit-scale weights
the logits of 48 layers are near-tied, and vLLM's CUDA-graph runs are not deterministic run to run
(on an H200 a second ``llm-graphs-noplugin`` run differed from the first exactly as the plugin run
did, and matched the plugin run token for token), so one plugin/no-plugin comparison cannot tell
the plugin's effect from vLLM's spread. When a mode's comparison (greedy tokens, or a tokens/s
batch's digest) differs, the no-plugin run runs once more (same arguments and environment, its own
log, within ``--budget``: not started if less than ``--min-run-s`` is left). Each sequence set then
passes when the plugin's tokens equal either no-plugin run's (vLLM's spread); it fails when the two
no-plugin runs agree and the plugin's differ (the plugin changes the tokens), when the plugin's
equal neither (which vLLM's spread alone has produced: three graph runs, three token sets), or when
the baseline did not run (the check says why); read a failed graph comparison beside the eager one,
whose tokens have matched exactly. ``--env VLLM_BATCH_INVARIANT=1`` makes the graph runs exact (vLLM's
kernels then do not follow how its engine composes a batch; every graph run's tokens matched on an H100,
at about 0.5-0.7x the tokens/s: docs/TESTING.md, "Greedy tokens"). ``results.json`` keeps the
per-mode verdicts under ``baseline``; the comparison checks add ``verdict``, ``why`` and ``baseline``.
The run without the plugin goes first (``--plugin``'s default order): a machine's first graph run
pays its first compilations (its timings read slow) and has been the odd one as often as any other
(docs/TESTING.md, "Greedy tokens"); with this order neither the plugin's run nor the baseline is a
first run.

CUDA graphs without torch.compile (``--compile-mode NONE --graph-mode FULL_DECODE_ONLY``, the
default): vLLM 0.33 captures FULL graphs of the whole forward without Dynamo/Inductor (piecewise
graphs need ``VLLM_COMPILE``: vLLM lowers PIECEWISE to NONE and FULL_AND_PIECEWISE to
FULL_DECODE_ONLY without it), so a graph run costs only the captures of ``--capture-sizes``, and
no torch.compile runs on a torch other than the one vLLM pins. ``--compile-mode VLLM_COMPILE
--graph-mode FULL_AND_PIECEWISE`` is vLLM's own default.

Data parallelism (next step): ``--dp 2`` (serve: ``--data-parallel-size 2``; llm: vLLM's offline
SPMD mode, one process per DP rank with ``VLLM_DP_*``, prompts split over the ranks), with
``--plugin on`` and e.g. ``--compare-backend allgather_reducescatter`` to compare MoonEP's tokens
with vLLM's own EP backend on the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_moonep.testing.models import model as model_shape
from vllm_moonep.tools.vllm_server import (SERVED_NAME, SERVE_CMD, ServerProcess, _group_alive, free_port,  # noqa: F401
                                            kill_group, serve_command)

__all__ = ["QWEN3_30B_A3B", "baseline_verdict", "build_parser", "compare_tokens", "engine_argv", "expected_lines",
           "main", "make_prompts", "register_check_plugin", "scan_log", "text_to_ids", "token_text", "write_model_dir"]

# ------------------------------------------------------------------------------------------ model
#: the routed-expert shape every tool measures at (``vllm_moonep.testing.models``); every layer of
#: Qwen3-30B-A3B is a MoE layer, so its MoE layers are its hidden layers
_SHAPE = model_shape("qwen3-30b-a3b")
#: Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B, public values), the keys vLLM 0.33's
#: qwen3_moe.py and transformers' Qwen3MoeConfig read; the MoE sizes from ``_SHAPE``
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": _SHAPE.H,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": _SHAPE.moe_layers,
    "mlp_only_layers": [],
    "moe_intermediate_size": _SHAPE.I,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": _SHAPE.E,
    "num_experts_per_tok": _SHAPE.K,
    "num_hidden_layers": _SHAPE.moe_layers,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # as in the public config; transformers 5 warns of a "Mistral regex" for a local tokenizer whose
    # config.json names no transformers version
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
#: Qwen's special tokens, at their ids
SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
#: ids prompts draw from (below the special tokens)
PROMPT_VOCAB = 151643


def token_text(i: int) -> str:
    """The tokenizer's token for id ``i``: ``w<i>``, or Qwen's special token at its id."""
    return SPECIAL_TOKENS.get(i, f"w{i}")


def text_to_ids(text: str) -> list[int]:
    """The ids of a text the check tokenizer wrote (words ``w<i>`` and special tokens, whitespace
    separated); raises ValueError on anything else."""
    inv = {v: k for k, v in SPECIAL_TOKENS.items()}
    out = []
    for word in text.split():
        if word in inv:
            out.append(inv[word])
        elif re.fullmatch(r"w\d+", word):
            out.append(int(word[1:]))
        else:
            raise ValueError(f"{word!r} is not a token of the check tokenizer")
    return out


def without_specials(ids: list[int]) -> list[int]:
    """``ids`` without Qwen's special tokens (what a detokenized text keeps: special tokens are skipped)."""
    return [i for i in ids if i not in SPECIAL_TOKENS]


def model_config(layers: int | None = None) -> dict[str, Any]:
    """Qwen3-30B-A3B's config, with its first ``layers`` decoder layers (None: all 48)."""
    cfg = json.loads(json.dumps(QWEN3_30B_A3B))
    if layers is not None:
        if not 1 <= layers <= QWEN3_30B_A3B["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {QWEN3_30B_A3B['num_hidden_layers']}], got {layers}")
        cfg["num_hidden_layers"] = layers
        cfg["max_window_layers"] = layers
    return cfg


def param_bytes(cfg: dict[str, Any]) -> int:
    """bf16 bytes of the model's parameters (what ``load_format="dummy"`` allocates)."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    attn = H * (q + 2 * kv) + q * H + 2 * cfg["head_dim"]
    moe = cfg["num_experts"] * 3 * H * cfg["moe_intermediate_size"] + cfg["num_experts"] * H
    per_layer = attn + moe + 2 * H
    return 2 * (L * per_layer + 2 * V * H + H)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json (a ``tokenizers`` WordLevel model over ``vocab_size`` words, whitespace
    pre-tokenizer, Qwen's special tokens as added tokens), tokenizer_config.json and
    special_tokens_map.json, loadable offline by transformers' AutoTokenizer (4.x and 5.x)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {token_text(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[151643]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [s for i, s in sorted(SPECIAL_TOKENS.items()) if i < vocab_size]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(path / "tokenizer.json"))
    eos, pad = SPECIAL_TOKENS[151645], SPECIAL_TOKENS[151643]
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, s in sorted(SPECIAL_TOKENS.items()) if i < vocab_size}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": eos, "pad_token": pad, "unk_token": pad, "model_max_length": 131072,
        "clean_up_tokenization_spaces": False, "errors": "replace"}, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "pad_token": pad, "unk_token": pad}))


def write_model_dir(path: str | Path, layers: int | None = None) -> dict[str, Any]:
    """Write config.json, generation_config.json (token ids only: no sampling defaults that ``vllm
    serve`` would apply to a request's unset fields) and the tokenizer into ``path``. Idempotent:
    an existing directory with the same config is reused (its tokenizer is kept). Returns a summary."""
    path = Path(path)
    cfg = model_config(layers)
    path.mkdir(parents=True, exist_ok=True)
    cfg_file = path / "config.json"
    same = cfg_file.exists() and json.loads(cfg_file.read_text()) == cfg and (path / "tokenizer.json").exists()
    if not same:
        cfg_file.write_text(json.dumps(cfg, indent=1))
        (path / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}, indent=1))
        write_tokenizer(path, cfg["vocab_size"])
    return {"path": str(path), "layers": cfg["num_hidden_layers"], "reused": same,
            "param_gb": round(param_bytes(cfg) / 1e9, 2), "vocab_size": cfg["vocab_size"]}


def make_prompts(n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """``n`` prompts of token ids (deterministic in ``seed``), lengths spread over ``lengths``."""
    rng = random.Random(seed)
    lo, hi = lengths
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(1, n - 1)
        out.append([rng.randrange(PROMPT_VOCAB) for _ in range(length)])
    return out


# ------------------------------------------------------------------------------- engine arguments
GRAPH_MODES = ("FULL_DECODE_ONLY", "FULL", "PIECEWISE", "FULL_AND_PIECEWISE")
COMPILE_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}


def engine_argv(model_dir: str, *, mode: str, dp: int = 1, ep: bool = True, backend: str | None = "moonep",
                max_model_len: int = 1024, max_num_seqs: int = 32, gpu_mem: float = 0.85, seed: int = 0,
                attention_backend: str = "TRITON_ATTN", compile_mode: str = "NONE",
                graph_mode: str = "FULL_DECODE_ONLY", capture_sizes: list[int] | None = None,
                extra: list[str] | None = None) -> list[str]:
    """vLLM CLI engine arguments (the same list for ``vllm serve`` and, parsed by vLLM's own parser,
    for ``vllm.LLM``). ``mode``: ``eager`` (``--enforce-eager``) or ``graphs``."""
    if mode not in ("eager", "graphs"):
        raise ValueError(f"mode must be 'eager' or 'graphs', got {mode!r}")
    argv = ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16", "--seed", str(seed),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--gpu-memory-utilization", str(gpu_mem), "--attention-backend", attention_backend,
            "--no-enable-prefix-caching"]
    if mode == "eager":
        argv.append("--enforce-eager")
    else:
        sizes = sorted({s for s in (capture_sizes or [1, 2, 4, 8, 16, 32]) if s <= max_num_seqs})
        cc: dict[str, Any] = {"mode": COMPILE_MODES[compile_mode], "cudagraph_mode": graph_mode}
        if sizes:
            cc["cudagraph_capture_sizes"] = sizes
        argv += ["--compilation-config", json.dumps(cc, separators=(",", ":"))]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if ep:
        argv.append("--enable-expert-parallel")
    if backend:
        argv += ["--all2all-backend", backend]
    return argv + list(extra or [])


def strip_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


# ----------------------------------------------------------------------------------- log lines
#: what the runs' logs are searched for: name -> regex (the plugin's exact wording, vLLM's timings)
LOG_PATTERNS: dict[str, str] = {
    # vllm_plugin/seams.py apply_seams: the load line
    "plugin_load": r"vllm-moonep (\S+) hooked vLLM (\S+) \((\d+) seams: [^)]*\); --all2all-backend moonep builds",
    "plugin_untested_vllm": r"vllm-moonep \S+ is tested with vLLM \S+; this is vLLM (\S+)",
    "plugin_seam_error": r"vllm-moonep cannot hook vLLM .*",
    # vllm_plugin/checks.py check_engine_config: moonep requested but inactive, and why
    "plugin_inactive": r"vllm-moonep: --all2all-backend moonep is set but MoonEP will not run: (.+?)\. vLLM runs its",
    # ... and active: the front-end line, each worker's resolved line, the graph rule's line
    "plugin_active": r"vllm-moonep: --all2all-backend moonep for (.+?); options: ",
    "plugin_worker": r"vllm-moonep: weight_layout=(\w+), engine=(\w+)",
    "plugin_graphs_kept": r"MoonEP: CUDA graphs kept \(([^)]*)\): cudagraph_mode=(\w+)",
    "plugin_graphs_off": r"MoonEP: CUDA graphs stay off as vLLM 0\.33 sets for --all2all-backend moonep: (.*)",
    "vllm_moonep_eager_switch": r"MoonEP: Disabling CUDA Graphs since the MoonEP integration",
    "unknown_moonep_env": r"Unknown vLLM environment variable detected: (VLLM_MOONEP_\w+)",
    # this tool's weights plugin (register_check_plugin)
    "scaled_weights": r"vllm_model_check: scaled dummy weights: (\d+) tensors \((\d+) expert tensors",
    # vLLM's own
    "model_loading": r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
    "graph_capture": r"Graph capturing finished in ([\d.]+) secs, took ([\d.]+) GiB",
    "init_engine": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "kv_cache": r"Available KV cache memory: ([\d.]+) GiB",
    "cudagraph_override": r"Cudagraph mode (\S+) is not compatible with compilation mode (\S+)\. Overriding to (\S+)\.",
    "traceback": r"Traceback \(most recent call last\)",
    "import_error": r"(?:ModuleNotFoundError|ImportError): (.+)",
}


#: patterns looked for only before the run was being stopped (a shutdown may print tracebacks)
BEFORE_STOP = ("traceback", "import_error")
#: what the llm child prints once its result is written, before it shuts its engine down
RESULT_MARK = "vllm_model_check: result written"


def scan_log(text: str, stop_at: int | None = None) -> dict[str, list[list[str]]]:
    """For each pattern found in ``text``: its matches' groups (the whole match where it has none),
    at most 8 each; the ``BEFORE_STOP`` patterns only in ``text[:stop_at]``."""
    out: dict[str, list[list[str]]] = {}
    for name, pat in LOG_PATTERNS.items():
        hits = []
        for m in re.finditer(pat, text if name not in BEFORE_STOP or stop_at is None else text[:stop_at]):
            hits.append(list(m.groups()) if m.groups() else [m.group(0)])
            if len(hits) == 8:
                break
        if hits:
            out[name] = hits
    return out


def expected_lines(*, plugin: bool, dp: int, ep: bool, backend: str | None, mode: str,
                   weights: str) -> tuple[list[str], list[str]]:
    """(log lines a run must show, lines it must not show), by LOG_PATTERNS name."""
    need, forbid = [], ["plugin_seam_error", "traceback"]
    moonep = backend == "moonep"
    if weights == "scaled":
        need.append("scaled_weights")
    (need if mode == "graphs" else forbid).append("graph_capture")
    if plugin:
        need.append("plugin_load")
        forbid.append("unknown_moonep_env")
        if moonep and (dp <= 1 or not ep):
            need.append("plugin_inactive")
            forbid += ["plugin_active", "plugin_worker"]
        elif moonep:
            need += ["plugin_active", "plugin_worker"]
            forbid.append("plugin_inactive")
            if mode == "graphs":
                need.append("plugin_graphs_kept")
        else:
            forbid += ["plugin_inactive", "plugin_active", "plugin_worker"]
    else:
        # VLLM_MOONEP_PLUGIN=0: nothing hooked, yet our variables are still registered (no warning)
        forbid += ["plugin_load", "plugin_inactive", "plugin_active", "plugin_worker", "unknown_moonep_env"]
    return need, forbid


# ----------------------------------------------------------------------------------- comparison
def tokens_digest(seqs: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(seqs).encode()).hexdigest()[:16]


def compare_tokens(a: list[list[int]] | None, b: list[list[int]] | None, limit: int | None = None) -> dict[str, Any]:
    """Sequence-by-sequence comparison of two runs' token ids (each cut to ``limit`` tokens).
    ``equal``: every sequence identical; ``first_mismatch``: (sequence, position, a's token, b's
    token) of the first difference; ``common_prefix``: per sequence, how many leading tokens agree."""
    if a is None or b is None:
        return {"equal": None, "why": "a run has no tokens"}
    if limit is not None:
        a, b = [s[:limit] for s in a], [s[:limit] for s in b]
    if len(a) != len(b):
        return {"equal": False, "why": f"{len(a)} vs {len(b)} sequences", "first_mismatch": None, "common_prefix": []}
    prefixes, first = [], None
    for i, (x, y) in enumerate(zip(a, b)):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
        if first is None and (n < len(x) or n < len(y)):
            first = [i, n, x[n] if n < len(x) else None, y[n] if n < len(y) else None]
    return {"equal": first is None, "first_mismatch": first, "common_prefix": prefixes,
            "tokens": sum(len(s) for s in a)}


#: what a pass on vLLM's own run-to-run spread says
SPREAD_WHY = ("plugin tokens equal a run without the plugin; vLLM's runs without the plugin differ from each "
              "other (run-to-run spread)")
#: a set's verdicts, mildest first (a mode's verdict is its sets' worst)
VERDICTS = ("identical", "spread", "no_baseline", "differs_from_both", "plugin_differs")


def pair_sets(result: dict[str, Any]) -> dict[str, Any]:
    """The sequence sets an llm run's tokens are compared by: ``greedy`` (the ``--prompts``' token
    ids) and ``batch <b>`` (the digest of the tokens/s run's tokens at batch ``b``)."""
    sets: dict[str, Any] = {"greedy": result.get("tokens")}
    for e in result.get("bench") or []:
        sets[f"batch {e['batch']}"] = e.get("digest")
    return sets


def baseline_verdict(on: dict[str, Any], off: dict[str, Any], off2: dict[str, Any] | None,
                     not_run: str | None = None) -> dict[str, Any]:
    """The plugin run's sequence sets (``pair_sets``) against the run without the plugin (``off``)
    and, where given, a second run without it (``off2``, the baseline of vLLM's own run-to-run
    spread; ``not_run``: why there is none). A set passes when the plugin's tokens equal either
    run's without the plugin; the mode passes when every set does. Per set and for the mode:
    ``identical`` (equal to ``off``: no baseline needed), ``spread`` (equal to ``off2`` only: the
    runs without the plugin differ from each other), ``no_baseline`` (differs from ``off``, no
    ``off2``), ``plugin_differs`` (``off`` and ``off2`` identical, the plugin's differs),
    ``differs_from_both`` (equal to neither, which differ from each other too); only the first
    two pass."""
    def eq(x: Any, y: Any) -> bool:
        return x is not None and x == y

    sets: dict[str, dict[str, Any]] = {}
    for k in dict.fromkeys([*on, *off, *(off2 or {})]):
        s: dict[str, Any] = {"plugin_vs_noplugin": eq(on.get(k), off.get(k))}
        if off2 is not None:
            s["plugin_vs_noplugin_2"] = eq(on.get(k), off2.get(k))
            s["noplugin_vs_noplugin_2"] = eq(off.get(k), off2.get(k))
        if s["plugin_vs_noplugin"]:
            s.update(verdict="identical", why="identical to the run without the plugin")
        elif off2 is None:
            s.update(verdict="no_baseline", why="differs from the run without the plugin; the baseline (a second run "
                                                f"without the plugin) was not run: {not_run or 'no reason given'}")
        elif s["plugin_vs_noplugin_2"]:
            s.update(verdict="spread", why=SPREAD_WHY)
        elif s["noplugin_vs_noplugin_2"]:
            s.update(verdict="plugin_differs", why="the two runs without the plugin are identical to each other and "
                                                   "the plugin run differs: the plugin changes the tokens")
        else:
            s.update(verdict="differs_from_both", why="plugin tokens equal neither run without the plugin (which "
                                                      "differ from each other as well)")
        s["ok"] = s["verdict"] in ("identical", "spread")
        sets[k] = s
    verdict = max((s["verdict"] for s in sets.values()), key=VERDICTS.index, default="identical")
    ok = all(s["ok"] for s in sets.values())
    if verdict == "identical":
        why = "plugin tokens identical to the run without the plugin"
    elif ok:
        why = SPREAD_WHY
    else:
        why = "; ".join(f"{k}: {s['why']}" for k, s in sets.items() if not s["ok"])
    out = {"ok": ok, "verdict": verdict, "why": why, "baseline_run": off2 is not None, "sets": sets}
    if off2 is None and verdict != "identical":
        out["not_run"] = not_run
    return out


# --------------------------------------------------------------------------- subprocess handling
def child_env(base: dict[str, str], *, plugin: bool, site_dir: str | None, weights: str, weights_seed: int,
              extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base)
    if plugin:
        env.pop("VLLM_MOONEP_PLUGIN", None)
    else:
        env["VLLM_MOONEP_PLUGIN"] = "0"
    if site_dir:
        env["PYTHONPATH"] = site_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[WEIGHTS_ENV] = weights
    env[WEIGHTS_SEED_ENV] = str(weights_seed)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------ weights plugin
WEIGHTS_ENV = "MOONEP_CHECK_WEIGHTS"
WEIGHTS_SEED_ENV = "MOONEP_CHECK_WEIGHTS_SEED"
#: tests only: a file standing in for vLLM's LLM API in the llm child
FAKE_VLLM_ENV = "MOONEP_CHECK_FAKE_VLLM"
CHECK_PLUGIN_NAME = "moonep_model_check"


def _seed_of(base: int, name: str, expert: int) -> int:
    h = hashlib.blake2b(f"{base}:{name}:{expert}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _local_expert_ids(module: Any) -> list[int] | None:
    """Global expert ids of a fused-MoE weight holder's local experts, in local order (None: not one)."""
    mgr = getattr(module, "expert_map_manager", None)
    n_local = getattr(module, "local_num_experts", None)
    if mgr is None or n_local is None:
        return None
    emap = getattr(mgr, "expert_map", None)
    if emap is None:
        return list(range(int(n_local)))
    out: list[int | None] = [None] * int(n_local)
    for g, local in enumerate(emap.tolist()):
        if 0 <= local < len(out):
            out[local] = g
    return None if any(x is None for x in out) else [int(x) for x in out if x is not None]


def scaled_init(model: Any, seed: int) -> tuple[int, int]:
    """Re-fill ``model``'s floating parameters (see the module doc). Returns (tensors, expert tensors)."""
    import torch

    def fill(t: torch.Tensor, a: float, s: int) -> None:
        gen = torch.Generator(device=t.device)
        gen.manual_seed(s)
        t.uniform_(-a, a, generator=gen)

    n = n_exp = 0
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            experts = _local_expert_ids(mod)
            for pname, p in list(mod._parameters.items()):
                if p is None or not torch.is_floating_point(p) or p.device.type == "meta" or p.numel() == 0:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                if p.ndim == 1:
                    p.fill_(0.0 if "bias" in pname else 1.0)
                else:
                    a = math.sqrt(3.0 / p.shape[-1])
                    if p.ndim == 3 and experts is not None and len(experts) == p.shape[0]:
                        for j, g in enumerate(experts):
                            fill(p.data[j], a, _seed_of(seed, full, g))
                        n_exp += 1
                    else:
                        fill(p.data, a, _seed_of(seed, full, -1))
                n += 1
    return n, n_exp


def register_check_plugin() -> None:
    """General-plugin entry point of this tool's runs (written by the tool into a dist-info on the
    runs' PYTHONPATH, never installed): with ``MOONEP_CHECK_WEIGHTS=scaled``, vLLM's dummy loader
    re-fills the weights as ``scaled_init`` does. Never raises (vLLM calls it unguarded)."""
    try:
        if os.environ.get(WEIGHTS_ENV, "vllm") != "scaled":
            return
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

        if getattr(DummyModelLoader.load_weights, "_moonep_check", False):
            return
        orig = DummyModelLoader.load_weights
        seed = int(os.environ.get(WEIGHTS_SEED_ENV, "0"))

        def load_weights(self, model, model_config):
            orig(self, model, model_config)
            t0 = time.perf_counter()
            n, n_exp = scaled_init(model, seed)
            print(f"vllm_model_check: scaled dummy weights: {n} tensors ({n_exp} expert tensors, per global expert "
                  f"id), U(+-sqrt(3/fan_in)), seed {seed}, {time.perf_counter() - t0:.2f}s (pid {os.getpid()})",
                  file=sys.stderr, flush=True)

        load_weights._moonep_check = True  # type: ignore[attr-defined]
        DummyModelLoader.load_weights = load_weights
    except Exception as exc:  # noqa: BLE001 - the run then lacks the marker line and fails its check
        print(f"vllm_model_check: the weights plugin failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def moonep_entry_point() -> bool:
    return any(e.name == "moonep" for e in importlib.metadata.entry_points(group="vllm.general_plugins"))


def write_entry_points(site_dir: Path, with_moonep: bool) -> list[str]:
    """dist-info folders in ``site_dir`` (put first on the runs' PYTHONPATH) declaring this tool's
    weights plugin and, when ``with_moonep``, the moonep entry point (where our package is on
    PYTHONPATH without its metadata). Returns what was written."""
    written = []
    entries = [("vllm_moonep_model_check", "0.0.0", f"{CHECK_PLUGIN_NAME} = vllm_moonep.tools.vllm_model_check:register_check_plugin")]
    if with_moonep:
        entries.append(("vllm_moonep", "0.1.0", "moonep = vllm_moonep.vllm_plugin:register"))
    for name, ver, line in entries:
        d = site_dir / f"{name}-{ver}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {ver}\n")
        (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{line}\n")
        written.append(str(d))
    return written


# ----------------------------------------------------------------------------------- preflight
#: import name -> pip distribution, by the path that needs it (vLLM 0.33's imports, read on its
#: sources and checked in an environment of only the device image's packages plus these)
NEEDED_LLM = {"vllm": "vllm (sources)", "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
              "zmq": "pyzmq", "pydantic": "pydantic", "msgspec": "msgspec", "cbor2": "cbor2", "cachetools": "cachetools",
              "pybase64": "pybase64", "openai": "openai", "openai_harmony": "oss-harmony", "xgrammar": "xgrammar",
              "llguidance": "llguidance", "tvm_ffi": "apache-tvm-ffi", "partial_json_parser": "partial-json-parser",
              "compressed_tensors": "compressed-tensors", "loguru": "loguru", "cloudpickle": "cloudpickle",
              "cpuinfo": "py-cpuinfo", "einops": "einops", "triton": "triton", "vllm_moonep": "vllm-moonep"}
NEEDED_SERVE = {"fastapi": "fastapi", "starlette": "starlette", "annotated_doc": "annotated-doc", "uvicorn": "uvicorn",
                "prometheus_fastapi_instrumentator": "prometheus-fastapi-instrumentator",
                "prometheus_client": "prometheus-client", "orjson": "orjson", "watchfiles": "watchfiles",
                "uvloop": "uvloop", "h11": "h11"}


def preflight(need_serve: bool) -> dict[str, Any]:
    """What can be checked without importing vLLM (fast): modules present, compiled extensions,
    the FlashAttention package's import guard, the moonep entry point, GPUs."""
    def missing(table: dict[str, str]) -> list[str]:
        out = []
        for mod, dist in table.items():
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(f"{mod} ({dist})")
        return out

    res: dict[str, Any] = {"python": sys.version.split()[0], "missing_llm": missing(NEEDED_LLM),
                           "missing_serve": missing(NEEDED_SERVE) if need_serve else []}
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        vdir = Path(list(spec.submodule_search_locations)[0])
        res["vllm_dir"] = str(vdir)
        # vllm/platforms/cuda.py imports vllm._C_stable_libtorch (the .so, or a .py that loads it)
        res["vllm_C"] = sorted(p.name for p in vdir.glob("_C_stable_libtorch*") if p.suffix in (".so", ".py"))
        res["vllm_moe_C"] = sorted(p.name for p in vdir.glob("_moe_C_stable_libtorch*") if p.suffix in (".so", ".py"))
        fa = vdir / "vllm_flash_attn"
        res["flash_attn_ext"] = sorted(p.name for p in fa.glob("_vllm_fa*_C*")) if fa.is_dir() else ["(no package)"]
        with contextlib.suppress(Exception):
            res["vllm_version"] = importlib.metadata.version("vllm")
    with contextlib.suppress(Exception):
        res["transformers_version"] = importlib.metadata.version("transformers")
    with contextlib.suppress(Exception):
        res["torch_version"] = importlib.metadata.version("torch")
    res["moonep_entry_point"] = moonep_entry_point()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        res["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        res["gpus"] = []
    return res


# ------------------------------------------------------------------------------ the llm child
def _llm_child(spec_file: str) -> int:
    """One ``vllm.LLM`` run (in its own process): the spec (JSON) says the engine argv, prompts,
    tokens, bench batches; the result (JSON) goes to ``spec['result']``."""
    spec = json.loads(Path(spec_file).read_text())
    res: dict[str, Any] = {"pid": os.getpid(), "stage": "import"}
    result_file = Path(spec["result"])

    def save() -> None:
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(result_file)

    t0 = time.perf_counter()
    llm = None
    try:
        fake = os.environ.get(FAKE_VLLM_ENV)
        api: dict[str, Any]
        if fake:  # the unit tests' stand-in for vLLM's LLM API (a file defining the four names below)
            import runpy

            api = runpy.run_path(fake)
        else:
            from vllm import LLM, SamplingParams
            from vllm.engine.arg_utils import EngineArgs
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            api = {"LLM": LLM, "SamplingParams": SamplingParams, "EngineArgs": EngineArgs,
                   "FlexibleArgumentParser": FlexibleArgumentParser}
        LLMc, SP, EA = api["LLM"], api["SamplingParams"], api["EngineArgs"]

        res["import_s"] = round(time.perf_counter() - t0, 2)
        res["stage"] = "engine"
        save()
        parser = EA.add_cli_args(api["FlexibleArgumentParser"]())
        engine_args = EA.from_cli_args(parser.parse_args(spec["argv"]))
        t1 = time.perf_counter()
        llm = LLMc.from_engine_args(engine_args)
        res["engine_start_s"] = round(time.perf_counter() - t1, 2)
        cc = llm.llm_engine.vllm_config.compilation_config
        res["resolved"] = {"cudagraph_mode": str(getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode)),
                           "compile_mode": str(getattr(cc.mode, "name", cc.mode)),
                           "capture_sizes": list(cc.cudagraph_capture_sizes or []),
                           "all2all_backend": llm.llm_engine.vllm_config.parallel_config.all2all_backend,
                           "data_parallel_size": llm.llm_engine.vllm_config.parallel_config.data_parallel_size}
        res["stage"] = "generate"
        save()

        def gen(prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, list[str]]:
            sp = SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            return [list(o.outputs[0].token_ids) for o in outs], dt, [o.outputs[0].text for o in outs]

        toks, dt, texts = gen(spec["prompts"], spec["tokens"])
        res["tokens"] = toks
        res["texts_head"] = [t[:120] for t in texts]
        res["texts_decode_ok"] = all(text_to_ids(t) == without_specials(s) for t, s in zip(texts, toks))
        res["check_generate_s"] = round(dt, 3)
        bench = []
        for i, b in enumerate(spec["bench_batches"]):
            prompts = spec["bench_prompts"][:b]
            gen(prompts, 4)  # warm-up: this batch's kernels (Triton JIT in eager mode)
            # the 1-token time twice, the lower kept: on a machine's first run the first one has read
            # 5-6x the rest (0.72-0.84 s against 0.12-0.25 at batch 32), which inflated decode-only
            t_ones = [gen(prompts, 1)[1] for _ in range(2)]
            t_one = min(t_ones)
            seqs, t_all, _ = gen(prompts, spec["bench_tokens"])
            n = sum(len(s) for s in seqs)
            decode = (b * (spec["bench_tokens"] - 1)) / (t_all - t_one) if t_all > t_one else None
            entry = {"batch": b, "tokens": n, "generate_s": round(t_all, 3), "tok_s": round(n / t_all, 1),
                     "first_token_s": round(t_one, 4), "first_token_runs_s": [round(t, 4) for t in t_ones],
                     "decode_tok_s": round(decode, 1) if decode else None,
                     "digest": tokens_digest(seqs)}
            if b == 1:
                entry["tokens_ids"] = seqs
            bench.append(entry)
            res["bench"] = bench
            save()
        res["stage"] = "done"
        res["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded, then the process exits
        import traceback

        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    save()
    sys.stdout.flush()
    print(RESULT_MARK, file=sys.stderr, flush=True)
    if llm is not None:  # a bounded clean shutdown of the engine core, then leave (the parent kills the rest)
        import threading

        def stop() -> None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

        th = threading.Thread(target=stop, daemon=True)
        th.start()
        th.join(20)
    os._exit(0 if res.get("ok") else 1)


# ------------------------------------------------------------------------------ orchestration
@dataclasses.dataclass
class Run:
    name: str
    kind: str  # llm | serve
    mode: str  # eager | graphs
    plugin: bool
    backend: str | None
    argv: list[str]
    result: dict[str, Any] = dataclasses.field(default_factory=dict)


class Budget:
    def __init__(self, total: float):
        self.t0 = time.monotonic()
        self.total = total

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)


def _say(msg: str) -> None:
    print(f"[vllm_model_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def first_error(text: str) -> str | None:
    """The first exception line after the first traceback in a log (a failed engine's root cause,
    which the front end's own traceback at the log's end only points to)."""
    i = text.find("Traceback (most recent call last)")
    if i < 0:
        return None
    m = re.search(r"\b([A-Z]\w*(?:Error|Exception)): (.+)", text[i:])
    return f"{m.group(1)}: {m.group(2)[:400]}" if m else None


def _tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def run_llm(run: Run, a: argparse.Namespace, env: dict[str, str], out: Path, work: Path, prompts: list[list[int]],
            bench_prompts: list[list[int]], budget: Budget) -> None:
    """The ``llm`` run: one process (or ``--dp`` SPMD processes), bounded."""
    log = out / f"{run.name}.log"
    timeout = min(a.run_timeout, budget.left() - 5)
    r = run.result
    r.update({"kind": "llm", "mode": run.mode, "plugin": run.plugin, "backend": run.backend, "argv": run.argv,
              "log": str(log)})
    if timeout < a.min_run_s:
        r.update({"status": "skipped", "why": f"budget: {budget.left():.0f}s left"})
        _say(f"{run.name}: SKIPPED ({r['why']})")
        return
    dp = a.dp
    procs: list[tuple[subprocess.Popen, Path]] = []
    master_port = free_port()
    t0 = time.monotonic()
    with open(log, "w") as lf:
        lf.write(f"# {run.name}: VLLM_MOONEP_PLUGIN={'<unset>' if run.plugin else '0'}\n# argv: {shlex.join(run.argv)}\n")
        lf.flush()
        for rank in range(dp):
            argv = run.argv if dp == 1 else strip_option(run.argv, "--data-parallel-size")
            spec = {"argv": argv, "prompts": prompts[rank::dp], "tokens": a.tokens,
                    "bench_batches": a.bench_batch, "bench_tokens": a.bench_tokens,
                    "bench_prompts": bench_prompts, "result": str(work / f"{run.name}.r{rank}.json")}
            Path(spec["result"]).unlink(missing_ok=True)
            sf = work / f"{run.name}.r{rank}.spec.json"
            sf.write_text(json.dumps(spec))
            extra = {} if dp == 1 else {"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank), "VLLM_DP_SIZE": str(dp),
                                        "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(master_port)}
            cmd = [sys.executable, "-m", "vllm_moonep.tools.vllm_model_check", "_llm", "--spec", str(sf)]
            p = subprocess.Popen(cmd, env={**env, **extra}, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append((p, Path(spec["result"])))
        _say(f"{run.name}: started (pid {', '.join(str(p.pid) for p, _ in procs)}), timeout {timeout:.0f}s, log {log}")
        end = t0 + timeout
        while time.monotonic() < end and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break  # a rank failed: the others would wait for it until the timeout
            time.sleep(0.5)
        timed_out = any(p.poll() is None for p, _ in procs)
        stops = [kill_group(p) for p, _ in procs]
    r["wall_s"] = round(time.monotonic() - t0, 1)
    r["stop"] = stops
    ranks = []
    for p, rf in procs:
        try:
            ranks.append(json.loads(rf.read_text()))
        except (OSError, ValueError):
            ranks.append({"ok": False, "error": "no result written", "stage": "start"})
        ranks[-1]["rc"] = p.returncode
    r["ranks"] = ranks if dp > 1 else None
    r0 = ranks[0]
    for k in ("import_s", "engine_start_s", "resolved", "check_generate_s", "texts_decode_ok", "texts_head", "bench",
              "error", "stage"):
        if k in r0:
            r[k] = r0[k]
    if dp == 1:
        r["tokens"] = r0.get("tokens")
    else:  # back in prompt order
        toks: list[list[int]] = [[] for _ in prompts]
        for rank, rr in enumerate(ranks):
            for j, s in enumerate(rr.get("tokens") or []):
                toks[rank + j * dp] = s
        r["tokens"] = toks if all(rr.get("tokens") for rr in ranks) else None
    ok = all(rr.get("ok") for rr in ranks) and not timed_out
    r["status"] = "ok" if ok else ("timeout" if timed_out else "failed")
    text = log.read_text(errors="replace")
    mark = text.find(RESULT_MARK)
    r["log_lines"] = scan_log(text, stop_at=mark if mark >= 0 else None)
    if not ok or "traceback" in r["log_lines"]:
        r["first_error"] = first_error(text if mark < 0 else text[:mark])
    if not ok:
        r["log_tail"] = _tail(log)
    bench = ", ".join(f"b{e['batch']}: {e['tok_s']} tok/s (decode {e['decode_tok_s']})" for e in r.get("bench") or [])
    _say(f"{run.name}: {r['status']} in {r['wall_s']}s (engine start {r.get('engine_start_s')}s); {bench}"
         + (f"; error: {r.get('error')}" if not ok else ""))


def run_serve(run: Run, a: argparse.Namespace, env: dict[str, str], out: Path, prompt: list[int],
              budget: Budget) -> None:
    """``vllm serve`` on loopback: wait for /health, one completion request, stop the server."""
    log = out / f"{run.name}.log"
    r = run.result
    r.update({"kind": "serve", "mode": run.mode, "plugin": run.plugin, "backend": run.backend, "log": str(log)})
    timeout = min(a.serve_timeout, budget.left() - 5)
    if timeout < a.min_run_s:
        r.update({"status": "skipped", "why": f"budget: {budget.left():.0f}s left"})
        _say(f"{run.name}: SKIPPED ({r['why']})")
        return
    cmd = serve_command(a.serve_cmd, run.argv, free_port())
    r["cmd"] = cmd
    t0 = time.monotonic()
    end = t0 + timeout
    srv = ServerProcess(cmd, env, log, f"# {run.name}: VLLM_MOONEP_PLUGIN={'<unset>' if run.plugin else '0'}\n"
                                       f"# {shlex.join(cmd)}")
    srv.start()
    _say(f"{run.name}: started (pid {srv.proc.pid if srv.proc else '?'}) on {srv.base}, timeout {timeout:.0f}s, log {log}")
    try:
        state, why = srv.wait_healthy(timeout)
        r["ready_s"] = round(time.monotonic() - t0, 1)
        if state == "ok":
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": a.serve_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t1 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=max(5.0, end - time.monotonic())) as resp:
                    reply = json.loads(resp.read().decode())
                dt = time.monotonic() - t1
                choice = reply["choices"][0]
                ids = choice.get("token_ids")
                text_ids = text_to_ids(choice.get("text", ""))
                r.update({"request_s": round(dt, 3), "text_head": choice.get("text", "")[:160],
                          "finish_reason": choice.get("finish_reason"), "usage": reply.get("usage"),
                          "tokens": [ids if ids is not None else text_ids], "token_ids_returned": ids is not None,
                          "text_matches_ids": ids is None or without_specials(ids) == text_ids})
                n = (reply.get("usage") or {}).get("completion_tokens") or len(text_ids)
                r["tok_s"] = round(n / dt, 1) if dt > 0 else None
                r["status"] = "ok" if n == a.serve_tokens else "failed"
                if n != a.serve_tokens:
                    r["error"] = f"{n} completion tokens, asked for {a.serve_tokens}"
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
                detail = ""
                if isinstance(exc, urllib.error.HTTPError):
                    with contextlib.suppress(Exception):
                        detail = " " + exc.read().decode()[:500]
                r.update({"status": "failed", "error": f"completion request: {type(exc).__name__}: {exc}{detail}"})
        else:
            r.update({"status": state, "error": why})
    finally:
        stopped = srv.stop()
        r["stop"], r["stop_s"] = stopped["stop"], stopped["stop_s"]
    r["wall_s"] = round(time.monotonic() - t0, 1)
    raw = log.read_bytes()
    text = raw.decode(errors="replace")
    before_stop = raw[:stopped["log_bytes_at_stop"]].decode(errors="replace")
    r["log_lines"] = scan_log(text, stop_at=len(before_stop))
    if r.get("status") != "ok" or "traceback" in r["log_lines"]:
        r["first_error"] = first_error(before_stop if r.get("status") == "ok" else text)
    if r.get("status") != "ok":
        r["log_tail"] = _tail(log)
    _say(f"{run.name}: {r['status']} (ready after {r.get('ready_s')}s, request {r.get('request_s')}s, "
         f"{r.get('tok_s')} tok/s, stopped: {r['stop']})" + (f"; error: {r.get('error')}" if r.get("error") else ""))


def check_lines(run: Run, a: argparse.Namespace) -> list[dict[str, Any]]:
    need, forbid = expected_lines(plugin=run.plugin, dp=a.dp, ep=not a.no_ep, backend=run.backend, mode=run.mode,
                                  weights=a.weights)
    found = run.result.get("log_lines", {})
    out = []
    for name in need:
        out.append({"check": f"{run.name}: log shows {name}", "ok": name in found,
                    "detail": found.get(name, [None])[0] if name in found else f"no match for /{LOG_PATTERNS[name]}/"})
    for name in forbid:
        # a traceback alone is a warning (vLLM logs some for what it then survives, e.g. a general plugin
        # of another package that fails to load); what it broke fails its own check
        out.append({"check": f"{run.name}: log has no {name}", "ok": name not in found, "strict": name != "traceback",
                    "detail": (run.result.get("first_error") if name == "traceback" else found[name][0])
                    if name in found else None})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_moonep.tools.vllm_model_check",
        description="Qwen3-30B-A3B-shaped MoE (dummy weights) through vLLM with the moonep plugin: vllm.LLM and "
                    "vllm serve, eager and CUDA graphs, with and without the plugin; same greedy tokens, the "
                    "plugin's log lines, tokens/s. See the module doc.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the model directory only", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c = sub.add_parser("check", help="the runs (default)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for p in (w, c):
        p.add_argument("--model-dir", default=None,
                       help="where the model directory is written (default /tmp/moonep-qwen3-30b-a3b-L<layers>)")
        p.add_argument("--layers", type=int, default=48, help="decoder layers kept of Qwen3-30B-A3B's 48")
    c.add_argument("--out", required=True, help="results folder: the results JSON, summary.txt, one log per run")
    c.add_argument("--json", default="results.json", help="the results JSON's file name in --out")
    c.add_argument("--logs", default=None, help="folder of the runs' logs (default --out)")
    c.add_argument("--modes", nargs="*", choices=("eager", "graphs"), default=["eager", "graphs"],
                   help="llm runs: eager (--enforce-eager) and/or CUDA graphs (none: no llm run)")
    c.add_argument("--plugin", nargs="+", choices=("on", "off"), default=["off", "on"],
                   help="llm runs without the plugin (VLLM_MOONEP_PLUGIN=0) and/or with it (unset), in this order "
                        "(the default puts a machine's first run, which pays its first compilations, off the plugin)")
    c.add_argument("--serve", choices=("graphs", "eager", "none"), default="graphs", help="the serve run's mode")
    c.add_argument("--serve-plugin", choices=("on", "off"), default="on", help="the serve run with or without the plugin")
    c.add_argument("--serve-cmd", default=SERVE_CMD,
                   help="python arguments that start the server (what the `vllm serve` console script runs); the "
                        "engine arguments, --host, --port, --served-model-name follow")
    c.add_argument("--dp", type=int, default=1, help="data-parallel size (serve: --data-parallel-size; llm: SPMD ranks)")
    c.add_argument("--no-ep", action="store_true", help="leave out --enable-expert-parallel")
    c.add_argument("--all2all-backend", default="moonep", help="--all2all-backend of every run ('' leaves it out)")
    c.add_argument("--compare-backend", default=None,
                   help="also run the llm runs with this --all2all-backend (plugin on) and compare tokens "
                        "(e.g. allgather_reducescatter at --dp 2)")
    c.add_argument("--weights", choices=("scaled", "vllm"), default="scaled",
                   help="scaled: vLLM's dummy weights re-filled at unit scale (the MoE then moves the logits); "
                        "vllm: vLLM's U(+-1e-3) fill")
    c.add_argument("--weights-seed", type=int, default=0, help="seed of the scaled weights")
    c.add_argument("--prompts", type=int, default=4, help="prompts whose greedy tokens are compared")
    c.add_argument("--prompt-len", type=int, nargs=2, default=[7, 61], metavar=("MIN", "MAX"), help="their lengths")
    c.add_argument("--tokens", type=int, default=32, help="greedy tokens per compared prompt")
    c.add_argument("--bench-batch", type=int, nargs="*", default=[1, 32],
                   help="batch sizes of the tokens/s runs (each: warm-up, 1-token and --bench-tokens generate)")
    c.add_argument("--bench-tokens", type=int, default=128, help="tokens per sequence of the tokens/s runs")
    c.add_argument("--serve-tokens", type=int, default=32, help="max_tokens of the completion request")
    c.add_argument("--max-model-len", type=int, default=1024, help="--max-model-len")
    c.add_argument("--max-num-seqs", type=int, default=None, help="--max-num-seqs (default: the largest batch, at least 8)")
    c.add_argument("--gpu-mem", type=float, default=0.85, help="--gpu-memory-utilization")
    c.add_argument("--attention-backend", default="TRITON_ATTN", help="--attention-backend")
    c.add_argument("--compile-mode", choices=tuple(COMPILE_MODES), default="NONE", help="graphs runs: compilation mode")
    c.add_argument("--graph-mode", choices=GRAPH_MODES, default="FULL_DECODE_ONLY", help="graphs runs: cudagraph_mode")
    c.add_argument("--capture-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="graphs runs: cudagraph_capture_sizes (those up to --max-num-seqs)")
    c.add_argument("--model-runner", choices=("auto", "v1", "v2"), default="auto",
                   help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER; auto: vLLM's choice, V2 in 0.33)")
    c.add_argument("--extra-engine-args", default="", help="more vLLM engine arguments for every run (one shell-quoted string)")
    c.add_argument("--env", nargs="*", default=[], metavar="K=V", help="more environment for every run")
    c.add_argument("--seed", type=int, default=0, help="vLLM --seed and the prompts' seed")
    c.add_argument("--budget", type=float, default=470.0, help="seconds for everything; a run that no longer fits is skipped")
    c.add_argument("--run-timeout", type=float, default=200.0, help="seconds per llm run (engine start included)")
    c.add_argument("--serve-timeout", type=float, default=200.0, help="seconds for the serve run (start to stop)")
    c.add_argument("--min-run-s", type=float, default=60.0, help="a run is skipped when less than this is left")
    c.add_argument("--baseline-runs", type=int, choices=(0, 1), default=1,
                   help="when a mode's tokens differ with and without the plugin: run the no-plugin run once more "
                        "(llm-<mode>-noplugin-2, within --budget) to tell the plugin from vLLM's own run-to-run "
                        "spread (0: no baseline; a mismatch fails)")
    c.add_argument("--dry-run", action="store_true", help="write the model, preflight, print the runs; start nothing")
    llm = sub.add_parser("_llm", help=argparse.SUPPRESS)
    llm.add_argument("--spec", required=True)
    return ap


def _default_dir(layers: int) -> str:
    return f"/tmp/moonep-qwen3-30b-a3b-L{layers}"


def plan_runs(a: argparse.Namespace, model_dir: str) -> list[Run]:
    backend = a.all2all_backend or None
    max_seqs = a.max_num_seqs or max([8, *a.bench_batch, a.prompts])

    def argv(mode: str, be: str | None) -> list[str]:
        return engine_argv(model_dir, mode=mode, dp=a.dp, ep=not a.no_ep, backend=be, max_model_len=a.max_model_len,
                           max_num_seqs=max_seqs, gpu_mem=a.gpu_mem, seed=a.seed, attention_backend=a.attention_backend,
                           compile_mode=a.compile_mode, graph_mode=a.graph_mode, capture_sizes=a.capture_sizes,
                           extra=shlex.split(a.extra_engine_args))
    runs = []
    for mode in a.modes:
        for pl in a.plugin:
            runs.append(Run(f"llm-{mode}-{'plugin' if pl == 'on' else 'noplugin'}", "llm", mode, pl == "on", backend,
                            argv(mode, backend)))
        if a.compare_backend:
            runs.append(Run(f"llm-{mode}-{a.compare_backend}", "llm", mode, True, a.compare_backend,
                            argv(mode, a.compare_backend)))
    if a.serve != "none":
        runs.append(Run(f"serve-{a.serve}-{'plugin' if a.serve_plugin == 'on' else 'noplugin'}", "serve", a.serve,
                        a.serve_plugin == "on", backend, argv(a.serve, backend) + ["--disable-log-stats"]))
    for r in runs:
        if r.kind == "llm":
            r.argv = r.argv + ["--disable-log-stats"]
    return runs


def baseline_name(mode: str) -> str:
    """The baseline run of ``mode``: the same run without the plugin, once more."""
    return f"llm-{mode}-noplugin-2"


def baseline_why_not(a: argparse.Namespace, left: float) -> str | None:
    """Why the baseline run cannot be started (None: it can): ``--baseline-runs 0``, or the budget
    (the test ``run_llm`` applies: less than ``--min-run-s`` left for it)."""
    if a.baseline_runs < 1:
        return "--baseline-runs 0"
    if min(a.run_timeout, left - 5) < a.min_run_s:
        return f"budget: {left:.0f}s of --budget left, a run needs --min-run-s {a.min_run_s:.0f}s"
    return None


def mode_verdicts(a: argparse.Namespace, runs: list[Run],
                  baseline_why: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``baseline_verdict`` of each mode whose plugin and no-plugin runs both ran (``baseline_why``:
    mode -> why its baseline run was not started)."""
    by = {r.name: r for r in runs}
    out = {}
    for mode in a.modes:
        on, off, off2 = by.get(f"llm-{mode}-plugin"), by.get(f"llm-{mode}-noplugin"), by.get(baseline_name(mode))
        if not (on and off and on.result.get("status") == "ok" and off.result.get("status") == "ok"):
            continue
        off2_ok = off2 is not None and off2.result.get("status") == "ok"
        why = (baseline_why or {}).get(mode)
        if off2 is not None and not off2_ok:
            why = f"{off2.name} {off2.result.get('status')}: {off2.result.get('error') or off2.result.get('why')}"
        out[mode] = baseline_verdict(pair_sets(on.result), pair_sets(off.result),
                                     pair_sets(off2.result) if off2 is not None and off2_ok else None, why)
        if off2 is not None:
            out[mode]["baseline"] = off2.name
    return out


def comparisons(a: argparse.Namespace, runs: list[Run],
                baseline_why: dict[str, str] | None = None) -> list[dict[str, Any]]:
    by = {r.name: r for r in runs}
    out: list[dict[str, Any]] = []
    verdicts = mode_verdicts(a, runs, baseline_why)

    def bench_digests(r: Run) -> dict[int, str]:
        return {e["batch"]: e["digest"] for e in r.result.get("bench") or []}

    def add(name: str, x: Run, y: Run, strict: bool, limit: int | None = None, xt=None, yt=None) -> None:
        if x.result.get("status") != "ok" or y.result.get("status") != "ok":
            out.append({"check": name, "ok": False if strict else None, "strict": strict,
                        "detail": f"not compared: {x.name} {x.result.get('status')}, {y.name} {y.result.get('status')}"})
            return
        cmp = compare_tokens(xt if xt is not None else x.result.get("tokens"),
                             yt if yt is not None else y.result.get("tokens"), limit)
        out.append({"check": name, "ok": bool(cmp["equal"]) if strict else cmp["equal"], "strict": strict, "detail": cmp})

    for mode in a.modes:
        on, off = by.get(f"llm-{mode}-plugin"), by.get(f"llm-{mode}-noplugin")
        if on and off:
            add(f"{mode}: greedy tokens with the plugin == with VLLM_MOONEP_PLUGIN=0", on, off, True)
            v = verdicts.get(mode)
            if v is not None:
                # both ran: a mismatch passes only within vLLM's own run-to-run spread (baseline_verdict)
                off2 = by.get(baseline_name(mode))
                off2_ok = off2 is not None and off2.result.get("status") == "ok"
                greedy, sg = out[-1], v["sets"]["greedy"]
                greedy.update(ok=sg["ok"], verdict=sg["verdict"], why=sg["why"])
                if off2 is not None and off2_ok:
                    t2 = off2.result.get("tokens")
                    greedy["baseline"] = {"run": off2.name,
                                          "plugin_vs_noplugin_2": compare_tokens(on.result.get("tokens"), t2),
                                          "noplugin_vs_noplugin_2": compare_tokens(off.result.get("tokens"), t2)}
                d_on, d_off = bench_digests(on), bench_digests(off)
                same = {b: d_on.get(b) == d_off.get(b) for b in d_on}
                batches = {k: s for k, s in v["sets"].items() if k != "greedy"}
                bv = max((s["verdict"] for s in batches.values()), key=VERDICTS.index, default="identical")
                entry = {"check": f"{mode}: tokens/s runs' tokens with the plugin == without (digests per batch)",
                         "ok": all(s["ok"] for s in batches.values()), "strict": True, "detail": same, "verdict": bv,
                         "why": "identical to the run without the plugin" if bv == "identical" else SPREAD_WHY
                         if bv == "spread" else "; ".join(f"{k}: {s['why']}" for k, s in batches.items() if not s["ok"])}
                if off2 is not None and off2_ok:
                    d2 = bench_digests(off2)
                    entry["baseline"] = {"run": off2.name,
                                         "plugin_vs_noplugin_2": {b: d_on.get(b) == d2.get(b) for b in d_on},
                                         "noplugin_vs_noplugin_2": {b: d_off.get(b) == d2.get(b) for b in d_off}}
                out.append(entry)
        cmp_run = by.get(f"llm-{mode}-{a.compare_backend}") if a.compare_backend else None
        if cmp_run and on:
            add(f"{mode}: greedy tokens {a.all2all_backend} vs {a.compare_backend} (kernels differ: prefix agreement)",
                on, cmp_run, False)
    for pl in ("plugin", "noplugin"):
        e, g = by.get(f"llm-eager-{pl}"), by.get(f"llm-graphs-{pl}")
        if e and g:
            add(f"{pl}: greedy tokens eager vs CUDA graphs (informational)", e, g, False)
    srv = next((r for r in runs if r.kind == "serve"), None)
    if srv is not None:
        ref = by.get(f"llm-{srv.mode}-{'plugin' if srv.plugin else 'noplugin'}")
        b1 = next((e for e in (ref.result.get("bench") or []) if e["batch"] == 1), None) if ref else None
        if ref is not None and b1 is not None and b1.get("tokens_ids"):
            n = min(a.serve_tokens, a.bench_tokens)
            add(f"serve: completion tokens == {ref.name}'s batch-1 offline tokens of the same prompt (first {n})",
                srv, ref, True, n, xt=srv.result.get("tokens"), yt=[b1["tokens_ids"][0]])
        else:
            out.append({"check": "serve: completion tokens vs offline", "ok": None, "strict": False,
                        "detail": "no batch-1 offline run of the same mode and plugin state to compare with"})
    return out


def _mark(c: dict[str, Any]) -> str:
    if c.get("strict", True):
        return {True: "PASS", False: "FAIL", None: "n/a "}[c["ok"]]
    if "tokens" not in c["check"]:
        return {True: "PASS", False: "WARN", None: "n/a "}[c["ok"]]
    return {True: "same", False: "DIFF", None: "n/a "}[c["ok"]]


def _cmp_text(d: Any) -> str:
    if isinstance(d, dict) and "equal" in d:
        if d["equal"] is None:
            return str(d.get("why"))
        return (f"{d.get('tokens')} tokens identical" if d["equal"] else
                f"first mismatch (seq, pos, a, b) {d.get('first_mismatch')}, common prefixes {d.get('common_prefix')}")
    return "" if d in (None, "") else str(d)[:240]


def _detail(c: dict[str, Any]) -> str:
    text = _cmp_text(c.get("detail"))
    if c.get("verdict") not in (None, "identical"):  # a plugin/no-plugin mismatch and what the baseline said
        text += f" => {c.get('why')}"
        b = c.get("baseline")
        if b:
            text += (f" [plugin vs {b['run']}: {_cmp_text(b.get('plugin_vs_noplugin_2'))}; no-plugin runs vs each "
                     f"other: {_cmp_text(b.get('noplugin_vs_noplugin_2'))}]")
    return text


def summary_text(a: argparse.Namespace, info: dict[str, Any], runs: list[Run], checks: list[dict[str, Any]],
                 total_s: float, verdicts: dict[str, dict[str, Any]] | None = None) -> str:
    """The printed summary: the runs (timings, tokens/s), what the plugin said in each, every token
    comparison, each mode's verdict against vLLM's run-to-run spread (``verdicts``, where the
    plugin's tokens differed), and every failed check (the passed log checks are counted, not listed)."""
    L = [f"vllm_model_check: Qwen3-30B-A3B architecture, {info['layers']} layers ({info['param_gb']} GB bf16), "
         f"weights {a.weights}, dp {a.dp}, all2all {a.all2all_backend or '-'}{'' if a.no_ep else ', EP'}; "
         f"{total_s:.0f}s in all"]
    L.append(f"{'run':26s} {'status':8s} {'wall s':>7s} {'ready s':>7s}  tokens/s (decode-only tokens/s) by batch")
    for r in runs:
        res = r.result
        if r.kind == "llm":
            tps = "  ".join(f"b{e['batch']}: {e['tok_s']} ({e['decode_tok_s']})" for e in res.get("bench") or [])
            ready = res.get("engine_start_s")
        else:
            tps = f"1 request, {res.get('serve_tokens', a.serve_tokens)} tokens in {res.get('request_s')}s: " \
                  f"{res.get('tok_s')} tok/s" if res.get("tok_s") else ""
            ready = res.get("ready_s")
        L.append(f"{r.name:26s} {res.get('status', '?'):8s} {res.get('wall_s', '-')!s:>7s} {ready!s:>7s}  {tps}")
    L.append("what the plugin said (log lines):")
    for r in runs:
        found = r.result.get("log_lines") or {}
        load = found.get("plugin_load")
        said = [f"load line {'vllm-moonep ' + load[0][0] + ' hooked vLLM ' + load[0][1] + ' (' + load[0][2] + ' seams)' if load else 'absent'}"]
        for key, label in (("plugin_inactive", "inactive"), ("plugin_active", "active"), ("plugin_worker", "worker"),
                           ("plugin_graphs_kept", "graphs kept"), ("plugin_graphs_off", "graphs off"),
                           ("plugin_seam_error", "SEAM ERROR"), ("unknown_moonep_env", "unknown env")):
            if key in found:
                said.append(f"{label}: {' '.join(found[key][0])[:160]}")
        L.append(f"  {r.name:24s} " + "; ".join(said))
    L.append("token comparisons:")
    for c in checks:
        if "tokens" in c["check"]:
            L.append(f"  {_mark(c)} {c['check']}: {_detail(c)}")
    for mode, v in (verdicts or {}).items():
        if v["verdict"] == "identical":
            continue
        base = (f"{v.get('baseline')} ran" if v["baseline_run"] else
                f"baseline not run ({v.get('not_run')})" if v.get("baseline") is None else f"{v.get('baseline')} did not run")
        L.append(f"  {'PASS' if v['ok'] else 'FAIL'} {mode}: plugin vs vLLM's own run-to-run spread ({base}): "
                 f"{v['verdict']}: {v['why']}"[:600])
    others = [c for c in checks if "tokens" not in c["check"]]
    failed = [c for c in others if c["ok"] is False]
    L.append(f"other checks: {len(others) - len(failed)} of {len(others)} passed (runs ran, required and forbidden "
             "log lines, the graph mode vLLM resolved)" + (":" if failed else ""))
    for c in failed:
        L.append(f"  {_mark(c)} {c['check']}: {_detail(c)}")
    for r in runs:
        if r.result.get("status") not in ("ok", "skipped") and r.result.get("log_tail"):
            L.append(f"--- {r.name}: first error in the log: {r.result.get('first_error')}")
            L.append(f"--- last lines of {r.result.get('log')}:")
            L += ["    " + x[:300] for x in r.result["log_tail"][-12:]]
    bad = [c for c in checks if c["ok"] is False and c.get("strict", True)]
    spread = [m for m, v in (verdicts or {}).items() if v["verdict"] == "spread"]
    L.append("RESULT: " + ("PASS" if not bad else f"FAIL ({len(bad)} check(s))")
             + (f" ({', '.join(spread)}: plugin tokens within vLLM's run-to-run spread)" if spread and not bad else ""))
    return "\n".join(L)


def check(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    budget = Budget(a.budget)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(a.logs) if a.logs else out
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = a.model_dir or _default_dir(a.layers)
    info = write_model_dir(model_dir, a.layers)
    _say(f"model: {info['path']} ({info['layers']} layers, {info['param_gb']} GB of bf16 weights, "
         f"{'reused' if info['reused'] else 'written'})")
    runs = plan_runs(a, model_dir)
    pre = preflight(need_serve=any(r.kind == "serve" for r in runs))
    work = Path(model_dir).parent / (Path(model_dir).name + "-work")
    work.mkdir(parents=True, exist_ok=True)
    site = work / "site"
    written = write_entry_points(site, with_moonep=not pre["moonep_entry_point"])
    pre["entry_points_written"] = written
    _say(f"preflight: python {pre['python']}, torch {pre.get('torch_version')}, vllm {pre.get('vllm_version')} "
         f"({pre.get('vllm_dir')}), transformers {pre.get('transformers_version')}; _C {pre.get('vllm_C')}, "
         f"_moe_C {pre.get('vllm_moe_C')}, flash-attn ext {pre.get('flash_attn_ext')}; GPUs {pre['gpus']}; "
         f"moonep entry point {'found' if pre['moonep_entry_point'] else 'MISSING (written into ' + str(site) + ')'}")
    results: dict[str, Any] = {"tool": "vllm_model_check", "argv": sys.argv, "args": vars(a), "model": info,
                               "config": model_config(a.layers), "preflight": pre,
                               "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM", "CUDA", "NCCL", "TORCH", "PYTHONPATH"))}}
    setup_errors, warnings = [], []
    if pre["missing_llm"]:
        setup_errors.append("missing for vLLM's engine: " + ", ".join(pre["missing_llm"]))
    if pre["missing_serve"]:
        setup_errors.append("missing for vllm serve: " + ", ".join(pre["missing_serve"]))
    if not pre.get("vllm_C") or not pre.get("vllm_moe_C"):
        warnings.append(f"vLLM's compiled extensions not found in {pre.get('vllm_dir')}: _C_stable_libtorch "
                        f"{pre.get('vllm_C')}, _moe_C_stable_libtorch {pre.get('vllm_moe_C')} (the CUDA platform imports them)")
    if pre.get("flash_attn_ext") == []:
        warnings.append("vllm/vllm_flash_attn has neither _vllm_fa2_C nor _vllm_fa3_C: its __init__ raised ImportError "
                        "at import whatever the attention backend (an empty _vllm_fa3_C.py there let it pass)")
    if a.dp > 1 and len(pre["gpus"]) < a.dp:
        setup_errors.append(f"--dp {a.dp} needs {a.dp} GPUs, nvidia-smi lists {len(pre['gpus'])}")
    env = {k: v for k, v in os.environ.items()}
    if a.model_runner != "auto":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.model_runner == "v2" else "0"
    extra_env = dict(kv.split("=", 1) for kv in a.env)
    prompts = make_prompts(a.prompts, (a.prompt_len[0], a.prompt_len[1]), a.seed)
    bench_prompts = make_prompts(max(a.bench_batch or [1]), (24, 40), a.seed + 1)
    results["prompts"] = prompts
    for r in runs:
        e = child_env(env, plugin=r.plugin, site_dir=str(site), weights=a.weights, weights_seed=a.weights_seed,
                      extra=extra_env)
        r.result["env_diff"] = {k: e.get(k) for k in set(e) | set(os.environ) if e.get(k) != os.environ.get(k)}
    if a.dry_run or setup_errors:
        for r in runs:
            print(f"--- {r.name} (VLLM_MOONEP_PLUGIN={'<unset>' if r.plugin else '0'}):\n    "
                  + ("vllm serve " if r.kind == "serve" else "vllm.LLM ") + shlex.join(r.argv))
        for s in warnings:
            _say(f"WARNING: {s}")
        for s in setup_errors:
            _say(f"SET-UP ERROR: {s}")
        results["setup_errors"] = setup_errors
        results["setup_warnings"] = warnings
        results["runs"] = {r.name: {"argv": r.argv, "env_diff": r.result["env_diff"]} for r in runs}
        (out / a.json).write_text(json.dumps(results, indent=1, default=str))
        return 2 if setup_errors else 0
    for s in warnings:
        _say(f"WARNING: {s}")
    results["setup_warnings"] = warnings
    import_error = None
    for r in runs:
        if import_error:  # every later run would stop at the same import
            r.result.update({"status": "skipped", "why": f"{import_error[0]} failed at an import: {import_error[1]}"})
            _say(f"{r.name}: SKIPPED ({r.result['why'][:200]})")
            continue
        e = child_env(env, plugin=r.plugin, site_dir=str(site), weights=a.weights, weights_seed=a.weights_seed,
                      extra=extra_env)
        if r.kind == "llm":
            run_llm(r, a, e, logs, work, prompts, bench_prompts, budget)
        else:
            run_serve(r, a, e, logs, bench_prompts[0], budget)
        err = str(r.result.get("error") or "")
        imp = (r.result.get("log_lines") or {}).get("import_error")
        if r.result.get("status") == "failed" and r.result.get("stage", "engine") in ("import", "engine") and (
                imp or re.search(r"ImportError|ModuleNotFoundError", err)):
            import_error = (r.name, imp[0][0][:300] if imp else err[:300])
        results["runs"] = {x.name: x.result for x in runs}
        (out / a.json).write_text(json.dumps(results, indent=1, default=str))
    # a plugin/no-plugin token mismatch: the same run without the plugin once more, the baseline of
    # vLLM's own run-to-run spread (module doc), if the budget still has a run in it
    baseline_why: dict[str, str] = {}
    for mode, v in mode_verdicts(a, runs).items():
        if v["verdict"] == "identical":
            continue
        off = next(r for r in runs if r.name == f"llm-{mode}-noplugin")
        why_not = baseline_why_not(a, budget.left())
        if why_not:
            baseline_why[mode] = why_not
            _say(f"{mode}: tokens differ with the plugin; the baseline run is not started ({why_not})")
            continue
        _say(f"{mode}: tokens differ with the plugin; {baseline_name(mode)}: the run without the plugin once more "
             "(vLLM's own run-to-run spread)")
        r2 = Run(baseline_name(mode), "llm", mode, False, off.backend, list(off.argv))
        runs.append(r2)
        e = child_env(env, plugin=False, site_dir=str(site), weights=a.weights, weights_seed=a.weights_seed,
                      extra=extra_env)
        r2.result["env_diff"] = {k: e.get(k) for k in set(e) | set(os.environ) if e.get(k) != os.environ.get(k)}
        run_llm(r2, a, e, logs, work, prompts, bench_prompts, budget)
        results["runs"] = {x.name: x.result for x in runs}
        (out / a.json).write_text(json.dumps(results, indent=1, default=str))
    checks: list[dict[str, Any]] = []
    for r in runs:
        status = r.result.get("status")
        checks.append({"check": f"{r.name}: ran", "ok": status == "ok", "strict": True,
                       "detail": r.result.get("error") or r.result.get("why") or status})
        if status != "skipped":
            checks += [dict(c, strict=c.get("strict", True)) for c in check_lines(r, a)]
        if r.kind == "llm" and status == "ok":
            got = (r.result.get("resolved") or {}).get("cudagraph_mode")
            want_none = r.mode == "eager"
            checks.append({"check": f"{r.name}: vLLM resolved cudagraph_mode {'NONE' if want_none else 'with graphs'}",
                           "ok": (got == "NONE") == want_none, "strict": True, "detail": r.result.get("resolved")})
        if r.kind == "llm" and status == "ok" and r.result.get("texts_decode_ok") is False:
            checks.append({"check": f"{r.name}: generated texts decode back to the token ids", "ok": False,
                           "strict": True, "detail": r.result.get("texts_head")})
    checks += comparisons(a, runs, baseline_why)
    verdicts = mode_verdicts(a, runs, baseline_why)
    total = time.monotonic() - t_start
    text = summary_text(a, info, runs, checks, total, verdicts)
    results.update({"checks": checks, "total_s": round(total, 1), "baseline": verdicts,
                    "ok": not any(c["ok"] is False and c.get("strict", True) for c in checks)})
    (out / a.json).write_text(json.dumps(results, indent=1, default=str))
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if results["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("check", "write", "_llm", "-h", "--help"):
        argv.insert(0, "check")  # the runs are the default command
    a = build_parser().parse_args(argv)
    if a.cmd == "_llm":
        return _llm_child(a.spec)
    if a.cmd == "write":
        info = write_model_dir(a.model_dir or _default_dir(a.layers), a.layers)
        print(json.dumps(info))
        return 0
    if a.dp < 1 or a.prompts < 1 or a.tokens < 1 or a.bench_tokens < 2 or a.serve_tokens < 1:
        build_parser().error("--dp, --prompts, --tokens, --serve-tokens must be >= 1 and --bench-tokens >= 2")
    if any(b < 1 for b in a.bench_batch):
        build_parser().error("--bench-batch sizes must be >= 1")
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
