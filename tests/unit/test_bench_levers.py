"""``bench_levers``'s command line and the variants it times (nothing is timed here: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.tools import bench_levers


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        bench_levers.parse_args(argv)
    assert exc.value.code == 2, "argparse errors exit with status 2"
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_defaults_are_the_issue_points():
    """The default sweep drifting from the two shapes at 256, 1024 and 4096 tokens the lever is measured on."""
    a = bench_levers.parse_args([])
    assert a.shapes == ["kimi-k2", "qwen3-30b-a3b"] and a.tokens == [256, 1024, 4096] and a.rep == bench_levers.DEFAULT_REP
    a = bench_levers.parse_args(["--shapes", "qwen3-30b-a3b", "--tokens", "1024", "--rep", "20"])
    assert a.shapes == ["qwen3-30b-a3b"] and a.tokens == [1024] and a.rep == 20
    assert a.lever == "w13i" and bench_levers.parse_args(["--lever", "flat"]).lever == "flat"
    assert a.impl == "triton" and bench_levers.parse_args(["--impl", "deepgemm"]).impl == "deepgemm"


def test_flush_is_clean_unless_asked_dirty():
    """The timer falling back to a write-only L2 flush by default (its write-back charged to every timing), or
    ``--flush dirty`` (the method of older figures) not reaching it."""
    from vllm_moonep.tools import bench_experts

    assert bench_levers.parse_args([]).flush == "clean" and bench_experts.CLEAN_FLUSH
    try:
        bench_experts.use_flush(bench_levers.parse_args(["--flush", "dirty"]).flush)
        assert not bench_experts.CLEAN_FLUSH
    finally:
        bench_experts.use_flush("clean")
    assert bench_experts.CLEAN_FLUSH


@pytest.mark.parametrize("argv,needle", [
    (["--shapes", "kimi"], "unknown shape(s) ['kimi']"),
    (["--tokens", "256,0"], "--tokens must be comma-separated positive integers"),
    (["--tokens", "many"], "--tokens must be comma-separated positive integers"),
    (["--rep", "0"], "--rep must be a positive number"),
    (["--rounds", "0"], "--rounds must be a positive number"),
    (["--lever", "tma"], "argument --lever: invalid choice: 'tma'"),
    (["--lever", "flat", "--impl", "deepgemm"], "--impl deepgemm times the w13i lever only"),
])
def test_bad_flags_refused_with_a_sentence(capsys, argv, needle):
    """A typo in a shape or tokens reaching the GPU as a KeyError or ValueError traceback minutes into a device call."""
    msg = _error(capsys, argv)
    assert msg.startswith("bench_levers: error:") and needle in msg, msg


def test_variants_add_half_bn_only_past_the_widest_mma():
    """The BN/2 variant missing where 2*BN exceeds 256 (BN 256 tiles: the interleaved MMA would be two anyway), or
    timed where it is not, the committed tiles changed by the variants, or a w13i variant (or the committed tiles,
    or the control) run over the wrong order of the weights."""
    gu = {"BM": 64, "BN": 256, "BK": 64, "tma": True}
    dn = {"BM": 128, "BN": 256, "BK": 64}
    v = bench_levers.variants({"gate_up": gu, "down": dn})
    assert list(v) == ["committed", "w13i", "w13i_bn_half", "control"]
    assert v["committed"]["gate_up"] == gu and "w13i" not in gu
    assert v["w13i"] == {"gate_up": gu, "down": dn}, "the w13i variant is the same tiles (over interleaved weights)"
    assert v["w13i_bn_half"]["gate_up"] == {**gu, "BN": 128}
    assert set(bench_levers.INTERLEAVED_VARIANTS) == {"w13i", "w13i_bn_half"}
    assert list(bench_levers.variants({"gate_up": {**gu, "BN": 128}, "down": dn})) == ["committed", "w13i", "control"]
    # the committed tiles' other options ride along (the warp-specialized loop of Kimi-K2's 4096-token tiles)
    assert bench_levers.variants({"gate_up": {**gu, "ws": True}, "down": dn})["w13i"]["gate_up"]["ws"] is True
    # the control is the committed tiles, in dicts of its own (a variant edited in place must not move it)
    assert v["control"] == {"gate_up": gu, "down": dn} and v["control"]["gate_up"] is not gu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: main would run the benchmark")
def test_refuses_without_a_gpu(capsys):
    """Without a GPU the tool crashed in its first CUDA call instead of saying it needs one."""
    assert bench_levers.main(["--tokens", "256"]) == 2
    assert "bench_levers: needs a CUDA GPU" in capsys.readouterr().err


def _row(tokens, half, lever="w13i", **fields):
    gu = {"BM": 64, "BN": 256 if half else 128, "BK": 64, "tma": True}
    confs = bench_levers.variants({"gate_up": gu, "down": {"BM": 128, "BN": 256, "BK": 64, "flat": half}}, lever)
    row = {"shape": "kimi-k2", "tokens": tokens, "routing": "balanced", "configs": confs, "absent": {},
           "lever": lever, "kernel": bench_levers.LEVER_KERNEL[lever]}
    for k in confs:
        row.update({f"{k}_us": 100.0, f"{k}_kernel_us": 60.0, f"{k}_unwritten": 0,
                    f"{k}_err": None if k == "committed" else 1e-4})
        if k != "committed":
            row.update({f"{k}_ratio": 0.95, f"{k}_kernel_ratio": 0.9})
        if k not in ("committed", "control"):  # the control is one of the pooled ratio's two baselines
            row[f"{k}_pooled_ratio"] = 0.96
    row.update(fields)
    return row


def test_table_reads_every_row_kind():
    """The table (printed after minutes of device time) raising on a row whose variant could not run or that has no
    BN/2 variant, or a wrong output not named."""
    rows = [_row(1024, True), _row(256, False),
            _row(4096, True, w13i_us=None, w13i_kernel_us=None, w13i_unwritten=None, w13i_err=None,
                 absent={"w13i": "OutOfResources: shared memory"}),
            _row(4096, False, w13i_err=0.5)]
    for r in rows[2:3]:
        del r["w13i_ratio"], r["w13i_kernel_ratio"], r["w13i_pooled_ratio"]
    lines = bench_levers.table(rows)
    assert len(lines) == 2 + 4 + 2, lines
    assert lines[0].startswith("| shape | tokens | routing | committed gate/up tile | committed us | w13i us |")
    assert "w13i_bn_half us" in lines[0] and lines[0].endswith("| control us | ratio | pooled | gate/up ratio | err |")
    assert ("| 64x256x64 tma | 100.0 | 100.0 | 0.950 | 0.960 | 0.900 | 1.0e-04 | 100.0 | 0.950 | 0.960 | 0.900 "
            "| 1.0e-04 | 100.0 | 0.950 | - | 0.900 | 1.0e-04 |") in lines[2]
    assert "| 1.0e-04 | - | - | - | - | - | 100.0 | 0.950 |" in lines[3], "a row without BN/2 must read - there"
    assert "| - | - | - | - | - |" in lines[4]
    assert bench_levers.wrong(rows) == [("kimi-k2", 4096, "balanced", "w13i")]
    assert "WRONG OUTPUTS" in lines[6] and "OutOfResources" in lines[7]


def test_flat_lever_toggles_the_down_tiles_only():
    """The flat lever timing the committed tiles against themselves (the toggle lost), changing the gate/up tiles,
    or its table naming the gate/up kernel it does not change."""
    gu = {"BM": 64, "BN": 256, "BK": 64, "tma": True, "ws": True}
    on = {"BM": 128, "BN": 256, "BK": 64, "tma": True, "flat": True}
    v = bench_levers.variants({"gate_up": gu, "down": on}, "flat")
    assert list(v) == ["committed", "flat_off", "control"]
    assert v["flat_off"]["down"] == {k: x for k, x in on.items() if k != "flat"} and v["flat_off"]["gate_up"] is gu
    assert on["flat"] is True, "the committed down tiles were edited in place"
    off = {k: x for k, x in on.items() if k != "flat"}
    v = bench_levers.variants({"gate_up": gu, "down": off}, "flat")
    assert list(v) == ["committed", "flat_on", "control"] and v["flat_on"]["down"] == on
    # a one-launch entry does not take flat: no variant that would time the committed tiles again, and a reason
    one = {"gate_up": gu, "down": on, "fused": {"num_warps": 8, "num_stages": 4, "progs_per_sm": 1}}
    assert list(bench_levers.variants(one, "flat")) == ["committed", "control"]
    assert "one launch" in bench_levers.lever_absent(one, "flat")
    assert bench_levers.lever_absent({"gate_up": gu, "down": on}, "flat") is None
    assert bench_levers.lever_absent(one, "w13i") is None, "the one launch takes w13i"
    assert "w13i" in bench_levers.variants(one, "w13i")
    with pytest.raises(ValueError, match="unknown lever 'tma'"):
        bench_levers.variants({"gate_up": gu, "down": on}, "tma")
    lines = bench_levers.table([_row(4096, True, "flat"), _row(1024, False, "flat")])
    assert lines[0] == ("| shape | tokens | routing | committed down tile | committed us | flat_off us | ratio | pooled "
                        "| down ratio | err | control us | ratio | pooled | down ratio | err | flat_on us | ratio | pooled "
                        "| down ratio | err |"), lines[0]
    assert lines[2].startswith("| kimi-k2 | 4096 | balanced | 128x256x64 flat | 100.0 | 100.0 | 0.950 | 0.960 |")
    assert lines[3].endswith("| - | - | - | - | - | 100.0 | 0.950 | - | 0.900 | 1.0e-04 | 100.0 | 0.950 | 0.960 | 0.900 "
                             "| 1.0e-04 |")


@pytest.mark.parametrize("lever", ["mix", "streamk"])
def test_both_kernel_levers_time_both_kernels_and_each_alone(lever):
    """A lever set on both kernels (the mixed order, stream-K) leaving a kernel out, changing anything but its own
    option, editing the committed tiles in place, or timing a one-launch entry (which takes neither) against
    itself."""
    gu = {"BM": 64, "BN": 128, "BK": 64, "tma": True}
    dn = {"BM": 64, "BN": 128, "BK": 64, "tma": True, "flat": True}
    v = bench_levers.variants({"gate_up": gu, "down": dn}, lever)
    assert list(v) == ["committed", lever, f"{lever}_gate_up", f"{lever}_down", "control"]
    assert v[lever] == {"gate_up": {**gu, lever: True}, "down": {**dn, lever: True}}
    assert v[f"{lever}_gate_up"] == {"gate_up": {**gu, lever: True}, "down": dn}
    assert v[f"{lever}_down"] == {"gate_up": gu, "down": {**dn, lever: True}}
    assert lever not in gu and lever not in dn, "the committed tiles were edited in place"
    one = {"gate_up": gu, "down": dn, "fused": {"num_warps": 8, "num_stages": 4, "progs_per_sm": 1}}
    assert list(bench_levers.variants(one, lever)) == ["committed", "control"]
    assert "one launch" in bench_levers.lever_absent(one, lever) and lever in bench_levers.lever_absent(one, lever)
    assert bench_levers.parse_args(["--lever", lever]).lever == lever
    assert bench_levers.LEVER_KERNEL[lever] == "gate_up", "the kernel timed alone beside the whole compute"


def test_pair_lever_doubles_rows_within_the_widest_sums():
    """The pair lever's tiles holding more float32 sums than the committed widest tile (128 x 256: registers spilled,
    timing a tile no entry would ship), more shared memory than a block may hold, keeping 2 programs per SM (two
    tiles of double rows cannot both reside), pairing 128-row tiles (256 rows), or editing the committed tiles."""
    gu = {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True}
    dn = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True, "flat": True}
    v = bench_levers.variants({"gate_up": gu, "down": dn}, "pair")
    assert list(v) == ["committed", "pair", "pair_gate_up", "pair_bn", "pair_down", "control"]
    pg, pd = v["pair"]["gate_up"], v["pair"]["down"]
    assert pg == {**gu, "pair": True, "BN": 128} and pd == {**dn, "pair": True, "num_warps": 8, "progs_per_sm": 1}
    assert 2 * pg["BM"] * 2 * pg["BN"] <= bench_levers.PAIR_MAX_ACC and 2 * pd["BM"] * pd["BN"] <= bench_levers.PAIR_MAX_ACC
    assert v["pair_bn"]["gate_up"] == {**gu, "BN": 128}, "the BN change alone, no pair"
    assert v["pair_gate_up"]["down"] == dn and v["pair_down"]["gate_up"] == gu
    assert "pair" not in gu and "pair" not in dn, "the committed tiles were edited in place"
    deep = bench_levers.pair_tiles({**dn, "BK": 256, "num_stages": 8}, 1)
    assert 2 * (128 + deep["BN"]) * deep["BK"] * deep["num_stages"] <= bench_levers.PAIR_MAX_SMEM
    assert deep["num_stages"] >= 2, "a pipeline of one stage"
    big = {"BM": 256, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
    assert bench_levers.pair_tiles(big, 1) is None and bench_levers.pair_tiles({**dn, "streamk": True}, 1) is None
    assert list(bench_levers.variants({"gate_up": big, "down": big}, "pair")) == ["committed", "control"]
    assert "128 rows" in bench_levers.lever_absent({"gate_up": big, "down": big}, "pair")
    one = {"gate_up": gu, "down": dn, "fused": {"num_warps": 8, "num_stages": 4, "progs_per_sm": 1}}
    assert "one launch" in bench_levers.lever_absent(one, "pair")


def test_pair_lever_halves_128_row_tiles():
    """Committed 128-row tiles paired as 256 rows (twice the widest sums), or their BN, warps or stages changed: the
    lever there is the same 128-row tile, as a pair of 64-row tiles (a group's odd last 64 rows a tile of 64)."""
    gu = {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True, "ws": True}
    dn = {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True, "flat": True}
    v = bench_levers.variants({"gate_up": gu, "down": dn}, "pair")
    assert v["pair_down"]["down"] == {**dn, "BM": 64, "pair": True}
    assert v["pair_down"]["gate_up"] == gu and v["pair"]["down"] == v["pair_down"]["down"]
    assert "pair" not in dn and dn["BM"] == 128, "the committed tiles were edited in place"
    assert bench_levers.lever_absent({"gate_up": dn, "down": dn}, "pair") is None


def test_pair_with_streamk_is_refused_by_name():
    """A tile config asking for pairs of row tiles and stream-K (whose cut tiles are of one size) compiled one of
    them silently off, or failed inside Triton; refused with both options named."""
    from vllm_moonep.common.grouped_gemm.triton_kernels import _pair
    from vllm_moonep.engine.errors import MoonEPInputError

    assert _pair({"pair": True}) and not _pair({}) and not _pair({"streamk": True})
    with pytest.raises(MoonEPInputError, match='"pair" and "streamk"'):
        _pair({"pair": True, "streamk": True})


def test_generic_lever_times_the_other_generic_regimes_on_an_untuned_shape():
    """The generic tiles (shapes without a tuning.json entry) had no A/B in the repo: the regime select_config picks
    must run against each other one, on a shape the packaged table has no entry for, and none twice."""
    from vllm_moonep.common.grouped_gemm import policy
    from vllm_moonep.common.grouped_gemm.triton_kernels import DEFAULT_CONFIGS

    shp = bench_levers.LEVER_SHAPES["untuned"]
    assert bench_levers.parse_args(["--lever", "generic", "--shapes", "untuned"]).shapes == ["untuned"]
    tuned = {(e["H"], e["I"]) for sec in policy.load_table()["devices"].values() for e in sec.get("tiles", [])}
    assert (shp["H"], shp["I"]) not in tuned, "the untuned shape got a tile entry: the lever would time no generic pick"
    v = bench_levers.variants(DEFAULT_CONFIGS["stream"], "generic")
    assert list(v) == ["committed", "mid", "compute", "control"]
    assert v["mid"] == DEFAULT_CONFIGS["mid"] and v["mid"]["gate_up"] is not DEFAULT_CONFIGS["mid"]["gate_up"]
    assert list(bench_levers.variants(DEFAULT_CONFIGS["compute"], "generic")) == ["committed", "stream", "mid", "control"]
    # a tuned entry's tiles: every generic regime against them
    assert list(bench_levers.variants({"gate_up": {"BM": 32}, "down": {"BM": 16}}, "generic")) == [
        "committed", "stream", "mid", "compute", "control"]


def test_deepgemm_half_lever_times_each_half_and_the_whole():
    """The DeepGEMM-half lever leaving a half out, timing a one-launch entry (which has no halves) against itself, or
    handing the variants configs other than the committed tiles (the Triton half must be what ships)."""
    gu = {"BM": 64, "BN": 128, "BK": 64, "tma": True, "ws": True}
    dn = {"BM": 64, "BN": 128, "BK": 64, "tma": True, "flat": True}
    v = bench_levers.variants({"gate_up": gu, "down": dn}, "deepgemm_half")
    assert list(v) == ["committed", "deepgemm", "deepgemm_gate_up", "deepgemm_down", "control"]
    assert all(c == {"gate_up": gu, "down": dn} for c in v.values())
    assert bench_levers.DEEPGEMM_HALVES == {"deepgemm": (True, True), "deepgemm_gate_up": (True, False),
                                            "deepgemm_down": (False, True)}
    one = {"gate_up": gu, "down": dn, "fused": {"num_warps": 8, "num_stages": 4, "progs_per_sm": 1}}
    assert list(bench_levers.variants(one, "deepgemm_half")) == ["committed", "control"]
    assert "one launch" in bench_levers.lever_absent(one, "deepgemm_half")
    assert bench_levers.parse_args(["--lever", "deepgemm_half"]).lever == "deepgemm_half"
