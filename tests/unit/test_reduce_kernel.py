"""The combine's K-sum kernel (``symmetric_kernels.reduce_kernel``: the symmetric transport's reduce, and
``sum_entries`` on CUDA for every transport) under Triton's CPU interpreter, against the order written out
in ``sum_entries_torch`` (fp32, k ascending, from +0), bit for bit.

The output is fp32 here: the interpreter rounds fp32 to bf16 by truncation, the GPU to nearest, so a bf16
output would test the interpreter. The GPU case (``tests/unit/test_transport_interface.py``) checks the
bf16 rounding natively. Each case names the bug it catches.
"""

from __future__ import annotations

import pytest

from tests.interpreter_child import interpreter_report, print_report

# (S, K, H, programs, BLOCK_H, with weights): the bug each catches
CASES = {
    # token 0's rows 1e8, -1e8, 1: a sum in any order but k ascending gives 0, not 1
    "k_ascending": (4, 3, 16, 4, 16, False),
    # one row per token, -0 rows: a sum that starts from the first row keeps -0
    "k1_minus_zero": (5, 1, 16, 2, 16, False),
    # H past a power of two (two column blocks, the last partial): columns past the block lost or written
    "h_partial_block": (3, 4, 100, 3, 64, False),
    # fewer programs than work items: the grid-stride loop skipping or repeating an item
    "grid_stride": (9, 2, 40, 2, 16, False),
    # route weights back to [S, K] (the symmetric transport's combine): a token's weights lost or shifted
    "weights": (6, 3, 16, 4, 16, True),
}


def _run(name: str):
    import torch
    import triton

    from vllm_moonep.engine.transports.base import sum_entries_torch
    from vllm_moonep.engine.transports.symmetric_kernels import reduce_kernel

    S, K, H, n_prog, bh, has_w = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    rows = torch.randn(S * K, H, generator=g)
    if K >= 3:
        rows[0:K] = 0.0
        rows[0:3] = torch.tensor([1e8, -1e8, 1.0])[:, None]
    if K == 1:
        rows[1::2] = -0.0
    w = torch.rand(S * K, generator=g)
    out = torch.full((S, H), -7.0)  # a sentinel: a column no program wrote shows
    out_w = torch.full((S, K), -7.0)
    reduce_kernel[(n_prog, 1, 1)](rows, w, out, out_w, S, K, H, n_prog, HAS_W=has_w, K_PAD=triton.next_power_of_2(K),
                                  BLOCK_H=bh)
    want = sum_entries_torch(rows, S, K, torch.float32)
    if not torch.equal(out.view(torch.int32), want.view(torch.int32)):  # the bits, so -0 against +0 shows
        bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()[:3].tolist()
        return f"sums differ from the k-ascending order at {bad}: {out[tuple(zip(*bad))] if bad else ''}"
    if K >= 3 and float(out[0, 0]) != 1.0:
        return f"1e8, -1e8, 1 summed to {float(out[0, 0])}"
    if has_w and not torch.equal(out_w, w.view(S, K)):
        return "route weights not copied back to [S, K]"
    if not has_w and not bool((out_w == -7.0).all()):
        return "route weights written without HAS_W"
    return None


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_reduce_kernel(report, case):
    assert report[case]["err"] is None, report[case]["err"]


if __name__ == "__main__":
    print_report(list(CASES), _run)
