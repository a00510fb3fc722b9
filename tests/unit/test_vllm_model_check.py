"""``vllm_model_check`` (a Qwen3-30B-A3B-shaped model through vLLM on a GPU) where no GPU is needed:
the model directory and its tokenizer, the engine arguments, the log lines it looks for (against the
plugin's own messages), the token comparison and the checks built on it, the scaled dummy weights,
process-group clean-up, and the dry run. One ``vllm`` case builds vLLM 0.33's engine config from the
tool's exact arguments on its CPU platform (told it captures graphs)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from vllm_moonep.tools import vllm_model_check as vmc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vmc") / "model"
    info = vmc.write_model_dir(d, layers=2)
    assert info["layers"] == 2 and not info["reused"]
    return d


def test_config_is_qwen3_30b_a3b_and_layers_cut(model_dir):
    """A wrong public value (or a key vLLM's qwen3_moe.py reads left out) makes a different model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    full = vmc.model_config(None)
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "max_window_layers")} == \
        {k: v for k, v in full.items() if k not in ("num_hidden_layers", "max_window_layers")}
    assert cfg["num_hidden_layers"] == 2 and full["num_hidden_layers"] == 48
    want = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, decoder_sparse_step=1,
                mlp_only_layers=[], tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu")
    assert {k: full[k] for k in want} == want
    assert 60e9 < vmc.param_bytes(full) < 62e9, "Qwen3-30B-A3B is 30.5B parameters (61 GB in bf16)"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert not {"temperature", "top_k", "top_p"} & set(gen), "sampling defaults would change serve's requests"
    with pytest.raises(ValueError):
        vmc.model_config(49)


def test_model_dir_is_reused_when_unchanged(model_dir):
    """Rewriting the 3.5 MB tokenizer on every run cost time on the device."""
    t = (model_dir / "tokenizer.json").stat().st_mtime_ns
    assert vmc.write_model_dir(model_dir, layers=2)["reused"]
    assert (model_dir / "tokenizer.json").stat().st_mtime_ns == t


def test_transformers_loads_config_and_tokenizer_offline(model_dir, monkeypatch, caplog):
    """The tokenizer must load offline with AutoTokenizer, cover every model id and round-trip text."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 128 and cfg.num_hidden_layers == 2
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    assert rope["rope_theta"] == 1000000.0
    with caplog.at_level(logging.WARNING):
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert "incorrect regex pattern" not in caplog.text
    assert len(tok) == 151936 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    ids = [0, 17, 151642, 151935]
    text = " ".join(vmc.token_text(i) for i in ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert tok.decode(ids) == text
    assert vmc.text_to_ids(tok.decode([5, 151645, 9], skip_special_tokens=True)) == vmc.without_specials([5, 151645, 9])
    assert tok.decode([5, 151645, 9]).split() == ["w5", "<|im_end|>", "w9"]


def test_token_text_round_trip_and_prompts():
    assert vmc.text_to_ids("w3 <|im_end|>  w151935\n w0") == [3, 151645, 151935, 0]
    with pytest.raises(ValueError):
        vmc.text_to_ids("w3 hello")
    p = vmc.make_prompts(4, (7, 61), 0)
    assert p == vmc.make_prompts(4, (7, 61), 0) and p != vmc.make_prompts(4, (7, 61), 1)
    assert [len(x) for x in p] == [7, 25, 43, 61]
    assert all(0 <= i < vmc.PROMPT_VOCAB for x in p for i in x)


def test_engine_argv_eager_graphs_dp():
    """A graphs run that torch.compiles (mode 3) or captures sizes above --max-num-seqs costs device minutes."""
    e = vmc.engine_argv("/m", mode="eager")
    assert "--enforce-eager" in e and "--compilation-config" not in e
    assert e[e.index("--attention-backend") + 1] == "TRITON_ATTN" and e[e.index("--load-format") + 1] == "dummy"
    assert "--no-enable-prefix-caching" in e
    assert e[-3:] == ["--enable-expert-parallel", "--all2all-backend", "moonep"]
    g = vmc.engine_argv("/m", mode="graphs", max_num_seqs=8, capture_sizes=[1, 4, 8, 16])
    cc = json.loads(g[g.index("--compilation-config") + 1])
    assert cc == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 4, 8]}
    assert "--enforce-eager" not in g and "--data-parallel-size" not in g
    d = vmc.engine_argv("/m", mode="graphs", dp=2, backend="allgather_reducescatter", extra=["--foo", "1"])
    assert d[d.index("--data-parallel-size") + 1] == "2" and d[-4:] == ["--all2all-backend", "allgather_reducescatter", "--foo", "1"]
    assert vmc.strip_option(d, "--data-parallel-size") == [a for i, a in enumerate(d) if i not in
                                                          (d.index("--data-parallel-size"), d.index("--data-parallel-size") + 1)]
    assert "--all2all-backend" not in vmc.engine_argv("/m", mode="eager", backend=None, ep=False)
    with pytest.raises(ValueError):
        vmc.engine_argv("/m", mode="cudagraph")


def _inactive_message(caplog) -> str:
    """The plugin's own warning for --all2all-backend moonep at DP size 1 (checks.check_engine_config)."""
    from vllm_moonep.vllm_plugin import checks

    pc = types.SimpleNamespace(all2all_backend="moonep", enable_expert_parallel=True, data_parallel_size=1,
                               tensor_parallel_size=1, prefill_context_parallel_size=1)
    cfg = types.SimpleNamespace(additional_config={}, parallel_config=pc, model_config=types.SimpleNamespace(is_moe=True))
    checks._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_moonep"):
        checks.check_engine_config(cfg)
    return caplog.text


