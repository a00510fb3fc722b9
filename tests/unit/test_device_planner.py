"""The device planner (Triton) against the host planner: every GlobalPlan field and every placement
must be equal, values and dtypes.

On CPU the kernels run under Triton's interpreter in one child process (``TRITON_INTERPRET`` must
be set before Triton is imported, and this pytest process may already have imported it): this file
run as a script computes every case and prints a JSON report; each test asserts one case. The
``gpu`` tests run the same kernels natively on CUDA, over random cases up to R=128, with host
syncs forbidden, and inside a captured CUDA graph.
"""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from tests.interpreter_child import interpreter_report, print_report

from vllm_moonep.engine.planning.planner import place_entries, plan_global
from vllm_moonep.testing.routing import route


def _routing(R, S, E, K, sigma, seed):
    ids = [route(S, E, K, sigma=sigma, seed=seed, rank=r)[0] for r in range(R)]
    tpe = torch.stack([torch.bincount(i.reshape(-1).long(), minlength=E) for i in ids])
    return ids, tpe


def _from_lists(rows, S, K):
    return [torch.tensor(r, dtype=torch.int32).view(S, K) for r in rows]


def _tpe_of(ids, E):
    """Per-rank bincount over the ids inside [0, E) (the others count nowhere)."""
    flat = [i.reshape(-1).long() for i in ids]
    return torch.stack([torch.bincount(f[(f >= 0) & (f < E)], minlength=E) for f in flat])


