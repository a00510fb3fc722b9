"""The tools' command lines refuse bad input with a sentence before any rank is spawned, document
every flag, and report what they measured next to what was asked (no ranks are started here)."""

from __future__ import annotations

import json
import re

import pytest

from vllm_moonep.engine.defaults import slots_beyond_experts
from vllm_moonep.testing.models import MODELS
from vllm_moonep.tools import ab, balance, memory_projection, profile_step
from vllm_moonep.tools.ab import checks, cli, configs, driver


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

    monkeypatch.setattr(driver, "run_on_ranks", no_spawn)
    msg = _error(capsys, ab.main, argv)
    assert msg.startswith("moonep-ab: error:"), msg
    for n in needles:
        assert n in msg, msg


def test_ab_help_documents_every_flag_project_and_legend(capsys):
    """`moonep-ab --help` had no text for most flags, no word of `project`, no legend for measured MiB/pad/ref err."""
    with pytest.raises(SystemExit):
        ab.main(["--help"])
    out = capsys.readouterr().out
    parser = cli.build_parser()
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []
    for needle in ("moonep-ab project", "measured MiB =", "pad =", "ref err =", "got =", "no-plan =", "load transient"):
        assert needle in out, needle


def test_ab_run_api_validates_before_spawning(monkeypatch, tmp_path):
    """run_ab (the programmatic entry) accepted configurations that failed only inside the ranks."""
    monkeypatch.setattr(driver, "run_on_ranks", lambda *a, **k: pytest.fail("spawned"))
    with pytest.raises(ValueError, match="did you mean 'symmetric'"):
        ab.run_ab(configs=["symetric"], out_dir=str(tmp_path), plots=False, progress=False)
    with pytest.raises(ValueError, match="--slots 1 < E/R = 8"):
        ab.run_ab(configs=["symmetric"], impl="grouped_mm", slots=1, out_dir=str(tmp_path), plots=False,
                  progress=False)


def _spawn_fails(monkeypatch):
    monkeypatch.setattr(driver, "run_on_ranks", lambda *a, **k: pytest.fail("ranks were spawned for a run that "
                                                                              "cannot run or cannot save its results"))


def test_ab_refuses_an_out_path_it_cannot_write_before_any_work(capsys, monkeypatch, tmp_path):
    """`moonep-ab --out <an existing file>` ran the whole comparison, then died with a traceback and saved nothing."""
    _spawn_fails(monkeypatch)
    taken = tmp_path / "results.txt"
    taken.write_text("kept")
    msg = _error(capsys, ab.main, ["--out", str(taken)])
    assert f"--out {taken} is a file, not a folder" in msg, msg
    msg = _error(capsys, ab.main, ["--out", str(taken / "ab")])  # a folder that cannot be made
    assert f"--out {taken / 'ab'}: cannot write the results there (Not a directory)" in msg, msg
    assert taken.read_text() == "kept"
    with pytest.raises(ValueError, match="is a file, not a folder"):
        ab.run_ab(out_dir=str(taken), progress=False)


def test_ab_refuses_plots_without_matplotlib_before_any_work(capsys, monkeypatch, tmp_path):
    """Without matplotlib the plots failed after every configuration had run, before the JSON was written."""
    _spawn_fails(monkeypatch)
    find_spec = checks.importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    msg = _error(capsys, ab.main, ["--out", str(tmp_path)])
    assert "the plots need matplotlib" in msg and "--no-plots" in msg, msg
    checks.check_run(preset="tiny", ranks=4, layers=None, tokens=[16], maxvios=[0.0], steps=1, warmup=0,
                     check_steps=1, device="cpu", configs=None, impl="auto", slots=None, budget_gb=None,
                     out_dir=str(tmp_path), plots=False)  # --no-plots needs no matplotlib


