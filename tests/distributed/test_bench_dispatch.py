"""`python -m vllm_moonep.tools.bench_dispatch` on CPU ranks: every column it reports is measured."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_moonep.engine.launch import sm_count
from vllm_moonep.engine.transports.symmetric import DEFAULT_PROGRAMS_PER_SM, PROGRAMS_PER_SM
from vllm_moonep.testing.launch import launched_world_size
from vllm_moonep.tools import bench_dispatch

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="the tool spawns its own ranks")


def test_bench_dispatch_reports_paired_and_separate_anchors(tmp_path, capsys):
    """A ratio taken against an anchor measured at another time of the run only (the machine drifts:
    the same command's anchor read 47-113 us at 1 token on 2 H200s), or a paired column left empty."""
    out = tmp_path / "rows.json"
    assert bench_dispatch.main(["--preset", "qwen3-30b-a3b", "--ranks", "2", "--tokens", "2", "--maxvio", "0", "2",
                                "--iters", "3", "--warmup", "1", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    # a figure is only comparable with what it was measured on: command, date, machine, transport
    assert run["argv"][1:3] == ["--preset", "qwen3-30b-a3b"] and run["date"] and run["torch"] == torch.__version__
    assert (run["device"], run["ranks"], run["H"], run["E"], run["K"]) == ("cpu", 2, 2048, 128, 8)
    assert run["transport"] and run["backend"] == "gloo"
    rows = run["rows"]
    assert [(r["tokens"], r["maxvio"]) for r in rows] == [(2, 0.0), (2, 2.0)]
    for r in rows:
        for key in ("dispatch_us", "combine_us", "a2a_us", "a2a_paired_us", "dispatch_over_a2a_paired",
                    "combine_over_a2a_paired"):
            assert r[key] is not None and r[key] > 0, (key, r)
    table = capsys.readouterr().out
    assert "dispatch/a2a paired" in table and table.count("| 2 | ") == 2


def test_programs_sweep_times_every_setting_against_one_anchor(tmp_path, capsys):
    """The paired programs sweep (buffers of several num_sms in one process, rounds in rotating order):
    a setting left untimed or timed against another round's anchor, a buffer of one setting serving
    another's calls (the settings must each reach their own Buffer), or a negative count accepted."""
    out = tmp_path / "sweep.json"
    assert bench_dispatch.main(["--preset", "qwen3-30b-a3b", "--ranks", "2", "--tokens", "2", "--maxvio", "0",
                                "--transport", "symmetric", "--iters", "3", "--warmup", "1",
                                "--programs-sweep", "0", "2", "3", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["transport"] == "symmetric", "the record must name the transport the buffers resolved to"
    rows = run["rows"]
    assert len(rows) == 1 and rows[0]["a2a_us"] > 0
    default = sm_count(torch.device("cpu")) * DEFAULT_PROGRAMS_PER_SM
    want = [default, 2 * PROGRAMS_PER_SM, 3 * PROGRAMS_PER_SM]
    assert len(set(want)) == 3, "the settings must give three different program counts, or the check below is vacuous"
    assert [(c["num_sms"], c["programs"]) for c in rows[0]["settings"]] == list(zip([0, 2, 3], want))
    assert all(c["us"] > 0 for c in rows[0]["settings"])
    table = capsys.readouterr().out
    assert " | ".join(f"{p} programs us (x a2a)" for p in want) in table
    assert table.count("| 2 | 0.0 | ") == 1
    with pytest.raises(SystemExit):
        bench_dispatch.main(["--ranks", "2", "--programs-sweep", "-1"])


def test_sum_refuses_without_a_gpu(capsys):
    """``--sum`` times the reduce kernel, which only runs on CUDA: on CPU it must refuse and say why, not time
    the torch adds under the kernel's name."""
    with pytest.raises(SystemExit):
        bench_dispatch.main(["--sum", "--device", "cpu"])
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.gpu
def test_sum_times_the_kernel_the_adds_and_the_anchor_gpu(tmp_path, capsys):
    """A ``--sum`` column left untimed, or a run whose kernel and adds disagree in bits reported as a figure."""
    out = tmp_path / "sum.json"
    assert bench_dispatch.main(["--sum", "--device", "cuda", "--preset", "qwen3-30b-a3b", "--tokens", "1", "64",
                                "--iters", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows_dtype"], r["tokens"]) for r in rows] == [("bfloat16", 1), ("bfloat16", 64), ("float32", 1),
                                                               ("float32", 64)]
    assert all(r[k] > 0 for r in rows for k in ("kernel_us", "adds_us", "one_sum_us"))
    assert capsys.readouterr().out.count("| 64 | ") == 2