# Each case: a name -> (R, E, S, K, B, tp, ids per rank, tpe). tpe defaults to the bincount of ids.
def _case(name):
    for way in ("_sort", "_pairwise", "_wide"):  # the same case with rule 4 forced one way, or in int64 (OPTIONS)
        if name.endswith(way):
            return _case(name[: -len(way)])
    if name.startswith("sigma_"):
        _, R, sigma = name.split("_")
        R, sigma = int(R), float(sigma)
        E, K, S, tp = (8 * R if R != 3 else 12), 4, 24, 8
        ids, tpe = _routing(R, S, E, K, sigma, seed=int(sigma * 10) + R)
        return R, E, S, K, E // R, tp, ids, tpe
    if name.startswith("few_slots_B"):  # B too small: remote experts overflow into segment e
        B = int(name[len("few_slots_B"):])
        ids, tpe = _routing(2, 32, 16, 4, 3.0, seed=11)
        return 2, 16, 32, 4, B, 16, ids, tpe
    if name == "hand_single_sender":
        ids = _from_lists([[0, 0, 0, 0], [0, 0, 1, 2]], 4, 1)
        return 2, 4, 4, 1, 2, 1, ids, _tpe_of(ids, 4)
    if name == "hand_tie_break_overshoot":
        ids = _from_lists([[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]], 4, 1)
        return 3, 3, 4, 1, 1, 1, ids, _tpe_of(ids, 3)
    if name in ("hand_slot_order_B1", "hand_slot_order_B2"):
        ids = _from_lists([[0, 1, 2, 3], [0, 1, 2, 3]], 4, 1)
        return 2, 8, 4, 1, int(name[-1]), 1, ids, _tpe_of(ids, 8)
    if name == "token_padding_128":
        ids = _from_lists([[0, 0, 0, 0], [0, 0, 1, 2]], 4, 1)
        return 2, 4, 4, 1, 2, 128, ids, _tpe_of(ids, 4)
    if name == "single_token_single_k":
        ids = _from_lists([[3], [3]], 1, 1)
        return 2, 4, 1, 1, 2, 1, ids, _tpe_of(ids, 4)
    if name == "all_tokens_one_expert":
        ids = _from_lists([[5] * 16 for _ in range(4)], 16, 1)
        return 4, 8, 16, 1, 2, 4, ids, _tpe_of(ids, 8)
    if name == "B_more_than_epn":
        ids, tpe = _routing(4, 16, 16, 2, 3.0, seed=5)
        return 4, 16, 16, 2, 10, 2, ids, tpe
    if name == "B_more_than_E":  # slots past the padded expert tile
        ids, tpe = _routing(4, 16, 16, 2, 5.0, seed=6)
        return 4, 16, 16, 2, 40, 1, ids, tpe
    if name == "many_chunks_ragged":  # S*K not a multiple of any block; several chunks in place
        ids, tpe = _routing(4, 1000, 32, 3, 2.0, seed=8)
        return 4, 32, 1000, 3, 8, 128, ids, tpe
    if name == "tpe_int64_strided":  # int64 counts in a non-contiguous view
        ids, tpe = _routing(4, 24, 32, 4, 2.0, seed=9)
        return 4, 32, 24, 4, 8, 8, ids, tpe.to(torch.int64).T.contiguous().T
    if name == "many_experts_per_rank":  # E/R > 64: rule 4's pairwise count in column chunks
        # home 1 sends 64 rows to rank 0 from experts spread over several chunks: allocs 24, 24, 16
        # (equal allocs: larger id first), B=2 so the third overflows into its segment
        hot = [128 + j for j in (3, 20, 37, 54, 71, 88, 105, 122)]
        flat = torch.tensor([e for e in hot for _ in range(24)] + list(range(64)), dtype=torch.int32)
        flat = flat[torch.randperm(256, generator=torch.Generator().manual_seed(12))]
        ids = [flat[:128].view(16, 8), flat[128:].view(16, 8)]
        return 2, 256, 16, 8, 2, 4, ids, _tpe_of(ids, 256)
    if name == "direct_seven_subblocks":  # place without the histogram, ragged last sub-block
        ids, tpe = _routing(4, 200, 32, 4, 2.0, seed=21)
        return 4, 32, 200, 4, 8, 8, ids, tpe
    if name == "direct_eight_subblocks_kimi_r2":  # the most sub-blocks placed directly; E/R=192 (rule 4 sorted)
        ids, tpe = _routing(2, 128, 384, 8, 2.0, seed=22)
        return 2, 384, 128, 8, 192, 128, ids, tpe
    if name == "hist_nine_subblocks":  # one sub-block past the direct limit: the histogram path again
        ids, tpe = _routing(4, 257, 32, 4, 1.0, seed=23)
        return 4, 32, 257, 4, 8, 8, ids, tpe
    if name == "kimi_r2_rule4_chunk32":  # rule 4 with another column-chunk width than the planner's own
        return _case("direct_eight_subblocks_kimi_r2")
    if name == "many_experts_per_rank_chunk2":  # the narrowest chunk: equal allocs across many chunks
        return _case("many_experts_per_rank")
    if name == "kimi_r8":  # E/R=48: sorted by default (above RULE4_SORT_ABOVE), B = E/R
        ids, tpe = _routing(8, 16, 384, 8, 3.0, seed=48)
        return 8, 384, 16, 8, 48, 128, ids, tpe
    if name == "R16":
        ids, tpe = _routing(16, 24, 128, 4, 2.0, seed=16)
        return 16, 128, 24, 4, 8, 8, ids, tpe
    if name == "R32":
        ids, tpe = _routing(32, 8, 64, 4, 2.0, seed=32)
        return 32, 64, 8, 4, 2, 8, ids, tpe
    if name == "counts_not_summing_to_cap":  # plan only: any non-negative counts give the host's plan
        g = torch.Generator().manual_seed(77)
        tpe = torch.randint(0, 40, (4, 16), generator=g)
        tpe[1] = 0
        tpe[2, 3] = 500
        return 4, 16, 8, 2, 3, 4, None, tpe
    if name == "large_counts":  # plan only: 2**21 rows a rank, all for home 0's first 8 experts (E/R=40: sorted)
        hot = [2**18 + d for d in (-7, -5, -3, -1, 1, 3, 5, 7)]  # each rank's counts sum to S*K = 2**21
        tpe = torch.zeros(2, 80, dtype=torch.int64)
        tpe[0, :8] = torch.tensor(hot)
        tpe[1, :8] = torch.tensor(hot[::-1])
        return 2, 80, 2**18, 8, 3, 8, None, tpe  # B=3: a fourth remote expert stays in its segment
    if name == "out_of_range_ids":
        ids, _ = _routing(4, 24, 32, 4, 2.0, seed=10)
        for r, bad in enumerate([-1, 32, 10**6, -(2**31)]):
            flat = ids[r].view(-1)
            flat[r::7] = bad
        return 4, 32, 24, 4, 8, 8, ids, _tpe_of(ids, 32)
    raise KeyError(name)


