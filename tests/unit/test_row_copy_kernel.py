"""The prefetch's device copy kernel (``engine/row_copy.py``) under Triton's CPU interpreter,
against the rule written out in the test (a used slot, and with ``live`` one whose segment has a
non-zero weight, gets its source row), byte for byte.

The kernel is persistent: each program walks the used slots and takes every ``n_prog``-th chunk
of each (a slot's chunks run over its planes in turn). Each case names the bug it catches; the destination starts as a sentinel (-7), so a
slot written that should not be, or a chunk no program took, shows as a byte difference.
"""

from __future__ import annotations

import pytest

from tests.interpreter_child import interpreter_report, print_report

# (name, chunk, block, programs, live[, planes]): the bug each catches
CASES = {
    # chunks split over programs unevenly, the last chunk partial: a chunk no program takes, or one
    # taken twice with a wrong offset
    "chunks_over_3_programs": (64, 32, 3, False),
    # more programs than chunks of a slot: the rotation of the first chunk per slot must still
    # cover every chunk of every slot exactly once
    "more_programs_than_chunks": (64, 32, 7, False),
    # one program does everything: the walk over used slots skips -1 slots and keeps the order
    "one_program": (1024, 512, 1, False),
    # live: a used slot whose rows all have weight 0 is not copied (it keeps its sentinel), a slot
    # with an empty segment is not copied, a slot whose first live row is past the first block is
    "live_rule": (64, 32, 3, True),
    "live_rule_one_program": (1024, 4, 1, True),
    # two planes of different row sizes in one launch (w13 and w2): a chunk offset not rebased to its
    # plane, a plane's last partial chunk lost, or plane 1 written with plane 0's row size
    "two_planes": (64, 32, 3, False, 2),
    # three planes (gate, up, down) with the live rule and more programs than a slot's chunks
    "three_planes_live": (64, 32, 11, True, 3),
}


def _run(name: str):
    import torch
    import triton

    from vllm_moonep.engine import row_copy

    chunk, block, n_prog, live, *more = CASES[name]
    planes = more[0] if more else 1
    g = torch.Generator().manual_seed(7)
    B, N, E = 7, 5, 4
    shapes = [(3, 100), (130,), (2, 45)][:planes]  # 300, 130, 90 elements per row: partial chunks
    srcs = [torch.randn(N, *sh, generator=g).to(torch.bfloat16) for sh in shapes]
    # segment lengths of rows [0, E+B): slot 1 empty, slot 4's live row is the 9th of its segment
    lens = [0, 2, 0, 0, 3, 0, 6, 3, 11, 1, 4]
    cu = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    w = torch.rand(int(cu[-1]), generator=g) + 0.1
    ids = torch.tensor([2, 3, -1, 0, 4, 1, 2], dtype=torch.int32)
    seg = lambda b: slice(int(cu[E + b - 1]), int(cu[E + b]))  # noqa: E731
    w[seg(3)] = 0.0  # slot 3: every row weight 0
    w[seg(4)][:8] = 0.0  # slot 4: live only from its 9th row (past a 4-row block)
    dsts = [torch.full((B, *sh), -7.0).to(torch.bfloat16) for sh in shapes]
    elems = [d[0].numel() for d in dsts]
    pad = 3 - planes
    row_copy._kernel().fn[(n_prog, 1, 1)](
        ids, *(dsts + [dsts[0]] * pad), *(srcs + [srcs[0]] * pad), ids, ids, ids, *(elems + [0] * pad),
        *([triton.cdiv(n, chunk) for n in elems] + [0] * pad), N, B, cu, w, E if live else 0, n_prog,
        PLANES=planes, TABLE=False, LIVE=live, B_PAD=8, CHUNK=chunk, BLOCK=block)
    for p, (dst, src) in enumerate(zip(dsts, srcs)):
        want = torch.full_like(dst, -7.0)  # the rule written out here, not the module's host version
        for b, e in enumerate(ids.tolist()):
            if e >= 0 and (not live or bool((w[seg(b)] != 0).any())):
                want[b] = src[e]
        if not torch.equal(dst.view(torch.int16), want.view(torch.int16)):
            bad = sorted({int(i) for i in (dst.view(torch.int16) != want.view(torch.int16)).nonzero()[:, 0]})
            return f"plane {p}: slots {bad} differ from the rule"
    return None


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_copy_rows_kernel(report, case):
    assert report[case]["err"] is None, report[case]["err"]


if __name__ == "__main__":
    print_report(list(CASES), _run)