@pytest.mark.parametrize("argv,needles", [
    (["--slots", "1000"], [f"--slots 1000 {slots_beyond_experts(1000, 32, 4)}", "exceeds the model's 32 experts"]),
    (["--preset", "kimi-k2", "--slots", "16"],  # 384 experts, 8 of them kept within 1 GiB per CPU rank
     ["--slots 16 exceeds the model's 8 experts", "the kimi-k2 preset runs 8 of its 384 experts within --budget-gb 1"]),
    (["--configs", "vllm-poc", "symmetric", "vllm-poc"], ["--configs names vllm-poc more than once"]),
], ids=["slots-above-E", "slots-above-scaled-E", "repeated-config"])
def test_ab_refuses_slots_above_the_experts_and_repeated_configs(capsys, monkeypatch, argv, needles):
    """`--slots 1000` with E=32 ran (1.5 GiB per rank) where the plugin refuses slots above E (the
    same rule, ``slots_beyond_experts``); `--configs vllm-poc vllm-poc` ran it twice and printed it once."""
    _spawn_fails(monkeypatch)
    msg = _error(capsys, ab.main, argv)
    for n in needles:
        assert n in msg, msg


def test_ab_says_once_when_the_shape_cannot_reach_the_requested_skew(monkeypatch, tmp_path):
    """`--preset kimi-k2` on CPU scales to E=8 with top-8 (every token picks every expert): a
    requested maxvio of 2 read `got 0.00` with no word why."""
    shape = configs.run_shape("kimi-k2", 4, None, 1.0, None, [16], [0.0, 1.0, 2.0])
    assert (shape["experts"], shape["topk"]) == (8, 8)
    note = shape["note"]
    assert "--maxvio 1 2 cannot be reached with E=8 experts and top-8 routing" in note and "E/K - 1 = 0" in note
    # the advice holds: that budget keeps enough experts for the skew asked
    hint = re.search(r"--budget-gb ([0-9.]+) keeps E=(\d+) experts", note)
    assert hint, note
    kept = configs.scaled_shape(configs.PRESETS["kimi-k2"], 4, None, int(float(hint[1]) * configs.GiB), None)
    assert kept["experts"] == int(hint[2]) and configs.max_skew(kept["experts"], 8) >= 2
    assert "note" not in configs.run_shape("tiny", 4, None, 1.0, None, [16, 128], [0.0, 1.0, 2.0])
    assert "the tiny preset's 32 experts reach at most 7" in configs.run_shape("tiny", 4, None, 1.0, None, [16],
                                                                               [8.0])["note"]
    # the run carries it (the table prints the shape's note once)
    seen = {}

    def first_spawn(ranks, fn, cfg, shape, *a, **k):
        seen.update(shape)
        raise RuntimeError("stop before the ranks start")

    monkeypatch.setattr(driver, "run_on_ranks", first_spawn)
    with pytest.raises(RuntimeError, match="stop before"):
        ab.run_ab(preset="kimi-k2", ranks=4, tokens=(16,), maxvios=(2.0,), configs=["replicated"], out_dir=str(tmp_path),
                  progress=False)
    assert seen["note"].count("cannot be reached") == 1, seen
    table = ab.format_table({"preset": "kimi-k2", "shape": seen, "configs": {}, "anchor": {},
                             "environment": {"ranks": 4, "device": "cpu"}})
    assert table.count("--maxvio 2 cannot be reached") == 1, table


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
    table = {m.name: m for m in MODELS}
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
    got = merged_tuning(shipped, tuned)
    assert [(x["H"], x["tokens_per_rank"], x["gate_up"]["BM"]) for x in got] == [
        (2048, 1, 16), (2048, 1024, 128), (7168, 1, 16), (7168, 256, 32), (7168, 1024, 128)]


