"""``bench_median``: the median of several ``bench_experts`` runs per point, and the column ``impl="auto"``
runs there, from synthetic runs whose medians are known (each differs from the runs' mean)."""

from __future__ import annotations

import json
import statistics

import pytest

from vllm_moonep.tools import bench_median as bm

KIMI_FLOP = 2.0e12


def _row(shape, tokens, routing, triton, floor=100.0, **cols):
    return {"shape": shape, "tokens": tokens, "routing": routing, "triton_us": triton, "floor_us": floor,
            "floor_kind": "flop", "flop": KIMI_FLOP, **{f"{c}_us": t for c, t in cols.items()}}


def _run(device="NVIDIA H200", flush="clean", rows=None, date="2026-12-06T10:00:00"):
    return {"device": device, "flush": flush, "date": date, "rows": rows or []}


def _runs(**kw):
    """Three runs: Triton 110/100/190 at 4096 tokens (median 110, mean 133), DeepGEMM 90/95/200 (median 95)."""
    t, d = (110.0, 100.0, 190.0), (90.0, 95.0, 200.0)
    return [_run(rows=[_row("kimi-k2", 4096, "balanced", t[i], deepgemm=d[i], quack=None),
                       _row("kimi-k2", 1024, "skewed", 50.0 + i, floor=40.0, deepgemm=45.0)], **kw)
            for i in range(3)]


