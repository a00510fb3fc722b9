"""Our MoonEP prepare/finalize and experts under vLLM 0.33's modular kernel, on CPU gloo ranks (or,
with ``VLLM_MOONEP_TEST_DEVICE=cuda``, on one GPU per rank over NCCL: ``workers``).

Mirrors vLLM's in-tree MoonEP test matrix (m x (H, I), E=32, top-4, skew that fills slots) at world
size 1 and 2, both bare (prepare -> experts.apply -> finalize by hand) and through vLLM's
``FusedMoEKernel``; then top-1 with ``apply_router_weight_on_input``, capacity switching over
steps, DP ranks with different token counts, and every bad input with the next valid step still
correct.
Reference: ``dense_moe`` in float32 on the full weights (tolerance: ``workers.close``).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ranks
from tests.vllm import workers as W

pytestmark = pytest.mark.vllm

E, K, B = 32, 4, 4
# vLLM's in-tree matrix is (m, H, I) in {(1,256,512), (37,256,512), (100,512,1024), (512,768,2048)};
# the last shape is scaled to I=1024 to fit a 2-core CPU budget (H=768 kept: 6 weight tiles).
MATRIX = [(1, 256, 512), (37, 256, 512), (100, 512, 1024), (512, 768, 1024)]
SKEW = 2.0  # sigma of the log-normal expert popularity: hot experts line up across ranks


# ---------------------------------------------------------------------------- rank functions
def rk_matrix(kind, m, H, I, sigma, seed):
    W.set_threads()
    rank, R = W.rank_world()
    o = W.build(kind, E, K, H, I, B, max_tokens=1024, seed=seed)
    x, ids, w = W.tokens(m, H, E, K, sigma=sigma, seed=seed, rank=rank)
    ref = W.dense_ref(o, x, ids, w)
    err_bare = W.close(W.run_bare(o, x, ids, w), ref, f"bare P/F m={m} rank={rank}")
    slots_bare = int((o["pf"].last.experts_to_copy >= 0).sum())
    err_k = W.close(W.run_kernel(o, x, ids, w), ref, f"FusedMoEKernel m={m} rank={rank}")
    slots_k = int((o["pf"].last.experts_to_copy >= 0).sum())
    assert not o["pf"].pending
    W.teardown(o)
    return dict(err=max(err_bare, err_k), slots=(slots_bare, slots_k), cap=o["pf"].last.capacity)


def rk_top1(kind, m, H, I, seed):
    W.set_threads()
    rank, R = W.rank_world()
    o = W.build(kind, E, 1, H, I, B, max_tokens=256, seed=seed, tp=64)  # not the default padding: it must travel
    x, ids, w = W.tokens(m, H, E, 1, sigma=SKEW, seed=seed, rank=rank)
    w = w * 0.5 + 0.25  # top-1 weights of a sigmoid-style router (not 1)
    ref = W.dense_ref(o, x, ids, w, apply_on_input=True)
    # apply hands the metadata's padding to the expert compute (a spy around the real call): dropped, the DeepGEMM
    # paths would take these 64-row segments for 128s
    from vllm_moonep.common import vllm_modular

    seen, real = [], vllm_modular.expert_ffn
    vllm_modular.expert_ffn = lambda *a, **k: (seen.append(k.get("token_padding")), real(*a, **k))[1]
    try:
        W.close(W.run_bare(o, x, ids, w, apply_on_input=True), ref, "top-1 bare")
    finally:
        vllm_modular.expert_ffn = real
    assert seen and set(seen) == {64}, seen
    W.close(W.run_kernel(o, x, ids, w, apply_on_input=True), ref, "top-1 kernel")
    # the weight must really matter: without folding it the output differs
    plain = W.dense_ref(o, x, ids, torch.ones_like(w))
    assert float((plain - ref).abs().max()) > 0.1
    slots = int((o["pf"].last.experts_to_copy >= 0).sum())
    # invalid (negative) ids contribute nothing, also with the weight folded into the input
    bad = ids.clone()
    bad[::4] = -1
    out = W.run_kernel(o, x, bad, w, apply_on_input=True)
    assert float(out[::4].float().abs().max()) == 0.0, "an invalid id produced output"
    W.close(out[1::4], ref[1::4], "top-1 valid rows beside invalid ones")
    W.teardown(o)
    return slots


def rk_steps(kind, counts, seed):
    W.set_threads()
    rank, R = W.rank_world()
    H, I, max_tokens = 256, 256, 1024
    o = W.build(kind, E, K, H, I, B, max_tokens=max_tokens, seed=seed)
    caps = []
    for step, n in enumerate(counts):
        x, ids, w = W.tokens(n, H, E, K, sigma=SKEW, seed=seed + step, rank=rank)
        run = W.run_kernel if step % 2 else W.run_bare
        W.close(run(o, x, ids, w), W.dense_ref(o, x, ids, w), f"step {step} n={n}")
        caps.append(o["pf"].last.capacity)
    nbuf = len(o["pool"].buffers)
    W.teardown(o)
    return caps, nbuf


def rk_dp(kind, local_counts, seed):
    """Each DP rank has its own token count; vLLM's DP metadata (max) picks the shared capacity."""
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    W.set_threads()
    rank, R = W.rank_world()
    H, I = 256, 256
    o = W.build(kind, E, K, H, I, B, max_tokens=1024, seed=seed)
    n = local_counts[rank]
    x, ids, w = W.tokens(n, H, E, K, sigma=SKEW, seed=seed, rank=rank)
    ref = W.dense_ref(o, x, ids, w)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                         dp_metadata=DPMetadata(torch.tensor(local_counts, dtype=torch.int32)))
    with override_forward_context(ctx):
        out_k = W.run_kernel(o, x, ids, w)
        cap_k = o["pf"].last.capacity
        out_b = W.run_bare(o, x, ids, w)
        cap_b = o["pf"].last.capacity
    W.close(out_k, ref, f"dp kernel rank={rank} n={n}")
    W.close(out_b, ref, f"dp bare rank={rank} n={n}")
    W.teardown(o)
    return n, cap_k, cap_b