def test_log_patterns_match_the_plugins_messages(caplog):
    """A reworded plugin message made the device run report the line as missing."""
    text = _inactive_message(caplog)
    # the load line as docs/SERVING.md shows it (seams.apply_seams builds it; the vllm case below sees the real one)
    text += ("\nINFO 12-01 10:00:00 [hooks.py:71] vllm-moonep 0.1.0 hooked vLLM 0.33.0 (12 seams: MoonEPAll2AllManager, "
             "init_model_parallel_group, get_ep_all2all_manager, MoonEPPrepareAndFinalize, MOONEP_DEFAULT_*, MoonEPExperts, "
             "gather_moonep_weight_layout, EngineArgs.create_engine_config, VllmConfig._set_compile_ranges, "
             "CompilationConfig.set_splitting_ops_for_v1); --all2all-backend moonep builds vllm-moonep's classes\n"
             "(EngineCore pid=9) INFO [gpu_model_runner.py:1] Model loading took 57.01 GiB memory and 12.345678 seconds\n"
             "INFO Graph capturing finished in 7 secs, took 0.52 GiB\n"
             "vllm_model_check: scaled dummy weights: 290 tensors (96 expert tensors, per global expert id), ...\n")
    found = vmc.scan_log(text)
    assert found["plugin_inactive"][0][0].startswith("--data-parallel-size is 1")
    assert found["plugin_load"] == [["0.1.0", "0.33.0", "12"]]
    assert found["model_loading"] == [["57.01", "12.345678"]] and found["graph_capture"] == [["7", "0.52"]]
    assert found["scaled_weights"] == [["290", "96"]]
    assert "traceback" not in found and "plugin_active" not in found
    assert vmc.scan_log(seams_error := "WARNING vllm-moonep cannot hook vLLM 0.34.0: seam x.y differs")["plugin_seam_error"]
    assert seams_error


def test_expected_lines_by_case():
    need, forbid = vmc.expected_lines(plugin=True, dp=1, ep=True, backend="moonep", mode="graphs", weights="scaled")
    assert {"plugin_load", "plugin_inactive", "scaled_weights", "graph_capture"} <= set(need)
    assert {"plugin_active", "traceback", "unknown_moonep_env"} <= set(forbid)
    need, forbid = vmc.expected_lines(plugin=False, dp=1, ep=True, backend="moonep", mode="eager", weights="vllm")
    assert need == [] and {"plugin_load", "plugin_inactive", "graph_capture", "unknown_moonep_env"} <= set(forbid)
    need, forbid = vmc.expected_lines(plugin=True, dp=2, ep=True, backend="moonep", mode="graphs", weights="vllm")
    assert {"plugin_load", "plugin_active", "plugin_worker", "plugin_graphs_kept"} <= set(need) and "plugin_inactive" in forbid
    need, forbid = vmc.expected_lines(plugin=True, dp=2, ep=True, backend="allgather_reducescatter", mode="eager",
                                      weights="vllm")
    assert "plugin_active" in forbid and "plugin_inactive" in forbid and "plugin_load" in need


def test_compare_tokens():
    a = [[1, 2, 3], [4, 5, 6]]
    assert vmc.compare_tokens(a, [[1, 2, 3], [4, 5, 6]])["equal"] is True
    c = vmc.compare_tokens(a, [[1, 2, 3], [4, 9, 6]])
    assert c["equal"] is False and c["first_mismatch"] == [1, 1, 5, 9] and c["common_prefix"] == [3, 1]
    assert vmc.compare_tokens(a, [[1, 2], [4, 5, 6]])["first_mismatch"] == [0, 2, 3, None]
    assert vmc.compare_tokens(a, [[1, 2, 7], [4, 5, 8]], limit=2)["equal"] is True
    assert vmc.compare_tokens(a, [[1, 2, 3]])["equal"] is False
    assert vmc.compare_tokens(None, a)["equal"] is None


