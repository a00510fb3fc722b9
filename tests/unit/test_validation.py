"""The input-validation audit (docs/VALIDATION.md), single process: every public entry point
rejects each bad input with a ``MoonEPInputError``/``MoonEPStateError`` that names it, and the
object stays usable. A world of one rank needs no process group; rows that need several ranks
(world size, group, config mismatch, faults) live in tests/distributed.

Each case id below is the name the table in docs/VALIDATION.md cites.
"""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE, capacity_for, pad_to_capacity, sanitize_routing
from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn
from vllm_moonep.common.padding import tokens_per_expert
from vllm_moonep.engine import Buffer, MoonEPInputError, MoonEPStateError
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.routing import route

S, H, K, E, B, TP = 16, 8, 2, 8, 2, 4


def _inputs(dtype=torch.bfloat16):
    ids, w = route(S, E, K, sigma=1.0, seed=3, rank=0)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    return x, w, ids, tpe


def _buf(**kw):
    return Buffer(S, H, K, E, 1, B=B, token_padding=TP, device="cpu", **kw)


# ------------------------------------------------------------------------------ Buffer(...)
BUFFER_CASES = {
    "buffer_S_nonpositive": (dict(S=0), "S .tokens per rank."),
    "buffer_S_not_int": (dict(S=16.0), "S .tokens per rank."),
    "buffer_H_nonpositive": (dict(H=0), "H .hidden size."),
    "buffer_K_range": (dict(K=33), "top-k"),
    "buffer_E_divisible": (dict(E=9, R=2), "divisible"),
    "buffer_R_range": (dict(R=129, E=129 * 2), "num_ep_ranks must be in"),
    "buffer_B_positive": (dict(B=0), "B .prefetch slots."),
    "buffer_tp_positive": (dict(token_padding=0), "token_padding"),
    "buffer_nvs_bound": (dict(S=2**20, K=32), "2\\*\\*24"),
    "buffer_dtype": (dict(dtype=torch.float16), "dtype must be torch.bfloat16"),
    "buffer_world_without_group": (dict(R=2), "needs a process group"),
    "buffer_timeout_nonpositive": (dict(timeout_s=0), "timeout_s"),
    # a misspelt option must not be ignored silently (tokenpadding=64 used to leave the padding at 128)
    "buffer_unknown_keyword": (dict(tokenpadding=64, timeout=5), "unknown keyword.*'timeout', 'tokenpadding'"),
    "buffer_transport_unknown": (dict(transport="nvlink"), "transport must be one of"),
}


@pytest.mark.parametrize("case", list(BUFFER_CASES))
def test_buffer_construction_rejects(case):
    """A Buffer built with a shape or setting the engine cannot honour, instead of a MoonEPInputError naming it."""
    kw, needle = BUFFER_CASES[case]
    args = dict(S=S, H=H, K=K, E=E, R=1, B=B, token_padding=TP)
    args.update(kw)
    R = args.pop("R")
    with pytest.raises(MoonEPInputError, match=needle):
        Buffer(args.pop("S"), args.pop("H"), args.pop("K"), args.pop("E"), R, device="cpu", **args)


