"""A/B of a Triton expert-kernel lever against the committed tiles, in one run on one GPU.

``python -m vllm_moonep.tools.bench_levers [--lever w13i|flat|mix|streamk|pair|generic|deepgemm_half]
[--impl triton|deepgemm]
[--shapes kimi-k2,qwen3-30b-a3b] [--tokens 256,1024,4096] [--rep 50] [--rounds 4]``

The levers (``--lever``; ``LEVER_KERNEL``: the kernel timed alone beside the whole compute, the one the lever
changes, or for ``mix``, ``streamk`` and ``pair``, which change both, gate/up):

- ``w13i`` (gate/up): the weights stored as the symmetric layout stores them (gate and up interleaved row by row
  in one ``w13``: the gate/up tiles read one ``[2BN, BK]`` block and run one MMA of ``2BN`` columns per step,
  ``triton_tiles.gate_up_acc``) against the same values stored as the replicated layout stores them (gate and
  up as two tensors: two blocks and two MMAs of ``BN``), the same tiles. With ``--impl deepgemm``: DeepGEMM's
  compute (``expert_ffn_deepgemm``) over the interleaved ``w13`` against the same values as the halves of one
  ``w13`` (vLLM's order: one GEMM operand either way), the activation between its GEMMs (``deepgemm_act``: pairs
  of columns, or the two halves) timed alone;
- ``flat`` (down): the committed down tiles with their flattened tile loop (``"flat"``: the next tile's loads
  during this tile's epilogue) toggled: off where the table sets it, on where it does not. A one-launch
  entry does not take ``flat``: such a point has no flat variant, and its row says so.
- ``mix`` (both kernels; gate/up timed alone): the committed tiles taken in the mixed order (``"mix"``,
  ``triton_kernels._tile``: the groups sorted by rows, tiles from both ends in turn), on both kernels and on
  each alone. A one-launch entry does not take it (its row says so).
- ``streamk`` (both kernels; gate/up timed alone): the committed tiles with their last tiles cut between
  programs (``"streamk"``, ``triton_kernels._sk_range``), on both kernels and on each alone; as ``mix``, none
  at a one-launch entry.
- ``pair`` (both kernels; gate/up timed alone): two row tiles of a group run as one tile of twice the rows where
  both hold rows (``"pair"``, ``triton_kernels._gate_up_kernel``: each weight block loaded once for both), on both
  kernels and on each alone (``pair_tiles``: BN halved until the doubled tile's sums fit what the committed
  widest tile holds, 8 warps, one program per SM; committed 128-row tiles: the same tiles as pairs of 64 rows, so
  that a group's odd last 64 rows run as a tile of 64), and the pair's gate/up tiles without the pair
  (``pair_bn``: where its BN differs from the committed); none at a one-launch entry or above 128 rows;
- ``deepgemm_half`` (both kernels; gate/up timed alone, with its activation): one half of the compute from
  DeepGEMM (``deepgemm_impl.gate_up_act``: its gate/up GEMM then ``swiglu_route``; ``deepgemm_impl.down``: its
  down GEMM) and the other from the committed Triton tiles (gate/up with the activation in its epilogue; down),
  and the whole of DeepGEMM's compute, over the same rows and weights (``deepgemm_impl.deepgemm_unusable`` must
  pass: DeepGEMM importable, see ``tools/gpu_deepgemm.sh``); none at a one-launch entry;
- ``generic`` (gate/up timed alone): the generic tiles (``triton_kernels.DEFAULT_CONFIGS``, for shapes
  tuning.json has no entry for), each regime's against the one ``select_config`` picks; meant for the shape
  ``untuned`` (``UNTUNED_SHAPE``: Qwen3-235B-A22B's experts), which has none.

For each shape, tokens per rank and routing (balanced, skewed) it builds the same rank-0 case as
``bench_experts`` (its ``rank0_case``, ``make_weights``, ``make_inputs``, ``entry_ends``: rank 0 of EP=8,
the real planner's ``cu_seqlens`` over ``E+B`` groups, padding 128) and times, as CUDA-graph replays
(``bench_experts._graphed``, ``_bench``: median, L2 flushed and left clean)::

    committed     select_config's tiles for the point (tuning.json, the step's tokens per rank), over the
                  weights as the symmetric layout stores them (w13 interleaved), except for --lever w13i:
                  over gate and up as two tensors (--impl deepgemm: the halves of one w13)
    w13i          the same tiles over the same weights stored interleaved (INTERLEAVED_VARIANTS)
    w13i BN/2     where the committed gate/up BN makes 2*BN exceed 256 (the widest warpgroup MMA):
                  the same tiles with BN halved, over the interleaved weights (the same MMA width as
                  committed)
    flat_off/on   (--lever flat) the same tiles with the down tiles' "flat" toggled
    mix, mix_gate_up, mix_down
                  (--lever mix) the same tiles with "mix" on both kernels, on gate/up only, on down only
    streamk, streamk_gate_up, streamk_down
                  (--lever streamk) the same, with "streamk"
    pair, pair_gate_up, pair_down, pair_bn
                  (--lever pair) the pair tiles on both kernels, on gate/up only, on down only, and the
                  pair's gate/up tiles without the pair (its BN, warps, stages)
    deepgemm, deepgemm_gate_up, deepgemm_down
                  (--lever deepgemm_half) DeepGEMM's whole compute, its gate/up and activation before the
                  committed down tiles, the committed gate/up tiles before its down GEMM
    stream, mid, compute
                  (--lever generic) the generic regimes' tiles, each but the committed one
    control       the committed tiles again, as a variant of their own (own graph and buffers): its
                  ratio to committed is the run's noise at the point, the band a lever must clear

each as the whole expert compute, as the layer calls it (``row_ends``, ``zero_tail=False``, ``padded=False``,
as ``bench_experts``), and as the kernel the lever changes alone (``_launch_gate_up`` or ``_launch_down``).
The variants are timed in alternation, ``--rounds`` times, each round's order from a Williams design
(``timing.alternated_times``: at the power-bound 4096-token points the same tiles read up to 10% apart by
their place in a round, or by the variant timed before them), and each time is the median of the rounds. Each
variant's output (untimed call, every row written) is checked against the committed one: relative
error. Prints the ceilings (``bench_experts.measure_ceilings``) and a markdown table; writes
``bench_levers.json`` to ``$OUT`` if set. A variant that cannot run (compile error, out of shared memory)
reads ``-`` with the reason.

Memory (w13i): the interleaved weights are a second copy of gate and up (Kimi-K2: 432 x 2 x 2048 x 7168 bf16 =
25 GB beside the 38 GB of weights), made once per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

from vllm_moonep.engine import default_num_slots
from vllm_moonep.testing.reference import relative_error
from vllm_moonep.tools.bench_experts import (PAD, R, SHAPES, SKEW_SIGMA, _bench, _ceiling_line, _graphed,
                                             add_flush_option, entry_ends, make_inputs, make_weights,
                                             measure_ceilings, rank0_case, tile_text, use_flush)
from vllm_moonep.tools.timing import ROUNDS, alternated_times, pooled_ratio

#: the points of the A/B by default: where the GEMMs are compute-bound enough for the levers to matter
DEFAULT_TOKENS = (256, 1024, 4096)
#: the shapes by default (``bench_experts.SHAPES``)
DEFAULT_SHAPES = ("kimi-k2", "qwen3-30b-a3b")
#: a shape tuning.json has no tile entry for, so the generic tiles run it: Qwen3-235B-A22B's experts (its public
#: config.json: hidden_size 4096, moe_intermediate_size 1536, num_experts 128, num_experts_per_tok 8)
UNTUNED_SHAPE = {"H": 4096, "I": 1536, "E": 128, "K": 8}
#: the shapes ``--shapes`` takes: ``bench_experts``' and ``untuned``
LEVER_SHAPES = {**SHAPES, "untuned": UNTUNED_SHAPE}
#: ``rep`` (ms of timed calls, ``timing.flushed_median_ms``) per timing by default: 2 shapes x 3 points x 2 routings x 4 variants x 2 scopes x ROUNDS
#: timings (about 40 s of replays, each timing also pays its warm-up and L2 flushes), plus compiles
DEFAULT_REP = 50
#: the widest warpgroup MMA's N on Hopper: a w13i tile of 2*BN above it runs two MMAs per step anyway
MAX_MMA_N = 256
#: the levers ``--lever`` takes, and the kernel each one changes (mix, streamk, pair: both; gate/up), timed alone
#: beside the whole compute
LEVER_KERNEL = {"w13i": "gate_up", "flat": "down", "mix": "gate_up", "streamk": "gate_up", "pair": "gate_up",
                "generic": "gate_up", "deepgemm_half": "gate_up"}
#: the float32 sums one tile of the pair lever may hold (``pair_tiles``): the committed tiles' largest, 128 x 256
PAIR_MAX_ACC = 128 * 256
#: the shared memory the pair lever's stages may take (``pair_tiles``), below Hopper's 227 KB per block
PAIR_MAX_SMEM = 200 * 1024
#: the rows of the pair lever's largest tile (``pair_tiles``): committed tiles of these rows are halved and paired
PAIR_ROWS = 128
#: the levers that are one tile option set on both kernels and on each alone (none at a one-launch entry)
BOTH_KERNELS = ("mix", "streamk")
#: ``--lever deepgemm_half``'s variants: which half of the compute DeepGEMM runs (``(gate_up, down)``)
DEEPGEMM_HALVES = {"deepgemm": (True, True), "deepgemm_gate_up": (True, False), "deepgemm_down": (False, True)}
#: the lever by default
DEFAULT_LEVER = "w13i"
#: the variants of ``--lever w13i`` that run over the weights stored interleaved; its others run over two tensors
#: (the halves of one ``w13`` with ``--impl deepgemm``), every other lever's over the interleaved ``w13``
INTERLEAVED_VARIANTS = ("w13i", "w13i_bn_half")
#: the implementations ``--impl`` takes (``deepgemm`` with ``--lever w13i`` only)
IMPLS = ("triton", "deepgemm")


def _positive_ints(text: str) -> list[int]:
    vals = [int(t) for t in text.split(",") if t.strip()]
    if not vals or any(v < 1 for v in vals):
        raise ValueError(text)
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad shapes or tokens are refused with a sentence (exit status 2)."""
    ap = argparse.ArgumentParser(prog="bench_levers", description=__doc__.split("\n")[0])
    ap.add_argument("--lever", choices=sorted(LEVER_KERNEL), default=DEFAULT_LEVER,
                    help="the lever to A/B against the committed tiles (default: %(default)s)")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                    help=f"comma-separated model shapes, of {', '.join(sorted(LEVER_SHAPES))} (default: %(default)s)")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                    help="comma-separated tokens per rank (default: %(default)s)")
    ap.add_argument("--rep", type=int, default=DEFAULT_REP,
                    help="ms of timed calls per timing (timing.flushed_median_ms; default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="alternated rounds of timings per variant, each round's order from a Williams design "
                         "(timing.round_orders; default: %(default)s)")
    ap.add_argument("--impl", choices=IMPLS, default="triton",
                    help="the expert compute the variants run (deepgemm: --lever w13i only; default: %(default)s)")
    add_flush_option(ap)
    args = ap.parse_args(argv)
    if args.impl == "deepgemm" and args.lever != "w13i":
        ap.error(f"--impl deepgemm times the w13i lever only (the storage order), got --lever {args.lever}")
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in LEVER_SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: unknown shape(s) {bad or [args.shapes]}; known: {', '.join(sorted(LEVER_SHAPES))}")
    try:
        tokens = _positive_ints(args.tokens)
    except ValueError:
        ap.error(f"--tokens must be comma-separated positive integers, got {args.tokens!r}")
    if args.rep < 1:
        ap.error(f"--rep must be a positive number of milliseconds, got {args.rep}")
    if args.rounds < 1:
        ap.error(f"--rounds must be a positive number of rounds, got {args.rounds}")
    args.shapes, args.tokens = shapes, tokens
    return args