def _args(**kw):
    a = vmc.build_parser().parse_args(["check", "--out", "/tmp/unused"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _llm_result(tokens, digests, status="ok", mode="eager"):
    return {"status": status, "tokens": tokens, "bench": [{"batch": b, "digest": d, "tok_s": 1.0, "decode_tok_s": 1.0,
                                                           **({"tokens_ids": [[7, 8, 9, 10]]} if b == 1 else {})}
                                                          for b, d in digests.items()],
            "resolved": {"cudagraph_mode": "NONE" if mode == "eager" else "FULL_DECODE_ONLY"}}


def test_comparisons_fail_on_any_difference_and_skip_nothing_silently():
    """The plugin-on/off comparison must fail on one differing token, and a serve answer must match offline."""
    a = _args(modes=["eager"], serve="eager", serve_tokens=3)
    runs = vmc.plan_runs(a, "/m")
    assert [r.name for r in runs] == ["llm-eager-noplugin", "llm-eager-plugin", "serve-eager-plugin"]
    off, on, srv = runs
    on.result = _llm_result([[1, 2]], {1: "x", 32: "y"})
    off.result = _llm_result([[1, 2]], {1: "x", 32: "y"})
    srv.result = {"status": "ok", "tokens": [[7, 8, 9]]}
    cs = vmc.comparisons(a, runs)
    assert [c["ok"] for c in cs if c["strict"]] == [True, True, True], cs
    off.result = _llm_result([[1, 3]], {1: "x", 32: "z"})
    srv.result = {"status": "ok", "tokens": [[7, 8, 0]]}
    cs = vmc.comparisons(a, runs)
    assert [c["ok"] for c in cs if c["strict"]] == [False, False, False], cs
    off.result = {"status": "timeout"}
    cs = vmc.comparisons(a, runs)
    assert cs[0]["ok"] is False and "not compared" in cs[0]["detail"]
    text = vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0)
    assert "RESULT: FAIL" in text


# ------------------------------------------------- the baseline: vLLM's own run-to-run spread
_ON = [[1, 2, 3], [4, 5, 6]]
_OFF = [[1, 2, 9], [4, 5, 6]]  # a run without the plugin that differs at (seq 0, pos 2)


def _sets(tokens, digest32="d32"):
    return vmc.pair_sets(_llm_result(tokens, {1: "d1", 32: digest32}))


def _graph_runs(on, off, off2=None, **kw):
    """llm-graphs-plugin, llm-graphs-noplugin (and llm-graphs-noplugin-2 where ``off2``) with these results."""
    a = _args(modes=["graphs"], serve="none", **kw)
    runs = vmc.plan_runs(a, "/m")
    by = {r.name: r for r in runs}
    by["llm-graphs-plugin"].result, by["llm-graphs-noplugin"].result = on, off
    if off2 is not None:
        runs.append(vmc.Run(vmc.baseline_name("graphs"), "llm", "graphs", False, "moonep",
                            list(by["llm-graphs-noplugin"].argv), off2))
    return a, runs


def _strict(cs):
    return {c["check"].split(": ", 1)[1]: c["ok"] for c in cs if c["strict"]}


def test_baseline_identical_passes_without_a_baseline_run():
    """A check that started the extra run (or failed for want of it) when the tokens were already
    identical: device time spent, or a pass turned into a failure, for nothing."""
    v = vmc.baseline_verdict(_sets(_ON), _sets(_ON), None, "--baseline-runs 0")
    assert v["ok"] and v["verdict"] == "identical" and not v["baseline_run"] and "not_run" not in v
    assert all(s["verdict"] == "identical" for s in v["sets"].values()) and set(v["sets"]) == {"greedy", "batch 1", "batch 32"}
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "d32"}), _llm_result(_ON, {1: "d1", 32: "d32"}))
    assert vmc.mode_verdicts(a, runs)["graphs"]["verdict"] == "identical"  # check() starts no baseline on this
    cs = vmc.comparisons(a, runs)
    assert all(_strict(cs).values()) and all(c.get("verdict") in (None, "identical") for c in cs), cs
    assert "RESULT: PASS" in vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0, vmc.mode_verdicts(a, runs))


