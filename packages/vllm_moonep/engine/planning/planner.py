"""The MoonEP planner: who computes which token slots, and where each row lands.

Every rank runs the same function on the same all-gathered ``tokens_per_expert`` table and gets
the same plan. The rules are those of ``docs/CONTRACT.md`` ("The planner"); this module is
their direct, vectorized transcription. All loops are bounded by the problem's dimensions, never
by data, so on a GPU the whole plan is a fixed sequence of kernels with no host synchronization.

Notation: ``R`` ranks, ``E`` experts, ``epn = E // R``, ``B`` slots per rank, ``tp`` token padding,
``CAP = S*K`` rows every rank computes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["GlobalPlan", "padding_rows", "plan_global", "place_entries", "rank_quotas", "split_quotas"]


def _first_index_of(values: torch.Tensor, target: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Smallest index along ``dim`` where ``values == target`` (``target`` broadcast over dim)."""
    n = values.shape[dim]
    shape = [1] * values.dim()
    shape[dim] = n
    idx = torch.arange(n, device=values.device).view(shape)
    hit = values == target.unsqueeze(dim)
    return torch.where(hit, idx, n).amin(dim=dim)


def rank_quotas(balance: torch.Tensor, early_exit: bool = False) -> torch.Tensor:
    """Rule 2: rank-to-rank quotas ``z[h, u]`` (rows ``h`` send to ``u``) from ``balance[R]``.

    Each round the most over-full rank fills the most under-full one in one shot (ties: the
    smallest index). A round zeroes the receiver's balance, so at most ``R - 1`` rounds do work;
    the remaining rounds are masked no-ops.
    """
    R = balance.numel()
    bal = balance.to(torch.int64).clone()
    z = torch.zeros(R, R, dtype=torch.int64, device=bal.device)
    ar = torch.arange(R, device=bal.device)
    for _ in range(max(R - 1, 0)):
        mx = bal.amax()
        if early_exit and int(mx) <= 0:  # host tensors: stopping costs nothing
            break
        mn = bal.amin()
        h = _first_index_of(bal, mx, dim=0)
        u = _first_index_of(bal, mn, dim=0)
        delta = torch.where(mx > 0, mn, torch.zeros_like(mn))  # <= 0
        oh_h = (ar == h).to(torch.int64)
        oh_u = (ar == u).to(torch.int64)
        z -= delta * oh_h[:, None] * oh_u[None, :]
        bal += delta * oh_h - delta * oh_u
    return z


def split_quotas(count: torch.Tensor, z: torch.Tensor, epn: int, early_exit: bool = False) -> torch.Tensor:
    """Rule 3: split each home's quotas over its experts; returns ``alloc[E, R]``.

    ``alloc[e, d]`` is how many of expert ``e``'s rows rank ``d`` computes. All homes run in
    parallel. Each round zeroes a quota entry or an expert's remainder, so ``R - 1 + epn`` rounds
    bound the work (a home's total quota never exceeds its rows).
    """
    R = z.shape[0]
    dev = count.device
    rem = count.to(torch.int64).view(R, epn).clone()
    quota = z.clone()
    moved = torch.zeros(R, epn, R, dtype=torch.int64, device=dev)
    ar_r = torch.arange(R, device=dev)
    ar_e = torch.arange(epn, device=dev)
    for _ in range(R - 1 + epn):
        qmax = quota.amax(dim=1)
        if early_exit and int(qmax.max()) <= 0:
            break
        d = _first_index_of(quota, qmax, dim=1)
        rmax = rem.amax(dim=1)
        le = _first_index_of(rem, rmax, dim=1)
        take = torch.where(qmax > 0, torch.minimum(rmax, qmax), torch.zeros_like(qmax))
        oh_d = (ar_r[None, :] == d[:, None]).to(torch.int64)
        oh_le = (ar_e[None, :] == le[:, None]).to(torch.int64)
        rem -= take[:, None] * oh_le
        quota -= take[:, None] * oh_d
        moved += take[:, None, None] * oh_le[:, :, None] * oh_d[:, None, :]
    alloc = moved.view(R * epn, R)
    home = torch.arange(R * epn, device=dev) // epn
    alloc[torch.arange(R * epn, device=dev), home] += rem.view(-1)
    return alloc


@dataclass(frozen=True)
class GlobalPlan:
    """The part of the plan every rank computes identically (all tensors on one device, each
    contiguous: kernels read them by raw pointer).

    Attributes:
        tpe: ``[R, E]`` all-gathered tokens per expert (int64).
        alloc: ``[E, R]`` rows of expert ``e`` computed on rank ``d``.
        experts_to_copy: ``[R, B]`` int32, global expert in each slot, ``-1`` unused.
        seg_len: ``[R, E+B]`` real rows of each segment on each rank.
        cu_seqlens: ``[R, E+B]`` inclusive padded segment ends (int64).
        row_base: ``[E, R]`` first row of expert ``e``'s segment on rank ``d``.
        ordinal_base: ``[R, E]`` global ordinal of rank ``r``'s first entry of expert ``e``.
        cum_alloc: ``[E, R]`` cumulative ``alloc`` over ranks.
    """

    tpe: torch.Tensor
    alloc: torch.Tensor
    experts_to_copy: torch.Tensor
    seg_len: torch.Tensor
    cu_seqlens: torch.Tensor
    row_base: torch.Tensor
    ordinal_base: torch.Tensor
    cum_alloc: torch.Tensor

    def to(self, device: torch.device) -> "GlobalPlan":
        """The same plan with every table on ``device``."""
        return GlobalPlan(*(getattr(self, f.name).to(device).contiguous() for f in fields(self)))

    def flows(self) -> torch.Tensor:
        """``[R_src, R_dst]`` rows each rank sends to each rank (from the tables alone)."""
        lo = self.ordinal_base  # [R, E]
        hi = lo + self.tpe
        cum_hi = self.cum_alloc.T  # [R_dst, E]
        cum_lo = cum_hi - self.alloc.T
        a = torch.maximum(lo[:, None, :], cum_lo[None, :, :])
        b = torch.minimum(hi[:, None, :], cum_hi[None, :, :])
        return (b - a).clamp_min(0).sum(dim=2)


