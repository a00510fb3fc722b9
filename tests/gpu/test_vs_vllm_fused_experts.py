"""Our layer against an implementation we did not write: vLLM 0.33's own ``fused_experts``.

The same weights and routing go through vLLM's Triton fused-MoE path (``fused_experts``, what a user
gets without our backend; ``vllm_moonep.testing.vllm_fused`` says how it is called and what was
checked in vLLM's source) and through our layer at world size 1 on one GPU, the path the vLLM layer
runs: ``MoonEPPrepareAndFinalize`` (pad, dispatch over a world-size-1 ``Buffer`` from our
``MoonEPBufferPool``: the built-in engine's symmetric transport on CUDA, prefetch) ->
``MoonEPExperts.apply`` (``expert_ffn``, ``impl="auto"``: the Triton kernels on CUDA) ->
``finalize`` (combine), driven by vLLM's own ``FusedMoEKernel`` over a ``ReplicatedWeightLayout``
(at world size 1 every expert is home and no slot is filled). Shapes: Qwen3-30B-A3B (H=2048,
I=768, E=128) and Kimi-K2 (H=7168, I=2048, E=384), top-8, 1, 128 and 4096 tokens, bf16, seeded
weights (std 1/sqrt(fan_in)) and seeded skewed routing (``vllm_moonep.testing.routing.route``,
sigma 1). Both outputs are compared with each other and with the float32 dense MoE
(``vllm_moonep.testing.reference.dense_moe``, used experts only), one line per shape and token count
(``-s`` shows them), and a JSON (``$VLLM_MOONEP_TEST_COMPARE_JSON``, else ``$OUT/vs_vllm_fused_experts.json``
where ``$OUT`` is set).

Bounds (``vllm_fused.check``): relative Frobenius difference below ``REL_TOL`` (1e-2) and every
token within a number of its bf16 rounding budgets (``vllm_fused`` module doc): ours against the
reference 1 (the bar of every end-to-end test here, ``tests/moe_fixtures.py``), vLLM's 2 (it also
rounds the gate and up projections to bf16, and its compiled ``moe_sum`` may add the K outputs in
bf16), ours against vLLM's 3 (the two together). ``test_a_misroute_fails_the_comparison`` shows the
bounds can fail: one token's K experts permuted, one (token, k) pair sent to another expert, two
experts' weights swapped in our copy only; each moves its tokens by tens to hundreds of budgets.

Without a GPU the same rank functions run on a CPU rank at a small shape, with
``vllm_fused.fused_experts_torch`` (vLLM's computation and rounding points in plain torch) in vLLM's
place: the comparison and the mis-route checks themselves are exercised there; with a GPU those
cases skip (the real ``fused_experts`` runs instead). Under ``tests/gpu`` every case skips without a
GPU (``tests/conftest.py`` reads the folder's name as the ``gpu`` marker): the CPU cases run where a
module outside it imports them.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from tests.conftest import ranks
from vllm_moonep.testing.vllm_fused import SHAPES

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
TOKENS = (1, 128, 4096)
SIGMA = 1.0  # skew of the routing (as bench_experts' "skewed")
SEED = 33
B = 8  # prefetch slots of the world-size-1 buffer (every expert is home: they stay unused)
REL_TOL = 1e-2
SLACK = {"ours_vs_ref": 1.0, "vllm_vs_ref": 2.0, "ours_vs_vllm": 3.0}
#: the small shape of the CPU cases (the stand-in for vLLM's kernels, float32 reference on the CPU)
CPU_SHAPE = dict(H=256, I=256, E=16, K=4)
CPU_TOKENS = (1, 37)

_REPORT: dict = {"cases": {}, "misroute": {}}


def _has_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _write_report() -> str | None:
    path = os.environ.get("VLLM_MOONEP_TEST_COMPARE_JSON")
    if not path and os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "vs_vllm_fused_experts.json")
    if not path:
        return None
    _REPORT["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_REPORT, f, indent=1)
    return path


# ---------------------------------------------------------------------------- rank side
def _device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)
        # the float32 reference must be float32: no TF32 matmuls (vLLM does not turn them on either)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _vllm_side(dev: torch.device):
    """``(fn, info)`` of vLLM's fused_experts on CUDA, of the plain-torch stand-in on the CPU;
    ``(None, {"unavailable": why})`` where vLLM's cannot run on the GPU."""
    from vllm_moonep.testing.vllm_fused import VllmFusedUnavailable, fused_experts_torch, vllm_fused_experts

    if dev.type != "cuda":
        return fused_experts_torch, {"call": "vllm_fused.fused_experts_torch (CPU stand-in for vLLM's Triton path)"}
    try:
        return vllm_fused_experts(dev)
    except VllmFusedUnavailable as e:
        return None, {"unavailable": str(e)}