# ------------------------------------------------------------------------------ dispatch
def _dispatch_cases():
    x, w, ids, tpe = _inputs()
    nc = torch.randn(H, S).to(torch.bfloat16).t()  # [S, H], not contiguous
    return {
        "dispatch_hidden_dtype": ((x.half(), w, ids, tpe), "must be torch.bfloat16"),
        "dispatch_hidden_shape": ((x[:-1], w, ids, tpe), "callers pad"),
        "dispatch_hidden_not_tensor": ((x.tolist(), w, ids, tpe), "must be a tensor"),
        "dispatch_hidden_device": ((x.to("meta"), w, ids, tpe), "is on meta"),
        "dispatch_hidden_contiguity": ((nc, w, ids, tpe), "must be contiguous"),
        "dispatch_weights_dtype": ((x, w.double(), ids, tpe), "route_weights_sk must be float32"),
        "dispatch_weights_shape": ((x, w[:, :1], ids, tpe), "route_weights_sk must be"),
        "dispatch_weights_nonfinite": ((x, torch.full_like(w, float("inf")), ids, tpe), "non-finite"),
        "dispatch_ids_dtype": ((x, w, ids.long(), tpe), "topk_experts_sk must be int32.*torch.topk returns int64"),
        "dispatch_ids_shape": ((x, w, ids[:-1], tpe), "topk_experts_sk must be"),
        "dispatch_ids_out_of_range": ((x, w, torch.where(ids == ids[0, 0], E, ids), tpe), f"must be in \\[0, {E}\\)"),
        "dispatch_ids_negative": ((x, w, torch.where(ids == ids[0, 0], -1, ids), tpe), "sanitize"),
        "dispatch_ids_contiguity": ((x, w, ids.t().contiguous().t(), tpe), "must be contiguous"),
        "dispatch_tpe_dtype": ((x, w, ids, tpe.long()), "tokens_per_expert must be int32"),
        "dispatch_tpe_shape": ((x, w, ids, tpe[:-1]), "tokens_per_expert must be"),
        "dispatch_tpe_sum": ((x, w, ids, tpe + 1), "must be S\\*K"),
        "dispatch_tpe_not_bincount": ((x, w, ids, tpe.roll(1)), "not the bincount"),
    }


@pytest.mark.parametrize("case", list(_dispatch_cases()))
def test_dispatch_rejects_then_next_step_works(case):
    """dispatch accepting a bad argument, or a rejected call leaving the buffer unable to run the next valid step."""
    args, needle = _dispatch_cases()[case]
    buf = _buf()
    with pytest.raises(MoonEPInputError, match=needle):
        buf.dispatch(*args)
    x, w, ids, tpe = _inputs()
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    out, rw, _ = buf.combine(plan, xn, wn)
    assert torch.equal(rw, w)


# ------------------------------------------------------------------------------ prefetch_weight / combine / order
def _weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(E + B, 6, H, generator=g).to(dtype), torch.randn(E + B, 6, H, generator=g).to(dtype),
            torch.randn(E + B, H, 6, generator=g).to(dtype)]


def test_prefetch_weight_rejects():
    """prefetch_weight before dispatch, or on weights of the wrong shape, dtype, layout or device, writing instead of
    refusing."""
    buf = _buf()
    x, w, ids, tpe = _inputs()
    gate, up, down = _weights()
    with pytest.raises(MoonEPStateError, match="plan was not made"):  # prefetch_order_before_dispatch
        buf.prefetch_weight(plan=None, full_gate_weight=gate, full_up_weight=up, full_down_weight=down)
    _, _, _, plan = buf.dispatch(x, w, ids, tpe)
    cases = {
        "prefetch_shape": ((gate[:E], up, down), "must be \\[E\\+B"),
        "prefetch_not_tensor": ((None, up, down), "must be \\[E\\+B"),
        "prefetch_dtype": ((gate.float(), up, down), "contiguous bf16"),
        "prefetch_contiguity": ((gate.transpose(1, 2).contiguous().transpose(1, 2), up, down), "not contiguous"),
        "prefetch_device": ((gate.to("meta"), up, down), "is on meta"),
    }
    for name, ((g_, u_, d_), needle) in cases.items():
        with pytest.raises(MoonEPInputError, match=needle):
            buf.prefetch_weight(plan=plan, full_gate_weight=g_, full_up_weight=u_, full_down_weight=d_)
    buf.prefetch_weight(plan=plan, full_gate_weight=gate, full_up_weight=up, full_down_weight=down)


