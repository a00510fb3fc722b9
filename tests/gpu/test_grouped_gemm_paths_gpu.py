"""Every grouped GEMM path on the GPU against the float64 reference: bf16 random data, poisoned
outputs, empty groups, segment lengths that are not tile multiples. ``quack`` (the optional extra)
runs in both of its forms: gate and up as separate tensors (the split form) and as views of one
``w13`` (the fused epilogue), and once under CUDA-graph capture."""

import pytest
import torch

from vllm_moonep.common.grouped_gemm import (GroupedWeights, available_impls, expert_ffn, impl_unusable,
                                              interleave_gate_up)
from vllm_moonep.testing.reference import expert_ffn_float64

pytestmark = pytest.mark.gpu

CASES = [
    ([128, 0, 0, 384, 256, 0, 128, 0], 768, 2048),
    ([5, 0, 300, 17, 0, 1], 256, 512),
    ([0, 0, 0, 4096], 512, 1024),
]


def _case(lens, I, H, seed, w13=False):
    g = torch.Generator().manual_seed(seed)
    G = len(lens)
    gate = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    up = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    down = (torch.randn(G, H, I, generator=g) / I**0.5).to(torch.bfloat16).cuda()
    cu = torch.tensor(lens).cumsum(0).to(torch.int32).cuda()
    n = int(cu[-1]) + 64
    x = torch.randn(n, H, generator=g).to(torch.bfloat16).cuda()
    rw = torch.rand(n, generator=g).cuda()
    if w13 == "interleaved":  # the symmetric layout's w13: gate row j at 2j, up row j at 2j + 1
        return x, rw, cu, GroupedWeights.of_w13(interleave_gate_up(gate, up), down, interleaved=True)
    if w13:  # vLLM's w13 [G, 2I, H], gate and up as views
        one = torch.cat([gate, up], dim=1)
        ar = torch.arange(G)
        return x, rw, cu, GroupedWeights([one[:, :I]], [one[:, I:]], [down], torch.zeros(G, dtype=torch.int64), ar, ar)
    return x, rw, cu, GroupedWeights.contiguous(gate, up, down)


def _check(impl, x, rw, cu, w, out, what=""):
    end = int(cu[-1])
    ref = expert_ffn_float64(x, rw, cu, w)
    assert torch.isfinite(out[:end]).all(), "rows inside the segments were not all written"
    rel = float((out[:end].double() - ref[:end]).norm() / ref[:end].norm())
    print(f"{impl}{what} lens={cu.tolist()} I={w.intermediate} H={w.hidden}: relative error vs float64 {rel:.2e}")
    assert rel < 1e-2


@pytest.mark.parametrize("order", ["separate", "interleaved"])
@pytest.mark.parametrize("impl", ["reference", "grouped_mm", "triton", "quack"])
@pytest.mark.parametrize("lens,I,H", CASES)
def test_path_matches_float64(impl, lens, I, H, order):
    """A grouped GEMM path on the GPU drifting from float64 or leaving rows of a segment unwritten (NaN-poisoned
    output), with gate and up as separate tensors or stored interleaved in one w13 (the symmetric layout's order:
    the Triton tiles then read one weight, W13I; the library GEMMs one operand whose columns alternate). For quack
    the separate tensors take the split form (three GEMMs)."""
    x, rw, cu, w = _case(lens, I, H, seed=len(lens) + I, w13="interleaved" if order == "interleaved" else False)
    assert w.interleaved == (order == "interleaved")
    if impl not in available_impls(x, w):
        pytest.skip(f"{impl} is not available here: {impl_unusable(impl, x, w)}")
    out = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl=impl, out=out)
    torch.cuda.synchronize()
    _check(impl, x, rw, cu, w, out)


@pytest.mark.parametrize("lens,I,H", CASES)
def test_quack_fused_w13_matches_float64(lens, I, H):
    """quack with gate and up as views of one w13 (one GEMM with the swiglu_route epilogue, then down) drifting from
    float64, leaving rows unwritten, or not taking the fused form."""
    x, rw, cu, w = _case(lens, I, H, seed=len(lens) + I, w13=True)
    why = impl_unusable("quack", x, w)
    if why is not None:
        pytest.skip(f"quack is not available here: {why}")
    assert w.gate_up_as_one() is not None
    out = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl="quack", out=out)
    torch.cuda.synchronize()
    _check("quack", x, rw, cu, w, out, " (fused w13)")


@pytest.mark.parametrize("w13", [True, False], ids=["fused", "split"])
def test_quack_cuda_graph_replay(w13):
    """quack not capturable in a CUDA graph (a host sync or an allocation outside the pool), or a replay that does
    not follow new rows and a new cu_seqlens in the captured buffers."""
    lens, I, H = [5, 0, 300, 17, 0, 1], 256, 512
    x, rw, cu, w = _case(lens, I, H, seed=11, w13=w13)
    why = impl_unusable("quack", x, w)
    if why is not None:
        pytest.skip(f"quack is not available here: {why}")
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture
        expert_ffn(x, rw, cu, w, impl="quack", out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_ffn(x, rw, cu, w, impl="quack", out=out)
    x2, rw2, _, _ = _case(lens, I, H, seed=12, w13=w13)
    x.copy_(x2)
    rw.copy_(rw2)
    cu.copy_(torch.tensor([0, 40, 40, 200, 320, 323], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check("quack", x, rw, cu, w, out, " (graph replay)")