class _Ours:
    """Our pool, layout, prepare/finalize and experts at world size 1 under vLLM's ``FusedMoEKernel``."""

    def __init__(self, w13, w2, E, K, H, I, max_tokens, dev):
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

        from vllm_moonep.common import MoonEPBufferPool
        from vllm_moonep.common.vllm_modular import MoonEPExperts, MoonEPPrepareAndFinalize
        from vllm_moonep.replicated import ReplicatedWeightLayout
        from vllm_moonep.testing.vllm_harness import LayoutHolder, ensure_workspace, vllm_moe_config

        self.E, self.w13, self.w2 = E, w13, w2
        self.pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, token_padding=128, device=dev),
                                     max_tokens, engine="builtin")
        self.layout = ReplicatedWeightLayout(w13, w2, E, B)  # its own [E+B] copy: vLLM's w13 / w2 stay apart
        self.pf = MoonEPPrepareAndFinalize(self.pool, max_tokens_per_rank=max_tokens, num_dispatchers=1,
                                           num_global_experts=E)
        self.experts = MoonEPExperts(vllm_moe_config(E, K, H, I, 1, 0, max_tokens, dev), FUSED_MOE_UNQUANTIZED_CONFIG)
        ensure_workspace(dev)
        self.kernel = mk.FusedMoEKernel(self.pf, self.experts)
        self.experts.process_weights_after_loading(LayoutHolder(self.layout))

    kernel_error: str | None = None  # why vLLM's FusedMoEKernel could not drive our classes here (then: by hand)

    def __call__(self, x, ids, w) -> torch.Tensor:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        if self.kernel_error is None:
            try:
                out = self.kernel.apply(x, self.w13, self.w2, w, ids, MoEActivation.SILU, self.E, None, False)
                assert not self.pf.pending
                return out
            except Exception as e:  # vLLM's kernel around our classes, not our step: say so, go on by hand
                self.kernel_error = f"{type(e).__name__}: {str(e)[:300]}"
                self.pf.reset()
        return self.by_hand(x, ids, w)

    def by_hand(self, x, ids, w) -> torch.Tensor:
        """prepare -> experts.apply -> finalize without vLLM's FusedMoEKernel (the same three calls)."""
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

        a1q, _, meta, _, w_nvs = self.pf.prepare(x, w, ids, self.E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        y = torch.empty_like(a1q)
        empty = torch.empty(0, device=x.device)
        self.experts.apply(y, a1q, self.w13, self.w2, w_nvs, ids, MoEActivation.SILU, self.E, None, None, None,
                           empty, empty, meta, False)
        out = torch.empty_like(x)
        self.pf.finalize(out, y, w, ids, False, self.experts.finalize_weight_and_reduce_impl())
        return out

    def path(self) -> str:
        if self.kernel_error is None:
            return ("vLLM's FusedMoEKernel(MoonEPPrepareAndFinalize, MoonEPExperts impl=auto), ReplicatedWeightLayout, "
                    "world size 1")
        return (f"by hand (prepare -> MoonEPExperts.apply -> finalize): vLLM's FusedMoEKernel failed around our classes "
                f"here: {self.kernel_error}")

    def swap_experts(self, a: int, b: int) -> None:
        """Swap experts ``a`` and ``b`` in our copy of the weights only (gate, up and down rows)."""
        lay = self.layout
        for t in (lay.full_gate_weight, lay.full_up_weight, lay.full_down_weight):
            tmp = t[a].clone()
            t[a].copy_(t[b])
            t[b].copy_(tmp)

    def destroy(self) -> None:
        self.pool.destroy()
        self.layout.destroy()


def _first_call(vllm_fn, info, w13, w2, K, seed, dev) -> dict | None:
    """vLLM's fused_experts on one token before anything of ours is built: ``{"unavailable": why}``
    where it cannot compile or run on this machine (its Triton kernel, its compiled ops), else None."""
    x, ids, w = _inputs(1, w13.shape[2], w13.shape[0], K, seed, dev)
    try:
        vllm_fn(x, w13, w2, w, ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        return {"unavailable": f"its first call failed ({info}): {type(e).__name__}: {str(e)[:400]}"}
    return None


def _call_vllm(vllm_fn, info, T, *args) -> torch.Tensor:
    try:
        return vllm_fn(*args)
    except Exception as e:
        raise RuntimeError(f"vLLM's fused_experts failed at T={T} ({info}): {type(e).__name__}: {e}") from e


def _inputs(T, H, E, K, seed, dev):
    from vllm_moonep.testing.routing import route

    ids, w = route(T, E, K, sigma=SIGMA, seed=seed, rank=0)
    g = torch.Generator().manual_seed(seed * 7919 + T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x.to(dev), ids.to(dev), w.to(dev)


def _truth(x, ids, w, w13, w2):
    """The float32 dense MoE and each token's bf16 rounding budget, on ``x``'s device."""
    from vllm_moonep.testing.reference import dense_moe
    from vllm_moonep.testing.vllm_fused import contribution_norms, row_budget

    ref = dense_moe(x, ids, w, w13, w2)
    return ref, row_budget(ref, contribution_norms(x, ids, w, w13, w2))


def _both_sides(shape: dict, dev_kind: str, seed: int, capacity: int):
    """Both implementations on one set of seeded weights: ``(device, vllm_fn, info, w13, w2, ours)``
    with ours sized for ``capacity`` tokens, or a dict saying why vLLM's side cannot run here."""
    from vllm_moonep.testing.vllm_fused import draw_expert_weights

    dev = _device(dev_kind)
    H, I, E, K = shape["H"], shape["I"], shape["E"], shape["K"]
    vllm_fn, info = _vllm_side(dev)
    if vllm_fn is None:
        return info
    w13, w2 = draw_expert_weights(E, H, I, seed, dev)
    gone = _first_call(vllm_fn, info, w13, w2, K, seed, dev)
    if gone:
        return gone
    return dev, vllm_fn, info, w13, w2, _Ours(w13, w2, E, K, H, I, capacity, dev)


def rk_compare(shape: dict, tokens: tuple, dev_kind: str, seed: int) -> dict:
    """Rank side of the comparison: per token count, the three pairs' ``vllm_fused.compare``."""
    from vllm_moonep.testing.vllm_fused import compare, vllm_moe_config_used

    side = _both_sides(shape, dev_kind, seed, max(tokens))
    if isinstance(side, dict):
        return side
    dev, vllm_fn, info, w13, w2, ours = side
    H, E, K = shape["H"], shape["E"], shape["K"]
    res: dict = {"vllm": info, "points": {}}
    try:
        for T in tokens:
            x, ids, w = _inputs(T, H, E, K, seed, dev)
            out_o = ours(x, ids, w)
            out_v = _call_vllm(vllm_fn, info, T, x, w13, w2, w, ids)
            ref, budget = _truth(x, ids, w, w13, w2)
            pt = {"ours_vs_vllm": compare(out_o, out_v, budget), "ours_vs_ref": compare(out_o, ref, budget),
                  "vllm_vs_ref": compare(out_v, ref, budget), "ref_rms": float(ref.float().pow(2).mean().sqrt())}
            if dev.type == "cuda":
                pt["vllm_config"] = vllm_moe_config_used(w13, w2, K, T)
            res["points"][T] = pt
            del x, ids, w, out_o, out_v, ref, budget
        res["ours"] = ours.path()
    finally:
        ours.destroy()
        del w13, w2
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def rk_misroute(shape: dict, tokens: tuple, dev_kind: str, seed: int) -> dict:
    """Rank side of the mis-route checks, per token count: ours with the true routing and weights, then
    mis-routed (one token's ids permuted e -> (e+1) % E), then with two experts' weights swapped in our
    copy, then restored; each against vLLM's output with the true routing and against the reference."""
    from vllm_moonep.testing.vllm_fused import compare

    side = _both_sides(shape, dev_kind, seed, max(max(tokens), 128))
    if isinstance(side, dict):
        return side
    dev, vllm_fn, info, w13, w2, ours = side
    H, E, K = shape["H"], shape["E"], shape["K"]
    res: dict = {"vllm": info, "points": {}}
    try:
        for T in tokens:
            x, ids, w = _inputs(T, H, E, K, seed, dev)
            out_v = _call_vllm(vllm_fn, info, T, x, w13, w2, w, ids)
            ref, budget = _truth(x, ids, w, w13, w2)

            def both(out):
                return {"vs_vllm": compare(out, out_v, budget), "vs_ref": compare(out, ref, budget)}

            pt: dict = {"true": both(ours(x, ids, w))}
            # a routing bug: one token's K experts replaced by their neighbours (a bijection, so still K
            # distinct ids), everything else exact
            tok = T // 2
            bad = ids.clone()
            bad[tok] = (bad[tok] + 1) % E
            pt["misrouted_token"] = tok
            pt["misrouted"] = both(ours(x, bad, w))
            # the smallest routing bug: one (token, k) pair, the token's median-weight one, sent to the next
            # expert it does not already use; its Frobenius difference (about 3.5 w / sqrt(T) at top-8) falls
            # below the 1e-2 bound at thousands of tokens: there only the per-token bound sees it
            kk = int(w[tok].argsort()[K // 2])
            used = set(ids[tok].tolist())
            e = int(ids[tok, kk])
            new_e = next((e + j) % E for j in range(1, E) if (e + j) % E not in used)
            bad = ids.clone()
            bad[tok, kk] = new_e
            pt["misrouted_pair"] = [tok, kk, e, new_e, float(w[tok, kk])]
            pt["pair"] = both(ours(x, bad, w))
            # a weight-addressing bug: the two most used experts' rows swapped in our copy only
            counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)
            a, b = (int(v) for v in counts.argsort(descending=True)[:2])
            pt["swapped_experts"] = [a, b, int(counts[a]), int(counts[b])]
            ours.swap_experts(a, b)
            pt["swapped"] = both(ours(x, ids, w))
            ours.swap_experts(a, b)
            pt["restored"] = both(ours(x, ids, w))
            res["points"][T] = pt
        res["ours"] = ours.path()
    finally:
        ours.destroy()
        del w13, w2
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------- test side
def _fmt(m: dict) -> str:
    return f"max {m['max_abs']:.3e} rel {m['rel_fro']:.2e} worst {m['worst_ratio']:.2f} budgets"


def _report_compare(name: str, res: dict) -> list[str]:
    """Print one line per point; return every bound that failed."""
    from vllm_moonep.testing.vllm_fused import check

    _REPORT["cases"][name] = res
    where = _write_report()
    print(f"\n# {name}: vLLM side {res['vllm'].get('call')} ({res['vllm']}); ours: {res['ours']}")
    failed = []
    for T, pt in res["points"].items():
        cfg = pt.get("vllm_config", {})
        print(f"# {name} T={T:5d}: ours-vs-vllm {_fmt(pt['ours_vs_vllm'])} | ours-vs-ref {_fmt(pt['ours_vs_ref'])} | "
              f"vllm-vs-ref {_fmt(pt['vllm_vs_ref'])} | ref rms {pt['ref_rms']:.3f}"
              + (f" | vLLM tiles {cfg.get('from', cfg.get('error'))}" if cfg else ""))
        for pair, slack in SLACK.items():
            # ours_vs_ref: our layer wrong (a bug in padding, dispatch, the kernels, combine);
            # vllm_vs_ref: the anchor itself off (the comparison would be meaningless);
            # ours_vs_vllm: we and vLLM disagree on the same weights and routing
            why = check(f"{name} T={T} {pair}", pt[pair], rel_tol=REL_TOL, slack=slack)
            if why:
                failed.append(why)
    if where:
        print(f"# wrote {where}")
    return failed


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("name", list(SHAPES))
def test_ours_matches_vllm_fused_experts(name):
    """Our layer (pool, dispatch, Triton expert kernels, combine at world size 1) disagreeing with
    vLLM's own fused_experts, or either with the float32 dense MoE, at real widths and 1, 128 and
    4096 tokens."""
    res = ranks(1, rk_compare, SHAPES[name], TOKENS, "cuda", SEED, env=ENV)[0]
    if "unavailable" in res:
        pytest.skip(f"vLLM's fused_experts cannot run here: {res['unavailable']}")
    failed = _report_compare(name, res)
    assert not failed, "\n".join(failed)


def _assert_misroute(name: str, res: dict) -> None:
    from vllm_moonep.testing.vllm_fused import check

    _REPORT["misroute"][name] = res
    _write_report()
    print(f"\n# mis-route checks, {name}; ours: {res['ours']}")
    for T, pt in res["points"].items():
        for case in ("true", "misrouted", "pair", "swapped", "restored"):
            print(f"# mis-route T={T:5d} {case:9s}: vs vLLM {_fmt(pt[case]['vs_vllm'])} | vs ref {_fmt(pt[case]['vs_ref'])}")
        print(f"# mis-route T={T:5d}: token {pt['misrouted_token']} mis-routed (all K; pair: token, k, expert, "
              f"sent to, weight {pt['misrouted_pair']}); experts swapped (a, b, uses): {pt['swapped_experts']}")
    for T, pt in res["points"].items():
        # the unmutated run passes: the failures below come from the mutation, not from a loose setup
        for case in ("true", "restored"):
            assert check(f"T={T} {case}", pt[case]["vs_vllm"], rel_tol=REL_TOL, slack=SLACK["ours_vs_vllm"]) is None, pt
            assert check(f"T={T} {case}", pt[case]["vs_ref"], rel_tol=REL_TOL, slack=SLACK["ours_vs_ref"]) is None, pt
        # a routing bug (a token's rows sent to the wrong experts) fails the comparison with vLLM's output
        # on the true routing, and the one with the reference, at that token; the per-token bound is what
        # catches one token among thousands (the Frobenius difference moves by ~1/sqrt(T) of it)
        mis = pt["misrouted"]
        assert check("mis-routed", mis["vs_vllm"], rel_tol=REL_TOL, slack=SLACK["ours_vs_vllm"]), (T, mis)
        assert check("mis-routed", mis["vs_ref"], rel_tol=REL_TOL, slack=SLACK["ours_vs_ref"]), (T, mis)
        assert mis["vs_vllm"]["worst_token"] == pt["misrouted_token"], (T, mis)
        pair = pt["pair"]
        assert check("pair mis-routed", pair["vs_vllm"], rel_tol=REL_TOL, slack=SLACK["ours_vs_vllm"]), (T, pair)
        assert check("pair mis-routed", pair["vs_ref"], rel_tol=REL_TOL, slack=SLACK["ours_vs_ref"]), (T, pair)
        assert pair["vs_vllm"]["worst_token"] == pt["misrouted_token"], (T, pair)
        # a weight-addressing bug (a group reading another expert's rows) fails both as well
        sw = pt["swapped"]
        assert check("swapped", sw["vs_vllm"], rel_tol=REL_TOL, slack=SLACK["ours_vs_vllm"]), (T, sw)
        assert check("swapped", sw["vs_ref"], rel_tol=REL_TOL, slack=SLACK["ours_vs_ref"]), (T, sw)


@pytest.mark.gpu
@pytest.mark.vllm
def test_a_misroute_fails_the_comparison():
    """A comparison with vLLM's fused_experts too loose to see a mis-route: one token's experts
    permuted, one (token, k) pair sent to another expert, or two experts' weights swapped in our copy
    only, passing as agreement (Qwen3-30B-A3B widths, 128 and 4096 tokens)."""
    res = ranks(1, rk_misroute, SHAPES["qwen3-30b-a3b"], (128, 4096), "cuda", SEED, env=ENV)[0]
    if "unavailable" in res:
        pytest.skip(f"vLLM's fused_experts cannot run here: {res['unavailable']}")
    _assert_misroute("qwen3-30b-a3b", res)


# ---------------------------------------------------------------------------- without a GPU
_ON_GPU = pytest.mark.skipif(_has_cuda(), reason="a GPU is here: the gpu cases compare with vLLM's real fused_experts")


@_ON_GPU
@pytest.mark.vllm
def test_comparison_on_cpu_with_the_torch_stand_in():
    """The comparison's own logic broken (pairs, budgets, report) where no GPU runs vLLM's kernels:
    our layer on a CPU rank against vLLM's computation in plain torch and the dense MoE."""
    res = ranks(1, rk_compare, CPU_SHAPE, CPU_TOKENS, "cpu", SEED)[0]
    failed = _report_compare("cpu-small", res)
    assert not failed, "\n".join(failed)


@_ON_GPU
@pytest.mark.vllm
def test_a_misroute_fails_the_comparison_on_cpu():
    """The mis-route checks unable to fail where no GPU runs: the same mutations on a CPU rank."""
    _assert_misroute("cpu-small", ranks(1, rk_misroute, CPU_SHAPE, (37, 2000), "cpu", SEED)[0])


def test_torch_stand_in_matches_the_dense_moe():
    """The stand-in for vLLM's path computing something else than the MoE (gate and up swapped, the
    router weight not applied, the K-sum wrong): it is checked against the dense MoE, and a swap of
    gate and up is caught by the same bound."""
    from vllm_moonep.testing.reference import dense_moe
    from vllm_moonep.testing.routing import route
    from vllm_moonep.testing.vllm_fused import (
        check,
        compare,
        contribution_norms,
        draw_expert_weights,
        fused_experts_torch,
        row_budget,
    )

    H, I, E, K, T = 256, 128, 8, 2, 64
    w13, w2 = draw_expert_weights(E, H, I, 5, "cpu")
    ids, w = route(T, E, K, sigma=1.0, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = dense_moe(x, ids, w, w13, w2)
    budget = row_budget(ref, contribution_norms(x, ids, w, w13, w2))
    good = compare(fused_experts_torch(x, w13, w2, w, ids), ref, budget)
    assert check("stand-in", good, rel_tol=REL_TOL, slack=SLACK["vllm_vs_ref"]) is None, good
    # gate and up exchanged (silu on the up projection): far outside the bound
    swapped = torch.cat([w13[:, I:], w13[:, :I]], dim=1)
    bad = compare(fused_experts_torch(x, swapped, w2, w, ids), ref, budget)
    assert check("gate/up swapped", bad, rel_tol=REL_TOL, slack=SLACK["vllm_vs_ref"]), bad
    # the router weights left out (every weight 1)
    bad = compare(fused_experts_torch(x, w13, w2, torch.ones_like(w), ids), ref, budget)
    assert check("no router weight", bad, rel_tol=REL_TOL, slack=SLACK["vllm_vs_ref"]), bad