SIGMA_CASES = [f"sigma_{R}_{s}" for R in (1, 2, 3, 4, 8) for s in ("0.0", "0.5", "1.0", "2.0", "5.0")]
EDGE_CASES = [
    "few_slots_B1", "few_slots_B3", "few_slots_B8",
    "hand_single_sender", "hand_tie_break_overshoot", "hand_slot_order_B1", "hand_slot_order_B2",
    "token_padding_128", "single_token_single_k", "all_tokens_one_expert", "B_more_than_epn", "B_more_than_E",
    "many_chunks_ragged", "tpe_int64_strided", "many_experts_per_rank", "direct_seven_subblocks",
    "direct_eight_subblocks_kimi_r2", "hist_nine_subblocks", "kimi_r2_rule4_chunk32", "many_experts_per_rank_chunk2",
    "R16", "R32", "counts_not_summing_to_cap",
    "out_of_range_ids", "kimi_r8", "kimi_r8_pairwise",
    # rule 4 the other way than the planner picks for the shape (E/R <= 64: pairwise; above: sort). The
    # pairwise count over several of the planner's own chunks is many_experts_per_rank_pairwise (the Kimi-K2
    # R=2 shape pairwise: kimi_r2_rule4_chunk32); the sort on routed traffic one case per R
    "many_experts_per_rank_pairwise",
    "sigma_2_5.0_sort", "sigma_4_2.0_sort", "sigma_8_5.0_sort", "few_slots_B1_sort",
    "few_slots_B3_sort", "hand_tie_break_overshoot_sort", "hand_slot_order_B1_sort", "hand_slot_order_B2_sort",
    "B_more_than_epn_sort", "B_more_than_E_sort", "all_tokens_one_expert_sort", "R16_sort",
    "large_counts",
    # the plan kernel in int64 (the planner's own int32 wherever narrow_fits, so these keep the wide path honest):
    # routed traffic, ties, chunked counts, counts off S*K and counts past int32; the many-rank tiles are R16/R32's
    "sigma_8_5.0_wide", "hand_tie_break_overshoot_wide", "many_experts_per_rank_wide",
    "counts_not_summing_to_cap_wide", "large_counts_wide",
]
CASES = SIGMA_CASES + EDGE_CASES
#: planner options of a case (bench_planner --rule4 / --rule4-chunk): rule 4 forced one way, or the
#: pairwise count with another column chunk than the planner's own
OPTIONS = {"kimi_r2_rule4_chunk32": dict(rule4="pairwise", rule4_chunk=32),
           "many_experts_per_rank_chunk2": dict(rule4="pairwise", rule4_chunk=2)}
OPTIONS.update({n: dict(rule4=n.rsplit("_", 1)[1]) for n in EDGE_CASES if n.endswith(("_sort", "_pairwise"))})
OPTIONS.update({n: dict(wide=True) for n in EDGE_CASES if n.endswith("_wide")})


def _expected_place(gp, r, ids, E):
    """Host placement; out-of-range ids get -1 and are left out of the host call (they count nowhere)."""
    flat = ids.reshape(-1).long()
    ok = (flat >= 0) & (flat < E)
    dest = torch.full_like(flat, -1)
    row = torch.full_like(flat, -1)
    d, rw = place_entries(gp, r, flat[ok])
    dest[ok], row[ok] = d, rw
    return dest, row


def compare(dp, tpe_dev, ids_dev, tpe_cpu, ids_cpu, S, K, B, tp, ranks=None):
    """First difference between the device planner and the host planner, or None."""
    gp = dp.plan(tpe_dev)
    ref = plan_global(tpe_cpu, S, K, B, tp)
    for f in fields(ref):
        got, want = getattr(gp, f.name), getattr(ref, f.name)
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{f.name}: {got.dtype}{tuple(got.shape)} vs host {want.dtype}{tuple(want.shape)}"
        if not torch.equal(got.cpu(), want):
            bad = (got.cpu() != want).nonzero()[:3].tolist()
            return f"{f.name} differs at {bad}"
    if ids_cpu is None:
        return None
    R, E = tpe_cpu.shape
    for r in range(R) if ranks is None else ranks:
        d, row = dp.place(gp, r, ids_dev[r])
        ed, er = _expected_place(ref, r, ids_cpu[r], E)
        if d.dtype != torch.int64 or row.dtype != torch.int64:
            return f"place dtypes {d.dtype}, {row.dtype}"
        if not torch.equal(d.cpu(), ed) or not torch.equal(row.cpu(), er):
            i = int(((d.cpu() != ed) | (row.cpu() != er)).nonzero()[0])
            return f"rank {r} entry {i}: got ({int(d[i])}, {int(row[i])}), host ({int(ed[i])}, {int(er[i])})"
        if dp.direct:  # rule 5 as the symmetric transport's dispatch_rows runs it (its tiles, inline)
            d, row = _place_as_dispatch_rows(dp, gp, r, ids_dev[r])
            if not torch.equal(d.cpu(), ed) or not torch.equal(row.cpu(), er):
                i = int(((d.cpu() != ed) | (row.cpu() != er)).nonzero()[0])
                return (f"rank {r} entry {i} placed inline (dispatch_rows tiles): got ({int(d[i])}, {int(row[i])}), "
                        f"host ({int(ed[i])}, {int(er[i])})")
    return None


