"""``moonep-balance``: how much MoonEP's plan evens out skewed routing, on real ranks.

For several routing skews, every rank routes its tokens with the skewed-routing generator and
dispatches through the built-in engine. The report compares, rank against rank, what each rank
would compute without redundancy (all rows of its home experts) with what it computes under the
plan: the rows the expert compute runs (the real rows, exactly S*K on every rank, plus each
segment's padding to the token padding) and the measured time of that expert compute; it counts
the prefetch slots the plan used.

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
import statistics
import textwrap
import time

import torch
import torch.distributed as dist

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn, interleave_gate_up, resolve_impl
from vllm_moonep.common.layout import WEIGHT_TILE
from vllm_moonep.engine import Buffer, current_cuda_device
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING
from vllm_moonep.testing.launch import (add_launch_arguments, finish_launched_group, is_driver, launched_world_size,
                                        resolve_launch, run_on_ranks, shutdown_pools)
from vllm_moonep.testing.routing import maxvio, route, sigma_for_maxvio
from vllm_moonep.tools.cli import positive

#: untimed runs of each expert compute before the timed ones
WARMUP_RUNS = 3


def home_rows_cu(tpe_all: torch.Tensor, rank: int, num_slots: int, token_padding: int) -> torch.Tensor:
    """``cu_seqlens [E+B]`` of the expert compute ``rank`` runs without the plan: every row routed
    to one of its home experts (all ranks' tokens), each expert's segment padded to
    ``token_padding``, no slot rows."""
    R, E = tpe_all.shape
    epn = E // R
    seg = torch.zeros(E + num_slots, dtype=torch.int64)
    home = tpe_all.sum(0)[rank * epn:(rank + 1) * epn].long()
    seg[rank * epn:(rank + 1) * epn] = (home + token_padding - 1) // token_padding * token_padding
    return seg.cumsum(0).to(torch.int32)


def time_expert_compute(x: torch.Tensor, route_w: torch.Tensor, cu: torch.Tensor, weights: GroupedWeights, impl: str,
                        repeats: int) -> float:
    """Median seconds of ``expert_ffn`` over ``repeats`` runs after ``WARMUP_RUNS`` untimed ones
    (device-synchronized): the first runs in a process pay for allocation and cold caches."""
    out = torch.empty_like(x)

    def run() -> None:
        expert_ffn(x, route_w, cu, weights, impl=impl, out=out)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)

    for _ in range(WARMUP_RUNS):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank_balance(S, H, I, K, E, B, sigma, seed, device_kind="cpu", repeats=10):
    r, R = dist.get_rank(), dist.get_world_size()
    dev = current_cuda_device() if device_kind == "cuda" else torch.device("cpu")
    buf = Buffer(S, H, K, E, R, B=B, token_padding=DEFAULT_TOKEN_PADDING, device=dev)
    ids, w = route(S, E, K, sigma=sigma, seed=seed, rank=r)
    g = torch.Generator().manual_seed(seed * 7919 + r)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    hidden, wn, cu, plan = buf.dispatch(x.to(dev), w.to(dev), ids.to(dev), tpe.to(dev))
    gp = plan.global_plan
    tpe_all, seg_len = gp.tpe.cpu(), gp.seg_len.cpu()
    home_rows = tpe_all.sum(0).view(R, -1).sum(1)
    # the expert compute of this rank's rows: the product's grouped GEMM (impl=auto) over random
    # expert weights of every group (timing does not depend on their values), stored as the symmetric
    # layout stores them (w13 interleaved)
    gw = torch.Generator().manual_seed(seed + 1)
    gate, up, down = ((torch.randn(E + B, *shape, generator=gw) / shape[-1] ** 0.5).to(torch.bfloat16).to(dev)
                      for shape in ((I, H), (I, H), (H, I)))
    weights = GroupedWeights.of_w13(interleave_gate_up(gate, up), down, interleaved=True)
    del gate, up
    cu_home = home_rows_cu(tpe_all, r, B, DEFAULT_TOKEN_PADDING).to(dev)
    n_home = int(cu_home[-1])
    x_home = torch.randn(n_home, H, generator=g).to(torch.bfloat16).to(dev)
    w_home = torch.rand(n_home, generator=g).to(dev)
    n_plan = int(cu[-1])  # the rows past it are undefined and never read (the Triton kernels skip them)
    used = resolve_impl("auto", hidden, weights)  # the product's default choice on this device
    times = {}
    for turn in range(R):  # one rank at a time: ranks sharing cores or a GPU do not slow each other
        if turn == r:
            times["no plan"] = time_expert_compute(x_home, w_home, cu_home, weights, used, repeats)
            times["moonep"] = time_expert_compute(hidden[:n_plan], wn[:n_plan], cu, weights, used, repeats)
        dist.barrier()
    out = {
        "rows_with_plan": int(seg_len[r].sum()),
        "rows_without_plan": int(home_rows[r]),
        "padded_rows": n_plan,
        "padded_rows_without_plan": n_home,
        "expert_s_without_plan": times["no plan"],
        "expert_s_with_plan": times["moonep"],
        "impl": used,
        "slots_used": int((plan.experts_to_copy[r] >= 0).sum()),
        "maxvio": maxvio(tpe_all),
    }
    buf.destroy()
    return out


def max_over_mean(values) -> float:
    """``max / mean`` of per-rank figures (1.0 when they are all zero)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def report(ranks: int, tokens: int, experts: int, topk: int, hidden: int, maxvios, seed: int, *,
           intermediate: int = 256, repeats: int = 10, device: str = "cpu", backend: str = "auto",
           share_gpus: bool = False) -> list[dict]:
    """One row per requested skew; the ranks run as ``launch.resolve_launch`` says (``ValueError`` if they cannot).

    Each row keeps every rank's raw figures (``per_rank``) beside the max/mean ratios."""
    launch = resolve_launch(device, ranks, backend, share_gpus)
    spawn = dict(env=launch.env, backend=launch.backend, device=launch.device)
    rows = []
    for target in maxvios:
        sigma = sigma_for_maxvio(target, experts, topk, tokens * ranks, seed=seed)
        res = run_on_ranks(ranks, _rank_balance, tokens, hidden, intermediate, topk, experts, experts // ranks, sigma,
                           seed, device, repeats, **spawn)
        rows.append({
            "target_maxvio": target,
            "maxvio": res[0]["maxvio"],
            "sigma": sigma,
            "imbalance_without_plan": max_over_mean(r["rows_without_plan"] for r in res),
            "padded_imbalance_with_plan": max_over_mean(r["padded_rows"] for r in res),
            "expert_time_imbalance_without_plan": max_over_mean(r["expert_s_without_plan"] for r in res),
            "expert_time_imbalance_with_plan": max_over_mean(r["expert_s_with_plan"] for r in res),
            "slowest_expert_s_without_plan": max(r["expert_s_without_plan"] for r in res),
            "slowest_expert_s_with_plan": max(r["expert_s_with_plan"] for r in res),
            "impl": res[0]["impl"],
            "slots_used": sum(r["slots_used"] for r in res),
            "slots_total": ranks * (experts // ranks),
            "per_rank": res,
        })
    return rows


LEGEND = """requested / achieved maxvio: the routing skew asked for and the one the sampled routing had (max/mean tokens per
  expert - 1 over all ranks; 0 = even). Every other column compares the ranks (max over ranks / mean over ranks),
  without the plan (each rank computes all rows of its own experts) and under MoonEP's plan. rows, no plan: rows
  routed to each rank's experts. padded rows, MoonEP: the rows each rank's expert compute runs under the plan
  (cu_seqlens[-1]: its S*K real rows, the same on every rank by construction, plus each expert segment's padding to
  128 rows). expert time: the measured time of one expert compute (the product's grouped GEMM, impl=auto, named
  below the table) on each rank's rows, without the plan (its home experts' rows, padded the same way) and under it
  (the rows dispatch delivered, up to cu_seqlens[-1]); each rank is timed alone, the median of --repeats runs. slowest expert ms: the
  slowest rank's expert time, without -> with the plan. slots used: prefetch slots the plan filled, all ranks
  together / the slots there are (B = E/R per rank)."""


def format_report(rows: list[dict], ranks: int, tokens: int, experts: int, topk: int, *, device: str = "cpu",
                  backend: str = "gloo") -> str:
    where = "CPU" if device == "cpu" else "GPU"
    lines = [f"MoonEP balance: {ranks} {where} ranks ({backend}), {tokens} tokens/rank, E={experts}, top-{topk}",
             f"{'maxvio requested':>16} {'achieved':>8} {'rows, no plan':>13} {'padded rows, MoonEP':>19} "
             f"{'expert time, no plan':>20} {'expert time, MoonEP':>19} {'slowest expert ms':>19} {'slots used':>11}"]
    for r in rows:
        ms = f"{r['slowest_expert_s_without_plan'] * 1e3:.2f} -> {r['slowest_expert_s_with_plan'] * 1e3:.2f}"
        lines.append(f"{r['target_maxvio']:16.2f} {r['maxvio']:8.2f} {r['imbalance_without_plan']:13.2f} "
                     f"{r['padded_imbalance_with_plan']:19.2f} {r['expert_time_imbalance_without_plan']:20.2f} "
                     f"{r['expert_time_imbalance_with_plan']:19.2f} {ms:>19} {r['slots_used']:>5}/{r['slots_total']:<5}")
    impls = sorted({r["impl"] for r in rows})
    return "\n".join(lines + [f"expert compute: impl={', '.join(impls)}", "", LEGEND])


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
    ap.add_argument("--hidden", type=positive("--hidden"), default=128,
                    help="hidden size H of the dispatched rows and the experts, a multiple of 128 (default: %(default)s)")
    ap.add_argument("--intermediate", type=positive("--intermediate"), default=256,
                    help="intermediate size I of the experts whose compute is timed, a multiple of 128 "
                         "(default: %(default)s)")
    ap.add_argument("--repeats", type=positive("--repeats"), default=10,
                    help="timed runs of each rank's expert compute; the median is reported (default: %(default)s)")
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
    for flag, v in (("--hidden", a.hidden), ("--intermediate", a.intermediate)):
        if v % WEIGHT_TILE:
            ap.error(f"{flag} {v} is not a multiple of {WEIGHT_TILE} (MoonEP's expert weights are tiled by {WEIGHT_TILE})")
    try:
        launch = resolve_launch(a.device, ranks, a.backend, a.share_gpus)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        rows = report(ranks, a.tokens, a.experts, a.topk, a.hidden, a.maxvio, a.seed, intermediate=a.intermediate,
                      repeats=a.repeats, device=a.device, backend=a.backend, share_gpus=a.share_gpus)
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
