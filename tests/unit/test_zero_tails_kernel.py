"""``deepgemm_act.zero_tails`` (``impl="deepgemm_down"``: zeros from each segment's live end to its end, behind
the Triton gate/up tiles and before DeepGEMM's down GEMM) under Triton's CPU interpreter, against the rule
written out here: row ``r`` of segment ``g`` is zeroed exactly when ``clamp(ends[g], start_g, cu[g]) <= r <
cu[g]``; every other row keeps its bytes. The GPU runs it natively in ``tests/gpu/test_deepgemm_gpu.py``.
Each case names the bug it catches.
"""

from __future__ import annotations

import pytest

from tests.interpreter_child import interpreter_report, print_report

# (cu_seqlens, ends, I, index dtype): the bug each catches
CASES = {
    # tails of 27 and 22 rows: zeros starting at the segment's start (live rows lost) or stopping a 16-row
    # block short (stale rows reaching DeepGEMM)
    "tails": ([128, 384, 512], [101, 384, 490], 64, "int32"),
    # an empty first and middle segment, a segment zeroed whole (end at its start), one with no tail
    "empty_and_whole": ([0, 128, 128, 256, 384], [0, 128, 128, 128, 384], 64, "int32"),
    # ends past the segment's end or before its start: clamped into it, never the next group's rows
    "clamped": ([128, 256, 384], [200, 5, 129], 64, "int32"),
    # two column blocks, the last partial (ZERO_BLOCK 256): columns past the block lost or written
    "partial_columns": ([128, 256], [100, 250], 300, "int32"),
    # int64 segment ends and live ends, as a caller may pass them
    "int64": ([128, 256], [3, 129], 64, "int64"),
}


def _run(case: str) -> str | None:
    import torch

    from vllm_moonep.common.grouped_gemm.deepgemm_act import zero_tails

    cu_l, ends_l, I, dt = CASES[case]
    dtype = getattr(torch, dt)
    M = cu_l[-1] + 9  # rows past the last segment: never touched
    act = torch.randn(M, I, generator=torch.Generator().manual_seed(len(case))).bfloat16()
    act[act == 0] = 1.0  # no zero in the input: every zero in the output is a write
    got = act.clone()
    zero_tails(got, torch.tensor(cu_l, dtype=dtype), torch.tensor(ends_l, dtype=dtype))
    start = 0
    for g, (end, live) in enumerate(zip(cu_l, ends_l)):
        first = min(max(live, start), end)
        for r in range(start, end):
            want_zero = r >= first
            row = got[r]
            if want_zero and not bool((row == 0).all()):
                return f"segment {g}: tail row {r} not zeroed"
            if not want_zero and not torch.equal(row.view(torch.int16), act[r].view(torch.int16)):
                return f"segment {g}: live row {r} written"
        start = end
    if not torch.equal(got[cu_l[-1]:].view(torch.int16), act[cu_l[-1]:].view(torch.int16)):
        return "a row past the last segment was written"
    return None


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_zero_tails_kernel(report, case):
    assert report[case]["err"] is None, report[case]["err"]


if __name__ == "__main__":
    print_report(list(CASES), _run)