try:  # the kernel's globals must be module globals (the interpreter resolves them here)
    import triton
    import triton.language as tl

    from vllm_moonep.engine.planning.device_planner import place_direct
except ImportError:  # no Triton: the interpreter and GPU tests skip
    triton = None

if triton is not None:
    @triton.jit
    def _tile_place_kernel(ids_ptr, ob, cum, rb, dest, row, rank, N, E, R, ROWS: tl.constexpr, R_P: tl.constexpr,
                           CH: tl.constexpr):
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        im = i < N
        d, r = place_direct(ids_ptr, i, im, ob, cum, rb, rank, E, R, R_P, CH)
        tl.store(dest + i, d, mask=im)
        tl.store(row + i, r, mask=im)


def _place_as_dispatch_rows(dp, gp, rank, ids):
    """``(dest, row)`` from ``device_planner.place_direct`` on the tiles the symmetric transport's
    dispatch_rows kernel uses (``_ROWS`` entries a program, ``_PLACE_CHUNK`` compared at a time)."""
    from vllm_moonep.engine.transports.symmetric import _PLACE_CHUNK, _ROWS

    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    dest = torch.empty(n, dtype=torch.int64, device=flat.device)
    row = torch.empty(n, dtype=torch.int64, device=flat.device)
    ob, cum, rb = dp.tables(gp)
    _tile_place_kernel[(triton.cdiv(n, _ROWS),)](flat, ob, cum, rb, dest, row, rank, n, dp.E, dp.R, ROWS=_ROWS,
                                                 R_P=dp._R_P, CH=_PLACE_CHUNK)
    return dest, row


def _child_main() -> None:
    from vllm_moonep.engine.planning.device_planner import DevicePlanner

    def run_case(name):
        R, E, S, K, B, tp, ids, tpe = _case(name)
        dp = DevicePlanner(R, E, S, K, B, tp, torch.device("cpu"), **OPTIONS.get(name, {}))
        if name == "B_more_than_epn":  # a planner reused: the previous plan must leave no trace
            dp.plan(_routing(4, 16, 16, 2, 0.0, seed=1)[1])
        tpe_in = tpe if name == "tpe_int64_strided" else tpe.to(torch.int32)  # the engine passes int32
        return compare(dp, tpe_in, ids, tpe.to(torch.int64).contiguous(), ids, S, K, B, tp)

    print_report(CASES, run_case)


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", SIGMA_CASES)
def test_interpreter_routing_grid(report, case):
    """Rules 1-5 on routed traffic, R in 1..8 and skew from uniform to extreme: any divergence from the host."""
    assert report[case]["err"] is None, report[case]["err"]