def _write(tmp_path, runs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, r in enumerate(runs):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    return paths


def test_medians_ratios_spread_and_the_column_auto_runs():
    """A mean for a median (one slow run would move every figure), a column one run lacks kept (its median of
    fewer runs), or auto credited with a library's time where the table does not hand it that point."""
    rows = bm.median_rows(_runs())
    top, ridge = rows
    assert (top["tokens"], ridge["tokens"]) == (4096, 1024)  # the first run's order
    assert top["us"] == {"triton": 110.0, "deepgemm": 95.0}  # quack is None in the runs: no column
    assert top["x_floor"]["triton"] == pytest.approx(1.10)
    assert top["triton_spread"] == pytest.approx(190.0 / 100.0 - 1)
    # the H200's section hands Kimi-K2 4096 tokens to DeepGEMM, 1024 to Triton (tuning.json's auto regimes)
    assert top["auto"] == "deepgemm" and top["auto_us"] == 95.0
    assert top["auto_tflops_useful"] == pytest.approx(KIMI_FLOP / 95e-6 / 1e12)
    assert ridge["auto"] == "triton" and ridge["auto_us"] == 51.0 and ridge["x_floor"]["triton"] == pytest.approx(51 / 40)


def test_auto_falls_back_as_the_product_does():
    """Auto taken as a library the runs did not time, a GPU without a section credited with another's
    regimes without its capability, a shape the models do not know given a column, or runs made before a
    regime's column existed credited with the next regime's library."""
    assert bm.auto_column("NVIDIA H200", None, "kimi-k2", 4096, {"triton"}) == "triton"  # DeepGEMM not timed
    assert bm.auto_column("NVIDIA H100 PCIe", (9, 0), "kimi-k2", 4096, {"triton", "deepgemm"}) == "deepgemm"
    assert bm.auto_column("NVIDIA H100 PCIe", None, "kimi-k2", 4096, {"triton", "deepgemm"}) == "triton"
    # the H100 80GB HBM3 runs its own regimes (tuning.json's same_as with auto), capability or not: deepgemm_down
    # first, DeepGEMM's whole compute where only that column was timed, Triton where DeepGEMM did not run
    timed = {"triton", "deepgemm_down", "deepgemm"}
    assert bm.auto_column("NVIDIA H100 80GB HBM3", None, "kimi-k2", 4096, timed) == "deepgemm_down"
    assert bm.auto_column("NVIDIA H100 80GB HBM3", (9, 0), "qwen3-30b-a3b", 4096, timed) == "deepgemm_down"
    assert bm.auto_column("NVIDIA H100 80GB HBM3", None, "kimi-k2", 4096, {"triton", "deepgemm"}) == "deepgemm"
    assert bm.auto_column("NVIDIA H100 80GB HBM3", None, "kimi-k2", 1024, timed) == "triton"
    assert bm.auto_column("NVIDIA H100 80GB HBM3", (9, 0), "kimi-k2", 4096, {"triton"}) == "triton"
    # Qwen3 at 4096: quack first where it ran, DeepGEMM after it
    assert bm.auto_column("NVIDIA H200", None, "qwen3-30b-a3b", 4096, {"triton", "quack", "deepgemm"}) == "quack"
    assert bm.auto_column("NVIDIA H200", None, "qwen3-30b-a3b", 4096, {"triton", "deepgemm"}) == "deepgemm"
    assert bm.auto_column("NVIDIA H200", None, "no-such-model", 4096, {"triton"}) is None
    # rows with no deepgemm_down_us key at all (a run made before the column): whether auto ran it is unknown
    old = {"triton", "deepgemm"}
    assert bm.auto_column("NVIDIA H100 80GB HBM3", None, "kimi-k2", 4096, old, known=old) is None
    assert bm.auto_column("NVIDIA H100 80GB HBM3", None, "kimi-k2", 4096, old, known=old | {"deepgemm_down"}) == "deepgemm"


def test_deepgemm_down_column_is_medianed_and_named_where_auto_runs_it(tmp_path, monkeypatch, capsys):
    """bench_experts' deepgemm_down column left out of the medians and the table, or auto on the H100 (whose regimes
    list deepgemm_down before DeepGEMM at 4096 tokens) credited with DeepGEMM's whole compute, or with nothing."""
    down = (99.0, 93.0, 180.0)  # median 99, mean 124
    runs = _runs(device="NVIDIA H100 80GB HBM3")
    for run, t in zip(runs, down, strict=True):
        run["rows"][0]["deepgemm_down_us"] = t
        run["rows"][1]["deepgemm_down_us"] = None  # not timed at this point in every run: no median
    top, ridge = bm.median_rows(runs)
    assert top["us"] == {"triton": 110.0, "deepgemm": 95.0, "deepgemm_down": 99.0}
    assert top["x_floor"]["deepgemm_down"] == pytest.approx(0.99)
    assert top["auto"] == "deepgemm_down" and top["auto_us"] == 99.0  # not DeepGEMM's faster 95: auto's first regime
    assert top["auto_tflops_useful"] == pytest.approx(KIMI_FLOP / 99e-6 / 1e12)
    assert "deepgemm_down" not in ridge["us"] and ridge["auto"] == "triton"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bm.main(_write(tmp_path, runs)) == 0
    out = capsys.readouterr().out
    assert "| shape | tokens | routing | floor us | triton | deepgemm | deepgemm_down | Triton spread | auto |" in out
    assert ("| kimi-k2 | 4096 | balanced | 100.0 (flop) | 110.0 (1.10) | 95.0 (0.95) | 99.0 (0.99) | 90.0% | "
            "deepgemm_down | 0.99 |") in out
    assert "| kimi-k2 | 1024 | skewed | 40.0 (flop) | 51.0 (1.27) | 45.0 (1.12) | - | 4.0% | triton | 1.27 |" in out
    # the same runs made before the column existed: auto at 4096 is not credited with DeepGEMM's whole compute
    before = _runs(device="NVIDIA H100 80GB HBM3")
    assert [r["auto"] for r in bm.median_rows(before)] == [None, "triton"]


@pytest.mark.parametrize("why, auto", [("left out (--no-deepgemm)", None), ("DeepGEMM does not import (...)", "triton")])
def test_auto_column_tells_a_library_left_out_from_one_that_cannot_run(why, auto):
    """Runs made with --no-deepgemm (DeepGEMM's columns None, the reason 'left out') credited Triton with the
    H200's 4096-token points, which auto hands to DeepGEMM; where DeepGEMM cannot run, Triton is what auto runs."""
    runs = _runs()
    for run in runs:
        run["deepgemm"] = {"absent": {"kimi-k2": why}}
        for row in run["rows"]:
            row["deepgemm_us"] = row["deepgemm_down_us"] = None
    assert [r["auto"] for r in bm.median_rows(runs)] == [auto, "triton"]


@pytest.mark.parametrize("change, needle", [
    (lambda runs: runs[1].update(device="NVIDIA H100 80GB HBM3"), "differ in device"),
    (lambda runs: runs[2].update(flush="dirty"), "differ in flush"),
    (lambda runs: runs[1]["rows"].pop(), "other points"),
    (lambda runs: runs.__delitem__(slice(1, None)), "two runs or more, got 1"),
])
def test_runs_that_cannot_share_a_median_are_refused(tmp_path, change, needle):
    """Medians over runs of two GPUs, two flush methods or different points (a figure of no machine)."""
    runs = _runs()
    change(runs)
    with pytest.raises(ValueError, match=needle):
        bm.load_runs(_write(tmp_path, runs))


def test_command_line(tmp_path, monkeypatch, capsys):
    """The table on stdout, the JSON to $OUT, a refusal as exit status 2 with its reason."""
    monkeypatch.setenv("OUT", str(tmp_path))
    paths = _write(tmp_path, _runs(device="NVIDIA H200"))
    assert bm.main([*paths, "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "medians of 3 runs on NVIDIA H200 (clean flush)" in out
    assert "| kimi-k2 | 4096 | balanced | 100.0 (flop) | 110.0 (1.10) | 95.0 (0.95) | 90.0% | deepgemm | 0.95 |" in out
    saved = json.loads((tmp_path / "bench_median.json").read_text())
    assert saved["rows"][0]["auto"] == "deepgemm" and saved["runs"] == paths
    assert bm.main(paths[:1]) == 2
    assert "two runs or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bm.main([*paths, "--capability", "nine"])


def _timed(run_rounds: list[dict]) -> list[dict]:
    """Runs of one Kimi-K2 4096-token point whose rows keep their round timings (``times_us``) as given."""
    return [_run(device="NVIDIA H100 80GB HBM3",
                 rows=[{**_row("kimi-k2", 4096, "balanced", statistics.median(t["triton"])), "times_us": t}])
            for t in run_rounds]


def test_pooled_ratios_set_every_round_against_triton_and_its_control():
    """At a power-bound point one run's four-round median moves by several percent: a library judged by the median
    of run medians, against Triton's timings alone, read a lucky Triton run as the library's loss. The pooled ratio
    is the median of the library's timings over every run against that of Triton's and the control's together."""
    rows = _timed([
        {"triton": [100.0, 104.0], "control": [110.0, 120.0], "deepgemm_down": [98.0, 99.0],
         "deepgemm": [90.0, float("inf")]},
        {"triton": [102.0, 130.0], "control": [101.0, 103.0], "deepgemm_down": [97.0, 140.0],
         "deepgemm": [91.0, 92.0]},
    ])
    pooled = bm.median_rows(rows)[0]["pooled"]
    base = statistics.median([100.0, 104.0, 102.0, 130.0, 110.0, 120.0, 101.0, 103.0])  # 103.5
    assert pooled["deepgemm_down"] == pytest.approx(statistics.median([98.0, 99.0, 97.0, 140.0]) / base)
    assert pooled["control"] == pytest.approx(statistics.median([110.0, 120.0, 101.0, 103.0]) / 103.0)
    assert pooled["timings"] == 4
    assert "deepgemm" not in pooled  # a round it could not run: no ratio rather than one over the rounds it ran
    assert "quack" not in pooled and "poc" not in pooled  # not a candidate column
    # runs made before alternated rounds kept no round timings: nothing pooled
    assert bm.median_rows(_runs())[0]["pooled"] is None


def test_common_points_pools_a_full_table_with_runs_of_its_power_bound_points(tmp_path, capsys):
    """Runs of the 4096-token points alone (more rounds where a point is noisy) refused beside a full table, or taken
    with the full table's other points medianed over fewer runs than the table says."""
    full = _runs(device="NVIDIA H100 80GB HBM3")
    part = _runs(device="NVIDIA H100 80GB HBM3")[:2]
    for run in part:
        run["rows"] = run["rows"][:1]
    paths = _write(tmp_path, full + part)
    with pytest.raises(ValueError, match="other points"):
        bm.load_runs(paths)
    runs = bm.load_runs(paths, common=True)
    assert [[bm._key(r) for r in run["rows"]] for run in runs] == [[("kimi-k2", 4096, "balanced")]] * 5
    other = _runs()[0]
    other["device"] = "NVIDIA H100 80GB HBM3"
    other["rows"] = other["rows"][1:]  # only the 1024-token point: none shared with the parts
    with pytest.raises(ValueError, match="share no point"):
        bm.load_runs(_write(tmp_path / "other", part + [other]), common=True)
    assert bm.main([*paths, "--common-points"]) == 0
    out = capsys.readouterr().out
    assert "medians of 5 runs" in out and "| kimi-k2 | 1024 |" not in out
