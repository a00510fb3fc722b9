"""The tools' command lines refuse bad input with a sentence before any rank is spawned, document
every flag, and report what they measured next to what was asked (no ranks are started here)."""

from __future__ import annotations

import json

import pytest

from vllm_moonep.tools import ab, balance, memory_projection, profile_step


def _error(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2, "argparse errors exit with status 2"
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,needles", [
    (["--configs", "symetric"], ["unknown configuration 'symetric'", "did you mean 'symmetric'?"]),
    (["--configs", "replicated", "tests.layouts:broken"], ["unknown configuration 'tests.layouts:broken'"]),
    (["--impl", "cutlass"], ["invalid choice: 'cutlass'", "'grouped_mm'"]),
    (["--ranks", "3"], ["--ranks 3 does not divide the tiny preset's 32 experts", "2, 4, 8, 16, 32"]),
    (["--ranks", "0"], ["--ranks must be a positive integer"]),
    (["--check-steps", "4"], ["--check-steps 4 exceeds --steps 3"]),
    (["--maxvio", "-1"], ["--maxvio must be >= 0"]),
    (["--tokens", "0"], ["--tokens must be positive"]),
    (["--slots", "0"], ["--slots must be >= 1"]),
    (["--budget-gb", "-5"], ["--budget-gb must be > 0"]),
    (["--impl", "triton"], ["--impl triton cannot run on cpu ranks here"]),
    (["--impl", "grouped_mm"], ["cannot read symmetric-shared's shared slot pool"]),
    (["--graphs"], ["--graphs times CUDA-graph replays of the step: it needs --device cuda"]),
])
def test_ab_refuses_bad_flags_before_spawning(capsys, monkeypatch, argv, needles):
    """`moonep-ab --configs symetric` spawned 4 ranks and failed 16 s later; --ranks 3 silently made E=30."""
    def no_spawn(*a, **k):
        raise AssertionError("ranks were spawned for a command line that cannot run")

    monkeypatch.setattr(ab, "run_on_ranks", no_spawn)
    msg = _error(capsys, ab.main, argv)
    assert msg.startswith("moonep-ab: error:"), msg
    for n in needles:
        assert n in msg, msg


def test_ab_help_documents_every_flag_project_and_legend(capsys):
    """`moonep-ab --help` had no text for most flags, no word of `project`, no legend for measured MiB/pad/ref err."""
    with pytest.raises(SystemExit):
        ab.main(["--help"])
    out = capsys.readouterr().out
    parser = ab.build_parser()
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []
    for needle in ("moonep-ab project", "measured MiB =", "pad =", "ref err =", "got =", "no-plan =", "load transient"):
        assert needle in out, needle


def test_ab_run_api_validates_before_spawning(monkeypatch, tmp_path):
    """run_ab (the programmatic entry) accepted configurations that failed only inside the ranks."""
    monkeypatch.setattr(ab, "run_on_ranks", lambda *a, **k: pytest.fail("spawned"))
    with pytest.raises(ValueError, match="did you mean 'symmetric'"):
        ab.run_ab(configs=["symetric"], out_dir=str(tmp_path), plots=False, progress=False)
    with pytest.raises(ValueError, match="--slots 1 < E/R = 8"):
        ab.run_ab(configs=["symmetric"], impl="grouped_mm", slots=1, out_dir=str(tmp_path), plots=False,
                  progress=False)


@pytest.mark.parametrize("argv,needle", [
    (["--ep", "0"], "argument --ep: --ep must be >= 1, got 0"),
    (["--ep", "7"], "no projection: no --ep value (7) divides an expert count"),
    (["--slots", "0"], "--slots must be >= 1"),
    (["--gpu-gb", "-5"], "--gpu-gb must be > 0"),
    (["--hidden", "4096", "--experts", "64"], "missing: --intermediate, --layers"),
    (["--config", "/nonexistent/config.json"], "cannot read /nonexistent/config.json"),
])
def test_project_rejects_impossible_inputs(capsys, argv, needle):
    """`moonep-ab project --ep 0` was a ZeroDivisionError, --ep 7 an empty table, --slots 0 / --gpu-gb -5 accepted."""
    msg = _error(capsys, ab.main, ["project", *argv])
    assert msg.startswith("moonep-ab project: error:") and needle in msg, msg