def plan_global(tpe: torch.Tensor, S: int, K: int, B: int, token_padding: int) -> GlobalPlan:
    """Rules 1 to 4 from the all-gathered ``tpe[R, E]``.

    On CPU tensors the bounded loops stop as soon as no work is left (reading a host value is
    free); on a device they run their full bound, so the plan needs no host synchronization.
    The built-in engine plans on the host (one small ``[R, E]`` read per step, which it needs
    anyway for the transfer sizes): at full size (E=384) the device version is launch-bound.
    """
    early_exit = tpe.device.type == "cpu"
    R, E = tpe.shape
    epn = E // R
    dev = tpe.device
    tpe = tpe.to(torch.int64)
    count = tpe.sum(dim=0)  # [E]
    group = count.view(R, epn).sum(dim=1)
    cap = S * K
    z = rank_quotas(group - cap, early_exit)
    alloc = split_quotas(count, z, epn, early_exit)

    # Rule 4: slots of each destination, by (alloc, e) descending.
    e_ids = torch.arange(E, device=dev)
    home = e_ids // epn
    ar_r = torch.arange(R, device=dev)
    remote = (alloc > 0) & (home[:, None] != ar_r[None, :])
    key = torch.where(remote, alloc * E + e_ids[:, None], torch.full_like(alloc, -1))
    nb = min(B, E)
    top_key, top_e = key.topk(nb, dim=0, largest=True, sorted=True)  # [nb, R]
    # [R, nb], laid out row-major: a transposed view here stayed column-major through .to(int32)
    # and .to(device), and the prefetch kernel reads ``experts_to_copy[rank]`` as contiguous ids
    etc = torch.where(top_key >= 0, top_e, torch.full_like(top_e, -1)).T.contiguous()
    if nb < B:
        etc = torch.cat([etc, torch.full((R, B - nb), -1, dtype=etc.dtype, device=dev)], dim=1)
    # slot_of[e, d]: the slot holding e on d, or -1
    slot_of = torch.full((E + 1, R), -1, dtype=torch.int64, device=dev)
    b_ids = torch.arange(B, device=dev).expand(R, B)
    d_ids = ar_r[:, None].expand(R, B)
    slot_of[torch.where(etc >= 0, etc, E), d_ids] = torch.where(etc >= 0, b_ids, -1)
    slot_of = slot_of[:E]

    seg_len = torch.zeros(R, E + B, dtype=torch.int64, device=dev)
    seg_len[:, :E] = torch.where(slot_of >= 0, 0, alloc).T
    slot_rows = torch.where(etc >= 0, alloc[etc.clamp_min(0), d_ids], 0)
    seg_len[:, E:] = slot_rows
    padded = torch.where(seg_len > 0, (seg_len + token_padding - 1) // token_padding * token_padding, 0)
    cu = padded.cumsum(dim=1)
    start = cu - padded
    group_of = torch.where(slot_of >= 0, E + slot_of, e_ids[:, None])  # [E, R]
    row_base = start.T.gather(0, group_of)  # start.T is [E+B, R]

    ordinal_base = tpe.cumsum(dim=0) - tpe  # [R, E]
    cum_alloc = alloc.cumsum(dim=1)
    return GlobalPlan(
        tpe=tpe,
        alloc=alloc,
        experts_to_copy=etc.to(torch.int32),
        seg_len=seg_len,
        cu_seqlens=cu,
        row_base=row_base,
        ordinal_base=ordinal_base,
        cum_alloc=cum_alloc,
    )


def padding_rows(gp: GlobalPlan, rank: int, token_padding: int) -> torch.Tensor:
    """Rows of ``rank``'s shard that are segment padding (each non-empty segment's tail up to a
    multiple of ``token_padding``), int64, ascending; from the host plan."""
    seg = gp.seg_len[rank].to(torch.int64).cpu()
    cu = gp.cu_seqlens[rank].to(torch.int64).cpu()
    padded = torch.where(seg > 0, (seg + token_padding - 1) // token_padding * token_padding, 0)
    lens = padded - seg
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.repeat_interleave(cu - padded + seg, lens)
    within = torch.arange(total) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return first + within


def place_entries(gp: GlobalPlan, rank: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 5: destination rank and row for each of ``rank``'s flat entries ``ids[S*K]``."""
    ids = ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    local_counts = gp.tpe[rank]
    local_start = local_counts.cumsum(0) - local_counts
    within = torch.arange(n, device=ids.device) - local_start[sorted_ids]
    ordinal = torch.empty_like(ids)
    ordinal[order] = within + gp.ordinal_base[rank, sorted_ids]
    cum = gp.cum_alloc[ids]  # [n, R]
    dest = (cum <= ordinal[:, None]).sum(dim=1)
    prev = torch.where(dest > 0, cum.gather(1, (dest - 1).clamp_min(0)[:, None]).squeeze(1), 0)
    row = gp.row_base[ids, dest.clamp_max(gp.alloc.shape[1] - 1)] + ordinal - prev
    return dest, row
