"""The A/B tool end to end on a tiny configuration: complete JSON and plots, a wrong layout failing
the reference check, and every configuration's memory measured in fresh rank processes next to
its accounting, with the difference explained where it exceeds 10%."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.common.memory import expert_bytes
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.launch import launched_world_size, resolve_launch, run_on_ranks, shutdown_pools
from vllm_moonep.testing.routing import sigma_for_maxvio
from vllm_moonep.tools import ab
from vllm_moonep.tools.ab import configs, driver, measure, memory
from vllm_moonep.tools.memory_projection import projection_rows

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="the A/B tool spawns its own ranks")

MiB = 2**20


class SkipsPrefetch(ReplicatedWeightLayout):
    """A deliberately wrong layout: never fills the slots (stale zeros are read instead)."""

    def prefetch(self, buffer, plan, rows=None):
        return None


class KeepsGatheredCopy(ReplicatedWeightLayout):
    """A layout whose accounting leaves out a copy it holds: the gathered gate/up rows, kept."""

    def __init__(self, w13_local, w2_local, num_experts, num_slots):
        super().__init__(w13_local, w2_local, num_experts, num_slots)
        E = num_experts
        self.gathered_w13 = torch.cat([self.full_gate_weight[:E], self.full_up_weight[:E]], dim=1)


def _built(shape, local, device, layout_cls):
    """A ``configs.Built`` of ``layout_cls`` per layer (all replicated-style, local teardown)."""
    R, E, B = dist.get_world_size(), shape["experts"], shape["slots"]
    pool = MoonEPBufferPool(dict(H=shape["hidden"], K=shape["topk"], E=E, num_ep_ranks=R, B=B, token_padding=128,
                                 device=device), max_tokens_per_rank=shape["max_tokens"], engine="builtin")
    layouts = [layout_cls(w13, w2, E, B) for w13, w2 in local]
    report = sum((lay.memory_report() for lay in layouts[1:]), layouts[0].memory_report())
    return configs.Built(moes=[MoonEPMoE(pool, lay, impl="reference") for lay in layouts], pool=pool, report=report,
                    held=layouts, heaps=[], destroy_layouts=lambda: [lay.destroy() for lay in layouts])


WRONG = {"broken_layout": SkipsPrefetch, "leaky_layout": KeepsGatheredCopy}


def rank_build_wrong(name, shape, seed):
    """moonep-ab's own measurement (``measure.measure_build``) of a deliberately wrong layout."""
    return measure.measure_build(name, lambda local, device: _built(shape, local, device, WRONG[name]), shape, seed, "cpu")


SMALL = dict(preset="tiny", ranks=2, layers=2, tokens=(8, 32), maxvios=(0.0, 3.0), steps=2, warmup=1, check_steps=1,
             budget_gb=0.05, progress=False)
OURS = ["replicated", "symmetric", "symmetric-shared"]


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    return out, ab.run_ab(configs=OURS, out_dir=str(out), **SMALL)


@pytest.fixture(scope="module")
def wrong():
    """Each wrong layout through moonep-ab's own rank steps (build and measure, one point, teardown)
    in fresh rank processes, as ``run_ab`` runs a configuration."""
    launch = resolve_launch("cpu", 2)
    shape = configs.scaled_shape(configs.PRESETS["tiny"], 2, 2, int(SMALL["budget_gb"] * configs.GiB), None)
    shape["max_tokens"] = 32
    sigma = sigma_for_maxvio(3.0, shape["experts"], shape["topk"], 32 * 2)
    out = {"shape": shape}
    for name in WRONG:
        tag = f"test_ab {name}"
        try:
            mem = run_on_ranks(2, rank_build_wrong, name, shape, 0, tag=tag, **driver.spawn_options(launch))
            res = run_on_ranks(2, measure.rank_point, name, 32, sigma, 2, 1, 1, 0, tag=tag,
                               **driver.spawn_options(launch))
            run_on_ranks(2, measure.rank_teardown, name, tag=tag, **driver.spawn_options(launch))
        finally:
            shutdown_pools(tag)
        out[name] = {"memory": mem, "memory_check": [memory.memory_check(m, "cpu") for m in mem],
                     "point": driver.summarize_point(res, tokens=32, maxvio=3.0, sigma=sigma)}
    return out


