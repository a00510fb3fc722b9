"""``moonep-balance``: how much MoonEP's plan evens out skewed routing, on real CPU ranks.

For several maxvio values, every rank routes its tokens with the skewed-routing generator and
dispatches through the built-in engine. The report compares the rows each rank would compute
without redundancy (all rows of its home experts) with the rows it computes under the plan
(always exactly S*K), and counts the prefetch slots the plan used.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from vllm_moonep.common.routing import maxvio, route, sigma_for_maxvio
from vllm_moonep.engine import Buffer
from vllm_moonep.tools.launch import run_on_ranks, shutdown_pools


def _rank_balance(S, H, K, E, B, sigma, seed):
    r, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(S, H, K, E, R, B=B, token_padding=128, device="cpu")
    ids, w = route(S, E, K, sigma=sigma, seed=seed, rank=r)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    _, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
    gp = plan.global_plan
    home_rows = gp.tpe.sum(0).view(R, -1).sum(1)
    out = {
        "rows_with_plan": int(gp.seg_len[r].sum()),
        "rows_without_plan": int(home_rows[r]),
        "slots_used": int((plan.experts_to_copy[r] >= 0).sum()),
        "maxvio": maxvio(gp.tpe),
        "padded_rows": int(cu[-1]),
    }
    buf.destroy()
    return out


def report(ranks: int, tokens: int, experts: int, topk: int, hidden: int, maxvios, seed: int) -> list[dict]:
    rows = []
    for target in maxvios:
        sigma = sigma_for_maxvio(target, experts, topk, tokens * ranks, seed=seed)
        res = run_on_ranks(ranks, _rank_balance, tokens, hidden, topk, experts, experts // ranks, sigma, seed)
        without = [r["rows_without_plan"] for r in res]
        with_plan = [r["rows_with_plan"] for r in res]
        mean = sum(with_plan) / ranks
        rows.append({
            "target_maxvio": target,
            "maxvio": res[0]["maxvio"],
            "sigma": sigma,
            "imbalance_without_plan": max(without) / mean,
            "imbalance_with_plan": max(with_plan) / mean,
            "slots_used": sum(r["slots_used"] for r in res),
            "slots_total": ranks * (experts // ranks),
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moonep-balance", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 3.0])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        rows = report(a.ranks, a.tokens, a.experts, a.topk, a.hidden, a.maxvio, a.seed)
    finally:
        shutdown_pools()
    print(f"MoonEP balance: {a.ranks} CPU ranks, {a.tokens} tokens/rank, E={a.experts}, top-{a.topk}")
    print(f"{'maxvio':>7} {'max/mean rows, no plan':>23} {'max/mean rows, MoonEP':>22} {'slots used':>11}")
    for r in rows:
        print(f"{r['maxvio']:7.2f} {r['imbalance_without_plan']:23.2f} {r['imbalance_with_plan']:22.2f} "
              f"{r['slots_used']:>5}/{r['slots_total']:<5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