def test_baseline_equal_to_the_plugin_run_passes_as_run_to_run_spread():
    """The H200 graphs run: the plugin's tokens differed from one no-plugin run, and a second
    no-plugin run matched the plugin's token for token; one pairwise comparison called that a
    plugin failure when it was vLLM's own spread."""
    v = vmc.baseline_verdict(_sets(_ON, "p32"), _sets(_OFF, "x32"), _sets(_ON, "p32"))
    assert v["ok"] and v["verdict"] == "spread" and v["why"] == vmc.SPREAD_WHY and v["baseline_run"]
    assert v["sets"]["greedy"] == {"plugin_vs_noplugin": False, "plugin_vs_noplugin_2": True,
                                   "noplugin_vs_noplugin_2": False, "verdict": "spread", "why": vmc.SPREAD_WHY, "ok": True}
    assert v["sets"]["batch 1"]["verdict"] == "identical" and v["sets"]["batch 32"]["verdict"] == "spread"
    # a set may match either no-plugin run: greedy the first, batch 32 the second
    v = vmc.baseline_verdict(_sets(_ON, "p32"), _sets(_ON, "x32"), _sets(_OFF, "p32"))
    assert v["ok"] and v["verdict"] == "spread"
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "p32"}), _llm_result(_OFF, {1: "d1", 32: "x32"}),
                          _llm_result(_ON, {1: "d1", 32: "p32"}, mode="graphs"))
    cs = vmc.comparisons(a, runs)
    assert all(_strict(cs).values()), cs
    g = next(c for c in cs if c["check"].startswith("graphs: greedy tokens with the plugin"))
    assert g["verdict"] == "spread" and g["detail"]["first_mismatch"] == [0, 2, 3, 9], "the pairwise mismatch is kept"
    assert g["baseline"]["run"] == "llm-graphs-noplugin-2" and g["baseline"]["plugin_vs_noplugin_2"]["equal"]
    assert g["baseline"]["noplugin_vs_noplugin_2"]["equal"] is False
    text = vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0, vmc.mode_verdicts(a, runs))
    assert vmc.SPREAD_WHY in text and "llm-graphs-noplugin-2" in text
    assert text.rstrip().endswith("RESULT: PASS (graphs: plugin tokens within vLLM's run-to-run spread)")


def test_baseline_identical_to_the_first_noplugin_run_fails():
    """A spread rule that passed any mismatch once a baseline ran: when the two runs without the
    plugin agree and the plugin's differs, the plugin changes the tokens."""
    v = vmc.baseline_verdict(_sets(_ON), _sets(_OFF), _sets(_OFF))
    assert not v["ok"] and v["verdict"] == "plugin_differs" and "the plugin changes the tokens" in v["why"]
    assert v["sets"]["greedy"]["noplugin_vs_noplugin_2"] and not v["sets"]["greedy"]["plugin_vs_noplugin_2"]
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "d32"}), _llm_result(_OFF, {1: "d1", 32: "d32"}),
                          _llm_result(_OFF, {1: "d1", 32: "d32"}))
    cs = vmc.comparisons(a, runs)
    assert _strict(cs) == {"greedy tokens with the plugin == with VLLM_MOONEP_PLUGIN=0": False,
                           "tokens/s runs' tokens with the plugin == without (digests per batch)": True}
    text = vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0, vmc.mode_verdicts(a, runs))
    assert "FAIL graphs: plugin vs vLLM's own run-to-run spread" in text and "RESULT: FAIL (1 check(s))" in text


def test_each_set_needs_its_own_match_within_the_spread():
    """A whole-run rule ("some set matched the baseline") would have passed the H200 data, where the
    greedy tokens were within the spread but the batch-32 digest of both no-plugin runs agreed and
    the plugin's differed."""
    v = vmc.baseline_verdict(_sets(_ON, "p32"), _sets(_OFF, "x32"), _sets(_ON, "x32"))
    assert not v["ok"] and v["verdict"] == "plugin_differs"
    assert v["sets"]["greedy"]["verdict"] == "spread" and v["sets"]["batch 32"]["verdict"] == "plugin_differs"
    assert v["why"].startswith("batch 32: the two runs without the plugin are identical")
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "p32"}), _llm_result(_OFF, {1: "d1", 32: "x32"}),
                          _llm_result(_ON, {1: "d1", 32: "x32"}))
    assert _strict(vmc.comparisons(a, runs)) == {"greedy tokens with the plugin == with VLLM_MOONEP_PLUGIN=0": True,
                                                 "tokens/s runs' tokens with the plugin == without (digests per batch)": False}


def test_baseline_different_from_both_fails_with_both_mismatches():
    """Passing on "the no-plugin runs differ from each other" alone: the plugin's tokens must equal
    one of them; and the report must show both mismatches, not only the first pair's."""
    third = [[1, 7, 3], [4, 5, 6]]
    v = vmc.baseline_verdict(_sets(_ON), _sets(_OFF), _sets(third))
    assert not v["ok"] and v["verdict"] == "differs_from_both" and "equal neither" in v["why"]
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "d32"}), _llm_result(_OFF, {1: "d1", 32: "d32"}),
                          _llm_result(third, {1: "d1", 32: "d32"}))
    cs = vmc.comparisons(a, runs)
    g = next(c for c in cs if c["check"].startswith("graphs: greedy tokens with the plugin"))
    assert g["ok"] is False and g["verdict"] == "differs_from_both"
    assert g["detail"]["first_mismatch"] == [0, 2, 3, 9] and g["baseline"]["plugin_vs_noplugin_2"]["first_mismatch"] == [0, 1, 2, 7]
    text = vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0, vmc.mode_verdicts(a, runs))
    assert "[0, 2, 3, 9]" in text and "[0, 1, 2, 7]" in text and "RESULT: FAIL" in text