def test_ab_writes_complete_json_and_plots(ours):
    """The A/B run must leave every raw figure, the environment and three plots behind."""
    out, res = ours
    assert res["failures"] == []
    with open(out / "moonep-ab.json") as f:
        data = json.load(f)
    for key in ("preset", "shape", "configs", "environment", "anchor", "sigmas", "elapsed_s", "failures", "projection"):
        assert key in data, key
    assert {"torch", "ranks", "device", "python", "backend", "heap"} <= set(data["environment"])
    assert data["environment"]["backend"] == "gloo" and data["environment"]["launched_by_torchrun"] is False
    for cfg in OURS:
        entry = data["configs"][cfg]
        assert len(entry["memory"]) == 2 and len(entry["memory_check"]) == 2
        for m in entry["memory"]:
            assert {"accounted", "measured_resident", "measured_peak", "load_s", "detail"} <= set(m)
            assert {"home_rows", "replicated_rows", "slots", "transient", "resident"} <= set(m["accounted"])
        assert len(entry["points"]) == 4
        for p in entry["points"]:
            for key in ("tokens", "maxvio", "median_s", "p90_s", "phases_median_s", "imbalance_without_plan",
                        "imbalance_with_plan", "slots_used_per_step", "ref_rel_err", "raw"):
                assert key in p, key
            assert set(p["phases_median_s"]) == {"pad", "dispatch", "prefetch", "experts", "combine"}
            assert 0 < p["ref_rel_err"] < 2e-2
            assert p["median_s"] > 0 and p["p90_s"] >= p["median_s"]
            # the communication anchor of the same run: a plain all-to-all of the point's payload
            assert p["a2a_s"] > 0 and all(r["a2a_s"] > 0 for r in p["raw"])
    rep = data["configs"]["replicated"]["memory"][0]["accounted"]
    sym = data["configs"]["symmetric"]["memory"][0]["accounted"]
    shared = data["configs"]["symmetric-shared"]["memory"][0]["accounted"]
    assert rep["resident"] > sym["resident"] > shared["resident"]
    skewed = [p for p in data["configs"]["replicated"]["points"] if p["maxvio"] == 3.0]
    assert any(p["slots_used_per_step"] > 0 for p in skewed)
    for name in ("memory.png", "latency_vs_maxvio.png", "latency_vs_tokens.png"):
        path = out / name
        assert path.exists() and path.stat().st_size > 5000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = ab.format_table(res)
    assert "replicated" in text and "symmetric-shared" in text and "2xa2a" in text
    # the engine's own buffers, outside the layouts' accounting: one per capacity used (8 and 32
    # tokens share one: the pool's smallest, 128, capped at the run's largest token count); on CPU
    # ranks the transport is the collective one (no heap)
    for cfg in OURS:
        assert data["configs"][cfg]["engine_buffers"] == {"capacities": [32], "heap_bytes": 0}
    assert "engine buffers" not in text
    held = json.loads(json.dumps(res, default=str))
    held["configs"]["symmetric"]["engine_buffers"] = {"capacities": [128, 256], "heap_bytes": 3 * 2**20}
    assert "symmetric 3.0 MiB for capacities [128, 256]" in ab.format_table(held)


def test_each_configuration_is_measured_in_fresh_processes(ours):
    """vllm-poc measured 36 MiB against 72 accounted: RSS growth in rank processes an earlier
    configuration had used, whose freed pages hid the growth."""
    _, res = ours
    pids = [{m["detail"]["pid"] for m in res["configs"][c]["memory"]} for c in OURS]
    for i, a in enumerate(pids):
        assert len(a) == 2
        for b in pids[i + 1:]:
            assert not a & b, "two configurations were measured in the same rank process"
    assert all(chk["fresh_process"] for c in OURS for chk in res["configs"][c]["memory_check"])


def test_measured_memory_matches_the_accounting_or_says_why(ours):
    """measured MiB sat next to the accounting unexplained (replicated 114 against 72 MiB)."""
    _, res = ours
    for cfg in OURS:
        for m, chk in zip(res["configs"][cfg]["memory"], res["configs"][cfg]["memory_check"]):
            acc = m["accounted"]["resident"]
            # what the process really holds beyond the layout's tensors: nothing big left unattributed
            assert abs(chk["unexplained"]) <= 0.10 * acc + 2 * MiB, (cfg, chk)
            # the layout's tensors are what the accounting says
            d = m["detail"]
            assert d["tensors_torch"] + d["tensors_heap"] == acc, (cfg, d, acc)
            if cfg == "replicated":
                assert abs(chk["relative"]) <= 0.10, (cfg, chk)
                assert chk["why"] is None
            else:  # CPU host heap with staging: a private copy beside the shared pages
                assert d["host_staging"] == acc
                assert chk["why"] is not None and "staging copy" in chk["why"], chk
    text = ab.format_table(res)
    assert "measured: each configuration in fresh rank processes" in text
    assert "differ by more than 10%, why:" in text and "  symmetric: measured" in text


def test_ab_fails_a_wrong_layout(wrong):
    """A layout that skips prefetch (stale slots) must fail the run's reference check, and one whose
    output is right (it only holds an extra copy) must pass it."""
    broken, leaky = wrong["broken_layout"]["point"], wrong["leaky_layout"]["point"]
    assert broken["slots_used_per_step"] > 0, "the skewed routing must use slots, or skipping prefetch is harmless"
    assert not broken["ref_rel_err"] <= ab.MAX_REF_ERR, broken["ref_rel_err"]
    assert leaky["ref_rel_err"] <= ab.MAX_REF_ERR, leaky["ref_rel_err"]