_EDGE_DOCS = {
    "few_slots_B1": "B=1: remote experts past the slots must stay in segment e (wrong slot cut-off)",
    "few_slots_B3": "B=3: slot cut-off in the middle of the remote list",
    "few_slots_B8": "B=8: more slots than remote experts (unused slots must be -1 / empty)",
    "hand_single_sender": "contract's worked example: one sender splitting its hottest expert",
    "hand_tie_break_overshoot": "argmax/argmin ties (smallest index) and a sender that overshoots and receives",
    "hand_slot_order_B1": "slot order by (alloc, e) descending with equal allocs; overflow into segment e",
    "hand_slot_order_B2": "slot order with equal allocs: larger expert id first",
    "token_padding_128": "padding of every non-empty segment to token_padding",
    "single_token_single_k": "S=K=1: degenerate sizes (one entry per rank)",
    "all_tokens_one_expert": "one expert split over every rank, including its home",
    "B_more_than_epn": "B > E/R, on a reused planner: stale values of an earlier plan must not survive",
    "B_more_than_E": "B > E: slots beyond every expert must be -1 with cu_seqlens at the total",
    "many_chunks_ragged": "place over several chunks with a ragged tail: per-chunk prefix counts",
    "tpe_int64_strided": "int64 counts given as a non-contiguous view (strides honoured)",
    "many_experts_per_rank": "E/R > 64: slots by one sort (slot lanes, held-key threshold, padded rows ahead)",
    "direct_seven_subblocks": "place without the histogram: counts from earlier sub-blocks, ragged last one",
    "direct_eight_subblocks_kimi_r2": "the last sub-block count placed directly (off-by-one at the limit), E/R=192",
    "many_experts_per_rank_pairwise": "E/R > 64 the pairwise way: chunk extraction, padded rows carried across chunks",
    "kimi_r8": "Kimi-K2 at R=8 (E/R=48, skewed): the sorted slot order at the shape the planner sorts from",
    "kimi_r8_pairwise": "the same with the one-tile pairwise count (the planner's way up to 32 experts per rank)",
    "hist_nine_subblocks": "just past the direct limit: the histogram path must take over",
    "kimi_r2_rule4_chunk32": "rule 4 with 32-column chunks (a benchmarked override) must give the same slots",
    "many_experts_per_rank_chunk2": "rule 4 with 2-column chunks: the count carried across 64 chunks",
    "R16": "R=16: quota rounds and tiles beyond the small-R cases",
    "R32": "R=32 with K*S small: many receivers, few rows each",
    "counts_not_summing_to_cap": "rows not summing to S*K: the host's exact arithmetic, not the contract's shortcut",
    "out_of_range_ids": "ids outside [0,E) must give dest=row=-1 and not shift other entries' ordinals",
}
_EDGE_DOCS["large_counts"] = ("2**21 rows a rank on one home: remote allocs of ~2**18 packed to ~2**24-2**25 in "
                              "int32 (an overflow, or a reduction's sentinel inside the values' range)")
_EDGE_DOCS.update({n: f"{_EDGE_DOCS.get(n[:-5], 'random routing of ' + n[:-5])}, slots ordered by the sort"
                   for n in EDGE_CASES if n.endswith("_sort")})
_EDGE_DOCS.update({n: f"{_EDGE_DOCS.get(n[:-5], 'random routing of ' + n[:-5])}, in the int64 plan arithmetic"
                   for n in EDGE_CASES if n.endswith("_wide")})


@pytest.mark.parametrize("case", EDGE_CASES)
def test_interpreter_edge_case(report, case):
    """Hand-worked and edge plans (see _EDGE_DOCS for the bug each one catches)."""
    assert report[case]["err"] is None, f"{case} ({_EDGE_DOCS[case]}): {report[case]['err']}"


# ---------------------------------------------------------------------------------------------
# native CUDA
# ---------------------------------------------------------------------------------------------


# (R, E) shapes of the random GPU cases: few shapes (each one is a compile), random everything else
GPU_SHAPES = [(1, 8), (1, 1024), (2, 16), (2, 96), (2, 256), (3, 12), (3, 48), (4, 32), (4, 1024), (5, 40), (8, 64),
              (8, 384), (16, 128), (32, 256), (64, 512), (128, 256), (128, 1024)]


