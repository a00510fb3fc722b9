"""The A/B tool end to end on a tiny configuration: complete JSON, plots, and a wrong layout
failing the reference check."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.memory import MemoryReport
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.tools import ab
from vllm_moonep.tools.launch import launched_world_size

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="the A/B tool spawns its own ranks")


class SkipsPrefetch(ReplicatedWeightLayout):
    """A deliberately wrong layout: never fills the slots (stale zeros are read instead)."""

    def prefetch(self, buffer, plan):
        return None


def broken_layout(shape, local, device, impl):
    R, E, B = dist.get_world_size(), shape["experts"], shape["slots"]
    pool = MoonEPBufferPool(dict(H=shape["hidden"], K=shape["topk"], E=E, num_ep_ranks=R, B=B, token_padding=128,
                                 device=device), max_tokens_per_rank=shape["max_tokens"], engine="builtin")
    layouts = [SkipsPrefetch(w13, w2, E, B) for w13, w2 in local]
    return [MoonEPMoE(pool, lay, impl=impl) for lay in layouts], pool, layouts, [], MemoryReport()


SMALL = dict(preset="tiny", ranks=2, layers=2, tokens=(8, 32), maxvios=(0.0, 3.0), steps=2, warmup=1, check_steps=1,
             budget_gb=0.05, progress=False)


def test_ab_writes_complete_json_and_plots(tmp_path):
    res = ab.run_ab(configs=["replicated", "symmetric", "symmetric-shared"], out_dir=str(tmp_path), **SMALL)
    assert res["failures"] == []
    with open(tmp_path / "moonep-ab.json") as f:
        data = json.load(f)
    for key in ("preset", "shape", "configs", "environment", "anchor", "sigmas", "elapsed_s", "failures", "projection"):
        assert key in data, key
    assert {"torch", "ranks", "device", "python"} <= set(data["environment"])
    for cfg in ("replicated", "symmetric", "symmetric-shared"):
        entry = data["configs"][cfg]
        assert len(entry["memory"]) == 2
        for m in entry["memory"]:
            assert {"accounted", "measured_resident", "measured_peak", "load_s"} <= set(m)
            assert {"home_rows", "replicated_rows", "slots", "transient", "resident"} <= set(m["accounted"])
        assert len(entry["points"]) == 4
        for p in entry["points"]:
            for key in ("tokens", "maxvio", "median_s", "p90_s", "phases_median_s", "imbalance_without_plan",
                        "imbalance_with_plan", "slots_used_per_step", "ref_rel_err", "raw"):
                assert key in p, key
            assert set(p["phases_median_s"]) == {"pad", "dispatch", "prefetch", "experts", "combine"}
            assert 0 < p["ref_rel_err"] < 2e-2
            assert p["median_s"] > 0 and p["p90_s"] >= p["median_s"]
    rep = data["configs"]["replicated"]["memory"][0]["accounted"]
    sym = data["configs"]["symmetric"]["memory"][0]["accounted"]
    shared = data["configs"]["symmetric-shared"]["memory"][0]["accounted"]
    assert rep["resident"] > sym["resident"] > shared["resident"]
    # measured resident memory follows the same order as the accounting
    meas = {c: data["configs"][c]["memory"][0]["measured_resident"] for c in ("replicated", "symmetric")}
    assert meas["replicated"] > meas["symmetric"]
    skewed = [p for p in data["configs"]["replicated"]["points"] if p["maxvio"] == 3.0]
    assert any(p["slots_used_per_step"] > 0 for p in skewed)
    for name in ("memory.png", "latency_vs_maxvio.png", "latency_vs_tokens.png"):
        path = tmp_path / name
        assert path.exists() and path.stat().st_size > 5000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = ab.format_table(res)
    assert "replicated" in text and "symmetric-shared" in text


def test_ab_fails_a_wrong_layout(tmp_path):
    res = ab.run_ab(configs=["replicated", f"{__name__}:broken_layout"], out_dir=str(tmp_path), plots=False, **SMALL)
    assert res["failures"], "a layout that skips prefetch must fail the reference check"
    assert all("broken_layout" in f for f in res["failures"])
    assert not any(f.startswith("replicated") for f in res["failures"])


def test_ab_projection_mode(capsys):
    assert ab.main(["project", "--ep", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert "Kimi-K2" in out
    rows = {(r["model"], r["R"]): r for r in ab.projection_rows(eps=(64,))}
    kimi = rows[("Kimi-K2", 64)]
    assert kimi["fits"]["replicated"] is False and kimi["fits"]["symmetric"] is True


def test_scaled_shape_fits_budget():
    s = ab.scaled_shape(ab.PRESETS["kimi-k2"], 4, None, 2 * ab.GiB, None)
    assert s["experts"] % 4 == 0 and s["experts"] >= s["topk"]
    from vllm_moonep.common.memory import replicated_accounting

    assert replicated_accounting(s["experts"], 4, s["slots"], 7168, 2048, layers=s["layers"]).resident <= 2 * ab.GiB
    assert s["expert_scale"] > 1


@pytest.mark.vllm
def test_ab_vllm_poc_configuration(tmp_path):
    """vLLM's own in-tree MoonEP classes on our engine pass the same reference check."""
    small = dict(SMALL, tokens=(32,), maxvios=(3.0,))
    res = ab.run_ab(configs=["vllm-poc"], out_dir=str(tmp_path), plots=False, **small)
    assert res["failures"] == []
    pts = res["configs"]["vllm-poc"]["points"]
    assert pts and 0 < pts[0]["ref_rel_err"] < 2e-2
    assert pts[0]["slots_used_per_step"] > 0