def test_baseline_not_run_fails_and_says_why():
    """A mismatch with no baseline (budget spent, --baseline-runs 0, or the baseline run failed)
    must fail as before, and say the baseline was not run rather than leave it unexplained; nor may
    the baseline start with less than --min-run-s of --budget left."""
    a = _args(modes=["graphs"], serve="none", budget=470.0, run_timeout=200.0, min_run_s=60.0)
    assert vmc.baseline_why_not(a, 300.0) is None
    why = vmc.baseline_why_not(a, 50.0)
    assert why and why.startswith("budget: 50s of --budget left") and "--min-run-s 60s" in why
    assert vmc.baseline_why_not(_args(baseline_runs=0), 1000.0) == "--baseline-runs 0"
    v = vmc.baseline_verdict(_sets(_ON), _sets(_OFF), None, why)
    assert not v["ok"] and v["verdict"] == "no_baseline" and v["not_run"] == why and why in v["why"]
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "d32"}), _llm_result(_OFF, {1: "d1", 32: "d32"}))
    cs = vmc.comparisons(a, runs, {"graphs": why})
    g = next(c for c in cs if c["check"].startswith("graphs: greedy tokens with the plugin"))
    assert g["ok"] is False and g["verdict"] == "no_baseline" and why in g["why"] and "baseline" not in g
    text = vmc.summary_text(a, {"layers": 2, "param_gb": 3.7}, runs, cs, 1.0, vmc.mode_verdicts(a, runs, {"graphs": why}))
    assert f"baseline not run ({why})" in text and "RESULT: FAIL (1 check(s))" in text
    # a baseline run that failed is no baseline either
    a, runs = _graph_runs(_llm_result(_ON, {1: "d1", 32: "d32"}), _llm_result(_OFF, {1: "d1", 32: "d32"}),
                          {"status": "timeout", "error": "no result"})
    v = vmc.mode_verdicts(a, runs)["graphs"]
    assert not v["ok"] and v["verdict"] == "no_baseline" and "llm-graphs-noplugin-2 timeout" in v["not_run"]


def test_check_lines_uses_the_run_state(tmp_path):
    a = _args(weights="vllm")
    run = vmc.plan_runs(a, "/m")[0]  # llm-eager-noplugin
    run.result = {"log_lines": vmc.scan_log("vllm-moonep 0.1.0 hooked vLLM 0.33.0 (3 seams: a); --all2all-backend "
                                            "moonep builds vllm-moonep's classes")}
    bad = [c for c in vmc.check_lines(run, a) if not c["ok"]]
    assert [c["check"] for c in bad] == ["llm-eager-noplugin: log has no plugin_load"]


class _Mgr:
    def __init__(self, expert_map):
        self.expert_map = expert_map


class _Experts(torch.nn.Module):
    """Stands for vLLM's RoutedExperts: w13/w2 [E_local, ...], expert_map_manager, local_num_experts."""

    def __init__(self, n_local, expert_map):
        super().__init__()
        self.local_num_experts = n_local
        self.expert_map_manager = _Mgr(expert_map)
        self.w13_weight = torch.nn.Parameter(torch.zeros(n_local, 6, 4), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(n_local, 4, 3), requires_grad=False)


class _Model(torch.nn.Module):
    def __init__(self, n_local, expert_map):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.proj = torch.nn.Linear(4, 8, bias=True)
        self.experts = _Experts(n_local, expert_map)


def test_scaled_weights_are_unit_scale_and_the_same_expert_rows_on_every_ep_rank():
    """vLLM's dummy fill gives every tensor U(+-1e-3) from one seed: the MoE vanished in bf16 rounding;
    and per-tensor seeds would give EP ranks other expert rows than one GPU holds."""
    full = _Model(4, None)
    assert vmc.scaled_init(full, 7) == (5, 2)
    assert torch.equal(full.norm, torch.ones(4)) and torch.equal(full.proj.bias, torch.zeros(8))
    a = (3.0 / 4) ** 0.5
    assert 0.5 * a < full.proj.weight.abs().max() <= a
    rank1 = _Model(2, torch.tensor([-1, -1, 0, 1]))  # EP rank 1 of 2 holds global experts 2, 3
    vmc.scaled_init(rank1, 7)
    assert torch.equal(rank1.experts.w13_weight, full.experts.w13_weight[2:])
    assert torch.equal(rank1.experts.w2_weight, full.experts.w2_weight[2:])
    assert torch.equal(rank1.proj.weight, full.proj.weight)
    other = _Model(4, None)
    vmc.scaled_init(other, 8)
    assert not torch.equal(other.proj.weight, full.proj.weight)
    assert not torch.equal(full.experts.w13_weight[0], full.experts.w13_weight[1])


