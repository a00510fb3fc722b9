"""The collective transport: rows move by ``torch.distributed`` all-to-all, planned on the host.

Works wherever ``torch.distributed`` works (gloo on CPU, NCCL on GPUs, across nodes) and holds
nothing between steps: every tensor is sized by the step's plan. The transport of CPU ranks
and of groups whose ranks are each alone on their node::

    dispatch:  plan on the host (all-gather the counts: ``planning/host_plan.py``)
               -> place own entries (dest, row), sorted by (dest, row): each peer's rows are
                  one contiguous, already ordered slice
               -> all_to_all(meta: row, weight) and all_to_all(hidden) with the plan's splits
               -> the shard: used rows zeroed (padding reads 0), received rows put at their row
    combine:   each received row's output back to its source by all_to_all (splits reversed)
               -> acc[entry] = fp32 row; out[t] = bf16(sum_k acc[t*K + k])

Every collective goes through the buffer's ``BoundedCollectives`` (bounded, names the late peer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_moonep.engine.errors import MoonEPStateError
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.planning.planner import GlobalPlan, place_entries
from vllm_moonep.engine.transports.base import Dispatched, HostPlannedTransport, sum_entries

__all__ = ["CollectiveStep", "CollectiveTransport"]


@dataclass
class CollectiveStep:
    """What dispatch leaves for combine: which local entry went where, and which shard row came from whom."""

    step: int
    send_order: torch.Tensor  # local flat entries, by (dest, row)
    send_splits: list[int]
    recv_splits: list[int]
    recv_rows: torch.Tensor  # shard row of each received entry


class CollectiveTransport(HostPlannedTransport):
    """Rows of one ``Buffer`` by all-to-all over its ``collectives`` (see the module doc).

    Args: ``collectives`` (the buffer's bounded collectives over the EP group), the buffer's shape
    (``S, K, E, B, H, NvS, token_padding``), ``dtype`` of the rows, ``device``.
    """

    name = "collective"

    def __init__(self, collectives: BoundedCollectives, *, S: int, K: int, E: int, B: int, H: int, NvS: int,
                 token_padding: int, dtype: torch.dtype, device: torch.device) -> None:
        self.coll = collectives
        self.rank = collectives.rank
        self.S, self.K, self.E, self.B, self.H, self.NvS, self.tp = S, K, E, B, H, NvS, token_padding
        self.dtype, self.device = dtype, device

    def dispatch(self, hidden: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor,
                 plan: GlobalPlan | None, num_tokens: int | None, step: int) -> Dispatched:
        if plan is None:  # not reachable: the Buffer passes what plan() returned
            raise MoonEPStateError("the collective transport's dispatch needs the host plan")
        tr, rank = self.coll, self.rank
        gp_host = plan
        gp = gp_host if self.device.type == "cpu" else gp_host.to(self.device)
        dest, row = place_entries(gp, rank, ids)
        # local entries in (destination, row) order: rows reach each peer already sorted
        send_order = torch.argsort(dest * self.NvS + row, stable=True)
        flows = gp_host.flows()  # [src, dst]
        send_splits, recv_splits = flows[rank].tolist(), flows[:, rank].tolist()
        used_rows = int(gp_host.cu_seqlens[rank, -1])
        tok = send_order // self.K
        send_hidden = hidden.index_select(0, tok)
        meta = torch.stack(
            [row[send_order].to(torch.int32), route_w.reshape(-1)[send_order].contiguous().view(torch.int32)],
            dim=1,
        )
        recv_meta = tr.all_to_all(meta, send_splits, recv_splits, "dispatch: all_to_all(meta)")
        recv_hidden = tr.all_to_all(send_hidden, send_splits, recv_splits, "dispatch: all_to_all(hidden)")
        recv_rows = recv_meta[:, 0].to(torch.int64)
        # rows past the last segment are undefined by contract: only the used rows are zeroed
        # (padding rows must read 0), not all NvS, whose (tp-1)*2*epn slack can dwarf S*K
        hidden_nvsh = torch.empty(self.NvS, self.H, dtype=self.dtype, device=self.device)
        hidden_nvsh[:used_rows].zero_()
        hidden_nvsh.index_copy_(0, recv_rows, recv_hidden)
        route_nvs = torch.zeros(self.NvS, dtype=torch.float32, device=self.device)
        route_nvs.index_copy_(0, recv_rows, recv_meta[:, 1].contiguous().view(torch.float32))
        cu = gp.cu_seqlens[rank].to(torch.int32)
        state = CollectiveStep(step=step, send_order=send_order, send_splits=send_splits, recv_splits=recv_splits,
                               recv_rows=recv_rows)
        return Dispatched(hidden_nvsh, route_nvs, cu, gp, state)

    def combine(self, state: Any, y: torch.Tensor,
                y_w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(state, CollectiveStep):  # not reachable: the Buffer checks the plan is its own
            raise MoonEPStateError("the collective transport's combine needs its own dispatch's state")
        tr = self.coll
        tr.step = state.step
        recv_rows, send_order = state.recv_rows, state.send_order
        back = tr.all_to_all(y.index_select(0, recv_rows), state.recv_splits, state.send_splits,
                             "combine: all_to_all(hidden)")
        n = self.S * self.K
        # every entry comes back; kept in the rows' dtype (the sum reads each value exactly as fp32)
        acc = torch.empty(n, self.H, dtype=back.dtype, device=self.device)
        acc.index_copy_(0, send_order, back)
        out = sum_entries(acc, self.S, self.K, self.dtype)
        rw = None
        if y_w is not None:
            wb = tr.all_to_all(y_w.index_select(0, recv_rows), state.recv_splits, state.send_splits,
                               "combine: all_to_all(route_weights)")
            rw = torch.empty(n, dtype=torch.float32, device=self.device)
            rw.index_copy_(0, send_order, wb)
            rw = rw.view(self.S, self.K)
        return out, rw

    def close(self, local: bool) -> None:
        """Nothing to release: every tensor of a step is the caller's or freed with it."""