def test_combine_rejects_and_calling_order():
    """combine accepting bad rows or route weights, another buffer's plan, no plan or a stale one."""
    buf, other = _buf(), _buf()
    x, w, ids, tpe = _inputs()
    xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    cases = {
        "combine_shape": ((xn[:, :-1],), "must be \\[NvS"),
        "combine_rows": ((xn[:-1],), "must be \\[NvS"),
        "combine_dtype": ((xn.float(),), "must be torch.bfloat16"),
        "combine_device": ((xn.to("meta"),), "on meta"),
        "combine_contiguity": ((torch.empty(H, xn.shape[0], dtype=torch.bfloat16).t(),), "must be contiguous"),
        "combine_route_weights_dtype": ((xn, wn.double()), "route_weights_nvs must be contiguous float32"),
        "combine_route_weights_shape": ((xn, wn[:3]), "route_weights_nvs must be contiguous float32"),
        # a strided view: the GPU kernel indexes the weights as a dense vector (read the wrong ones)
        "combine_route_weights_strided": ((xn, torch.stack([wn, wn], dim=1)[:, 0]), "must be contiguous float32"),
    }
    for name, (args, needle) in cases.items():
        with pytest.raises(MoonEPInputError, match=needle):
            buf.combine(plan, *args)
    with pytest.raises(MoonEPStateError, match="not made by this buffer"):  # combine_foreign_plan
        other.combine(plan, xn)
    with pytest.raises(MoonEPStateError, match="not made by this buffer"):  # combine_before_dispatch
        other.combine(None, xn)
    _, _, _, plan2 = buf.dispatch(x, w, ids, tpe)
    with pytest.raises(MoonEPStateError, match="dispatched since"):  # combine_stale_plan
        buf.combine(plan, xn)
    buf.combine(plan2, xn)
    # destroy: idempotent; every later call is a state error
    buf.destroy()
    buf.destroy()
    for call in (lambda: buf.dispatch(x, w, ids, tpe), lambda: buf.combine(plan2, xn),
                 lambda: buf.prefetch_weight(plan=plan2, full_gate_weight=None)):
        with pytest.raises(MoonEPStateError, match="destroyed"):
            call()


# ------------------------------------------------------------------------------ pool, padding, routing
def test_pool_get_rejects():
    """A buffer pool accepting a token count over capacity, negative or not an int, or used after destroy."""
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, token_padding=TP, device="cpu"),
                            max_tokens_per_rank=64, engine="builtin", min_capacity=16)
    with pytest.raises(MoonEPInputError, match="capacity exceeded"):  # pool_capacity_exceeded
        pool.get(65)
    with pytest.raises(MoonEPInputError, match=">= 0"):  # pool_negative
        pool.get(-1)
    for bad in (3.5, "8", None, True):  # pool_not_int
        with pytest.raises(MoonEPInputError, match="must be an int"):
            pool.get(bad)
    assert pool.get(torch.tensor(5))[0] == 16 and pool.get(1)[0] == 16 and pool.get(64)[0] == 64
    with pytest.raises(MoonEPInputError, match="max_tokens_per_rank"):  # pool_max_nonpositive
        MoonEPBufferPool({}, max_tokens_per_rank=0)
    pool.destroy()
    pool.destroy()
    with pytest.raises(MoonEPStateError, match="destroyed"):  # pool_after_destroy
        pool.get(1)
    assert capacity_for(0, 64, 16) == 16