def variants(committed: dict, lever: str = DEFAULT_LEVER) -> dict[str, dict]:
    """The configs one point times: the committed tiles; for ``w13i`` the same (run over the interleaved weights:
    ``INTERLEAVED_VARIANTS``) and (where the committed gate/up BN makes ``2*BN`` exceed ``MAX_MMA_N``) with BN
    halved; for ``flat`` the
    same with the down tiles' ``"flat"`` toggled (``flat_off`` or ``flat_on``; none where the committed entry
    is one launch, which does not take ``flat``: ``lever_absent`` says so); for ``mix`` and ``streamk`` the same
    with that option on both kernels and on each alone (none for a one-launch entry); for ``generic`` each
    generic regime's tiles (``DEFAULT_CONFIGS``) but the committed ones; and the committed tiles again as
    ``control`` (last)."""
    if lever not in LEVER_KERNEL:
        raise ValueError(f"bench_levers: unknown lever {lever!r}; known: {', '.join(sorted(LEVER_KERNEL))}")
    out = {"committed": committed}
    if lever == "w13i":
        gu = committed["gate_up"]
        out["w13i"] = {k: dict(v) for k, v in committed.items()}
        if 2 * gu["BN"] > MAX_MMA_N:
            out["w13i_bn_half"] = {**committed, "gate_up": {**gu, "BN": gu["BN"] // 2}}
    elif lever == "generic":
        from vllm_moonep.common.grouped_gemm.triton_kernels import DEFAULT_CONFIGS

        for name, tiles in DEFAULT_CONFIGS.items():
            if tiles != committed:
                out[name] = {k: dict(v) for k, v in tiles.items()}
    elif lever == "pair":
        if not committed.get("fused"):
            out.update(_pair_variants(committed))
    elif lever == "deepgemm_half":
        if not committed.get("fused"):
            out.update({name: {k: dict(v) for k, v in committed.items()} for name in DEEPGEMM_HALVES})
    elif lever in BOTH_KERNELS:
        if not committed.get("fused"):
            gu, dn = committed["gate_up"], committed["down"]
            out[lever] = {**committed, "gate_up": {**gu, lever: True}, "down": {**dn, lever: True}}
            out[f"{lever}_gate_up"] = {**committed, "gate_up": {**gu, lever: True}}
            out[f"{lever}_down"] = {**committed, "down": {**dn, lever: True}}
    elif not committed.get("fused"):
        dn = committed["down"]
        if dn.get("flat"):
            out["flat_off"] = {**committed, "down": {k: v for k, v in dn.items() if k != "flat"}}
        else:
            out["flat_on"] = {**committed, "down": {**dn, "flat": True}}
    out["control"] = {k: dict(v) for k, v in committed.items()}
    return out


def pair_tiles(c: dict, width: int) -> dict | None:
    """Tile config ``c`` with ``"pair"`` (two ``BM``-row tiles as one of ``2 BM`` rows where both hold rows), its
    BN halved until the doubled tile's sums (``2 BM x width BN``; gate/up over interleaved weights: width 2) fit
    ``PAIR_MAX_ACC``, 8 warps, one program per SM, its stages (and BK, to keep two) cut to ``PAIR_MAX_SMEM``.
    Committed tiles of ``PAIR_ROWS`` rows keep their tile and get ``BM`` halved with the pair: the same tiles where
    a group's rows fill them, a tile of half the rows for a group's odd last half (fewer rows that carry no token
    at the compute-bound points). ``None`` above ``PAIR_ROWS`` rows, or where it runs stream-K (which does not
    take it)."""
    if c["BM"] > PAIR_ROWS or c.get("streamk"):
        return None
    if c["BM"] == PAIR_ROWS:
        return {**c, "BM": PAIR_ROWS // 2, "pair": True}
    bmt, bn, bk = 2 * c["BM"], c["BN"], c["BK"]
    while bmt * width * bn > PAIR_MAX_ACC and bn > 16:
        bn //= 2
    while 2 * 2 * (bmt + width * bn) * bk > PAIR_MAX_SMEM and bk > 32:  # two stages at least
        bk //= 2
    stages = max(2, min(c["num_stages"], PAIR_MAX_SMEM // (2 * (bmt + width * bn) * bk)))
    return {**c, "pair": True, "BN": bn, "BK": bk, "num_warps": max(8, c["num_warps"]), "num_stages": stages,
            "progs_per_sm": 1}


def _pair_variants(committed: dict) -> dict[str, dict]:
    """``--lever pair``'s variants of the committed tiles (see ``variants``)."""
    gu, dn = committed["gate_up"], committed["down"]
    pg, pd = pair_tiles(gu, 2), pair_tiles(dn, 1)
    out = {}
    if pg is not None and pd is not None:
        out["pair"] = {**committed, "gate_up": pg, "down": pd}
    if pg is not None:
        out["pair_gate_up"] = {**committed, "gate_up": pg}
        if pg["BN"] != gu["BN"]:
            out["pair_bn"] = {**committed, "gate_up": {k: v for k, v in pg.items() if k != "pair"}}
    if pd is not None:
        out["pair_down"] = {**committed, "down": pd}
    return out


def lever_absent(committed: dict, lever: str) -> str | None:
    """Why a point has no variant of ``lever`` (``None`` where it has one)."""
    if (lever in ("flat", "pair", "deepgemm_half") or lever in BOTH_KERNELS) and committed.get("fused"):
        return f"the committed entry runs as one launch, which does not take \"{lever}\""
    if lever == "pair" and not _pair_variants(committed):
        return f"the committed tiles have more than {PAIR_ROWS} rows on both kernels (or run stream-K)"
    return None


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def point(tk, stored: dict, sname: str, shp: dict, tokens: int, routing: str, sigma: float, dev, rep: int,
          rounds: int = ROUNDS, lever: str = DEFAULT_LEVER, impl: str = "triton") -> dict:
    """One point's row: the lever's variants (``variants``) checked (untimed call, every row written) and timed
    (whole compute and the kernel the lever changes, ``rounds`` alternated rounds of ``_graphed`` replays,
    ``timing.alternated_times``). ``stored``: ``{"base": (weights, prepared table), "interleaved": ...}``, the same
    values: ``base`` what every variant runs over but ``INTERLEAVED_VARIANTS`` (``main`` says which order),
    ``interleaved`` only for ``--lever w13i``. ``impl="deepgemm"``: the variants run
    DeepGEMM's compute (no tiles: the BN/2 variant is left out) and the kernel timed alone is the activation."""
    kernel = LEVER_KERNEL[lever] if impl == "triton" else "activation"
    H, I = shp["H"], shp["I"]
    G = stored["base"][0].num_groups
    cu_h, real, nvs, mv = rank0_case(shp, tokens, sigma)
    cu = cu_h.to(dev)
    x, rw = make_inputs(H, cu_h, real, nvs, dev, seed=tokens * 7 + int(sigma * 10))
    ends = entry_ends(cu_h, real).to(dev)
    n = int(cu_h[-1])
    committed = tk.select_config(H, I, nvs, G, tokens=tokens)
    confs = variants(committed, lever)
    if impl == "deepgemm":
        confs.pop("w13i_bn_half", None)
    eff = torch.empty(G, dtype=torch.int32, device=dev)
    tk._launch_trim(cu, rw, eff)
    outs, fns, why = {}, {}, {}
    absent = lever_absent(committed, lever)
    if absent is not None:
        why[lever] = absent
    for name, conf in confs.items():
        weights, prep = stored["interleaved" if name in INTERLEAVED_VARIANTS else "base"]
        try:
            o = torch.full_like(x, float("nan"))
            act = torch.empty(nvs, I, device=dev, dtype=x.dtype)
            if impl == "deepgemm":
                whole, alone = _deepgemm_fns(x, rw, cu, weights, o, act)
                whole()
                outs[name] = o[:n].clone()
                fns[name] = (_graphed(whole), _graphed(alone))
                continue
            if name in DEEPGEMM_HALVES:
                whole, alone = _half_fns(tk, DEEPGEMM_HALVES[name], x, rw, cu, ends, weights, prep, conf, o, tokens)
                whole(True)
                outs[name] = o[:n].clone()
                fns[name] = (_graphed(whole), _graphed(alone))
                continue
            tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=conf, act=act, padded=False, row_ends=ends)
            outs[name] = o[:n].clone()  # the timed calls write o again (tails left)
            whole = (lambda conf=conf, o=o, act=act, weights=weights:
                     tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=conf, act=act, padded=False,
                                          row_ends=ends, zero_tail=False))

            def alone(conf=conf, act=act, o=o, prep=prep):  # the lever's kernel (down: on the act rows the check call wrote)
                if kernel == "gate_up":
                    return tk._launch_gate_up(x, rw, cu, eff, prep, act, conf["gate_up"], False)
                return tk._launch_down(act, rw, cu, eff, prep, o, conf["down"], False)

            fns[name] = (_graphed(whole), _graphed(alone))
        except Exception as e:  # out of resources, compile errors: the column reads "-"
            why[name] = f"{type(e).__name__}: {str(e)[:160]}"
            print(f"#   {sname} t={tokens} {routing} {name}: - ({why[name]})", flush=True)

    def both(name):  # one variant's whole compute, then the lever's kernel alone (us)
        (r_whole, _g1), (r_alone, _g2) = fns[name]
        return _bench(r_whole, rep=rep) * 1e3, _bench(r_alone, rep=rep) * 1e3

    # alternated, each round in the design's order: drift, place and the call before land on every variant alike
    per_round = alternated_times(list(fns), both, rounds)
    times = {k: {"whole": [w for w, _ in v], "kernel": [g for _, g in v]} for k, v in per_round.items()}
    del fns
    med = {k: {s: statistics.median(v) for s, v in t.items()} for k, t in times.items()}
    base = outs.get("committed")
    row = {"shape": sname, "tokens": tokens, "routing": routing, "maxvio": mv, "NvS": nvs, "rows": n,
           "real_rows": int(real.sum()), "busy_groups": int((real > 0).sum()), "lever": lever, "kernel": kernel,
           "impl": impl, "configs": confs, "absent": why, "times_us": times}
    for name in confs:
        m = med.get(name)
        row[f"{name}_us"] = None if m is None else m["whole"]
        row[f"{name}_kernel_us"] = None if m is None else m["kernel"]
        got = outs.get(name)
        row[f"{name}_unwritten"] = None if got is None else int(torch.isnan(got).sum())
        row[f"{name}_err"] = None if got is None or base is None or name == "committed" else relative_error(got, base)
        if name != "committed" and m is not None and "committed" in med:
            row[f"{name}_ratio"] = m["whole"] / med["committed"]["whole"]
            row[f"{name}_kernel_ratio"] = m["kernel"] / med["committed"]["kernel"]
            if name != "control" and "control" in times:  # the steadier figure where a point is noisy
                row[f"{name}_pooled_ratio"] = pooled_ratio(times[name]["whole"], times["committed"]["whole"],
                                                           times["control"]["whole"])
    return row


def _deepgemm_fns(x, rw, cu, weights, out, act):
    """``(whole, activation)`` of DeepGEMM's compute over ``weights`` (``expert_ffn_deepgemm``) and of its
    activation alone, on an ``h`` of the gate/up GEMM's shape read as the weights' order has it (pairs of columns
    or halves)."""
    from vllm_moonep.common.grouped_gemm.deepgemm_act import swiglu_route
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import expert_ffn_deepgemm

    I = weights.intermediate
    h = torch.zeros(x.shape[0], 2 * I, device=x.device, dtype=x.dtype)
    g, u = (h[:, 0::2], h[:, 1::2]) if weights.interleaved else (h[:, :I], h[:, I:])
    act_alone = torch.empty_like(act)
    return (lambda: expert_ffn_deepgemm(x, rw, cu, weights, out=out, token_padding=PAD),
            lambda: swiglu_route(g, u, rw, act_alone))


def _half_fns(tk, halves, x, rw, cu, ends, weights, prep, conf, out, tokens):
    """``(whole, gate_up)`` of a compute whose halves run DeepGEMM where ``halves`` (``(gate_up, down)``) says and
    the committed Triton tiles elsewhere, as the layer runs them (``row_ends``; ``whole(zero_tail)``: ``True`` for
    the check call, every row written) and of its gate/up half alone (with the activation). The two computes that
    ship run through their own entry points (``expert_ffn_deepgemm``; ``expert_ffn_deepgemm_down``, its
    ``zero_tails`` launch included); only DeepGEMM's gate/up before the Triton down tiles is composed here."""
    from vllm_moonep.common.grouped_gemm import deepgemm_impl as dgi

    why = dgi.deepgemm_unusable(x, weights, PAD)
    if why is not None:
        raise RuntimeError(why)
    dg_gu, dg_dn = halves
    layout = dgi.grouped_layout(cu, weights, x.shape[0])
    act = torch.zeros(x.shape[0], weights.intermediate, device=x.device, dtype=x.dtype)

    def gate_up():
        if dg_gu:
            return dgi.gate_up_act(x, rw, weights, layout, act)
        return tk._launch_gate_up(x, rw, cu, ends, prep, act, conf["gate_up"], False)

    def whole(zero_tail=False):
        if dg_gu and dg_dn:  # what impl="deepgemm" runs
            return dgi.expert_ffn_deepgemm(x, rw, cu, weights, out=out, token_padding=PAD)
        if dg_dn:  # what impl="deepgemm_down" runs, tiles picked by tokens as committed
            return dgi.expert_ffn_deepgemm_down(x, rw, cu, weights, out=out, tokens=tokens, padded=False,
                                                row_ends=ends, zero_tail=zero_tail, token_padding=PAD)
        gate_up()
        return tk._launch_down(act, rw, cu, ends, prep, out, conf["down"], False, zero_tail=zero_tail)

    return whole, gate_up


def table(rows: list[dict]) -> list[str]:
    """The markdown table of ``point`` rows (a column group per variant but the committed one: time, its ratio to
    the committed tiles for the whole compute, pooled (``timing.pooled_ratio``) and for the lever's kernel, its
    output's error; ``-`` where a row has no such variant), then a line naming any variant with wrong outputs
    (rows left unwritten, or relative error >= 1e-2 against the committed tiles) and one per variant that could
    not run."""
    names: list[str] = []
    for r in rows:
        names += [k for k in r["configs"] if k != "committed" and k not in names]
    kernel = (rows[0].get("kernel") if rows else None) or "kernel"
    label = kernel.replace("_", "/")
    lines = [f"| shape | tokens | routing | committed {label} tile | committed us |"
             + "".join(f" {k} us | ratio | pooled | {label} ratio | err |" for k in names),
             "|---|---:|---|---|---:|" + "---:|---:|---:|---:|---:|" * len(names)]
    for r in rows:
        tile = "deepgemm" if r.get("impl") == "deepgemm" else tile_text(r["configs"]["committed"][kernel])
        cells = [r["shape"], str(r["tokens"]), r["routing"], tile,
                 _fmt(r["committed_us"])]
        for k in names:
            cells += ([_fmt(r.get(f"{k}_us")), _fmt(r.get(f"{k}_ratio"), ".3f"), _fmt(r.get(f"{k}_pooled_ratio"), ".3f"),
                       _fmt(r.get(f"{k}_kernel_ratio"), ".3f"), _fmt(r.get(f"{k}_err"), ".1e")]
                      if k in r["configs"] else ["-"] * 5)
        lines.append("| " + " | ".join(cells) + " |")
    bad = wrong(rows)
    if bad:
        lines.append(f"# WRONG OUTPUTS (unwritten rows, or relative error >= 1e-2 against the committed tiles): {bad}")
    for r in rows:
        for k, why in r["absent"].items():
            lines.append(f"# {r['shape']} t={r['tokens']} {r['routing']} {k}: - ({why})")
    return lines


def wrong(rows: list[dict]) -> list[tuple]:
    """``(shape, tokens, routing, variant)`` of each variant whose check call left rows unwritten or whose output
    is off the committed tiles' by a relative error of 1e-2 or more."""
    return [(r["shape"], r["tokens"], r["routing"], k) for r in rows for k in r["configs"]
            if (r.get(f"{k}_unwritten") or 0) > 0 or not (r.get(f"{k}_err") is None or r[f"{k}_err"] < 1e-2)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_levers: needs a CUDA GPU (it times Triton kernels as CUDA-graph replays); none is visible here",
              file=sys.stderr)
        return 2
    import triton

    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk

    use_flush(args.flush)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ceil = measure_ceilings(dev, warm_s=1.0, rounds=3)
    print(f"# device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    print("# " + _ceiling_line(ceil, "measured first"), flush=True)
    rows: list[dict] = []
    for sname in args.shapes:
        shp = LEVER_SHAPES[sname]
        H, I, E = shp["H"], shp["I"], shp["E"]
        G = E + default_num_slots(E, R)
        gate, up, down = make_weights(H, I, G, dev)
        if args.lever != "w13i":  # the tiles over what the symmetric layout stores: w13 interleaved
            weights = GroupedWeights.of_w13(interleave_gate_up(gate, up), down, interleaved=True)
        elif args.impl == "deepgemm":  # one GEMM operand either way: the halves of one w13 (vLLM's order)
            weights = GroupedWeights.of_w13(torch.cat([gate, up], dim=1), down, interleaved=False)
        else:
            weights = GroupedWeights.contiguous(gate, up, down)
        del gate, up
        stored = {"base": (weights, tk.prepare_weights(weights, dev))}
        if args.lever == "w13i":  # the same values interleaved, once per shape, before any capture
            inter = GroupedWeights.of_w13(interleave_gate_up(weights.gate[0], weights.up[0]), down, interleaved=True)
            stored["interleaved"] = (inter, tk.prepare_weights(inter, dev))
            del inter
        del down
        for tokens in args.tokens:
            for routing, sigma in (("balanced", 0.0), ("skewed", SKEW_SIGMA)):
                row = point(tk, stored, sname, shp, tokens, routing, sigma, dev, args.rep, args.rounds, args.lever,
                            args.impl)
                rows.append(row)
                print(f"# {sname:14s} t={tokens:5d} {routing:8s} committed {_fmt(row['committed_us'])} us "
                      f"({row['kernel']} {_fmt(row['committed_kernel_us'])})"
                      + "".join(f"  {k} {_fmt(row[f'{k}_us'])} us ({row['kernel']} {_fmt(row[f'{k}_kernel_us'])}) "
                                f"x{_fmt(row.get(f'{k}_ratio'), '.3f')}"
                                + (f" (pooled x{row[f'{k}_pooled_ratio']:.3f})" if f"{k}_pooled_ratio" in row else "")
                                + f" err {_fmt(row[f'{k}_err'], '.1e')}"
                                for k in row["configs"] if k != "committed"), flush=True)
        del weights, stored
        tk._CACHE.clear()
        torch.cuda.empty_cache()
    print()
    print("# " + _ceiling_line(ceil, props.name))
    print()
    print("Times: CUDA-graph replay, median of the alternated rounds; whole = the expert compute as the layer runs it, "
          f"{args.lever} changes the {'activation' if args.impl == 'deepgemm' else LEVER_KERNEL[args.lever]} kernel, "
          "timed alone too; ratio = variant / committed "
          "(below 1: the lever is faster); pooled = the variant's timings against the committed tiles' and the "
          "control's together (timing.pooled_ratio); err = the "
          "variant's output against the committed one (relative); control = the committed tiles timed again as a "
          "variant: a lever ratio no farther from 1 than the control's is noise.")
    print()
    for line in table(rows):
        print(line)
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": props.name,
                  "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                  "python": platform.python_version(), "ceilings": ceil, "lever": args.lever, "impl": args.impl,
                  "rounds": args.rounds,
                  "flush": args.flush, "rep_ms": args.rep,
                  "rows": rows, "argv": sys.argv}
        with open(os.path.join(out_dir, "bench_levers.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 1 if wrong(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
