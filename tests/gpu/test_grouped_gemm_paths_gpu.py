"""Every grouped GEMM path on the GPU against the float64 reference: bf16 random data, poisoned
outputs, empty groups, segment lengths that are not tile multiples."""

import pytest
import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights, available_impls, expert_ffn
from vllm_moonep.testing.reference import expert_ffn_float64

pytestmark = pytest.mark.gpu


def _case(lens, I, H, seed):
    g = torch.Generator().manual_seed(seed)
    G = len(lens)
    gate = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    up = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    down = (torch.randn(G, H, I, generator=g) / I**0.5).to(torch.bfloat16).cuda()
    cu = torch.tensor(lens).cumsum(0).to(torch.int32).cuda()
    n = int(cu[-1]) + 64
    x = torch.randn(n, H, generator=g).to(torch.bfloat16).cuda()
    rw = torch.rand(n, generator=g).cuda()
    return x, rw, cu, GroupedWeights.contiguous(gate, up, down)


@pytest.mark.parametrize("impl", ["reference", "grouped_mm", "triton"])
@pytest.mark.parametrize("lens,I,H", [
    ([128, 0, 0, 384, 256, 0, 128, 0], 768, 2048),
    ([5, 0, 300, 17, 0, 1], 256, 512),
    ([0, 0, 0, 4096], 512, 1024),
])
def test_path_matches_float64(impl, lens, I, H):
    """A grouped GEMM path on the GPU drifting from float64 or leaving rows of a segment unwritten (NaN-poisoned
    output)."""
    x, rw, cu, w = _case(lens, I, H, seed=len(lens) + I)
    if impl not in available_impls(x, w):
        pytest.skip(f"{impl} is not available here")
    out = torch.full_like(x, float("nan"))
    expert_ffn(x, rw, cu, w, impl=impl, out=out)
    torch.cuda.synchronize()
    end = int(cu[-1])
    ref = expert_ffn_float64(x, rw, cu, w)
    assert torch.isfinite(out[:end]).all(), "rows inside the segments were not all written"
    rel = float((out[:end].double() - ref[:end]).norm() / ref[:end].norm())
    print(f"{impl} lens={lens} I={I} H={H}: relative error vs float64 {rel:.2e}")
    assert rel < 1e-2