def test_measurement_catches_a_copy_the_accounting_leaves_out(wrong):
    """Comparing a layout's memory report with the formula that produced it could never see a copy
    the layout holds but does not report; the fresh-process measurement does, and names it."""
    shape = wrong["shape"]
    extra = shape["layers"] * shape["experts"] * expert_bytes(shape["hidden"], shape["intermediate"]) * 2 // 3
    entry = wrong["leaky_layout"]
    for m, chk in zip(entry["memory"], entry["memory_check"]):
        assert m["measured_resident"] - m["accounted"]["resident"] >= 0.9 * extra, (m, extra)
        assert chk["why"] is not None and memory.WHY_TENSORS in chk["why"], chk
        part = dict(chk["parts"])[memory.WHY_TENSORS]
        assert abs(part - extra) <= 0.01 * extra, (part, extra)


def test_ab_projection_mode(capsys):
    """`moonep-ab project` must print the full-size projection and its fit verdicts."""
    assert ab.main(["project", "--ep", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert "Kimi-K2" in out
    rows = {(r["model"], r["R"]): r for r in projection_rows(eps=(64,))}
    kimi = rows[("Kimi-K2", 64)]
    assert kimi["fits"]["replicated"] is False and kimi["fits"]["symmetric"] is True


def test_scaled_shape_fits_budget():
    """A full-size preset scaled to the budget must fit it and keep E a multiple of the ranks."""
    kimi = configs.PRESETS["kimi-k2"]
    s = configs.scaled_shape(kimi, 4, None, 2 * configs.GiB, None)
    assert s["experts"] % 4 == 0 and s["experts"] >= s["topk"]
    from vllm_moonep.common.memory import replicated_accounting

    assert replicated_accounting(s["experts"], 4, s["slots"], kimi.H, kimi.I,
                                 layers=s["layers"]).resident <= 2 * configs.GiB
    assert s["expert_scale"] > 1


def test_scaled_shape_keeps_the_expert_count_while_layers_can_shrink():
    """Shrinking experts before layers turned the GPU A/B's Kimi-K2 into E=8 (no routing skew, no
    plan worth measuring) where one full-width layer fitted; experts shrink only below one layer."""
    from vllm_moonep.common.memory import replicated_accounting

    kimi = configs.PRESETS["kimi-k2"]
    one_layer = replicated_accounting(kimi.E, 2, kimi.E // 2, kimi.H, kimi.I, layers=1).resident
    s = configs.scaled_shape(kimi, 2, None, int(1.5 * one_layer), None)
    assert (s["experts"], s["layers"]) == (kimi.E, 1)
    s = configs.scaled_shape(kimi, 2, None, int(3.5 * one_layer), None)
    assert (s["experts"], s["layers"]) == (kimi.E, 3)
    s = configs.scaled_shape(kimi, 2, None, one_layer // 2, None)
    assert s["layers"] == 1 and s["experts"] < kimi.E


@pytest.mark.vllm
def test_ab_vllm_poc_configuration(tmp_path):
    """vLLM's own in-tree MoonEP classes on our engine pass the same reference check, and their
    memory, measured in fresh processes, is the accounted replicated layout (it read 36 of 72 MiB);
    an --impl they cannot honour is said, not silently dropped."""
    small = dict(SMALL, tokens=(32,), maxvios=(3.0,), impl="reference")
    res = ab.run_ab(configs=["vllm-poc"], out_dir=str(tmp_path), plots=False, **small)
    assert res["failures"] == []
    assert "--impl reference apply to the other configurations only" in res["shape"]["note"]
    pts = res["configs"]["vllm-poc"]["points"]
    assert pts and 0 < pts[0]["ref_rel_err"] < 2e-2
    assert pts[0]["slots_used_per_step"] > 0
    for chk in res["configs"]["vllm-poc"]["memory_check"]:
        assert chk["fresh_process"] and abs(chk["relative"]) <= 0.10, chk


def test_a_nan_anywhere_fails_the_reference_check():
    """max() keeps the finite value it met before a NaN: a rank, layer or step whose output held NaN after the first
    passed the check ("a wrong one fails the run"). The worst error of any order holding a NaN is NaN, which
    fails ``err <= MAX_REF_ERR``."""
    nan = float("nan")
    for errs in ([3e-3, nan], [nan, 3e-3], [3e-3, 2e-3, nan, 1e-3]):
        assert not measure.worst_error(errs) <= configs.MAX_REF_ERR, errs
    assert measure.worst_error([3e-3, 2e-3]) == 3e-3
    res = [{"ref_rel_err": 3e-3}, {"ref_rel_err": nan}]  # the driver's fold over ranks takes it too
    assert not driver.worst_error((r["ref_rel_err"] or 0.0) for r in res) <= configs.MAX_REF_ERR