def test_check_plugin_is_a_no_op_unless_asked(monkeypatch):
    """vLLM calls general plugins unguarded: the tool's must neither raise nor patch by default."""
    monkeypatch.delenv(vmc.WEIGHTS_ENV, raising=False)
    vmc.register_check_plugin()
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.dummy_loader", None)  # import fails
    monkeypatch.setenv(vmc.WEIGHTS_ENV, "scaled")
    vmc.register_check_plugin()  # says so on stderr, does not raise


def test_entry_points_written(tmp_path):
    written = vmc.write_entry_points(tmp_path, with_moonep=True)
    assert len(written) == 2
    ep = (tmp_path / "vllm_moonep_model_check-0.0.0.dist-info" / "entry_points.txt").read_text()
    assert "vllm_moonep.tools.vllm_model_check:register_check_plugin" in ep
    code = ("import importlib.metadata as m; print(sorted(e.name for e in m.entry_points(group='vllm.general_plugins')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert vmc.CHECK_PLUGIN_NAME in out.stdout and "moonep" in out.stdout


def test_kill_group_stops_children_that_outlive_their_parent():
    """An engine core left running after its LLM process held the GPU's memory for the next run."""
    p = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"], start_new_session=True)
    time.sleep(0.3)
    t = time.monotonic()
    did = vmc.kill_group(p, grace=1.0)
    assert did == "SIGKILL" and not vmc._group_alive(p.pid) and time.monotonic() - t < 10


def test_dry_run_plans_every_run_and_writes_results(tmp_path, capsys):
    # no subcommand: check (tools/gpu_vllm.sh's model step calls it so), with its JSON under another name
    rc = vmc.main(["--out", str(tmp_path / "out"), "--model-dir", str(tmp_path / "m"), "--layers", "1",
                   "--dry-run", "--dp", "1", "--json", "model.json"])
    res = json.loads((tmp_path / "out" / "model.json").read_text())
    assert rc == (2 if res["setup_errors"] else 0)
    # the runs without the plugin first: a machine's first run of a mode is never the plugin's
    assert list(res["runs"]) == ["llm-eager-noplugin", "llm-eager-plugin", "llm-graphs-noplugin", "llm-graphs-plugin",
                                 "serve-graphs-plugin"]
    env = res["runs"]["llm-eager-noplugin"]["env_diff"]
    assert env["VLLM_MOONEP_PLUGIN"] == "0" and env[vmc.WEIGHTS_ENV] == "scaled"
    assert "VLLM_MOONEP_PLUGIN" not in res["runs"]["llm-eager-plugin"]["env_diff"] or \
        res["runs"]["llm-eager-plugin"]["env_diff"]["VLLM_MOONEP_PLUGIN"] is None
    assert "vllm serve --model" in capsys.readouterr().out


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        vmc.main(["check", "--out", "/tmp/x", "--bench-tokens", "1"])
    with pytest.raises(SystemExit):
        vmc.main(["check", "--out", "/tmp/x", "--graph-mode", "CUDA"])


# ----------------------------------------------------------------------- through vLLM's own code
_CONFIG_PROBE = r"""
import json, logging, os, sys
sys.path.insert(0, os.environ["REPO_ROOT"])
from vllm.plugins import load_general_plugins
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed
configure_logging_if_needed(LoggingConfig())
load_general_plugins()
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from tests.vllm.workers import graph_capable_platform
out = {"patched": bool(getattr(DummyModelLoader.load_weights, "_moonep_check", False))}
with graph_capable_platform():
    for name, argv in json.loads(os.environ["ARGVS"]).items():
        ea = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv))
        cc = ea.create_engine_config().compilation_config
        out[name] = [cc.cudagraph_mode.name, int(cc.mode), list(cc.cudagraph_capture_sizes or [])]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("plugin", ["1", "0"])
def test_vllm_builds_the_tools_engine_configs(model_dir, tmp_path, plugin):
    """The exact arguments of the device run through vLLM 0.33's parser and config build: an argument
    vLLM does not take, or a graph setting it rewrites, would have cost a device run to find out."""
    argvs = {m: vmc.engine_argv(str(model_dir), mode=m, max_num_seqs=8) + ["--disable-log-stats"]
             for m in ("eager", "graphs")}
    site = tmp_path / "site"
    vmc.write_entry_points(site, with_moonep=not vmc.moonep_entry_point())
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_MOONEP_PLUGIN": plugin, "ARGVS": json.dumps(argvs),
           "REPO_ROOT": str(ROOT), vmc.WEIGHTS_ENV: "scaled", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _CONFIG_PROBE], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["patched"]
    assert res["eager"] == ["NONE", 0, []]
    assert res["graphs"] == ["FULL_DECODE_ONLY", 0, [1, 2, 4, 8]]
    found = vmc.scan_log(out.stdout + out.stderr)
    need, forbid = vmc.expected_lines(plugin=plugin == "1", dp=1, ep=True, backend="moonep", mode="eager",
                                      weights="vllm")
    assert set(need) <= set(found), (need, sorted(found))
    assert not ({"plugin_load", "plugin_inactive", "unknown_moonep_env", "plugin_seam_error"} & set(forbid) & set(found))


_FAKE_SERVER = r'''
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
print("INFO vllm-moonep 0.1.0 hooked vLLM 0.33.0 (12 seams: a, b); --all2all-backend moonep builds vllm-moonep's classes")
print("WARNING vllm-moonep: --all2all-backend moonep is set but MoonEP will not run: --data-parallel-size is 1 "
      "(MoonEP runs with data parallelism: --data-parallel-size > 1). vLLM runs its default MoE path")
print("vllm_model_check: scaled dummy weights: 5 tensors (2 expert tensors, per global expert id)")
print("Graph capturing finished in 1 secs, took 0.10 GiB", flush=True)
time.sleep(1.5)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["ignore_eos"] and body["model"] == "moonep-check"
        ids = [(sum(body["prompt"]) + i) % 151936 for i in range(body["max_tokens"])]
        reply = {"choices": [{"text": " ".join(f"w{i}" for i in ids), "token_ids": ids, "finish_reason": "length"}],
                 "usage": {"completion_tokens": len(ids)}}
        data = json.dumps(reply).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.mark.vllm  # the preflight wants vLLM's modules present
def test_serve_run_waits_for_health_asks_once_and_stops_the_server(tmp_path):
    """The serve run's plumbing against a stand-in server (vLLM's own cannot start without a GPU):
    /health polled until it answers, the completion request, its tokens, the log checks, the stop."""
    fake = tmp_path / "fake_server.py"
    fake.write_text(_FAKE_SERVER)
    out = tmp_path / "out"
    rc = vmc.main(["check", "--out", str(out), "--model-dir", str(tmp_path / "m"), "--layers", "1", "--modes",
                   "--serve", "graphs", "--serve-cmd", str(fake), "--serve-tokens", "5", "--budget", "120",
                   "--serve-timeout", "60", "--min-run-s", "5"])
    res = json.loads((out / "results.json").read_text())
    srv = res["runs"]["serve-graphs-plugin"]
    assert srv["status"] == "ok" and srv["token_ids_returned"] and len(srv["tokens"][0]) == 5, srv
    assert srv["stop"] in ("SIGTERM", "exited") and srv["ready_s"] >= 1.5
    bad = [c for c in res["checks"] if c["ok"] is False]
    assert bad == [] and rc == 0, bad
    assert (out / "summary.txt").read_text().rstrip().endswith("RESULT: PASS")


_FAKE_VLLM = r'''
import argparse, json, os, sys, types
class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, argv=None, namespace=None):
        return self.parse_known_args(argv, namespace)[0]
plugin = os.environ.get("VLLM_MOONEP_PLUGIN", "1") != "0"
drift = 0
dp_rank = int(os.environ.get("VLLM_DP_RANK", "0"))

class EngineArgs:
    @staticmethod
    def add_cli_args(p):
        p.add_argument("--model"); p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--compilation-config", default=None); p.add_argument("--all2all-backend", default=None)
        return p
    @classmethod
    def from_cli_args(cls, ns):
        e = cls(); e.ns = ns; return e

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class LLM:
    @classmethod
    def from_engine_args(cls, ea):
        self = cls()
        ns = ea.ns
        if plugin:
            print("vllm-moonep 0.1.0 hooked vLLM 0.33.0 (12 seams: a); --all2all-backend moonep builds vllm-moonep's classes")
            print("vllm-moonep: --all2all-backend moonep is set but MoonEP will not run: --data-parallel-size is 1 (x). vLLM runs its")
        print("vllm_model_check: scaled dummy weights: 5 tensors (2 expert tensors, per global expert id)")
        graphs = not ns.enforce_eager
        if graphs:
            print("Graph capturing finished in 1 secs, took 0.10 GiB")
        mode = json.loads(ns.compilation_config)["cudagraph_mode"] if graphs else "NONE"
        global drift
        drift = int(os.environ.get("FAKE_DRIFT", "0"))
        once = os.environ.get("FAKE_DRIFT_ONCE")  # the first graphs run without the plugin drifts, later ones not
        if once and graphs and not plugin and not os.path.exists(once):
            open(once, "w").close()
            drift = 1
        cc = types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(name=mode), mode=0, cudagraph_capture_sizes=[])
        pc = types.SimpleNamespace(all2all_backend=ns.all2all_backend, data_parallel_size=1)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(compilation_config=cc, parallel_config=pc),
                                                engine_core=types.SimpleNamespace(shutdown=lambda: None))
        return self
    def generate(self, prompts, sp, use_tqdm=False):
        outs = []
        for p in prompts:
            ids = [(sum(p["prompt_token_ids"]) * 7 + i + (0 if plugin else drift)) % 151936 for i in range(sp.max_tokens)]
            o = types.SimpleNamespace(token_ids=ids, text=" ".join(f"w{i}" for i in ids if i not in (151643, 151644, 151645)))
            outs.append(types.SimpleNamespace(outputs=[o]))
        return outs
'''


@pytest.mark.parametrize("drift,dp", [(0, 1), (1, 1), (0, 2), ("once", 1)])
def test_llm_runs_end_to_end_with_a_stand_in_engine(tmp_path, monkeypatch, drift, dp):
    """The orchestration of the llm runs (child processes, results, log checks, comparisons, DP
    ranks' prompts back in order, summary, exit status) with a stand-in for vLLM's LLM API: one
    token that differs in every run without the plugin must fail the run (after each mode's baseline
    run agreed with the first no-plugin run); one that differs in the first graphs run without the
    plugin only is vLLM's run-to-run spread, which the baseline run shows."""
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(_FAKE_VLLM)
    monkeypatch.setenv(vmc.FAKE_VLLM_ENV, str(fake))
    monkeypatch.setenv("FAKE_DRIFT", "0" if drift == "once" else str(drift))
    if drift == "once":
        monkeypatch.setenv("FAKE_DRIFT_ONCE", str(tmp_path / "drifted"))
    monkeypatch.setattr(vmc, "preflight", lambda need_serve: {"python": "x", "missing_llm": [], "missing_serve": [],
                                                              "vllm_C": ["c"], "vllm_moe_C": ["m"], "gpus": ["g"] * dp,
                                                              "moonep_entry_point": True, "flash_attn_ext": ["f"]})
    out = tmp_path / "out"
    rc = vmc.main(["check", "--out", str(out), "--model-dir", str(tmp_path / "m"), "--layers", "1", "--serve", "none",
                   "--prompts", "3", "--tokens", "5", "--bench-batch", "1", "4", "--bench-tokens", "6", "--dp", str(dp),
                   "--budget", "200", "--run-timeout", "60", "--min-run-s", "5"])
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert all(r["status"] == "ok" for r in runs.values()), {k: (r["status"], r.get("log_tail")) for k, r in runs.items()}
    on = runs["llm-eager-plugin"]
    assert [len(s) for s in on["tokens"]] == [5, 5, 5] and on["texts_decode_ok"]
    want = [[(sum(p) * 7 + i) % 151936 for i in range(5)] for p in res["prompts"]]
    assert on["tokens"] == want, "DP ranks' tokens must come back in prompt order"
    assert [e["batch"] for e in on["bench"]] == [1, 4] and on["bench"][0]["tokens_ids"]
    failed = sorted(c["check"] for c in res["checks"] if c["ok"] is False)
    summary = (out / "summary.txt").read_text()
    if drift == "once":
        assert rc == 0 and failed == ["noplugin: greedy tokens eager vs CUDA graphs (informational)"], failed
        assert list(runs)[-1] == "llm-graphs-noplugin-2" and "llm-eager-noplugin-2" not in runs
        assert runs["llm-graphs-noplugin-2"]["tokens"] == on["tokens"] != runs["llm-graphs-noplugin"]["tokens"]
        assert res["baseline"]["eager"]["verdict"] == "identical" and res["baseline"]["graphs"]["verdict"] == "spread"
        assert vmc.SPREAD_WHY in summary and "RESULT: PASS (graphs:" in summary
    elif drift:
        assert [n for n in runs if n.endswith("-2")] == ["llm-eager-noplugin-2", "llm-graphs-noplugin-2"]
        assert {m: v["verdict"] for m, v in res["baseline"].items()} == {"eager": "plugin_differs",
                                                                         "graphs": "plugin_differs"}
        assert rc == 1 and failed == ["eager: greedy tokens with the plugin == with VLLM_MOONEP_PLUGIN=0",
                                      "eager: tokens/s runs' tokens with the plugin == without (digests per batch)",
                                      "graphs: greedy tokens with the plugin == with VLLM_MOONEP_PLUGIN=0",
                                      "graphs: tokens/s runs' tokens with the plugin == without (digests per batch)"]
    elif dp == 1:
        assert rc == 0 and failed == [], failed
        assert not [n for n in runs if n.endswith("-2")] and "run-to-run" not in summary
    else:  # the stand-in says "inactive" at --dp 2, which the checks then refuse
        assert rc == 1 and any("plugin_inactive" in c for c in failed) and any("plugin_active" in c for c in failed)
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.json", "summary.txt"] + [f"{n}.log" for n in runs])
