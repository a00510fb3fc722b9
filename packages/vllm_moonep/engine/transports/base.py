"""The interface every transport of the built-in engine implements.

A transport moves one step's rows for one ``Buffer`` (its capacity ``S`` fixes every size)::

    Buffer.dispatch: checks inputs ─► (refused: transport.refuse(step), the peers refuse it too where
                                        the transport can tell them)
                                   ─► transport.plan(tpe, step)
                                        the plan made on the host before any row moves
                                        (collective, hybrid), or None (symmetric: planned
                                        inside its dispatch launch)
                                   ─► transport.dispatch(x, w, ids, tpe, plan, num_tokens, step)
                                        each entry's row to the rank and row the plan gives it
                                   ─► Dispatched(shard, weights, cu_seqlens, plan, state, ...)
                     ─► Plan (public: experts_to_copy; the transport's state kept private)
    Buffer.combine:  checks plan and rows ─► transport.combine(state, y, y_w)
                                        each entry's output home, K rows summed in fp32
    Buffer.destroy:  transport.close(local=group failed) ─► the buffer's bounded collectives

``state`` is the transport's own record of the step (which rows went where), handed back to
its combine through the buffer's ``Plan``; the ``Buffer`` never looks inside it. The ``Buffer``
keeps what is the same for every transport: the input checks, the step counter (one step in
flight), the group's failure state and the order of teardown. Implementations:
``collective.py``, ``symmetric.py``, ``hybrid.py``; ``select.py`` says which one a buffer uses.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch

from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPCollectiveTimeout
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.launch import Launcher, interpreting
from vllm_moonep.engine.planning.host_plan import DISPATCH_GATHER_OP, plan_on_host, refuse_framed
from vllm_moonep.engine.planning.planner import GlobalPlan

__all__ = ["Dispatched", "HostPlannedTransport", "Transport", "sum_entries"]


def sum_entries(rows: torch.Tensor, S: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's ``K`` entry rows (``rows [S*K, H]`` in fp32, bf16 or fp16, token ``t``'s at ``t*K ..
    t*K+K-1``) summed in fp32, ``k`` ascending, from +0, rounded once to ``dtype``: ``[S, H]``. The order is
    written out, as the symmetric transport's reduce kernel writes it, so that a token's sum is the same bits
    on every transport and in every step, whatever the other tokens (batch invariance:
    ``grouped_gemm/invariance.py``). On CUDA it is that kernel: one pass over the rows, 0.80-1.05x one
    unordered torch reduction of bf16 rows from 1024 tokens on an H100, where K-1 torch adds, each reading
    and writing the fp32 sum, take 4.7-6.6x (docs/PERFORMANCE.md, "The combine's K-sum")."""
    H = rows.shape[-1]
    rows = rows.reshape(S * K, H)  # a wrong row count raises here, on either path
    launch = reduce_launcher() if rows.is_cuda else None
    if launch is None:
        return sum_entries_torch(rows, S, K, dtype)
    from vllm_moonep.engine.transports.symmetric_kernels import reduce_grid

    out = torch.empty(S, H, dtype=dtype, device=rows.device)
    if S:
        n_prog, bh, k_pad = reduce_grid(S, K, H)
        with torch.cuda.device(rows.device):  # the launcher launches on the current device
            launch((n_prog, 1, 1), rows.contiguous(), rows, out, out, S, K, H, n_prog, HAS_W=False, K_PAD=k_pad,
                   BLOCK_H=bh, num_warps=4)
    return out


