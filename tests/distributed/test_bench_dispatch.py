"""`python -m vllm_moonep.tools.bench_dispatch` on CPU ranks: every column it reports is measured."""

from __future__ import annotations

import json

import pytest
import torch

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