def _random_case(rng: random.Random, R: int, E: int):
    K = rng.randint(1, min(8 if R >= 64 else 32, E))
    S = rng.choice([1, 3, 17, 64, 200] if R >= 32 else [1, 5, 64, 333, 1024, 4096])
    if S * K > 70000:
        S = max(1, 70000 // K)
    epn = E // R
    B = rng.choice([1, 2, max(1, epn // 2), epn, epn + 3, 2 * E + 1])
    tp = rng.choice([1, 2, 8, 128])
    sigma = rng.choice([0.0, 0.5, 1.0, 2.0, 5.0])
    return K, S, B, tp, sigma, rng.randint(0, 10**6)


@pytest.mark.gpu
@pytest.mark.parametrize("R,E", GPU_SHAPES, ids=[f"R{R}-E{E}" for R, E in GPU_SHAPES])
def test_gpu_random_cases(R, E):
    """14 seeded random cases per shape natively on CUDA (4 from R=64 up), up to R=128: layout/race/codegen
    bugs the interpreter cannot show. A test per shape: each case compiles its own kernels, which is
    most of the time, so the GPU suite's workers share the shapes out."""
    from vllm_moonep.engine.planning.device_planner import DevicePlanner

    rng = random.Random(1234 + 7919 * R + E)
    dev = torch.device("cuda")
    failures = []
    widths = set()
    for i in range(14 if R <= 32 else 4):
        K, S, B, tp, sigma, seed = _random_case(rng, R, E)
        ids, tpe = _routing(R, S, E, K, sigma, seed)
        # both launch paths; every third case in the int64 plan arithmetic, the others the planner's own
        dp = DevicePlanner(R, E, S, K, B, tp, dev, fast_launch=i % 2 == 0, wide=True if i % 3 == 0 else None)
        widths.add(dp.arithmetic)
        ranks = range(R) if R <= 8 else sorted({0, R - 1, rng.randrange(R)})
        err = compare(dp, tpe.to(torch.int32).to(dev), [x.to(dev) for x in ids], tpe, ids, S, K, B, tp, ranks)
        if err:
            failures.append(f"case {i} R={R} E={E} S={S} K={K} B={B} tp={tp} sigma={sigma} "
                            f"{dp.arithmetic}: {err}")
    assert not failures, "\n".join(failures[:10])
    assert widths == {"int32", "int64"}, f"only {widths} ran natively"


def test_plan_width_choice():
    """int32 plan arithmetic where it is exact (Kimi-K2 at R=8 up to 8192 tokens), int64 beyond, and an
    explicit int32 refused where a contract input could overflow it (a silent wrong plan otherwise)."""
    from vllm_moonep.engine.planning.device_planner import DevicePlanner, narrow_fits

    cpu = torch.device("cpu")
    assert narrow_fits(8, 384, 8192, 8, 48, 128) and DevicePlanner(8, 384, 8192, 8, 48, 128, cpu).arithmetic == "int32"
    assert not narrow_fits(128, 1024, 8192, 8, 8, 128)
    assert DevicePlanner(128, 1024, 8192, 8, 8, 128, cpu).arithmetic == "int64"
    assert DevicePlanner(8, 384, 128, 8, 48, 128, cpu, wide=True).arithmetic == "int64"
    with pytest.raises(ValueError, match="narrow_fits"):
        DevicePlanner(128, 1024, 8192, 8, 8, 128, cpu, wide=False)


@pytest.mark.gpu
def test_gpu_no_sync_and_cuda_graph_replay():
    """plan()+place() with no host sync, replayed from a CUDA graph on new inputs (hidden sync, stale capture)."""
    from vllm_moonep.engine.planning.device_planner import DevicePlanner

    R, E, S, K, B, tp = 8, 384, 512, 8, 48, 128
    dev = torch.device("cuda")
    dp = DevicePlanner(R, E, S, K, B, tp, dev)
    ids0, tpe0 = _routing(R, S, E, K, 1.0, seed=1)
    tpe_in = tpe0.to(torch.int32).to(dev)
    ids_in = ids0[3].to(dev)
    dp.place(dp.plan(tpe_in), 3, ids_in)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gp = dp.plan(tpe_in)
        dp.place(gp, 3, ids_in)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gp = dp.plan(tpe_in)
        dest, row = dp.place(gp, 3, ids_in)
    for sigma, seed in [(0.0, 2), (2.0, 3), (5.0, 4)]:
        ids, tpe = _routing(R, S, E, K, sigma, seed)
        tpe_in.copy_(tpe.to(torch.int32))
        ids_in.copy_(ids[3])
        graph.replay()
        torch.cuda.synchronize()
        ref = plan_global(tpe, S, K, B, tp)
        for f in fields(ref):
            got, want = getattr(gp, f.name).cpu(), getattr(ref, f.name)
            assert torch.equal(got, want), f"{f.name} after replay (sigma={sigma})"
        ed, er = place_entries(ref, 3, ids[3])
        assert torch.equal(dest.cpu(), ed) and torch.equal(row.cpu(), er), f"placement after replay (sigma={sigma})"


if __name__ == "__main__":
    _child_main()