def test_project_help_names_the_subcommand(capsys):
    """`moonep-ab project --help` called itself moonep-ab and left the flags unexplained."""
    with pytest.raises(SystemExit):
        ab.main(["project", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: moonep-ab project")
    parser = memory_projection.build_parser("moonep-ab project")
    assert [a.option_strings for a in parser._actions if a.option_strings and not a.help] == []


def test_project_own_model_from_flags_and_hf_configs(capsys, tmp_path):
    """There was no way to project one's own model; the HF-config reader must agree with the built-in table."""
    hf = {
        "DeepSeek-V3": {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "moe_intermediate_size": 2048,
                        "intermediate_size": 18432, "n_routed_experts": 256, "num_hidden_layers": 61,
                        "first_k_dense_replace": 3, "moe_layer_freq": 1},
        "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "moe_intermediate_size": 768,
                          "intermediate_size": 6144, "num_experts": 128, "num_hidden_layers": 48,
                          "decoder_sparse_step": 1, "mlp_only_layers": []},
        "Kimi-K2": {"text_config": {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 384,
                                    "num_hidden_layers": 61, "first_k_dense_replace": 1}},
    }
    table = {m.name: m for m in memory_projection.MODELS}
    for name, cfg in hf.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        m = memory_projection.model_from_hf_config(str(d), name)  # a folder works like its config.json
        assert (m.moe_layers, m.E, m.H, m.I) == (table[name].moe_layers, table[name].E, table[name].H, table[name].I)
    assert ab.main(["project", "--config", str(tmp_path / "DeepSeek-V3" / "config.json"), "--ep", "8", "7"]) == 0
    out = capsys.readouterr().out
    ref = {(r["model"], r["R"]): r for r in memory_projection.projection_rows(eps=(8,))}[("DeepSeek-V3", 8)]
    assert f"{ref['symmetric'] / 1e9:,.1f}" in out and "DeepseekV3ForCausalLM" in out
    assert "skipped DeepseekV3ForCausalLM at EP 7" in out
    assert ab.main(["project", "--hidden", "7168", "--intermediate", "2048", "--experts", "256", "--layers", "58",
                    "--name", "mine", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "mine" in out and f"{ref['replicated'] / 1e9:,.1f}" in out
    (tmp_path / "dense.json").write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 11008,
                                                    "num_hidden_layers": 32}))
    msg = _error(capsys, ab.main, ["project", "--config", str(tmp_path / "dense.json")])
    assert "not a mixture-of-experts config" in msg and "n_routed_experts / num_experts" in msg, msg


def test_balance_reports_requested_and_achieved_skew(capsys):
    """moonep-balance showed 0.38 for a requested 0 without the request, and never defined maxvio."""
    rows = [{"target_maxvio": 0.0, "maxvio": 0.38, "imbalance_without_plan": 1.05, "padded_imbalance_with_plan": 1.02,
             "expert_time_imbalance_without_plan": 1.07, "expert_time_imbalance_with_plan": 1.01,
             "slowest_expert_s_without_plan": 2.5e-3, "slowest_expert_s_with_plan": 2.0e-3, "impl": "reference",
             "slots_used": 1, "slots_total": 16}]
    text = balance.format_report(rows, 2, 64, 16, 4)
    header, row = text.splitlines()[1:3]
    assert "maxvio requested" in header and "achieved" in header
    assert row.split()[:2] == ["0.00", "0.38"]
    assert row.split()[2:6] == ["1.05", "1.02", "1.07", "1.01"] and "2.50 -> 2.00" in row
    assert "max/mean tokens per" in text and "requested / achieved maxvio" in text
    assert "S*K" not in header and "cu_seqlens[-1]" in text, "the MoonEP column is measured, not S*K by construction"
    with pytest.raises(SystemExit):
        balance.main(["--help"])
    out = capsys.readouterr().out
    assert "maxvio (the skew) = max over experts" in out
    assert [a.option_strings for a in balance.build_parser()._actions if a.option_strings and not a.help] == []
    assert "--ranks 3 does not divide --experts 64" in _error(capsys, balance.main, ["--ranks", "3"])
    assert "--intermediate 100 is not a multiple of 128" in _error(capsys, balance.main, ["--intermediate", "100"])
    assert "must be >= 0" in _error(capsys, balance.main, ["--maxvio", "-1"])


@pytest.mark.parametrize("argv,needle", [
    (["--ranks", "3"], "--ranks 3 must be positive and divide the tiny preset's 32 experts"),
    (["--tokens", "0"], "--tokens, --steps and --iters must be positive"),
    (["--layout", "shared"], "invalid choice: 'shared'"),
])
def test_profile_step_refuses_bad_flags_before_spawning(capsys, monkeypatch, argv, needle):
    """A profile whose ranks fail after spawning (E not divisible, zero tokens) instead of a sentence."""
    def no_spawn(*a, **k):
        raise AssertionError("ranks were spawned for a command line that cannot run")

    monkeypatch.setattr(profile_step, "run_on_ranks", no_spawn)
    msg = _error(capsys, profile_step.main, argv)
    assert needle in msg, msg


@pytest.mark.parametrize("spec", ["kimi-k2", "kimi:1024", "kimi-k2:0", "kimi-k2:x"])
def test_bench_experts_profile_case_is_checked_before_cuda(capsys, spec):
    """`bench_experts --profile-case kimi:1024` (the program ncu wraps) said "needs a CUDA GPU" on a
    typo, or ran a whole sweep on the profiler when the case did not parse."""
    from vllm_moonep.tools import bench_experts

    msg = _error(capsys, bench_experts.main, ["--profile-case", spec])
    assert "--profile-case must be SHAPE:TOKENS" in msg and "kimi-k2" in msg, msg


def test_bench_experts_tune_keeps_the_points_it_did_not_measure():
    """--tune over a few token counts wrote a tile table of those points only: every other regime
    of the shipped table fell back to the generic tiles."""
    from vllm_moonep.tools.bench_experts import merged_tuning

    def e(H, t, bm):
        return {"H": H, "I": 7, "max_rows": 100 * t, "tokens_per_rank": t, "gate_up": {"BM": bm}, "down": {"BM": bm}}

    shipped = [e(2048, 1, 16), e(2048, 1024, 128), e(7168, 1, 16), e(7168, 1024, 64)]
    tuned = [e(7168, 1024, 128), e(7168, 256, 32)]
    got = merged_tuning(shipped, tuned)["entries"]
    assert [(x["H"], x["tokens_per_rank"], x["gate_up"]["BM"]) for x in got] == [
        (2048, 1, 16), (2048, 1024, 128), (7168, 1, 16), (7168, 256, 32), (7168, 1024, 128)]
