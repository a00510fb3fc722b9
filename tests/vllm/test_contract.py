"""Contract check: vLLM 0.33's own in-tree MoonEP classes run on our built-in engine.

A test-only import shim (``sys.modules["moonep"]`` = a module whose ``Buffer`` is our built-in
engine, removed afterwards) stands in for the real ``moonep`` package. vLLM's
``MoonEPBufferPool`` / ``MoonEPPrepareAndFinalize`` (prepare_finalize/moonep.py) and its
``MoonEPExperts`` (experts/moonep_experts.py, three ``torch._grouped_mm`` calls: torch 2.14 runs
them on CPU, so nothing is monkeypatched) run end to end through vLLM's ``FusedMoEKernel`` and
are checked against the dense reference; so are the mixed pairs (vLLM's P/F with our experts, our
P/F with vLLM's experts). At world size 2 and, with no remote expert to prefetch, at world size 1;
on the CPU, or on CUDA with ``VLLM_MOONEP_TEST_DEVICE=cuda`` (``workers``: one GPU per rank, NCCL).

Not exercised: vLLM's ``MoonEPAll2AllManager`` (its constructor calls
``check_moonep_system_support``, which needs the real package's CUDA extension and NVSwitch
multicast) and ``gather_moonep_weight_layout`` (needs vLLM's EP group; the test builds the same
``[E+B]`` layout with vLLM's ``make_moonep_weight_layout`` from the full weights instead).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import ranks
from tests.vllm import workers as W

pytestmark = pytest.mark.vllm

E, K, B, H, I = 32, 4, 4, 256, 512


def rk_contract(m: int, seed: int):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts import moonep_experts as vx
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vpf

    from vllm_moonep.common.vllm_modular import MoonEPExperts, MoonEPPrepareAndFinalize
    from vllm_moonep.engine import Buffer
    from vllm_moonep.replicated import ReplicatedWeightLayout

    W.set_threads()
    W.ensure_workspace()
    rank, R = W.rank_world()
    dev = W.device()
    saved = sys.modules.get("moonep")
    shim = types.ModuleType("moonep")
    shim.Buffer = Buffer
    sys.modules["moonep"] = shim
    try:
        w13, w2 = W.global_weights(E, H, I, seed)
        ours = ReplicatedWeightLayout(W.local_rows(w13, rank, R).to(dev), W.local_rows(w2, rank, R).to(dev), E, B)
        # vLLM's [E+B] layout object over the SAME tensors, so either P/F prefetches into what
        # either experts read
        vlay = vpf.MoonEPExpertWeightLayout(ours.full_gate_weight, ours.full_up_weight, ours.full_down_weight, B)
        ref_vlay = vpf.make_moonep_weight_layout(w13.to(dev), w2.to(dev), B)  # what vLLM's own builder makes
        assert torch.equal(ref_vlay.full_gate_weight[:E], vlay.full_gate_weight[:E])
        assert torch.equal(ref_vlay.full_down_weight[:E], vlay.full_down_weight[:E])
        # vLLM's pool imports `from moonep import Buffer` -> our engine; kwargs as vLLM's manager passes
        vpool = vpf.MoonEPBufferPool(
            dict(H=H, K=K, E=E, num_ep_ranks=R, num_sms=32, token_padding=128, B=B, group=None,
                 explicitly_destroy=True, device=dev), max_tokens_per_rank=512)
        opool = W.make_pool(R, H, K, E, B, 512)
        cfg = W.moe_config(E, K, H, I, R, rank, 512)
        holder_v, holder_o = W.LayoutHolder(vlay), W.LayoutHolder(ours)

        def vllm_pf():
            return vpf.MoonEPPrepareAndFinalize(buffer_pool=vpool, max_tokens_per_rank=512, num_dispatchers=R,
                                                num_global_experts=E, weight_layout=vlay)

        def vllm_experts():
            ex = vx.MoonEPExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG)
            ex.process_weights_after_loading(holder_v)
            return ex

        def our_pf():
            return MoonEPPrepareAndFinalize(opool, max_tokens_per_rank=512, num_dispatchers=R, num_global_experts=E,
                                            weight_layout=ours)

        def our_experts():
            ex = MoonEPExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG, impl="reference")
            ex.process_weights_after_loading(holder_o)
            return ex

        x, ids, w = W.tokens(m, H, E, K, sigma=2.0, seed=seed, rank=rank)
        ref = W.dense_ref(dict(w13=w13, w2=w2), x, ids, w)
        out = {}
        for name, make_pf, make_ex in [("vllm+vllm", vllm_pf, vllm_experts), ("vllm_pf+our_experts", vllm_pf, our_experts),
                                       ("our_pf+vllm_experts", our_pf, vllm_experts)]:
            pf, ex = make_pf(), make_ex()
            kernel = mk.FusedMoEKernel(pf, ex)
            # w1/w2 as vLLM's layer holds them after its MoonEP conversion: the [E+B] gate and down
            y = kernel.apply(x, ours.full_gate_weight, ours.full_down_weight, w, ids, MoEActivation.SILU, E, None, False)
            out[name] = W.close(y, ref, f"{name} rank={rank} m={m}")
        # one bare vLLM prepare to see the plan fill a slot under this skew
        pf = vllm_pf()
        pf.post_init_setup(vllm_experts())
        a1q, _, meta, _, w_nvs = pf.prepare(x, w, ids, E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        slots = int((pf.plan.experts_to_copy >= 0).sum())
        pf.finalize(torch.empty_like(x), torch.zeros_like(a1q), w, ids, False,
                    vx.MoonEPExperts(cfg, FUSED_MOE_UNQUANTIZED_CONFIG).finalize_weight_and_reduce_impl())
        vpool.destroy()
        opool.destroy()
        out["slots"] = slots
        return out
    finally:
        if saved is None:
            sys.modules.pop("moonep", None)
        else:
            sys.modules["moonep"] = saved


@pytest.mark.parametrize("m", [37, 300])
@pytest.mark.parametrize("R", [1, 2], ids=["R1", "R2"])
def test_vllm_in_tree_classes_on_builtin_engine(R, m):
    """vLLM's own in-tree MoonEP classes (alone and mixed with ours) off the dense MoE on our engine (at world size 1: a
    slot filled with no remote expert): a contract it does not honour."""
    res = ranks(R, rk_contract, m, 11)
    for r in res:
        assert set(r) >= {"vllm+vllm", "vllm_pf+our_experts", "our_pf+vllm_experts"}
    if R == 1:  # every expert is home: nothing to prefetch
        assert res[0]["slots"] == 0, res
    else:
        assert max(r["slots"] for r in res) > 0