def rk_bad_inputs(kind, seed):
    """Each bad input raises a clear error on every rank; the next valid step is still right."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceContiguous

    from vllm_moonep.common.vllm_modular import MoonEPExperts
    from vllm_moonep.engine import MoonEPError, MoonEPInputError, MoonEPStateError

    W.set_threads()
    rank, R = W.rank_world()
    H, I, max_tokens = 256, 256, 256
    o = W.build(kind, E, K, H, I, B, max_tokens=max_tokens, seed=seed)
    pf = o["pf"]
    x, ids, w = W.tokens(50, H, E, K, sigma=SKEW, seed=seed, rank=rank)
    ref = W.dense_ref(o, x, ids, w)
    msgs = {}

    def expect(name, exc, needle, fn):
        try:
            fn()
        except exc as e:
            assert needle.lower() in str(e).lower(), f"{name}: message {e!r} lacks {needle!r}"
            msgs[name] = str(e)
        else:
            raise AssertionError(f"{name}: no error raised")
        assert not pf.pending, f"{name}: left a pending step"
        # the next valid step is still correct (alternate bare / kernel)
        if not pf.pending:
            W.close(W.run_kernel(o, x, ids, w), ref, f"after {name}")

    # fp16 hidden states
    expect("fp16", MoonEPInputError, "BF16", lambda: W.run_kernel(o, x.half(), ids, w))
    # a quantized config: at prepare, and at experts construction
    fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn)
    expect("quantized prepare", MoonEPInputError, "unquantized",
           lambda: pf.prepare(x, w, ids, E, None, False, fp8))
    expect("quantized experts", MoonEPInputError, "unquantized",
           lambda: MoonEPExperts(o["experts"].moe_config, fp8))
    # expert biases (gpt-oss style): refused, not silently dropped from the compute
    from vllm.model_executor.layers.fused_moe.config import biased_moe_quant_config

    biased = biased_moe_quant_config(torch.zeros(E, 2 * I), torch.zeros(E, H))
    expect("biased prepare", MoonEPInputError, "w1_bias",
           lambda: pf.prepare(x, w, ids, E, None, False, biased))
    expect("biased experts", MoonEPInputError, "bias",
           lambda: MoonEPExperts(o["experts"].moe_config, biased))
    # more tokens than capacity
    xb, idb, wb = W.tokens(max_tokens + 1, H, E, K, sigma=SKEW, seed=seed, rank=rank)
    expect("over capacity", MoonEPInputError, "capacity", lambda: W.run_kernel(o, xb, idb, wb))
    # top-k > 1 with apply_router_weight_on_input
    expect("on-input top-4", MoonEPInputError, "top-1", lambda: W.run_kernel(o, x, ids, w, apply_on_input=True))
    # prepare twice without finalize (or a forward that died between them): one clear error that
    # drops the dead step, and the next step is right (expect() runs one)
    pf.prepare(x, w, ids, E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    expect("prepare twice", MoonEPStateError, "before finalize",
           lambda: pf.prepare(x, w, ids, E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG))
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    a1q, _, meta, _, w_nvs = pf.prepare(x, w, ids, E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)

    y = torch.empty_like(a1q)
    o["experts"].apply(y, a1q, None, None, w_nvs, ids, MoEActivation.SILU, E, None, None, None, None, None, meta, False)
    # finalize with the wrong weight-and-reduce: error, still pending, then the right one works
    out = torch.empty_like(x)
    try:
        pf.finalize(out, y, w, ids, False, TopKWeightAndReduceContiguous())
        raise AssertionError("wrong weight-and-reduce accepted")
    except MoonEPInputError as e:
        assert "TopKWeightAndReduceNoOP" in str(e)
        msgs["wrong weight-and-reduce"] = str(e)
    assert pf.pending
    pf.finalize(out, y, w, ids, False, o["experts"].finalize_weight_and_reduce_impl())
    W.close(out, ref, "finalize after the wrong weight-and-reduce")
    # reset drops a pending step (e.g. after a failed forward); the next step is right
    pf.prepare(x, w, ids, E, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    pf.reset()
    W.close(W.run_bare(o, x, ids, w), ref, "after reset")
    # finalize without prepare
    try:
        pf.finalize(out, y, w, ids, False, o["experts"].finalize_weight_and_reduce_impl())
        raise AssertionError("finalize without prepare accepted")
    except MoonEPStateError:
        pass
    # layout-level bad shapes: E not divisible by R, H / I not multiples of 128 (before any collective)
    from vllm_moonep.replicated import ReplicatedWeightLayout

    w13_l, w2_l = o["w13_l"], o["w2_l"]
    for name, args, needle in [
        ("E % R", (w13_l, w2_l, E + 1, B), "divisible"),
        ("H % 128", (w13_l[:, :, :200].contiguous(), w2_l[:, :200].contiguous(), E, B), "multiples of 128"),
        ("I % 128", (torch.cat([w13_l[:, :100], w13_l[:, 256:356]], 1).contiguous(), w2_l[:, :, :100].contiguous(), E, B),
         "multiples of 128"),
    ]:
        try:
            ReplicatedWeightLayout(*args)
            raise AssertionError(f"{name} accepted")
        except MoonEPError as e:
            assert needle in str(e), (name, str(e))
            msgs[name] = str(e)
    # the buffer pool refuses E not divisible by R, before the collective construction
    try:
        W.make_pool(R, H, K, E + 1, B, 256).get(10)
        raise AssertionError("pool with E % R != 0 accepted")
    except MoonEPInputError as e:
        assert "divisible" in str(e)
    W.close(W.run_kernel(o, x, ids, w), ref, "final step")
    W.teardown(o)
    return sorted(msgs)


def rk_one_rank_bad_hidden(kind, seed):
    """Rank 0 alone hands the P/F hidden states it refuses (fp16 through the kernel; the wrong width to a bare
    prepare); the other ranks a valid step, and then every rank the same valid step. Returns each case's error on
    this rank (``None``: its call completed)."""
    from vllm_moonep.engine import MoonEPInputError

    W.set_threads()
    rank, R = W.rank_world()
    H, I = 256, 256
    o = W.build(kind, E, K, H, I, B, max_tokens=64, seed=seed)
    x, ids, w = W.tokens(50, H, E, K, sigma=SKEW, seed=seed, rank=rank)
    ref = W.dense_ref(o, x, ids, w)
    cases = {"fp16": (W.run_kernel, x.half()), "width": (W.run_bare, torch.cat([x, x[:, :128]], 1))}
    seen = {}
    for name, (run, bad) in cases.items():
        try:
            run(o, bad if rank == 0 else x, ids, w)
            seen[name] = None
        except MoonEPInputError as e:
            seen[name] = str(e)
        assert not o["pf"].pending, name
        W.close(W.run_kernel(o, x, ids, w), ref, f"the step after {name}")
    W.teardown(o)
    return seen


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("m,H,I", MATRIX, ids=[f"m{m}-H{h}-I{i}" for m, h, i in MATRIX])
@pytest.mark.parametrize("R", [1, 2], ids=["R1", "R2"])
def test_matrix(R, m, H, I):
    """Our prepare/finalize and experts in vLLM's modular kernel (bare and FusedMoEKernel) off the dense MoE on vLLM's
    test matrix, or a slot filled at world size 1 (no remote expert)."""
    res = ranks(R, rk_matrix, "replicated", m, H, I, SKEW, 1)
    if R == 1:  # every expert is home: nothing to prefetch
        assert res[0]["slots"] == (0, 0), res
    else:
        assert all(r["slots"][0] > 0 and r["slots"][1] > 0 for r in res), f"skew did not fill a prefetch slot: {res}"
    assert len({r["cap"] for r in res}) == 1


def test_matrix_uniform_routing():
    """Even routing (few or no slots used) computed wrong through the vLLM classes."""
    # no skew: still correct (padding rows to expert 0 may or may not use slots)
    ranks(2, rk_matrix, "replicated", 100, 256, 512, 0.0, 2)


@pytest.mark.parametrize("R", [3, 4])
def test_matrix_more_ranks(R):
    """The vLLM classes right at 2 ranks only: 3 ranks (E=30) and 4 ranks against the dense MoE."""
    # R=4: E=32 as in vLLM's test; R=3: E must divide by R, so E=30 (rk_matrix_e)
    if R == 3:
        res = ranks(3, rk_matrix_e, 37, 256, 256, 3)
    else:
        res = ranks(4, rk_matrix, "replicated", 37, 256, 512, SKEW, 4)
    assert all(r["slots"][0] > 0 for r in res), res


def rk_matrix_e(m, H, I, seed):
    """R=3 with E=30 (E must divide by R), top-4, skewed."""
    W.set_threads()
    rank, R = W.rank_world()
    E3 = 30
    o = W.build("replicated", E3, K, H, I, B, max_tokens=512, seed=seed)
    x, ids, w = W.tokens(m, H, E3, K, sigma=SKEW, seed=seed, rank=rank)
    ref = W.dense_ref(o, x, ids, w)
    W.close(W.run_bare(o, x, ids, w), ref, "R=3 bare")
    W.close(W.run_kernel(o, x, ids, w), ref, "R=3 kernel")
    s = int((o["pf"].last.experts_to_copy >= 0).sum())
    W.teardown(o)
    return dict(slots=(s, s))


def test_top1_apply_router_weight_on_input():
    """Top-1 with apply_router_weight_on_input applying the router weight twice or not at all, or an invalid id giving
    output."""
    slots = ranks(2, rk_top1, "replicated", 100, 256, 256, 5)
    assert max(slots) > 0


def test_steps_switch_capacity():
    """Capacity not following each step's token count, or buffers made without bound, as steps change size."""
    counts = [1, 300, 37, 1024, 129, 600, 5]
    res = ranks(2, rk_steps, "replicated", counts, 6)
    caps, nbuf = res[0]
    assert caps == [128, 512, 128, 1024, 256, 1024, 128], caps
    assert nbuf <= 4  # log2(1024/128) + 1
    assert all(r == res[0] for r in res)


