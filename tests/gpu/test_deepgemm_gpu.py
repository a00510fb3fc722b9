"""``impl="deepgemm"`` on the GPU (DeepGEMM imports and compiles there): MoonEP's padded segments through
DeepGEMM's contiguous grouped GEMMs, against the float64 reference, in both grouped layouts, with gate and
up as one ``w13`` or two tensors, padding tails of NaN with weight 0, and replayed from a CUDA graph; and
``impl="deepgemm_down"`` (the Triton gate/up tiles before its down GEMM) the same way."""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn, interleave_gate_up
from vllm_moonep.common.grouped_gemm.deepgemm_impl import (deepgemm_unusable, expert_ffn_deepgemm,
                                                           expert_ffn_deepgemm_down)
from vllm_moonep.testing.reference import expert_ffn_float64

pytestmark = pytest.mark.gpu

PAD = 128


def _case(counts, G, H, I, seed, w13=True, dev="cuda"):
    """Group ``g`` gets ``counts[g]`` live rows padded to a multiple of 128 with weight-0 rows that hold NaN; pool 0
    serves every group (``dense_groups`` = all of them, the replicated ``[E+B]`` form)."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(G, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(G, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(G, H, I, generator=g) / I**0.5).bfloat16()
    seg = [-(-c // PAD) * PAD for c in counts]
    cu = torch.tensor(seg).cumsum(0).to(torch.int32)
    n = int(cu[-1]) + PAD
    x = torch.randn(n, H, generator=g).bfloat16()
    rw = torch.rand(n, generator=g) + 0.05
    start = 0
    for c, s in zip(counts, seg):
        x[start + c:start + s] = float("nan")
        rw[start + c:start + s] = 0.0
        start += s
    rw[int(cu[-1]):] = 0.0
    if w13 == "interleaved":  # the symmetric layout's order: one operand, gate and up columns alternating
        w = GroupedWeights.of_w13(interleave_gate_up(gate, up).to(dev), down.to(dev), interleaved=True)
    elif w13:
        one = torch.cat([gate, up], dim=1).to(dev)
        w = GroupedWeights([one[:, :I]], [one[:, I:]], [down.to(dev)], torch.zeros(G, dtype=torch.int64),
                           torch.arange(G), torch.arange(G))
    else:
        w = GroupedWeights.contiguous(gate.to(dev), up.to(dev), down.to(dev))
    return x.to(dev), rw.to(dev), cu.to(dev), w


def _skip_unless_usable():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x, rw, cu, w = _case([1], 1, 128, 128, 0)
    why = deepgemm_unusable(x, w)
    if why is not None:
        pytest.skip(f"DeepGEMM cannot run here: {why}")


CASES = [  # (live rows per group, H, I): decode (one row in some groups, empty ones), mid, and uneven prefill
    ([1, 0, 1, 3, 0, 0, 2, 1], 2048, 768),
    ([40, 0, 130, 7, 256, 1], 2048, 768),
    ([300, 5, 0, 129], 7168, 2048),
]


@pytest.mark.parametrize("layout", ["psum", "rows"])
@pytest.mark.parametrize("w13", [True, "interleaved", False], ids=["w13", "w13-interleaved", "separate"])
@pytest.mark.parametrize("counts,H,I", CASES, ids=["decode", "mid", "prefill"])
def test_deepgemm_matches_float64(counts, H, I, w13, layout):
    """DeepGEMM reading a group's rows from a neighbour (its M block straddling two segments: an alignment that does
    not divide the padding), gate and up swapped (or an interleaved w13's columns split in halves), the route weight
    dropped, a padding tail's NaN reaching an output, or rows left unwritten."""
    _skip_unless_usable()
    x, rw, cu, w = _case(counts, len(counts), H, I, seed=len(counts) + H, w13=w13)
    out = torch.full_like(x, float("nan"))
    expert_ffn_deepgemm(x, rw, cu, w, out=out, layout=layout)
    _check_against_float64(out, x, rw, cu, w)


def _check_against_float64(out, x, rw, cu, w) -> None:
    """Every row up to the last segment's end written and finite, weight-0 rows exactly 0, the live rows within
    1.5e-2 of the float64 reference (relative)."""
    torch.cuda.synchronize()
    end = int(cu[-1])
    ref = expert_ffn_float64(x.nan_to_num(), rw, cu, w)
    assert torch.isfinite(out[:end]).all(), "rows unwritten or a padding NaN reached the output"
    assert (out[:end][rw[:end] == 0] == 0).all(), "weight-0 rows (padding tails, padding entries) must be exactly 0"
    live = rw[:end] != 0
    err = float((out[:end][live].double() - ref[:end][live]).norm() / ref[:end][live].norm())
    assert err < 1.5e-2, f"relative error {err:.2e} against float64"


def test_deepgemm_replays_from_a_cuda_graph_through_the_dispatcher():
    """impl='deepgemm' synchronising with the host (a capture error) or reading a buffer the graph does not keep
    (a different result on replay after the inputs changed in place)."""
    _skip_unless_usable()
    x, rw, cu, w = _case([3, 0, 17, 1], 4, 2048, 768, seed=5)
    out = torch.empty_like(x)
    expert_ffn(x, rw, cu, w, impl="deepgemm", out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        expert_ffn(x, rw, cu, w, impl="deepgemm", out=out)
    x2, rw2, _, _ = _case([3, 0, 17, 1], 4, 2048, 768, seed=6)
    x.copy_(x2)
    rw.copy_(rw2)
    g.replay()
    torch.cuda.synchronize()
    want = torch.empty_like(x)
    expert_ffn(x, rw, cu, w, impl="deepgemm", out=want)
    end = int(cu[-1])
    assert torch.equal(out[:end], want[:end])


@pytest.mark.parametrize("zero_tail,given_ends", [(True, True), (True, False), (False, True)],
                         ids=["zero-tail-row_ends", "zero-tail-trimmed", "tail-free-row_ends"])  # False needs row_ends
@pytest.mark.parametrize("counts,H,I", CASES, ids=["decode", "mid", "prefill"])
def test_deepgemm_down_matches_float64(counts, H, I, zero_tail, given_ends):
    """impl='deepgemm_down' (the Triton gate/up tiles, then DeepGEMM's down GEMM): the rows of act past each live
    end, which the tiles do not write (NaN-filled scratch here), reaching DeepGEMM's down GEMM (zero_tails missing
    or short), a skipped weight-0 tile leaving its act rows stale, a live row lost to the zeros, or a row left
    unwritten; with row_ends and without (the trim kernel's ends), zero_tail both ways; then the same through the
    dispatcher, as the layer calls it."""
    _skip_unless_usable()
    x, rw, cu, w = _case(counts, len(counts), H, I, seed=len(counts) + H + 1, w13="interleaved")
    start, live = 0, []
    for c, e in zip(counts, cu.tolist()):
        live.append(start + c)
        start = e
    row_ends = torch.tensor(live, dtype=torch.int32, device=x.device) if given_ends else None
    rw[3] = 0.0  # a weight-0 row inside a segment (a padding token's entry): its output is 0 too
    if counts[0] >= 128:
        rw[64:128] = 0.0  # a whole 64-row tile of weight 0 inside the live rows: skipped (padded=True)
    stale = torch.full((x.shape[0], I), float("nan"), dtype=x.dtype, device=x.device)
    out = torch.full_like(x, float("nan"))
    expert_ffn_deepgemm_down(x, rw, cu, w, out=out, tokens=sum(counts), padded=True, row_ends=row_ends,
                             zero_tail=zero_tail, act=stale)
    _check_against_float64(out, x, rw, cu, w)
    end, ok = int(cu[-1]), rw[:int(cu[-1])] != 0
    tri = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl="triton", out=tri, tokens=sum(counts), row_ends=row_ends)
    e2 = float((out[:end][ok].double() - tri[:end][ok].double()).norm() / tri[:end][ok].double().norm())
    assert e2 < 1e-2, f"relative error {e2:.2e} against impl='triton' (the same gate/up tiles)"
    via = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl="deepgemm_down", out=via, tokens=sum(counts), padded=True, row_ends=row_ends,
               zero_tail=zero_tail)
    torch.cuda.synchronize()
    assert torch.equal(via[:end], out[:end]), "the dispatcher's deepgemm_down differs from the direct call"


def test_deepgemm_down_replays_from_a_cuda_graph():
    """impl='deepgemm_down' synchronising with the host inside a capture, or keeping a buffer the graph does not
    (a different result on replay after the inputs changed in place)."""
    _skip_unless_usable()
    x, rw, cu, w = _case([3, 0, 17, 1], 4, 2048, 768, seed=7, w13="interleaved")
    out = torch.empty_like(x)
    expert_ffn(x, rw, cu, w, impl="deepgemm_down", out=out, tokens=21)  # compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        expert_ffn(x, rw, cu, w, impl="deepgemm_down", out=out, tokens=21)
    x2, rw2, _, _ = _case([3, 0, 17, 1], 4, 2048, 768, seed=8, w13="interleaved")
    x.copy_(x2)
    rw.copy_(rw2)
    g.replay()
    torch.cuda.synchronize()
    want = torch.empty_like(x)
    expert_ffn(x, rw, cu, w, impl="deepgemm_down", out=want, tokens=21)
    end = int(cu[-1])
    assert torch.equal(out[:end], want[:end])
