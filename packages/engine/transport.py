"""How rows move between ranks: the collective transport (torch.distributed all-to-all).

Works wherever ``torch.distributed`` works: gloo on CPU (and CUDA tensors staged through the
host), NCCL on GPUs, across nodes. A world of one rank needs no process group at all.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from vllm_moonep.engine.errors import MoonEPCollectiveTimeout, MoonEPInputError

#: default bound on one collective, seconds (override with VLLM_MOONEP_COLLECTIVE_TIMEOUT_S)
DEFAULT_TIMEOUT_S = 300.0


def collective_timeout_s() -> float:
    return float(os.environ.get("VLLM_MOONEP_COLLECTIVE_TIMEOUT_S", DEFAULT_TIMEOUT_S))


class CollectiveTransport:
    """All-gather and all-to-all over a process group (``None``: the default group).

    ``world_size == 1`` without an initialised default group runs locally.
    """

    def __init__(self, group=None, world_size: int | None = None, timeout_s: float | None = None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        elif group is None and world_size in (None, 1):
            self.world_size, self.rank = 1, 0
        else:
            raise MoonEPInputError(
                "torch.distributed is not initialised: a MoonEP buffer with "
                f"num_ep_ranks={world_size} needs a process group"
            )
        self.timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
        self.step = 0
        self.last_op = ""

    @property
    def local(self) -> bool:
        return self.world_size == 1

    def _wait(self, work, op: str) -> None:
        self.last_op = op
        if work is None:
            return
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo/NCCL report timeouts and dead peers as RuntimeError
            raise MoonEPCollectiveTimeout(
                f"MoonEP collective {op!r} (step {self.step}, rank {self.rank} of {self.world_size}) "
                f"failed or timed out after {self.timeout_s:.0f}s: {exc}"
            ) from exc
        if ok is False:
            raise MoonEPCollectiveTimeout(
                f"MoonEP collective {op!r} (step {self.step}, rank {self.rank} of {self.world_size}) "
                f"did not complete within {self.timeout_s:.0f}s"
            )

    def all_gather(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``[world, *t.shape]``: every rank's ``t``."""
        if self.local:
            return t.unsqueeze(0).clone()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, t.contiguous(), group=self.group, async_op=True), op)
        return torch.stack(out)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], op: str) -> torch.Tensor:
        """Rows ``send[sum(send_splits[:d]) : ...]`` go to rank ``d``; returns received rows in rank order."""
        if self.local:
            return send.clone()
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        work = dist.all_to_all_single(
            recv, send.contiguous(), recv_splits, send_splits, group=self.group, async_op=True
        )
        self._wait(work, op)
        return recv

    def barrier(self, op: str = "barrier") -> None:
        if self.local:
            return
        self._wait(dist.barrier(group=self.group, async_op=True), op)