def test_dp_ranks_different_token_counts():
    """DP ranks with different token counts picking different capacities, not the one vLLM's DP metadata gives."""
    counts = [3, 200, 77, 129]
    res = ranks(4, rk_dp, "replicated", counts, 7)
    for n, cap_k, cap_b in res:
        assert cap_k == cap_b == 256, res  # every rank pads to the capacity of max(counts)


def test_bad_inputs_then_valid_step():
    """A bad input to the vLLM classes accepted, or a pending step left behind that breaks the next valid one."""
    names = ranks(2, rk_bad_inputs, "replicated", 8)[0]
    for want in ("fp16", "quantized prepare", "quantized experts", "biased prepare", "biased experts",
                 "over capacity", "prepare twice",
                 "wrong weight-and-reduce", "E % R", "H % 128", "I % 128"):
        assert want in names, names


def test_matrix_symmetric_layout():
    """The symmetric layout through vLLM's modular kernel off the dense MoE."""
    res = ranks(2, rk_matrix, "symmetric", 100, 512, 1024, SKEW, 9)
    assert all(r["slots"][0] > 0 for r in res), res


def test_one_rank_refusing_its_hidden_states_is_refused_by_every_rank():
    """A prepare that refused this rank's hidden states without telling the peers, which are already in the
    dispatch's counts exchange: their call completes with this rank's next one (another step's or layer's rows),
    or times out a step later naming the wrong step."""
    seen = ranks(2, rk_one_rank_bad_hidden, "replicated", 10, env={"VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": "20"})
    assert "BF16" in seen[0]["fp16"] and "H=256" in seen[0]["width"], seen[0]
    assert not any("refused their input" in m for m in seen[0].values()), seen[0]
    for name, msg in seen[1].items():
        assert msg is not None and "rank(s) [0] refused their input" in msg, (name, seen[1])
