"""Probe (decode): the expert compute on small programs, against the shipped one launch, on bench_levers' rows.

    python3 tools/probes/decode_items.py SHAPES TOKENS ROUNDS     (env FAMS=gemv,dot, TINY=0..4)

Rank 0 of EP=8 (bench_experts' rank0_case, make_inputs, entry_ends), weights stored as the symmetric layout stores
them (w13 interleaved). Columns, each a CUDA-graph replay after a clean L2 flush, in alternated rounds
(timing.alternated_times, Williams order) with the shipped tiles timed twice (committed, control):

    gemv*   items (group, 4-16 act columns) x the whole K, 1-8 rows at a time on CUDA cores (products summed per
            lane, one reduction after the K loop in the one launch): two launches (one program per item, or
            2 per SM) or one launch (_one4/_one8: the shipped work list and ready counters, 4 or 8 per SM)
    dot*    the same items through tl.dot (16-row tiles), one stage
    tiny*   the shipped one launch (triton_fused) with 8-16-column gate/up and 16-32-column down tiles, 1-2
            stages, 4-8 programs per SM

Each config family's gate/up then down tiles picked by a short timing first; outputs against the shipped ones.
"""
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up
from vllm_moonep.common.grouped_gemm import triton_kernels as tk
from vllm_moonep.tools.bench_experts import (SHAPES, PAD, R, _bench, _graphed, default_num_slots, entry_ends,
                                             make_inputs, make_weights, rank0_case, use_flush)
from vllm_moonep.tools.timing import alternated_times, pooled_ratio