def test_padding_and_sanitizing_reject():
    """Padding or sanitizing accepting mismatched shapes, float ids or out-of-range ids."""
    x, w, ids, _ = _inputs()
    with pytest.raises(MoonEPInputError, match="same shape"):  # sanitize_shape_mismatch
        sanitize_routing(ids, w[:, :1])
    with pytest.raises(MoonEPInputError, match="integer tensor"):  # sanitize_float_ids
        sanitize_routing(ids.float(), w)
    with pytest.raises(MoonEPInputError, match="capacity exceeded"):  # pad_capacity_exceeded
        pad_to_capacity(x, ids, w, S - 1)
    with pytest.raises(MoonEPInputError, match="rows"):  # pad_rows_mismatch
        pad_to_capacity(x, ids[:-1], w[:-1], S)
    with pytest.raises(MoonEPInputError, match="topk_ids must be in"):  # tokens_per_expert_out_of_range
        tokens_per_expert(torch.full((2, 2), E, dtype=torch.int32), E)
    ids2, w2 = sanitize_routing(torch.tensor([[-1, 3]]), torch.tensor([[0.5, 0.5]]))
    assert ids2.tolist() == [[0, 3]] and w2.tolist() == [[0.0, 0.5]]


# ------------------------------------------------------------------------------ expert_ffn
def test_expert_ffn_rejects():
    """expert_ffn accepting rows, route weights, cu_seqlens, dtypes, devices, an impl or an out buffer it would
    compute wrong."""
    G, Hh, Ii, N = 3, 8, 4, 12
    g = torch.Generator().manual_seed(0)
    gw = GroupedWeights.contiguous(torch.randn(G, Ii, Hh, generator=g), torch.randn(G, Ii, Hh, generator=g),
                                   torch.randn(G, Hh, Ii, generator=g))
    x, rw, cu = torch.randn(N, Hh), torch.rand(N), torch.tensor([4, 8, 12], dtype=torch.int32)
    cases = {
        "ffn_x_shape": ((x[:, :-1], rw, cu, gw), "x must be"),
        "ffn_route_w_shape": ((x, rw[:-1], cu, gw), "route_w must be"),
        "ffn_cu_groups": ((x, rw, cu[:-1], gw), "one entry per group"),
        "ffn_dtype_mismatch": ((x.double(), rw, cu, gw), "weights are"),
        "ffn_cu_dtype": ((x, rw, cu.float(), gw), "cu_seqlens must be int32"),
        "ffn_device_mismatch": ((x, rw.to("meta"), cu, gw), "route_w on meta"),
    }
    for name, (args, needle) in cases.items():
        with pytest.raises(MoonEPInputError, match=needle):
            expert_ffn(*args, impl="reference")
    with pytest.raises(MoonEPInputError, match="impl must be one of"):  # ffn_impl_unknown
        expert_ffn(x, rw, cu, gw, impl="cublas")
    with pytest.raises(MoonEPInputError, match="cannot run here"):  # ffn_impl_unavailable
        expert_ffn(x, rw, cu, gw, impl="grouped_mm")
    with pytest.raises(MoonEPInputError, match="out must be"):  # ffn_out_shape
        expert_ffn(x, rw, cu, gw, impl="reference", out=torch.empty(N, Hh + 1))


# ------------------------------------------------------------------------------ layout and MoonEPMoE.forward
def _layer(E_=8, Hh=128, Ii=128, Kk=2, Bb=2, max_tokens=32):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E_, 2 * Ii, Hh, generator=g) / Hh**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E_, Hh, Ii, generator=g) / Ii**0.5).to(torch.bfloat16)
    lay = ReplicatedWeightLayout(w13, w2, E_, Bb)
    pool = MoonEPBufferPool(dict(H=Hh, K=Kk, E=E_, num_ep_ranks=1, B=Bb, token_padding=8, device="cpu"),
                            max_tokens_per_rank=max_tokens, engine="builtin", min_capacity=8)
    return MoonEPMoE(pool, lay, impl="reference"), w13, w2


