"""The planner against the contract: invariants, an independent loop transcription, hand-worked plans."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from tests.reference_planner import reference_placement, reference_plan
from vllm_moonep.engine import nvs_rows, place_entries, plan_global
from vllm_moonep.testing.routing import route


def _routing(R, S, E, K, sigma, seed):
    ids = [route(S, E, K, sigma=sigma, seed=seed, rank=r)[0] for r in range(R)]
    tpe = torch.stack([torch.bincount(i.reshape(-1).long(), minlength=E) for i in ids])
    return ids, tpe


def _check_invariants(gp, ids, S, K, E, R, B, tp):
    epn = E // R
    cap = S * K
    nvs = nvs_rows(S, K, E, R, tp)
    etc = gp.experts_to_copy
    # every rank computes exactly S*K real rows
    assert gp.seg_len.sum(dim=1).tolist() == [cap] * R
    # at most 2*epn non-empty segments; padded segments multiples of tp; cu non-decreasing
    assert int((gp.seg_len > 0).sum(dim=1).max()) <= 2 * epn
    padded = torch.diff(gp.cu_seqlens, dim=1, prepend=torch.zeros(R, 1, dtype=torch.int64))
    assert bool((padded >= 0).all()) and bool((padded % tp == 0).all())
    assert int(gp.cu_seqlens[:, -1].max()) <= nvs
    # slots: values in {-1} u [0,E), never a home expert, used slots first
    assert bool(((etc == -1) | ((etc >= 0) & (etc < E))).all())
    for d in range(R):
        used = [e for e in etc[d].tolist() if e >= 0]
        assert all(e // epn != d for e in used)
        assert etc[d].tolist() == used + [-1] * (B - len(used))
        # remote experts beyond B keep their rows in segment e
        remote = [e for e in range(E) if gp.alloc[e, d] > 0 and e // epn != d]
        for e in remote:
            if e in used:
                assert gp.seg_len[d, e] == 0 and gp.seg_len[d, E + used.index(e)] == gp.alloc[e, d]
            else:
                assert len(used) == B and gp.seg_len[d, e] == gp.alloc[e, d]
    # alloc conserves counts
    assert gp.alloc.sum(dim=1).tolist() == gp.tpe.sum(dim=0).tolist()
    # every entry lands inside its segment's real rows; no two entries share a row
    for d in range(R):
        taken = set()
        for r in range(R):
            dest, row = place_entries(gp, r, ids[r])
            for dd, rr in zip(dest.tolist(), row.tolist()):
                if dd == d:
                    assert (dd, rr) not in taken
                    taken.add((dd, rr))
        assert len(taken) == cap


@pytest.mark.parametrize("R", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sigma", [0.0, 0.5, 1.0, 2.0, 5.0])
def test_invariants_and_reference_agreement(R, sigma):
    """The vectorized planner departing from the contract's loop-by-loop planner (alloc, slots, cu_seqlens, placement)
    or its invariants."""
    E, K, S, tp = 8 * R if R != 3 else 12, 4, 24, 8
    B = E // R
    ids, tpe = _routing(R, S, E, K, sigma, seed=int(sigma * 10) + R)
    gp = plan_global(tpe, S, K, B, tp)
    _check_invariants(gp, ids, S, K, E, R, B, tp)
    ref = reference_plan(tpe.tolist(), S, K, B, tp)
    assert gp.alloc.tolist() == ref["alloc"]
    assert gp.experts_to_copy.tolist() == ref["etc"]
    assert gp.cu_seqlens.tolist() == ref["cu"]
    dests, rows = reference_placement(tpe.tolist(), [i.reshape(-1).tolist() for i in ids], ref)
    for r in range(R):
        d, row = place_entries(gp, r, ids[r])
        assert d.tolist() == dests[r]
        assert row.tolist() == rows[r]


@pytest.mark.parametrize("B", [1, 3, 8])
def test_plan_tables_are_dense_row_major(B):
    """A plan table laid out as a transposed view: values compare equal, but a kernel that reads a
    rank's row of ``experts_to_copy`` by pointer (the prefetch's copy on CUDA) read other ranks' slot
    ids, and wrote slots that are unused (-1) on this rank. Every table, here and after ``to()``."""
    R, E, K, S, tp = 4, 16, 4, 24, 8
    _, tpe = _routing(R, S, E, K, 2.5, seed=5)
    gp = plan_global(tpe, S, K, B, tp)
    for where, plan in (("plan_global", gp), ("GlobalPlan.to", gp.to(torch.device("cpu")))):
        for f in fields(plan):
            t = getattr(plan, f.name)
            assert t.is_contiguous(), f"{where}: {f.name} {list(t.shape)} has strides {t.stride()}"
    row = gp.experts_to_copy[R - 1]
    flat = torch.as_strided(gp.experts_to_copy, (B,), (1,), row.storage_offset())
    assert flat.tolist() == row.tolist(), "rank R-1's slot ids, read as B contiguous values from its row's start"


def test_skew_uses_slots_and_balances():
    """Under skew, a plan that uses no slot or leaves a rank with other than S*K real rows."""
    R, E, K, S = 4, 32, 4, 64
    ids, tpe = _routing(R, S, E, K, 2.0, seed=3)
    gp = plan_global(tpe, S, K, E // R, 128)
    assert int((gp.experts_to_copy >= 0).sum()) > 0
    # without the plan, the hottest home would compute far more than S*K
    group = tpe.sum(0).view(R, -1).sum(1)
    assert int(group.max()) > S * K
    assert gp.seg_len.sum(1).tolist() == [S * K] * R


@pytest.mark.parametrize("B", [1, 3, 8])
def test_fewer_slots_than_needed_overflow(B):
    """With fewer slots than remote experts, the overflow rows lost or given a slot row that does not exist."""
    R, E, K, S = 2, 16, 4, 32
    ids, tpe = _routing(R, S, E, K, 3.0, seed=11)
    gp = plan_global(tpe, S, K, B, 16)
    _check_invariants(gp, ids, S, K, E, R, B, 16)
    ref = reference_plan(tpe.tolist(), S, K, B, 16)
    assert gp.experts_to_copy.tolist() == ref["etc"] and gp.cu_seqlens.tolist() == ref["cu"]


def _plan_from_ids(ids_by_rank, E, S, K, B, tp):
    ids = [torch.tensor(i, dtype=torch.int32).view(S, K) for i in ids_by_rank]
    tpe = torch.stack([torch.bincount(i.reshape(-1).long(), minlength=E) for i in ids])
    gp = plan_global(tpe, S, K, B, tp)
    placed = [place_entries(gp, r, ids[r]) for r in range(len(ids))]
    return gp, [(d.tolist(), row.tolist()) for d, row in placed]


def test_hand_worked_single_sender():
    """A wrong quota, split or row placement in the simplest case: one full home sends to one rank (by hand)."""
    # R=2, E=4 (epn 2), S=4, K=1 (CAP 4), tp=1, B=2.
    # counts e0=6, e1=1, e2=1 -> groups [7, 1] -> balance [3, -3] -> z[0,1] = 3.
    # home 0 splits its quota: e0 (largest remaining) gives 3 rows to rank 1.
    gp, placed = _plan_from_ids([[0, 0, 0, 0], [0, 0, 1, 2]], E=4, S=4, K=1, B=2, tp=1)
    assert gp.alloc.tolist() == [[3, 3], [1, 0], [0, 1], [0, 0]]
    assert gp.experts_to_copy.tolist() == [[-1, -1], [0, -1]]
    assert gp.cu_seqlens.tolist() == [[3, 4, 4, 4, 4, 4], [0, 0, 1, 1, 4, 4]]
    # e0 ordinals: rank0 0..3, rank1 4..5; cum e0 = [3, 6]
    assert placed[0] == ([0, 0, 0, 1], [0, 1, 2, 1])
    # rank1: two e0 entries -> rank1 slot rows 2,3; e1 -> rank0 row 3; e2 -> rank1 row 0
    assert placed[1] == ([1, 1, 0, 1], [2, 3, 3, 0])


def test_hand_worked_tie_break_and_overshooting_sender():
    """A tie broken towards the larger rank, or a sender whose quota overshot not sending again (worked by hand)."""
    # R=3, E=3 (epn 1), S=4, K=1 (CAP 4), tp=1, B=1.
    # counts e0=6, e1=6, e2=0 -> balance [2, 2, -4].
    # round 1: h=0 (tie with 1, smallest wins), u=2: z[0,2]=4, balance [-2, 2, 0] (0 overshoots)
    # round 2: h=1, u=0: z[1,0]=2.
    gp, placed = _plan_from_ids([[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]], E=3, S=4, K=1, B=1, tp=1)
    assert gp.alloc.tolist() == [[2, 0, 4], [2, 4, 0], [0, 0, 0]]
    assert gp.experts_to_copy.tolist() == [[1], [-1], [0]]
    assert gp.cu_seqlens.tolist() == [[2, 2, 2, 4], [0, 4, 4, 4], [0, 0, 0, 4]]
    # e0 ordinals: rank0 0,1,2 ; rank1 3,4 ; rank2 5. cum e0 = [2, 2, 6]
    # e1 ordinals: rank0 0 ; rank1 1,2 ; rank2 3,4,5. cum e1 = [2, 6, 6]
    assert placed[0] == ([0, 0, 2, 0], [0, 1, 0, 2])
    assert placed[1] == ([2, 2, 0, 1], [1, 2, 3, 0])
    assert placed[2] == ([2, 1, 1, 1], [3, 1, 2, 3])


def test_hand_worked_slot_order_ties_and_overflow():
    """Slots given in the wrong order on a tie, or the expert left without a slot not kept in its own segment (worked
    by hand)."""
    # R=2, E=8 (epn 4), S=4, K=1, tp=1. counts e0..e3 = 2 -> balance [4, -4] -> z[0,1] = 4.
    # home 0: remaining [2,2,2,2]; le=e0 takes 2, then le=e1 takes 2 -> alloc e0, e1 on rank 1 = 2 each.
    # Slots on rank 1 by (alloc, e) descending: e1 before e0.
    ids = [[0, 1, 2, 3], [0, 1, 2, 3]]
    gp, placed = _plan_from_ids(ids, E=8, S=4, K=1, B=1, tp=1)
    assert gp.experts_to_copy.tolist() == [[-1], [1]]
    # B=1: e0 overflows into segment 0 on rank 1, e1 takes slot 0 (group 8)
    assert gp.cu_seqlens.tolist() == [[0, 0, 2, 4, 4, 4, 4, 4, 4], [2, 2, 2, 2, 2, 2, 2, 2, 4]]
    assert placed[0] == ([1, 1, 0, 0], [0, 2, 0, 2])
    assert placed[1] == ([1, 1, 0, 0], [1, 3, 1, 3])
    gp2, _ = _plan_from_ids(ids, E=8, S=4, K=1, B=2, tp=1)
    assert gp2.experts_to_copy.tolist() == [[-1, -1], [1, 0]]


def test_token_padding_pads_each_segment():
    """Padding applied to the whole shard instead of to each non-empty segment, or to empty segments."""
    gp, _ = _plan_from_ids([[0, 0, 0, 0], [0, 0, 1, 2]], E=4, S=4, K=1, B=2, tp=128)
    assert gp.cu_seqlens.tolist() == [[128, 256, 256, 256, 256, 256], [0, 0, 128, 128, 256, 256]]


def test_single_token_single_k():
    """An off-by-one at the smallest step (S=1, K=1): one expert's two rows not split over the two ranks."""
    gp, placed = _plan_from_ids([[3], [3]], E=4, S=1, K=1, B=2, tp=1)
    # e3 (home 1) has 2 rows, CAP 1 each: rank 0 takes one in a slot
    assert gp.experts_to_copy.tolist() == [[3, -1], [-1, -1]]
    assert placed[0] == ([0], [0]) and placed[1] == ([1], [0])


def test_all_tokens_to_one_expert():
    """Every token on one expert: the plan not splitting it over all ranks, S rows each."""
    R, E, S, K = 4, 8, 16, 1
    ids = [[5] * S for _ in range(R)]
    gp, placed = _plan_from_ids(ids, E=E, S=S, K=K, B=2, tp=4)
    # expert 5 (home 2) is split over every rank; every rank computes S rows of it
    assert gp.alloc[5].tolist() == [S] * R
    assert gp.experts_to_copy[:, 0].tolist() == [5, 5, -1, 5]
    assert gp.seg_len.sum(1).tolist() == [S] * R