@triton.jit
def gemv_kernel(x_ptr, rw_ptr, cu_ptr, ends_ptr, w_ptr, o_ptr, G, N, K, s_wg, s_xm, s_om,
                GP2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MR: tl.constexpr, GLU: tl.constexpr,
                DOT: tl.constexpr, F32: tl.constexpr, EVK: tl.constexpr):
    # GLU: w is w13 [G, 2N, K] interleaved (gate row 2j, up 2j+1), o = act [*, N] = silu(g) u rw
    # else: w is down [G, N, K], o = out [*, N]
    gidx = tl.arange(0, GP2)
    gm = gidx < G
    end = tl.load(cu_ptr + gidx, mask=gm, other=0)
    start = tl.load(cu_ptr + gidx - 1, mask=gm & (gidx > 0), other=0)
    ends = tl.minimum(tl.maximum(tl.load(ends_ptr + gidx, mask=gm, other=0), start), end)
    live = (ends > start).to(tl.int32)
    cum = tl.cumsum(live, 0)
    nb = tl.sum(live, 0)
    n1 = tl.cdiv(N, BN)
    total = nb * n1
    WR: tl.constexpr = 2 * BN if GLU else BN
    kk = tl.arange(0, BK)
    mm = tl.arange(0, MR)
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        b = t // n1
        j = t - b * n1
        g = tl.sum((cum <= b).to(tl.int32), 0)
        sel = gidx == g
        s = tl.sum(tl.where(sel, start, 0), 0)
        e = tl.sum(tl.where(sel, ends, 0), 0)
        wrow = j * WR + tl.arange(0, WR)
        wmask = wrow < (2 * N if GLU else N)
        wbase = w_ptr + g.to(tl.int64) * s_wg + wrow[:, None].to(tl.int64) * K
        for r0 in range(s, e, MR):
            rows = r0 + mm
            rmask = rows < e
            acc = tl.zeros([MR, WR], dtype=tl.float32)
            for k0 in range(0, K, BK):
                if EVK:
                    km = kk >= 0
                    w = tl.load(wbase + (k0 + kk)[None, :], mask=wmask[:, None], other=0.0)
                else:
                    km = (k0 + kk) < K
                    w = tl.load(wbase + (k0 + kk)[None, :], mask=wmask[:, None] & km[None, :], other=0.0)
                xr = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + (k0 + kk)[None, :],
                             mask=rmask[:, None] & km[None, :], other=0.0)
                if DOT and F32:
                    acc = tl.dot(xr.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
                elif DOT:
                    acc = tl.dot(xr, tl.trans(w), acc)
                else:
                    acc += tl.sum(xr[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
            if GLU:
                gu = tl.reshape(acc, [MR, BN, 2])
                gg, uu = tl.split(gu)
                rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
                a = gg * tl.sigmoid(gg) * uu * rw[:, None]
                cols = j * BN + tl.arange(0, BN)
                tl.store(o_ptr + rows[:, None].to(tl.int64) * s_om + cols[None, :], a.to(o_ptr.dtype.element_ty),
                         mask=rmask[:, None] & (cols < N)[None, :])
            else:
                cols = j * BN + tl.arange(0, BN)
                tl.store(o_ptr + rows[:, None].to(tl.int64) * s_om + cols[None, :], acc.to(o_ptr.dtype.element_ty),
                         mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def _item_dot(x_ptr, rw_ptr, w_ptr, o_ptr, g, j, s, e, N, K, s_wg, s_xm, s_om,
              BN: tl.constexpr, BK: tl.constexpr, MR: tl.constexpr, GLU: tl.constexpr, DOT: tl.constexpr,
              F32: tl.constexpr, EVK: tl.constexpr = False):
    WR: tl.constexpr = 2 * BN if GLU else BN
    kk = tl.arange(0, BK)
    mm = tl.arange(0, MR)
    wrow = j * WR + tl.arange(0, WR)
    wmask = wrow < (2 * N if GLU else N)
    wbase = w_ptr + g.to(tl.int64) * s_wg + wrow[:, None].to(tl.int64) * K
    for r0 in range(s, e, MR):
        rows = r0 + mm
        rmask = rows < e
        acc = tl.zeros([MR, WR], dtype=tl.float32)
        acc3 = tl.zeros([MR, WR, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVK:
                km = kk >= 0
                w = tl.load(wbase + (k0 + kk)[None, :], mask=wmask[:, None], other=0.0)
            else:
                km = (k0 + kk) < K
                w = tl.load(wbase + (k0 + kk)[None, :], mask=wmask[:, None] & km[None, :], other=0.0)
            xr = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + (k0 + kk)[None, :],
                         mask=rmask[:, None] & km[None, :], other=0.0)
            if DOT and F32:
                acc = tl.dot(xr.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
            elif DOT:
                acc = tl.dot(xr, tl.trans(w), acc)
            else:
                acc3 += xr[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32)
        if not DOT:
            acc = tl.sum(acc3, axis=2)
        cols = j * BN + tl.arange(0, BN)
        if GLU:
            gg, uu = tl.split(tl.reshape(acc, [MR, BN, 2]))
            rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
            res = gg * tl.sigmoid(gg) * uu * rw[:, None]
        else:
            res = acc
        tl.store(o_ptr + rows[:, None].to(tl.int64) * s_om + cols[None, :], res.to(o_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def fused_gemv_kernel(x_ptr, rw_ptr, cu_ptr, ends_ptr, w13_ptr, wd_ptr, act_ptr, out_ptr, sync_ptr, G, I, H,
                      s_13, s_d, s_xm, s_am, s_om, GP2: tl.constexpr,
                      BN1: tl.constexpr, BK1: tl.constexpr, MR1: tl.constexpr, DOT1: tl.constexpr,
                      BN2: tl.constexpr, BK2: tl.constexpr, MR2: tl.constexpr, DOT2: tl.constexpr, F32: tl.constexpr,
                      EVK1: tl.constexpr, EVK2: tl.constexpr):
    gidx = tl.arange(0, GP2)
    gm = gidx < G
    end = tl.load(cu_ptr + gidx, mask=gm, other=0)
    start = tl.load(cu_ptr + gidx - 1, mask=gm & (gidx > 0), other=0)
    ends = tl.minimum(tl.maximum(tl.load(ends_ptr + gidx, mask=gm, other=0), start), end)
    live = (ends > start).to(tl.int32)
    cum = tl.cumsum(live, 0)
    nb = tl.sum(live, 0)
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    total1 = nb * n1
    total = total1 + nb * n2
    ready = sync_ptr + 2
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while t < total:
        if t < total1:
            b = t // n1
            j = t - b * n1
            g = tl.sum((cum <= b).to(tl.int32), 0)
            sel = gidx == g
            s = tl.sum(tl.where(sel, start, 0), 0)
            e = tl.sum(tl.where(sel, ends, 0), 0)
            _item_dot(x_ptr, rw_ptr, w13_ptr, act_ptr, g, j, s, e, I, H, s_13, s_xm, s_am, BN1, BK1, MR1, True, DOT1,
                      F32, EVK1)
            tl.debug_barrier()
            tl.atomic_add(ready + g, 1, sem="release", scope="gpu")
        else:
            u = t - total1
            b = u // n2
            j = u - b * n2
            g = tl.sum((cum <= b).to(tl.int32), 0)
            sel = gidx == g
            s = tl.sum(tl.where(sel, start, 0), 0)
            e = tl.sum(tl.where(sel, ends, 0), 0)
            seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
            while seen < n1:
                seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            _item_dot(act_ptr, rw_ptr, wd_ptr, out_ptr, g, j, s, e, H, I, s_d, s_am, s_om, BN2, BK2, MR2, False, DOT2,
                      F32, EVK2)
        t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == tl.num_programs(0) - 1:
        tl.store(ready + gidx, tl.zeros([GP2], tl.int32), mask=gm)
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)


def launch_fused(x, rw, cu, ends, w13, down, act, out, sync, I, H, cg, cd, nprog):
    G = cu.numel()
    fused_gemv_kernel[(nprog,)](x, rw, cu, ends, w13, down, act, out, sync, G, I, H, w13.stride(0), down.stride(0),
                                x.stride(0), act.stride(0), out.stride(0), GP2=triton.next_power_of_2(G),
                                BN1=cg["BN"], BK1=cg["BK"], MR1=cg["MR"], DOT1=cg.get("DOT", False),
                                BN2=cd["BN"], BK2=cd["BK"], MR2=cd["MR"], DOT2=cd.get("DOT", False),
                                F32=bool(os.environ.get("TRITON_INTERPRET")), EVK1=H % cg["BK"] == 0, EVK2=I % cd["BK"] == 0,
                                num_warps=cg["w"], num_stages=1)


def launch(x, rw, cu, ends, w, o, N, K, cfg, glu, nprog):
    G = cu.numel()
    gemv_kernel[(nprog,)](x, rw, cu, ends, w, o, G, N, K, w.stride(0), x.stride(0), o.stride(0),
                          GP2=triton.next_power_of_2(G), BN=cfg["BN"], BK=cfg["BK"], MR=cfg["MR"], GLU=glu,
                          DOT=cfg.get("DOT", False), F32=bool(os.environ.get("TRITON_INTERPRET")), EVK=K % cfg["BK"] == 0, num_warps=cfg["w"], num_stages=cfg.get("st", 1))


def grid(cfg, bound_groups, n, sms):
    items = bound_groups * -(-n // cfg["BN"])
    return items if not cfg.get("pps") else min(items, sms * cfg["pps"])


def main():
    use_flush("clean")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    print(f"# {props.name} {sms} SMs triton {triton.__version__}", flush=True)
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "kimi-k2"]
    toks = [int(t) for t in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1", "16"])]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    for sname in shapes:
        shp = SHAPES[sname]
        H, I, E = shp["H"], shp["I"], shp["E"]
        G = E + default_num_slots(E, R)
        gate, up, down = make_weights(H, I, G, dev)
        w13 = interleave_gate_up(gate, up)
        del gate, up
        weights = GroupedWeights.of_w13(w13, down, interleaved=True)
        for tokens in toks:
            for routing, sigma in (("balanced", 0.0), ("skewed", 1.0)):
                cu_h, real, nvs, _ = rank0_case(shp, tokens, sigma)
                cu = cu_h.to(dev)
                x, rw = make_inputs(H, cu_h, real, nvs, dev, seed=tokens * 7 + int(sigma * 10))
                ends = entry_ends(cu_h, real).to(dev)
                n = int(cu_h[-1])
                bound = min(G, nvs // PAD)
                maxr = int(real.max())
                committed = tk.select_config(H, I, nvs, G, tokens=tokens)
                fns, outs = {}, {}
                for name in ("committed", "control"):
                    o = torch.full_like(x, float("nan"))
                    act = torch.empty(nvs, I, device=dev, dtype=x.dtype)
                    tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=committed, act=act, padded=False,
                                         row_ends=ends)
                    outs[name] = o
                    fns[name] = _graphed(lambda o=o, act=act: tk.expert_ffn_triton(
                        x, rw, cu, weights, out=o, config=committed, act=act, padded=False, row_ends=ends,
                        zero_tail=False))
                ref = outs["committed"]
                mask = torch.zeros(nvs, dtype=torch.bool, device=dev)
                st = torch.cat([cu_h.new_zeros(1), cu_h[:-1]])
                for s0, r in zip(st.tolist(), real.tolist()):
                    mask[s0:s0 + r] = True
                mr = 2 if maxr <= 2 else (4 if maxr <= 4 else 8)
                gu_cfgs = [dict(BN=bn, BK=bk, MR=mr, w=wp) for bn in (4, 8, 16) for bk in (256, 512) for wp in (4,)
                           if mr * 2 * bn * bk // (32 * wp) <= 128]
                dn_cfgs = [dict(BN=bn, BK=bk, MR=mr, w=4) for bn in (8, 16, 32) for bk in (128, 256)
                           if mr * bn * bk // 128 <= 128]
                dot_gu = [dict(BN=bn, BK=bk, MR=16, w=4, DOT=True, st=1) for bn in (8, 16, 32) for bk in (128, 256)]
                dot_dn = [dict(BN=bn, BK=bk, MR=16, w=4, DOT=True, st=1) for bn in (16, 32, 64) for bk in (128, 256)]
                act2 = torch.empty(nvs, I, device=dev, dtype=x.dtype)

                sync = torch.zeros(2 + G, dtype=torch.int32, device=dev)

                def make(cg, cd, o):
                    if cg.get("one"):
                        return lambda: launch_fused(x, rw, cu, ends, w13, down, act2, o, sync, I, H, cg, cd,
                                                    sms * cg["one"])
                    ng, nd = grid(cg, bound, I, sms), grid(cd, bound, H, sms)
                    return lambda: (launch(x, rw, cu, ends, w13, act2, I, H, cg, True, ng),
                                    launch(act2, rw, cu, ends, down, o, H, I, cd, False, nd))

                # stage 1: each kernel's configs alone (gate/up with the first down; down with the best gate/up)
                cands = {}
                for fam, gus, dns in [f for f in (("gemv", gu_cfgs, dn_cfgs), ("dot", dot_gu, dot_dn))
                                      if f[0] in os.environ.get("FAMS", "gemv,dot").split(",")]:
                    best = None
                    for cg in gus:
                        o = torch.full_like(x, float("nan"))
                        try:
                            f = make(cg, dns[0], o)
                            f()
                            tt = _bench(_graphed(f)[0], rep=10) * 1e3
                        except Exception as ex:
                            print(f"#  {fam} gu {cg} failed {type(ex).__name__} {str(ex)[:100]}")
                            continue
                        if best is None or tt < best[0]:
                            best = (tt, cg)
                    if best is None:
                        continue
                    bg = best[1]
                    bestd = None
                    for cd in dns:
                        o = torch.full_like(x, float("nan"))
                        try:
                            f = make(bg, cd, o)
                            f()
                            tt = _bench(_graphed(f)[0], rep=10) * 1e3
                        except Exception as ex:
                            print(f"#  {fam} dn {cd} failed {type(ex).__name__} {str(ex)[:100]}")
                            continue
                        if bestd is None or tt < bestd[0]:
                            bestd = (tt, cd)
                    cands[fam] = (bg, bestd[1])
                    # persistent variant of the best
                    cands[fam + "_p2"] = (dict(bg, pps=2), dict(bestd[1], pps=2))
                    for pps in (4, 8):
                        cands[f"{fam}_one{pps}"] = (dict(bg, one=pps), bestd[1])
                # the shipped one launch with small tiles, few stages and many programs per SM
                for bn1, bn2, stg, pps in ((16, 32, 2, 4), (16, 32, 1, 8), (8, 16, 2, 4), (8, 16, 1, 8))[:int(os.environ.get("TINY", "4"))]:
                    conf = {"gate_up": {"BM": 16, "BN": bn1, "BK": 256, "num_warps": 4, "num_stages": stg},
                            "down": {"BM": 16, "BN": bn2, "BK": 256, "num_warps": 4, "num_stages": stg},
                            "fused": {"num_warps": 4, "num_stages": stg, "progs_per_sm": pps}}
                    o = torch.full_like(x, float("nan"))
                    a3 = torch.empty(nvs, I, device=dev, dtype=x.dtype)
                    f = (lambda conf=conf, o=o, a3=a3: tk.expert_ffn_triton(
                        x, rw, cu, weights, out=o, config=conf, act=a3, padded=False, row_ends=ends, zero_tail=False))
                    try:
                        f()
                        torch.cuda.synchronize()
                        outs[f"tiny{bn1}_{bn2}_s{stg}_p{pps}"] = o
                        fns[f"tiny{bn1}_{bn2}_s{stg}_p{pps}"] = _graphed(f)
                    except Exception as ex:
                        print(f"#  tiny {bn1} {bn2} failed {type(ex).__name__} {str(ex)[:100]}")
                for name, (cg, cd) in cands.items():
                    o = torch.full_like(x, float("nan"))
                    f = make(cg, cd, o)
                    f()
                    torch.cuda.synchronize()
                    outs[name] = o
                    fns[name] = _graphed(f)
                times = alternated_times(list(fns), lambda k: _bench(fns[k][0], rep=20) * 1e3, rounds)
                med = {k: statistics.median(v) for k, v in times.items()}
                line = f"{sname} t={tokens} {routing} rows={n} maxreal={maxr} committed {med['committed']:.1f}"
                for k in fns:
                    if k == "committed":
                        continue
                    got, refm = outs[k][mask].float(), ref[mask].float()
                    err = ((got - refm).norm() / refm.norm()).item()
                    nan = int(torch.isnan(outs[k][mask]).sum())
                    pr = pooled_ratio(times[k], times["committed"], times["control"]) if k != "control" else float("nan")
                    line += f" | {k} {med[k]:.1f} x{med[k] / med['committed']:.3f} (pooled {pr:.3f}) err {err:.1e} nan {nan}"
                print(line, flush=True)
                for k, (cg, cd) in cands.items():
                    print(f"#   {k}: gu {cg} dn {cd}")
                del fns
        del weights, w13, down
        tk._CACHE.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