def test_replicated_layout_rejects_single_rank():
    """The replicated layout accepting local weights of the wrong dtype, count, shape or device (or a bad timeout), or
    used after destroy."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(8, 256, 128, generator=g).to(torch.bfloat16)
    w2 = torch.randn(8, 128, 128, generator=g).to(torch.bfloat16)
    cases = {
        "layout_dtype": ((w13.float(), w2.float(), 8, 2), {}, "BF16"),
        "layout_expert_count": ((w13, w2, 9, 2), {}, "needs 9"),
        "layout_local_rows": ((w13[:4], w2[:4], 8, 2), {}, "holds 4 experts"),
        "layout_slots_positive": ((w13, w2, 8, 0), {}, "positive"),
        "layout_tile": ((w13[:, :, :64], w2[:, :64], 8, 2), {}, "multiples of 128"),
        "layout_w2_shape": ((w13, w2[:, :, :64], 8, 2), {}, "w2 must be"),
        "layout_dims": ((w13[0], w2, 8, 2), {}, "w13 must be"),
        "layout_odd_2I": ((w13[:, :255], w2, 8, 2), {}, "even"),
        "layout_device_mismatch": ((w13, w2.to("meta"), 8, 2), {}, "w2 on meta"),
        "layout_timeout": ((w13, w2, 8, 2), {"timeout_s": -1}, "timeout_s"),
    }
    for name, (args, kw, needle) in cases.items():
        with pytest.raises(MoonEPInputError, match=needle):
            ReplicatedWeightLayout(*args, **kw)
    lay = ReplicatedWeightLayout(w13, w2, 8, 2)
    lay.destroy()
    lay.destroy()
    with pytest.raises(MoonEPStateError, match="destroyed"):  # layout_after_destroy
        lay.grouped_weights()


def test_moe_forward_rejects_then_works():
    """MoonEPMoE.forward accepting a bad input, or a rejected step breaking the next valid one."""
    moe, w13, w2 = _layer()
    ids, w = route(10, 8, 2, sigma=1.0, seed=1, rank=0)
    x = torch.randn(10, 128).to(torch.bfloat16)
    cases = {
        "forward_hidden_dtype": ((x.float(), ids, w), {}, MoonEPInputError, "BF16"),
        "forward_hidden_shape": ((x[:, :64], ids, w), {}, MoonEPInputError, "hidden states must be"),
        "forward_hidden_not_tensor": ((x.tolist(), ids, w), {}, MoonEPInputError, "must be a tensor"),
        "forward_rows_mismatch": ((x, ids[:-1], w[:-1]), {}, MoonEPInputError, "rows"),
        "forward_topk_mismatch": ((x, ids[:, :1], w[:, :1]), {}, MoonEPInputError, "must be \\[S=16, K=2\\]"),
        "forward_ids_out_of_range": ((x, torch.full_like(ids, 8), w), {}, MoonEPInputError, "topk_ids must be in"),
        "forward_ids_float": ((x, ids.float(), w), {}, MoonEPInputError, "integer tensor"),
        "forward_weights_nonfinite": ((x, ids, torch.full_like(w, float("nan"))), {}, MoonEPInputError, "non-finite"),
        "forward_capacity": ((torch.randn(33, 128).to(torch.bfloat16), *route(33, 8, 2, seed=1)), {}, MoonEPInputError,
                             "capacity exceeded"),
        "forward_dp_count_small": ((x, ids, w), {"num_tokens_across_dp": 5}, MoonEPInputError, "smaller than"),
        "forward_dp_count_over_max": ((x, ids, w), {"num_tokens_across_dp": 33}, MoonEPInputError, "capacity exceeded"),
        "forward_weight_on_input_topk": ((x, ids, w), {"apply_router_weight_on_input": True}, MoonEPInputError, "top-1"),
    }
    for name, (args, kw, exc, needle) in cases.items():
        with pytest.raises(exc, match=needle):
            moe.forward(*args, **kw)
    from vllm_moonep.testing.reference import dense_moe

    out = moe.forward(x, ids, w)
    ref = dense_moe(x, ids, w, w13, w2)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    moe.pool.destroy()
    with pytest.raises(MoonEPStateError):  # forward_after_teardown
        moe.forward(x, ids, w)
    moe.layout.destroy()