def sum_entries_torch(rows: torch.Tensor, S: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum_entries`` as K-1 torch adds in the same order (the CPU path, any device)."""
    v = rows.view(S, K, rows.shape[-1])
    out = v[:, 0].to(torch.float32) + 0.0  # a new tensor, from +0 as the kernel's sum starts (-0 becomes +0)
    for k in range(1, K):
        out += v[:, k]
    return out.to(dtype)


#: the reduce kernel's launcher, made at the first CUDA sum (``[None]`` where Triton does not import, or
#: runs as its interpreter, which rounds fp32 to bf16 by truncation: the torch adds then)
_REDUCE: list[Launcher | None] = []


def reduce_launcher() -> Launcher | None:
    """The launcher ``sum_entries`` runs on CUDA tensors, or ``None`` where it sums with torch adds (said
    once: the same bits, 2-7x the time)."""
    if not _REDUCE:
        why = "Triton runs as its interpreter (TRITON_INTERPRET)" if interpreting() else None
        if why is None:
            try:
                from vllm_moonep.engine.transports.symmetric_kernels import reduce_kernel
            except ImportError as exc:
                why = f"Triton's kernels do not import ({type(exc).__name__}: {exc})"
            else:
                _REDUCE.append(Launcher(reduce_kernel))
        if why is not None:
            _REDUCE.append(None)
            say_once(f"MoonEP combine: each token's K-sum on CUDA as K-1 torch adds in the kernel's order: {why}",
                     level=logging.WARNING)
    return _REDUCE[0]


class Dispatched(NamedTuple):
    """What a transport's dispatch returns."""

    hidden_nvsh: torch.Tensor
    route_weights_nvs: torch.Tensor
    cu_seqlens: torch.Tensor  # this rank's [E+B] int32
    plan: GlobalPlan  # the step's plan, the same on every rank
    state: Any  # the transport's own record of the step, for its combine
    #: this rank's rows per segment [E+B] int32, padding included, where the transport's kernel wrote
    #: them (else ``Plan`` derives them from ``cu_seqlens`` when asked)
    rows: torch.Tensor | None = None
    #: this rank's end of each segment's entries [E+B] int32, where the transport's kernel wrote them
    #: (the expert kernels then need not look for the padding tails)
    live_ends: torch.Tensor | None = None


class Transport(ABC):
    """Moves one buffer's rows, step by step (collective over the EP group, one step in flight)."""

    #: the name ``Buffer(transport=...)`` selects it by (``select.TRANSPORTS``)
    name: ClassVar[str]
    #: programs of each row-moving kernel launch; ``None`` where rows move without kernels of ours
    programs: int | None = None

    def plan(self, tpe: torch.Tensor, step: int) -> GlobalPlan | None:
        """The step's plan from every rank's ``tokens_per_expert``, made before any row moves, for
        a transport that plans on the host; ``None`` (the default) for one that plans inside its
        dispatch. ``step``: the buffer's dispatch count, named by errors."""
        return None

    def refuse(self, step: int) -> None:
        """This rank refused the step's input (the ``Buffer``'s checks, before ``plan``): end the peers' half of
        the call with it where the transport can, so that they refuse it too rather than pair with this rank's
        next call. The default does nothing (the peers time out naming this rank); the symmetric transport, which
        exchanges nothing through a collective before moving rows, keeps the group where every rank refused the
        call and gives up on it otherwise."""

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor,
                 plan: GlobalPlan | None, num_tokens: int | None, step: int) -> Dispatched:
        """Move every entry's row, weight and source into the shard of the rank the plan gives it
        (``plan``: what ``plan`` returned). Inputs are checked by the ``Buffer``. ``num_tokens``:
        tokens from there to ``S`` are padding, which a transport may leave unmoved (their rows
        then read 0)."""

    @abstractmethod
    def combine(self, state: Any, y: torch.Tensor,
                y_w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert outputs ``y [>=NvS, H]`` (and their weights) of the step ``state`` recorded back
        to their tokens: ``(hidden_sh [S, H], route_weights_sk [S, K] or None)``, each token's K
        rows summed in fp32 and rounded once."""

    @abstractmethod
    def close(self, local: bool) -> None:
        """Release what the transport holds (idempotent). ``local``: the group failed, peers may
        be gone, so free this rank's memory without any collective."""

    @property
    def nbytes(self) -> int:
        """Bytes held on a symmetric heap per rank (receive and landing areas); 0 when none."""
        return 0

    def check_errors(self, sync: bool) -> None:
        """Raise what a device-side wait or check recorded (``sync``: after the stream finished
        the calls issued so far). Transports whose waits raise on the host record nothing."""

    def recorded_timeout(self) -> MoonEPCollectiveTimeout | None:
        """A device-side wait that gave up and was recorded, not raised yet (it makes the group
        unusable); ``None`` when there is none."""
        return None


class HostPlannedTransport(Transport):
    """A transport that plans on the host from every rank's counts, all-gathered in one frame
    (``planning/host_plan.py``): the collective and hybrid ones. A subclass sets ``coll`` (the buffer's
    bounded collectives over the EP group), the buffer's ``S, K, E, B``, ``tp`` (its token padding) and
    ``device``."""

    coll: BoundedCollectives
    S: int
    K: int
    E: int
    B: int
    tp: int
    device: torch.device

    def plan(self, tpe: torch.Tensor, step: int) -> GlobalPlan:
        self.coll.step = step
        return plan_on_host(self.coll, tpe, self.S, self.K, self.E, self.B, self.tp)

    def refuse(self, step: int) -> None:
        """The refusal frame in place of this rank's counts: the peers' all-gather completes and they refuse."""
        self.coll.step = step
        refuse_framed(self.coll, self.S, self.E, self.device, DISPATCH_GATHER_OP)