def test_tune_on_a_new_gpu_keeps_the_library_regimes_it_borrowed():
    """--tune on a GPU without a section of its own (an H100 borrowing the H200's) wrote a section with the tuned
    tiles and no auto regimes: from then on impl=auto ran Triton at the 4096-token points where DeepGEMM had been
    measured faster on that very GPU (the borrowed regimes were what it ran, and --tune measures no library)."""
    from vllm_moonep.common.grouped_gemm.policy import with_tiles

    regime = {"H": 7168, "I": 2048, "impl": "deepgemm", "from_tokens": 4096, "to_tokens": None}
    table = {"comment": "c", "fallback": {"sm_90": "GPU A"},
             "devices": {"GPU A": {"tiles": [{"t": "a"}], "auto": [regime]}}}
    got = with_tiles(table, "GPU B", [{"t": "b"}], (9, 0))
    assert got["devices"]["GPU B"] == {"tiles": [{"t": "b"}], "auto": [regime]}
    assert got["devices"]["GPU B"]["auto"][0] is not regime  # its own copy: editing one section moves no other
    assert got["devices"]["GPU A"] == table["devices"]["GPU A"] and got["fallback"] == {"sm_90": "GPU A"}
    # a section of its own keeps its regimes; a capability nothing was measured on starts with none
    mine = with_tiles(got, "GPU B", [{"t": "b2"}], (9, 0))["devices"]["GPU B"]
    assert mine == {"tiles": [{"t": "b2"}], "auto": [regime]}
    new = with_tiles(table, "GPU C", [{"t": "c"}], (10, 0))
    assert new["devices"]["GPU C"] == {"tiles": [{"t": "c"}], "auto": []} and new["fallback"]["sm_100"] == "GPU C"
    assert with_tiles(table, "GPU D", [], None)["devices"]["GPU D"]["auto"] == []
    # a GPU that ran another's section by same_as gets a section of its own from that one: a same_as left beside
    # the tuned tiles would go on running the other section's
    alias = {**table, "devices": {**table["devices"], "GPU E": {"same_as": "GPU A", "measured": "m"}}}
    own = with_tiles(alias, "GPU E", [{"t": "e"}], (10, 0))
    assert own["devices"]["GPU E"] == {"tiles": [{"t": "e"}], "auto": [regime]} and "sm_100" in own["fallback"]


def test_a_tuning_pass_replaces_the_shipped_tiles_only_past_the_controls_band():
    """A tuned entry the sweep found faster (in its one-after-another timings) replaced the shipped one though the
    rotated A/B found it slower at one routing, or faster only within what the shipped tiles timed twice read
    apart; and the entry a pass writes (``tile_entry``, the one place main builds it from the tiles it kept) carries
    other keys than the tiles or drops the one launch."""
    from vllm_moonep.tools.bench_experts import tile_entry, tuned_wins

    inf = float("inf")
    assert tuned_wins([90.0, 90.0], [100.0, 100.0], [100.0, 100.0])
    assert not tuned_wins([90.0, 101.0], [100.0, 100.0], [100.0, 100.0]), "slower at one routing"
    assert not tuned_wins([99.5, 99.5], [100.0, 100.0], [100.0, 100.0]), "inside the 1% margin"
    assert not tuned_wins([97.0, 97.0], [100.0, 100.0], [104.0, 100.0]), "inside the control's 4% band"
    assert tuned_wins([95.0, 97.0], [100.0, 100.0], [104.0, 100.0])
    assert tuned_wins([95.0, 95.0], [inf, inf], [inf, inf]), "shipped tiles that cannot run lose to ones that do"
    assert not tuned_wins([inf, 95.0], [100.0, 100.0], [100.0, 100.0]) and not tuned_wins([inf], [inf], [inf])
    shipped = {"gate_up": {"BM": 64}, "down": {"BM": 128}}
    one = {**shipped, "fused": {"num_stages": 4}}
    assert tile_entry("kimi-k2", 7168, 2048, 20384, 1024, shipped) == {
        "H": 7168, "I": 2048, "max_rows": 20384, "shape": "kimi-k2", "tokens_per_rank": 1024, **shipped}
    assert tile_entry("kimi-k2", 7168, 2048, 20384, 1024, {**one, "junk": 1})["fused"] == {"num_stages": 4}
    assert "junk" not in tile_entry("kimi-k2", 7168, 2048, 20384, 1024, {**one, "junk": 1})
