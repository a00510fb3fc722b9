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
from vllm_moonep.common.padding import pad_and_count, tokens_per_expert
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
    """combine accepting bad rows or route weights, another buffer's plan, no plan, a stale one or one combined
    already."""
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
    # combine_twice: on the GPU symmetric transport the first combine returns the rows to padding, so a second
    # sent nothing and returned the first one's sums, whatever its rows (here and on the other transports it
    # recomputed them): refused on every transport
    with pytest.raises(MoonEPStateError, match="combined already"):
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


_ABSENT = object()  # a buffer setting left out
_POOL_KW = dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, token_padding=TP, device="cpu")
POOL_CASES = {
    # int() of "64" failed with a bare TypeError; 64.5 and True made a pool
    "pool_max_str": (dict(), dict(max_tokens_per_rank="64"), "max_tokens_per_rank must be an int > 0, got str"),
    "pool_max_float": (dict(), dict(max_tokens_per_rank=64.5), "max_tokens_per_rank must be an int > 0, got float"),
    "pool_max_bool": (dict(), dict(max_tokens_per_rank=True), "max_tokens_per_rank must be an int > 0, got bool"),
    # the buffer settings were first read at the first get(), mid-serving: a misspelt one failed only there
    "pool_unknown_buffer_keyword": (dict(tokenpadding=3), dict(), "unknown keyword.*'tokenpadding'"),
    "pool_buffer_transport": (dict(transport="symetric"), dict(), "transport must be one of"),
    "pool_buffer_heap": (dict(heap="hots"), dict(), "heap must be None, a SymmetricHeap or one of"),
    "pool_buffer_missing": (dict(K=_ABSENT), dict(), "missing a required argument: 'K'"),
    # a truthy string from a config file turned the id checks on while it said 'no'
    "pool_buffer_check_inputs": (dict(check_inputs="no"), dict(), "check_inputs must be True or False, got 'no'"),
    "pool_buffer_config": (dict(K=33), dict(), "max_tokens_per_rank=64: K .top-k. must be in \\[1, 32\\]"),
    # the contract's bounds at the largest capacity, not at the first (small) one
    "pool_buffer_nvs_bound": (dict(K=32), dict(max_tokens_per_rank=2**20), "2\\*\\*24"),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pool_construction_rejects(case):
    """A buffer pool accepting a maximum that is not a positive int, or buffer settings that would fail only at its
    first get() (mid-serving): a misspelt keyword, an unknown transport, a missing size, a shape outside the
    contract."""
    kw, args, needle = POOL_CASES[case]
    buffer_kwargs = {k: v for k, v in {**_POOL_KW, **kw}.items() if v is not _ABSENT}
    with pytest.raises(MoonEPInputError, match=needle):
        MoonEPBufferPool(buffer_kwargs, **{"max_tokens_per_rank": 64, "engine": "builtin", **args})
    pool = MoonEPBufferPool(dict(_POOL_KW), max_tokens_per_rank=64, engine="builtin", min_capacity=16)
    assert pool.get(5)[0] == 16
    pool.destroy()


def _padding_cases():
    x, w, ids, _ = _inputs()
    return {
        "sanitize_shape_mismatch": (lambda: sanitize_routing(ids, w[:, :1]), "same shape"),
        "sanitize_float_ids": (lambda: sanitize_routing(ids.float(), w), "integer tensor"),
        # bool ids were routed as experts 0 and 1
        "sanitize_bool_ids": (lambda: sanitize_routing(ids > 3, w), "integer tensor .expert ids., got torch.bool"),
        # an int64 id of 2**32 + 3 was cast to int32 as expert 3
        "sanitize_ids_wrap": (lambda: sanitize_routing(ids.long() + 2**32, w), "fit int32.*got max 4294967"),
        # a negative pad expert left invalid ids negative: dispatch then blamed topk_experts_sk
        "sanitize_pad_expert_negative": (lambda: sanitize_routing(ids, w, pad_expert=-1),
                                         "pad_expert must be a non-negative int"),
        "pad_capacity_exceeded": (lambda: pad_to_capacity(x, ids, w, S - 1), "capacity exceeded"),
        "pad_rows_mismatch": (lambda: pad_to_capacity(x, ids[:-1], w[:-1], S), "rows"),
        # 1-D (squeezed top-1) routing failed inside F.pad with a bare RuntimeError
        "pad_ids_1d": (lambda: pad_to_capacity(x, ids[:, 0], w[:, 0], S + 4), "must be \\[s, K\\], got \\[16\\]"),
        # routing on another device than the hidden states: a bare torch error
        "pad_ids_device": (lambda: pad_to_capacity(x, ids.to("meta"), w.to("meta"), S),
                           "are on meta, the hidden states on cpu"),
        # pad_expert >= E was accepted; dispatch then blamed topk_experts_sk
        "pad_expert_out_of_range": (lambda: pad_to_capacity(x[:4], ids[:4], w[:4], 8, E + 5, num_experts=E),
                                    f"pad_expert must be an expert id in \\[0, E={E}\\), got {E + 5}"),
        "pad_and_count_pad_expert": (lambda: pad_and_count(x[:4], ids[:4], w[:4], 8, E, pad_expert=E),
                                     f"pad_expert must be an expert id in \\[0, E={E}\\)"),
        "tokens_per_expert_out_of_range": (lambda: tokens_per_expert(torch.full((2, 2), E, dtype=torch.int32), E),
                                           "topk_ids must be in"),
        # a negative id failed in torch.bincount although the message said negative ids are sanitized
        "tokens_per_expert_negative": (lambda: tokens_per_expert(torch.tensor([[-1, 3]]), E),
                                       "negative .invalid. ids must be sanitized first .sanitize_routing., got min -1"),
        # float ids were truncated to experts silently
        "tokens_per_expert_float_ids": (lambda: tokens_per_expert(ids.float() + 0.5, E), "integer tensor"),
    }


@pytest.mark.parametrize("case", list(_padding_cases()))
def test_padding_and_sanitizing_reject(case):
    """Padding, sanitizing or counting accepting mismatched shapes, ids that are not integers (float, bool, wider than
    int32), out-of-range or negative ids, a pad expert outside [0, E), or routing on another device."""
    call, needle = _padding_cases()[case]
    with pytest.raises(MoonEPInputError, match=needle):
        call()
    ids2, w2 = sanitize_routing(torch.tensor([[-1, 3]]), torch.tensor([[0.5, 0.5]]))
    assert ids2.tolist() == [[0, 3]] and w2.tolist() == [[0.0, 0.5]]
    # a wide negative id is invalid (pad expert, weight 0), not wrapped by the int32 cast into a valid one
    ids3, w3 = sanitize_routing(torch.tensor([[-(2**32) + 3, 3]]), torch.tensor([[0.5, 0.5]]), pad_expert=2)
    assert ids3.tolist() == [[2, 3]] and w3.tolist() == [[0.0, 0.5]]
    x, w, ids, tpe = _inputs()
    px, pid, pw, ptpe, s = pad_and_count(x, ids.long(), w, S + 4, E, pad_expert=E - 1)
    assert s == S and torch.equal(ptpe[:-1], tpe[:-1]) and int(ptpe[-1]) == int(tpe[-1]) + 4 * K


# ------------------------------------------------------------------------------ expert_ffn
def test_expert_ffn_rejects():
    """expert_ffn accepting rows, route weights, cu_seqlens (shape, dtype, or ends that are not cumulative),
    inconsistent weights, dtypes, devices, an impl or an out buffer it would compute wrong, or a rejected call changing
    the next valid one's result."""
    G, Hh, Ii, N = 3, 8, 4, 12
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(G, Ii, Hh, generator=g), torch.randn(G, Ii, Hh, generator=g),
                      torch.randn(G, Hh, Ii, generator=g))
    gw = GroupedWeights.contiguous(gate, up, down)
    x, rw, cu = torch.randn(N, Hh), torch.rand(N), torch.tensor([4, 8, 12], dtype=torch.int32)
    want = expert_ffn(x, rw, cu, gw, impl="reference")

    def ends(*v):
        return torch.tensor(v, dtype=torch.int32)

    cases = {
        "ffn_x_shape": ((x[:, :-1], rw, cu, gw), {}, "x must be"),
        # rows or weights that are not tensors / GroupedWeights: a bare AttributeError
        "ffn_x_not_tensor": ((x.tolist(), rw, cu, gw), {}, "x must be .NvS, H=8., got list"),
        "ffn_weights_not_grouped": ((x, rw, cu, (gate, up, down)), {}, "weights must be a GroupedWeights, got tuple"),
        "ffn_route_w_shape": ((x, rw[:-1], cu, gw), {}, "route_w must be"),
        "ffn_cu_groups": ((x, rw, cu[:-1], gw), {}, "one entry per group"),
        "ffn_dtype_mismatch": ((x.double(), rw, cu, gw), {}, "weights are"),
        "ffn_cu_dtype": ((x, rw, cu.float(), gw), {}, "cu_seqlens must be int32"),
        "ffn_device_mismatch": ((x, rw.to("meta"), cu, gw), {}, "route_w on meta"),
        # cu_seqlens not cumulative ends: a group's rows computed with another group's weights, rows never written
        # (out's old contents returned), or an end past the rows, all without an error
        "ffn_cu_decreasing": ((x, rw, ends(8, 4, 12), gw), {}, "cu_seqlens\\[1\\]=4 < cu_seqlens\\[0\\]=8"),
        "ffn_cu_negative": ((x, rw, ends(-4, 8, 12), gw), {}, "cu_seqlens\\[0\\]=-4 < 0"),
        "ffn_cu_past_rows": ((x, rw, ends(4, 8, 20), gw), {}, "cu_seqlens\\[-1\\]=20 > 12 rows"),
        # cu_seqlens on another device: NotImplementedError from the copy; out on another device: no error
        "ffn_cu_device": ((x, rw, cu.to("meta"), gw), {}, "cu_seqlens on meta"),
        "ffn_out_device": ((x, rw, cu, gw), {"out": torch.empty(N, Hh, device="meta")},
                           "out must be .* on cpu, got .* on meta"),
    }
    for name, (args, kw, needle) in cases.items():
        with pytest.raises(MoonEPInputError, match=needle):
            expert_ffn(*args, impl="reference", **kw)
    # inconsistent weights: a bare IndexError / matmul shape error, or a silent mixed-dtype compute; refused
    # where the GroupedWeights is made, before any compute can take them
    bad_weights = {
        "ffn_weights_down_experts": ((gate, up, down[:2]), "down must be \\[N=3, H=8, I=4\\], got \\[2, 8, 4\\]"),
        "ffn_weights_down_intermediate": ((gate, up, torch.zeros(G, Hh, Ii + 1)), "down must be \\[N=3, H=8, I=4\\]"),
        "ffn_weights_dtype": ((gate, up.double(), down), "share one dtype"),
        "ffn_weights_device": ((gate, up, down.to("meta")), "one device .cpu., got gate on cpu, up on cpu, down on meta"),
    }
    for name, (mats, needle) in bad_weights.items():
        with pytest.raises(MoonEPInputError, match=needle):
            expert_ffn(x, rw, cu, GroupedWeights.contiguous(*mats), impl="reference")
    assert torch.equal(expert_ffn(x, rw, cu, gw, impl="reference"), want)
    # ends that leave the last groups empty and rows past the last end are valid (the contract: undefined rows)
    assert torch.equal(expert_ffn(x, rw, ends(4, 4, 4), gw, impl="reference")[:4], want[:4])
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
        # top-1 ids with [s, 2] weights: a bare broadcast error
        "forward_weight_on_input_shape": ((x, ids[:, :1].contiguous(), w), {"apply_router_weight_on_input": True},
                                          MoonEPInputError, "needs topk_weights \\[s=10, 1\\] on cpu.*got \\[10, 2\\]"),
        # squeezed top-1 routing: a bare F.pad error
        "forward_ids_1d": ((x, ids[:, 0].contiguous(), w[:, 0].contiguous()), {}, MoonEPInputError,
                           "must be \\[s, K\\], got \\[10\\]"),
        # routing on another device than the hidden states: bare torch device errors
        "forward_ids_device": ((x, ids.to("meta"), w), {}, MoonEPInputError,
                               "topk_ids is on meta, topk_weights on cpu"),
        "forward_weights_device": ((x, ids, w.to("meta")), {}, MoonEPInputError, "topk_weights on meta"),
        "forward_routing_device": ((x, ids.to("meta"), w.to("meta")), {}, MoonEPInputError, "the hidden states on cpu"),
        # bool ids were routed as experts 0 and 1; int64 ids past int32 wrapped (2**32 + 3 became expert 3)
        "forward_ids_bool": ((x, ids > 3, w), {}, MoonEPInputError, "integer tensor .expert ids., got torch.bool"),
        "forward_ids_int64_wrap": ((x, torch.where(ids == ids[0, 0], ids.long() + 2**32, ids.long()), w), {},
                                   MoonEPInputError, "fit int32.*got max 4294967"),
        # int() took "12" and truncated 20.9 (pool.get refuses non-ints)
        "forward_dp_count_not_int": ((x, ids, w), {"num_tokens_across_dp": "12"}, MoonEPInputError,
                                     "num_tokens_across_dp must be an int .*got str '12'"),
        "forward_dp_count_float": ((x, ids, w), {"num_tokens_across_dp": 20.9}, MoonEPInputError,
                                   "num_tokens_across_dp must be an int .*got float 20.9"),
    }
    for name, (args, kw, exc, needle) in cases.items():
        with pytest.raises(exc, match=needle):
            moe.forward(*args, **kw)
    from vllm_moonep.testing.reference import dense_moe

    out = moe.forward(x, ids, w)
    ref = dense_moe(x, ids, w, w13, w2)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    # int64 ids (torch.topk's) and a one-element int tensor as the DP count stay accepted
    assert torch.equal(moe.forward(x, ids.long(), w, num_tokens_across_dp=torch.tensor([12])), out)
    moe.pool.destroy()
    with pytest.raises(MoonEPStateError):  # forward_after_teardown
        moe.forward(x, ids, w)
    moe.layout.destroy()
