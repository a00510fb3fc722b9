"""``moonep-balance``: how much MoonEP's plan evens out skewed routing, on real ranks.

For several routing skews, every rank routes its tokens with the skewed-routing generator and
dispatches through the built-in engine. The report compares the rows each rank would compute
without redundancy (all rows of its home experts) with the rows it computes under the plan
(always exactly S*K), and counts the prefetch slots the plan used.

maxvio (the skew) = max over experts of the tokens routed to the expert / the mean over experts - 1,
counted over every rank's tokens of the step: 0 is perfectly even routing, 1 means the busiest
expert gets twice the mean. A requested value sets the routing generator's spread; the achieved
value is what the sampled routing had (random routing is never perfectly even, so a requested 0
comes out above 0, and top-k without replacement caps it at E/k - 1).

Ranks: CPU processes over gloo (default), one GPU per rank over NCCL (--device cuda), or the
processes of a torchrun launch (torchrun --nproc-per-node 2 -m vllm_moonep.tools.balance --device cuda).
"""

from __future__ import annotations

import argparse
import textwrap

import torch
import torch.distributed as dist

from vllm_moonep.engine import Buffer, current_cuda_device
from vllm_moonep.testing.launch import (add_launch_arguments, finish_launched_group, is_driver, launched_world_size,
                                        resolve_launch, run_on_ranks, shutdown_pools)
from vllm_moonep.testing.routing import maxvio, route, sigma_for_maxvio
from vllm_moonep.tools.cli import positive


def _rank_balance(S, H, K, E, B, sigma, seed, device_kind="cpu"):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = current_cuda_device() if device_kind == "cuda" else torch.device("cpu")
    buf = Buffer(S, H, K, E, R, B=B, token_padding=128, device=dev)
    ids, w = route(S, E, K, sigma=sigma, seed=seed, rank=r)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    _, wn, cu, plan = buf.dispatch(x.to(dev), w.to(dev), ids.to(dev), tpe.to(dev))
    gp = plan.global_plan
    tpe_all, seg_len = gp.tpe.cpu(), gp.seg_len.cpu()
    home_rows = tpe_all.sum(0).view(R, -1).sum(1)
    out = {
        "rows_with_plan": int(seg_len[r].sum()),
        "rows_without_plan": int(home_rows[r]),
        "slots_used": int((plan.experts_to_copy[r] >= 0).sum()),
        "maxvio": maxvio(tpe_all),
        "padded_rows": int(cu[-1]),
    }
    buf.destroy()
    return out


def report(ranks: int, tokens: int, experts: int, topk: int, hidden: int, maxvios, seed: int, *,
           device: str = "cpu", backend: str = "auto", share_gpus: bool = False) -> list[dict]:
    """One row per requested skew; the ranks run as ``launch.resolve_launch`` says (``ValueError`` if they cannot)."""
    launch = resolve_launch(device, ranks, backend, share_gpus)
    spawn = dict(env=launch.env, backend=launch.backend, device=launch.device)
    rows = []
    for target in maxvios:
        sigma = sigma_for_maxvio(target, experts, topk, tokens * ranks, seed=seed)
        res = run_on_ranks(ranks, _rank_balance, tokens, hidden, topk, experts, experts // ranks, sigma, seed, device,
                           **spawn)
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


LEGEND = """\
requested / achieved maxvio: the routing skew asked for and the one the sampled routing had (max/mean tokens per
  expert - 1 over all ranks; 0 = even). max/mean rows: rows of the busiest rank over the mean rank, without the plan
  (each rank computes all rows of its own experts) and under MoonEP's plan (every rank computes exactly S*K rows, so
  1.00). slots used: prefetch slots the plan filled, all ranks together / the slots there are (B = E/R per rank)."""


def format_report(rows: list[dict], ranks: int, tokens: int, experts: int, topk: int, *, device: str = "cpu",
                  backend: str = "gloo") -> str:
    where = "CPU" if device == "cpu" else "GPU"
    lines = [f"MoonEP balance: {ranks} {where} ranks ({backend}), {tokens} tokens/rank, E={experts}, top-{topk}",
             f"{'maxvio requested':>16} {'achieved':>8} {'max/mean rows, no plan':>23} {'max/mean rows, MoonEP':>22} "
             f"{'slots used':>11}"]
    for r in rows:
        lines.append(f"{r['target_maxvio']:16.2f} {r['maxvio']:8.2f} {r['imbalance_without_plan']:23.2f} "
                     f"{r['imbalance_with_plan']:22.2f} {r['slots_used']:>5}/{r['slots_total']:<5}")
    return "\n".join(lines + ["", LEGEND])


def _skew(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {v!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is even routing), got {v}")
    return x


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(
        prog="moonep-balance", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join(textwrap.fill(p.replace("``", "").replace("\n", " "), 100) for p in doc[:3]),
        epilog="Columns:\n" + LEGEND)
    ap.add_argument("--ranks", type=positive("--ranks"), default=None,
                    help="rank processes (EP size); must divide --experts (default: 4, or the launched world size "
                         "under torchrun)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the ranks run: cpu (gloo) or cuda (one GPU per rank over NCCL) (default: %(default)s)")
    add_launch_arguments(ap)
    ap.add_argument("--tokens", type=positive("--tokens"), default=256, help="tokens per rank (default: %(default)s)")
    ap.add_argument("--experts", type=positive("--experts"), default=64, help="routed experts E (default: %(default)s)")
    ap.add_argument("--topk", type=positive("--topk"), default=8, help="experts per token, at most --experts (default: %(default)s)")
    ap.add_argument("--hidden", type=positive("--hidden"), default=128, help="hidden size of the dispatched rows (default: %(default)s)")
    ap.add_argument("--maxvio", type=_skew, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 3.0],
                    help="routing skews to request (see above); one row each (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the routing and the tokens (default: %(default)s)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    ranks = a.ranks if a.ranks is not None else (launched_world_size() or 4)
    if a.experts % ranks:
        ap.error(f"--ranks {ranks} does not divide --experts {a.experts} (MoonEP gives every rank E/R experts)")
    if a.topk > a.experts:
        ap.error(f"--topk {a.topk} exceeds --experts {a.experts}")
    try:
        launch = resolve_launch(a.device, ranks, a.backend, a.share_gpus)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        rows = report(ranks, a.tokens, a.experts, a.topk, a.hidden, a.maxvio, a.seed, device=a.device,
                      backend=a.backend, share_gpus=a.share_gpus)
    finally:
        shutdown_pools()
        finish_launched_group()
    if is_driver():
        print(format_report(rows, ranks, a.tokens, a.experts, a.topk, device=a.device, backend=launch.backend))
        if launch.device == "cuda" and launch.backend != "nccl":
            print(f"NOTE: {launch.note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
