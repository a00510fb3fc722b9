"""The hybrid transport: per peer, one-sided writes to peers on this node and one all-to-all to
peers on other nodes, in the same dispatch and combine.

A group that spans nodes (real hosts, or simulated ones: ``engine/nodes.py``) keeps the
one-sided path for its node-local traffic, which on GPUs of one node matched a plain
all-to-all, and sends only the rows that cross nodes through ``torch.distributed`` (NCCL, gloo).
Each step is planned on the host from the all-gathered counts, as for the collective transport
(``planning/host_plan.py``: an all-to-all needs its split sizes on the host anyway; the same
all-gather lets every rank refuse bad counts together before any row moves).

One ``HybridTransport`` per ``Buffer`` (its capacity ``S`` fixes every size), allocated once on a
heap over this node's ``L`` ranks (``nodes.acquire_node_subgroup``, made by every rank of the EP
group and destroyed with the last buffer that uses it; plain tensors when ``L == 1``)::

    this rank:   recv_x [NvS, H]    the dispatched shard (returned as hidden_nvsh)
                 recv_w [NvS] f32   route weight of each row
                 recv_src [NvS] i32 src_rank * S*K + flat entry of rows from node peers; -1 for
                                    rows from other nodes and padding
                 comb_x [S*K, H]    outputs of this rank's entries, pushed by node peers
                 comb_w [S*K] f32   their route weights
                 sig [3, L] i64     signal counters per phase (dispatch, combine) and node peer, then
                                    the gave_up row: gave_up[j] set when node peer j gave up on the group

    dispatch:  place own entries (dest, row), sorted by (dest, row) with the plan's host-known
               counts as boundaries (no host read of device data)
               -> entries for node peers (self included): row, weight, source id written into
                  the destination's recv_* (heap peer views)
               -> sync the stream (CUDA), signal(dispatch) to every node peer
               -> entries for other nodes: all_to_all over the EP group (zero splits for node
                  peers; skipped when the group is one node), written into own recv_* (source -1)
               -> padding rows of own segments: hidden 0, weight 0, source -1
               -> wait(dispatch): every node peer signalled (bounded, names the late peer)
    combine:   own rows sourced on this node, sorted by source id (counts from the plan)
               -> each output row (and weight) into comb_* of its source, at its entry
               -> sync, signal(combine); rows of other nodes back by all_to_all; wait(combine)
               -> acc = comb_x as fp32 with the entries from other nodes put in;
                  out[t] = bf16(sum_k acc[t, k]): the collective transport's arithmetic, so the
                  two give bit-identical outputs

Signals are monotonic counters, one writer per slot (the source peer), waited on by polling on
the host with the buffer's ``timeout_s``; a time-out raises ``MoonEPCollectiveTimeout`` naming
the late peer and marks the group failed (every MoonEP object on it refuses further steps,
teardown turns local). Before raising, the rank gives up on the group: it sets its entry of every
node peer's ``gave_up`` row, in each of its live buffers on the group (a pool holds one per
capacity). A node peer's wait reads that row with its counters and leaves at once naming the
rank; so does a step of any of those buffers that starts after the give-up (``plan``, before the
step's all-gather over the EP group), and teardown is then local. A node peer already inside that
all-gather, or in the node heap's collective free, when the rank gives up waits out its own bound
there, as do peers on other nodes (the bounded collectives do not read the row).

On GPUs a signal follows a stream synchronization, so a peer that sees it
also sees the rows (writes into peer memory have landed once the kernels that made them have
finished); on CPU ranks the host heap maps the shared pages directly (``staging=False``) and
x86-64's store order (TSO) makes the rows visible before the signal, as for the symmetric
transport's host executor.

Set-up is agreed on: a failure on one rank (heap creation, allocation) is all-gathered over the
EP group (bounded), and every rank then releases its part (collectively on nodes where every rank
succeeded, locally on the others) and raises the same error naming the failing rank(s): ranks on
other nodes do not get a buffer that would time out at its first dispatch.

Ordering between steps needs no extra barrier: a node peer writes into this rank's ``recv_*``
for step ``t+1`` only after the all-gather of step ``t+1``'s counts, which this rank enters once
its combine of step ``t`` returned; that combine synchronized the stream after the expert
compute read the shard. ``comb_*`` of step ``t+1`` is written only after this rank's dispatch
signal of step ``t+1``, which follows a stream synchronization that covers its reduce of step
``t``. So one step in flight per buffer, as the contract says.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

import vllm_moonep.engine.heaps as heaps
from vllm_moonep.engine.errors import (
    MoonEPCollectiveTimeout,
    MoonEPInputError,
    MoonEPStateError,
    MoonEPUnavailableError,
)
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.faults.teardown import each
from vllm_moonep.engine.heaps.base import HeapHandle, SymmetricHeap, describe_failure
from vllm_moonep.engine.nodes import NodeMap, acquire_node_subgroup, release_node_subgroup
from vllm_moonep.engine.planning.planner import GlobalPlan, padding_rows, place_entries
from vllm_moonep.engine.transports.base import Dispatched, HostPlannedTransport, sum_entries

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HybridStep", "HybridTransport", "node_heap_kind"]

_PHASE = {"dispatch": 0, "combine": 1}
#: the row of ``sig`` where node peers say they gave up on the group (after the phases' counters)
_GAVE_UP = 2
_WAIT_OP = {"dispatch": "dispatch: wait for node peers' rows", "combine": "combine: wait for node peers' outputs"}
#: longest pause between two polls of the signal counters (seconds); polls start back to back
_MAX_PAUSE_S = 1e-3
#: this process's live transports: a rank that gives up does so in every one on its EP group (a pool holds a buffer
#: per capacity, and a node peer's next call may be on another)
_LIVE: weakref.WeakSet[HybridTransport] = weakref.WeakSet()


def _live(handle: HeapHandle) -> torch.Tensor:
    t = handle.tensor
    assert t is not None  # a live allocation (freeing clears it)
    return t


def node_heap_kind(heap: object, device: torch.device) -> str:
    """The kind of heap the hybrid transport makes over this node's ranks, from ``Buffer(heap=)``
    (a kind or ``None``), else ``MoonEPInputError``. Checked on every rank (also those alone on
    their node, which make no heap), so that every rank refuses a bad one together."""
    if heap is not None and not isinstance(heap, str):
        raise MoonEPInputError(
            f"transport='hybrid' makes its own heap over this node's ranks; pass a heap kind ({heaps.HEAP_KINDS}) or "
            f"None, not a {type(heap).__name__} spanning the group")
    kind = heaps.resolve_heap_kind(heap or "auto", device)  # an unknown kind: MoonEPInputError
    if kind == "nvshmem":
        raise MoonEPInputError(
            "the hybrid transport allocates its receive buffers on a heap over this node's ranks; NVSHMEM is "
            "initialised once per process over the whole EP group, so use heap='auto', 'torch' or 'host'")
    if (kind == "host") != (device.type == "cpu"):
        raise MoonEPInputError(
            f"heap={kind!r} does not fit device {device}: the hybrid transport's node heap is 'host' "
            "(shared /dev/shm pages) for CPU ranks and 'torch' for CUDA ones; pass heap='auto'")
    return kind


@dataclass
class HybridStep:
    """What dispatch leaves for combine (one step in flight per buffer)."""

    step: int
    used: int  # rows [0, used) of the shard are this step's segments
    got: list[int]  # rows this rank received from each rank
    remote_order: torch.Tensor  # own entries sent to other nodes, in the order they went
    recv_rows: torch.Tensor  # shard rows that came from other nodes, in the order they came
    send_splits: list[int]
    recv_splits: list[int]


class HybridTransport(HostPlannedTransport):
    """Buffers, node heap and signals of one engine ``Buffer`` (see the module doc).

    Args: ``coll`` (the buffer's bounded collectives over the EP group), ``nodes`` (the group's
    ``NodeMap``), ``group`` (the EP process group), ``heap_kind`` (``"auto"``, ``"host"``,
    ``"torch"``: the heap made over this node's ranks; ``node_heap_kind`` refuses the others on
    every rank), the buffer's shape (``S, K, E, B, H, NvS, token_padding``), ``dtype`` of the rows,
    ``device``. Collective over the EP group; a failure on any rank raises on every rank (module doc).
    """

    name = "hybrid"

    def __init__(self, coll: BoundedCollectives, nodes: NodeMap, group: ProcessGroup | None, *, heap_kind: str,
                 S: int, K: int, E: int, B: int, H: int, NvS: int, token_padding: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.coll, self.nodes, self.group = coll, nodes, group
        # the group as every buffer on it names it (None is the default group): whom a give-up reaches
        self._group_key = group if group is not None else dist.group.WORLD
        self.rank, self.R = coll.rank, coll.world_size
        self.S, self.K, self.E, self.B, self.H, self.NvS, self.tp = S, K, E, B, H, NvS, token_padding
        self.dtype, self.device = dtype, device
        self.on_gpu = device.type == "cuda"
        self.local = nodes.node_ranks(self.rank)  # EP ranks of this node, ascending
        self.L = len(self.local)
        self.me = self.local.index(self.rank)  # this rank's index among them
        self.remote_any = nodes.num_nodes > 1  # every rank agrees: the all-to-alls run or not everywhere
        self._remote_dest = [not nodes.same_node(self.rank, d) for d in range(self.R)]
        self._epoch = [0, 0]
        self._handles: list[HeapHandle] = []
        self.heap: SymmetricHeap | None = None
        self.buf: dict[str, torch.Tensor] = {}
        self.peer: dict[str, list[torch.Tensor]] = {}  # this node's views of each buffer, by node index
        self._closed = False
        SK = S * K
        specs = [("recv_x", (NvS, H), dtype), ("recv_w", (NvS,), torch.float32), ("recv_src", (NvS,), torch.int32),
                 ("comb_x", (SK, H), dtype), ("comb_w", (SK,), torch.float32), ("sig", (3, max(self.L, 1)), torch.int64)]
        self._uses_subgroup = False
        failure: Exception | None = None
        sub: ProcessGroup | None = None
        try:
            if nodes.shares_nodes:  # every rank of the group takes part (the node map is the same everywhere)
                sub = acquire_node_subgroup(group, nodes, self.rank, coll.timeout_s)
                self._uses_subgroup = True
            if self.L > 1:
                assert sub is not None  # a member of a node of several ranks
                self.heap = self._make_heap(heap_kind, sub)
                for name, shape, dt in specs:
                    self._handles.append(self.heap.allocate(shape, dt, f"moonep.hybrid.S{S}.{name}"))
                self.buf = {name: _live(h) for (name, _, _), h in zip(specs, self._handles)}
            else:  # alone on its node: nothing is written by a peer, plain tensors
                self.buf = {name: torch.empty(shape, dtype=dt, device=device) for name, shape, dt in specs}
            b = self.buf
            b["recv_x"].zero_()  # padding rows must read 0: zeroed once, then each step clears its padding
            b["recv_w"].zero_()
            b["recv_src"].fill_(-1)
            b["comb_x"].zero_()
            b["comb_w"].zero_()
            b["sig"].zero_()
            if self.heap is not None:
                heap = self.heap
                self.peer = {name: [heap.peer_view(h, j) for j in range(self.L)] for (name, _, _), h
                             in zip(specs, self._handles)}
                heap.barrier()  # every node peer zeroed its signals before anyone signals
            else:
                self.peer = {name: [t] for name, t in self.buf.items()}
        except Exception as exc:  # told to every rank below, then released everywhere
            failure = exc
        except BaseException:  # interrupted: release what this rank holds (peers time out, bounded)
            self._close_quietly(local=True, exc=None)
            raise
        self._agree_on_setup(failure)
        _LIVE.add(self)

    def _close_quietly(self, local: bool, exc: BaseException | None) -> None:
        try:
            self.close(local=local)
        except Exception as cleanup:
            if exc is not None:
                exc.add_note(f"freeing what the set-up had allocated failed too: {type(cleanup).__name__}: {cleanup}")

    def _agree_on_setup(self, failure: Exception | None) -> None:
        """One bounded all-gather over the EP group of every rank's set-up outcome; when some rank
        failed, every rank releases its part (locally on nodes with a failed rank: their node
        collectives cannot complete) and raises the same error naming the failing rank(s)."""
        mine = None if failure is None else (isinstance(failure, MoonEPInputError), describe_failure(failure))
        try:
            every = self.coll.all_gather_object(mine, "Buffer.__init__ (hybrid transport set-up)")
        except BaseException as exc:
            if failure is not None:
                exc.add_note(f"this rank's set-up had failed: {describe_failure(failure)}")
            self._close_quietly(local=True, exc=exc)
            raise
        bad = {r: o for r, o in enumerate(every) if o is not None}
        if not bad:
            return
        failed_nodes = {self.nodes.node_of[r] for r in bad}
        err_cls = MoonEPInputError if any(is_input for is_input, _ in bad.values()) else MoonEPUnavailableError
        err = err_cls(
            f"the hybrid transport could not be set up on rank(s) {sorted(bad)} of {self.R} ("
            + "; ".join(f"rank {r}: {msg}" for r, (_, msg) in sorted(bad.items()))
            + f"); every rank released its part and raised this (nodes: {self.nodes.describe()})")
        self._close_quietly(local=self.nodes.node_of[self.rank] in failed_nodes, exc=err)
        raise err from failure

    def _make_heap(self, kind: str, sub: ProcessGroup) -> SymmetricHeap:
        # the host heap's staging mode hides owner writes until a barrier; peers write into each
        # other's buffers here, so it maps the shared pages directly
        extra = {"staging": False} if self.device.type == "cpu" else {}
        heap = heaps.make_heap(kind, group=sub, device=self.device, nodes=NodeMap.one_node(self.L), **extra)
        heap._collectives.timeout_s = self.coll.timeout_s  # its allocations, barrier and frees: the buffer's bound
        return heap

    # ------------------------------------------------------------------ signals
    def _signal(self, phase: str) -> None:
        """Tell every node peer that this rank's writes of ``phase`` into its memory have landed."""
        if self.L == 1:
            return
        if self.on_gpu:  # the rows' kernels have finished: their writes into peer memory are visible
            torch.cuda.current_stream(self.device).synchronize()
        p = _PHASE[phase]
        value = self._epoch[p] + 1
        for j in range(self.L):
            if j != self.me:
                self.peer["sig"][j][p, self.me] = value

    def _wait(self, phase: str, step: int | None) -> None:
        """Until every node peer signalled ``phase`` of this step; ``MoonEPCollectiveTimeout``
        naming the first late peer after ``timeout_s``, or at once naming a node peer that gave up."""
        p = _PHASE[phase]
        target = self._epoch[p] + 1
        if self.L > 1:
            sig = self.buf["sig"]
            timeout_s = self.coll.timeout_s
            t0 = time.monotonic()
            pause = 0.0
            while True:
                rows = sig.tolist()  # the counters and the gave_up row in one read
                seen = rows[p]
                late = [j for j in range(self.L) if j != self.me and seen[j] < target]
                if not late:
                    break
                gone = self._node_peers_gone(rows[_GAVE_UP])
                if gone:  # named with the peers this wait still lacks: those it would have timed out on
                    raise self._gave_up_error(gone, _WAIT_OP[phase], step, mark=True, late=late)
                elapsed = time.monotonic() - t0
                if elapsed >= timeout_s:
                    self._timed_out(phase, step, late, seen, target, elapsed)
                pause = min(_MAX_PAUSE_S, pause + 2e-5)
                time.sleep(pause)
        self._epoch[p] = target

    def _give_up(self) -> None:
        """Set this rank's entry of every node peer's ``gave_up`` row, its own too (on GPUs a small copy into each
        peer's memory, synchronized so that it has landed before the caller raises)."""
        for j in range(self.L):
            self.peer["sig"][j][_GAVE_UP, self.me] = 1
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()

    def _node_peers_gone(self, row: list[int] | None = None) -> list[int] | None:
        """Node indices of the peers that gave up on the group, from ``row`` (the gave_up row as read) or a host read
        of it (on GPUs it synchronizes the stream); ``[]``: none; ``None``: the row could not be read (a sticky CUDA
        error: the memory is not to be trusted)."""
        if row is None:
            if self.L == 1 or "sig" not in self.buf:
                return []
            try:
                row = self.buf["sig"][_GAVE_UP].tolist()
            except Exception:
                return None
        return [j for j in range(self.L) if j != self.me and row[j]]

    def _gave_up_error(self, gone: list[int] | None, op: str, step: int | None, *, mark: bool,
                       late: list[int] | None = None) -> MoonEPCollectiveTimeout:
        """The error for node peers that gave up on the group (``gone``: their node indices; ``None``: the row
        could not be read), the group marked failed when ``mark``. ``late``: the node peers a wait still lacked,
        which the error names as missing (the peer that gave up did so waiting on one of them); else those that
        gave up."""
        where = f"step {step}" if step is not None else "the next step"
        if gone is None:
            missing: list[int] = []
            summary = f"{op!r} at {where}: the node signals could not be read"
            why = "its node signal memory could not be read; the group is treated as failed"
        else:
            gave_up = [self.local[j] for j in gone]
            missing = [self.local[j] for j in late] if late else gave_up
            summary = f"{op!r} abandoned at {where}, node peers {gave_up} gave up on the group"
            why = (f"rank {gave_up[0]} on this node had given up on the group (one of its waits timed out; all that "
                   f"gave up: {gave_up})")
            if late:
                why += f", and this wait still lacked node peer(s) {missing}, first rank {missing[0]}"
        if mark:
            self.coll.mark_broken(f"hybrid transport: {summary}")
        return MoonEPCollectiveTimeout(
            f"MoonEP {op!r} was abandoned at {where} on rank {self.rank} of {self.R}: {why}, so this rank stops too "
            f"(nodes: {self.nodes.describe()}). The process group is unusable now: destroy the MoonEP buffers, "
            "pools and layouts, then the process group, and build a fresh set.",
            op=op, step=step, rank=self.rank, world_size=self.R, missing=missing, timed_out=False,
            timeout_s=self.coll.timeout_s)

    # ------------------------------------------------------------------ errors
    def _refuse_if_peer_gave_up(self, op: str, step: int) -> None:
        """Before the step's all-gather over the EP group (which a rank that gave up never joins): raise, the group
        marked failed, when a node peer gave up. A host read of the gave_up row (on GPUs a sync, which the plan's
        all-gather of the counts is anyway)."""
        gone = self._node_peers_gone()
        if gone is None or gone:
            raise self._gave_up_error(gone, op, step, mark=True)

    def plan(self, tpe: torch.Tensor, step: int) -> GlobalPlan:
        self._refuse_if_peer_gave_up("dispatch: the step's counts", step)
        return super().plan(tpe, step)

    def refuse(self, step: int) -> None:
        self._refuse_if_peer_gave_up("dispatch: the refusal frame", step)
        super().refuse(step)

    def recorded_timeout(self) -> MoonEPCollectiveTimeout | None:
        """A node peer that gave up on the group (its entry of the gave_up row), or a row that cannot be read: the
        group failed, so teardown frees locally instead of waiting on that peer in the node heap's collective free."""
        gone = self._node_peers_gone()
        if gone is None or gone:
            return self._gave_up_error(gone, "hybrid transport: teardown", None, mark=False)
        return None

    def _timed_out(self, phase: str, step: int | None, late: list[int], seen: list[int], target: int,
                   elapsed: float) -> NoReturn:
        op = _WAIT_OP[phase]
        missing = [self.local[j] for j in late]
        where = f"step {step}" if step is not None else "a step"
        summary = f"{op!r} timed out at {where}, node peers {missing} did not signal"
        self.coll.mark_broken(f"hybrid transport: {summary}")
        told: Exception | None = None
        try:  # the node peers' waits, next steps and teardown leave at once, on every buffer of the group
            each(HybridTransport._give_up,
                 [t for t in list(_LIVE) if t._group_key is self._group_key and not t._closed], Exception)
        except Exception as exc:  # the timeout is what is raised; the note says the peers were not all told
            told = exc
        err = MoonEPCollectiveTimeout(
            f"MoonEP {op!r} timed out after {elapsed:.1f}s (limit {self.coll.timeout_s:g}s) at {where} on rank "
            f"{self.rank} of {self.R}: peer(s) on this node that did not signal, first rank {missing[0]} (signal "
            f"{seen[late[0]]} of {target} expected; all late: {missing}); it died, stopped calling, or called another "
            f"buffer (nodes: {self.nodes.describe()}). The process group is unusable now: destroy the MoonEP buffers, "
            "pools and layouts, then the process group, and build a fresh set.",
            op=op, step=step, rank=self.rank, world_size=self.R, missing=missing, timed_out=True, elapsed_s=elapsed,
            timeout_s=self.coll.timeout_s, seq=target)
        if told is not None:
            err.add_note(f"telling the node peers that this rank gave up failed ({type(told).__name__}: {told}); "
                         "they leave at their own bound")
        raise err

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor,
                 plan: GlobalPlan | None, num_tokens: int | None, step: int) -> Dispatched:
        """Move this step's rows (``plan``: the plan on the host, the same on every rank; every
        row moves, ``num_tokens`` or not). The shard's plan is that plan on the device."""
        if plan is None:  # not reachable: the Buffer passes what plan() returned
            raise MoonEPStateError("the hybrid transport's dispatch needs the host plan")
        gp_host = plan
        rank, K, NvS, n = self.rank, self.K, self.NvS, self.S * self.K
        b = self.buf
        gp = gp_host if self.device.type == "cpu" else gp_host.to(self.device)
        dest, row = place_entries(gp, rank, ids)
        flows = gp_host.flows()  # [src, dst] rows, on the host
        sent = [int(v) for v in flows[rank].tolist()]
        got = [int(v) for v in flows[:, rank].tolist()]
        # every entry in (dest, row) order: the slices for each destination have host-known bounds
        order = torch.argsort(dest * NvS + row, stable=True)
        bounds = [0]
        for c in sent:
            bounds.append(bounds[-1] + c)
        wflat = route_w.reshape(-1)
        src_id = (rank * n + order).to(torch.int32)
        # 1) rows for node peers (self included): one-sided, straight into their shards
        for j, d in enumerate(self.local):
            lo, hi = bounds[d], bounds[d + 1]
            if hi > lo:
                sel, rows = order[lo:hi], row.index_select(0, order[lo:hi])
                self.peer["recv_x"][j].index_copy_(0, rows, hidden.index_select(0, sel // K))
                self.peer["recv_w"][j].index_copy_(0, rows, wflat.index_select(0, sel))
                self.peer["recv_src"][j].index_copy_(0, rows, src_id[lo:hi])
        self._signal("dispatch")
        # 2) rows for other nodes: one all-to-all over the group (node peers get zero rows)
        send_splits = [0 if not self._remote_dest[d] else sent[d] for d in range(self.R)]
        recv_splits = [0 if not self._remote_dest[s] else got[s] for s in range(self.R)]
        remote_order = order[:0]
        recv_rows = row[:0]
        if self.remote_any:
            parts = [order[bounds[d]:bounds[d + 1]] for d in range(self.R) if self._remote_dest[d] and sent[d]]
            remote_order = torch.cat(parts) if parts else order[:0]
            rrow = row.index_select(0, remote_order)
            meta = torch.stack([rrow.to(torch.int32), wflat.index_select(0, remote_order).view(torch.int32)], dim=1)
            coll = self.coll
            coll.step = step
            recv_meta = coll.all_to_all(meta, send_splits, recv_splits, "dispatch: all_to_all(meta) across nodes")
            recv_hidden = coll.all_to_all(hidden.index_select(0, remote_order // K), send_splits, recv_splits,
                                          "dispatch: all_to_all(hidden) across nodes")
            recv_rows = recv_meta[:, 0].to(torch.int64)
            b["recv_x"].index_copy_(0, recv_rows, recv_hidden)
            b["recv_w"].index_copy_(0, recv_rows, recv_meta[:, 1].contiguous().view(torch.float32))
            b["recv_src"].index_fill_(0, recv_rows, -1)  # these go back by all-to-all, not by a push
        # 3) this step's padding rows: read 0, weight 0, no source (rows past cu[-1] are undefined)
        pad = padding_rows(gp_host, rank, self.tp).to(self.device)
        if pad.numel():
            b["recv_x"].index_fill_(0, pad, 0)
            b["recv_w"].index_fill_(0, pad, 0)
            b["recv_src"].index_fill_(0, pad, -1)
        # 4) every node peer's rows have landed
        self._wait("dispatch", step)
        state = HybridStep(step=step, used=int(gp_host.cu_seqlens[rank, -1]), got=got, remote_order=remote_order,
                           recv_rows=recv_rows, send_splits=send_splits, recv_splits=recv_splits)
        return Dispatched(b["recv_x"], b["recv_w"], gp.cu_seqlens[rank].to(torch.int32), gp, state)

    # ------------------------------------------------------------------ combine
    def combine(self, state: Any, y: torch.Tensor,
                y_w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert outputs of the step ``state`` recorded back to their tokens: ``(hidden_sh [S,H],
        route weights [S,K] or None)``, each token's K rows summed in fp32 and rounded once."""
        if not isinstance(state, HybridStep):  # not reachable: the Buffer checks the plan is its own
            raise MoonEPStateError("the hybrid transport's combine needs its own dispatch's state")
        st = state
        S, K, n = self.S, self.K, self.S * self.K
        b = self.buf
        step, used, got = st.step, st.used, st.got
        # 1) rows whose source is on this node: pushed into the source's landing area at the entry.
        # Sorting the shard's source ids groups them by source rank (others, -1, last), and the
        # plan says how many each source sent: slices with host-known bounds again.
        src = b["recv_src"][:used].to(torch.int64)
        by_src = torch.argsort(torch.where(src >= 0, src, self.R * n), stable=True)
        lo = 0
        for j, s in enumerate(self.local):
            cnt = got[s]
            if cnt:
                rows = by_src[lo:lo + cnt]
                entries = src.index_select(0, rows) - s * n
                self.peer["comb_x"][j].index_copy_(0, entries, y.index_select(0, rows))
                if y_w is not None:
                    self.peer["comb_w"][j].index_copy_(0, entries, y_w.index_select(0, rows))
                lo += cnt
        self._signal("combine")
        # 2) rows of other nodes: back by all-to-all, in the order they came
        back = wb = None
        if self.remote_any:
            recv_rows, send_splits, recv_splits = st.recv_rows, st.send_splits, st.recv_splits
            coll = self.coll
            coll.step = step
            back = coll.all_to_all(y.index_select(0, recv_rows), recv_splits, send_splits,
                                   "combine: all_to_all(hidden) across nodes")
            if y_w is not None:
                wb = coll.all_to_all(y_w.index_select(0, recv_rows), recv_splits, send_splits,
                                     "combine: all_to_all(route_weights) across nodes")
        self._wait("combine", step)
        # 3) every entry's row is here (node peers' in comb_*, the others' in back): the collective
        # transport's sum, on the same values
        acc = b["comb_x"].clone()  # in the rows' dtype: the sum reads each value exactly as fp32
        if back is not None:
            acc.index_copy_(0, st.remote_order, back)
        out = sum_entries(acc, S, K, self.dtype)
        rw = None
        if y_w is not None:
            rw = b["comb_w"].clone()
            if wb is not None:
                rw.index_copy_(0, st.remote_order, wb)
            rw = rw.view(S, K)
        return out, rw

    # ------------------------------------------------------------------ teardown
    @property
    def nbytes(self) -> int:
        """Heap bytes of this transport's allocations, per rank (0 when alone on its node, or closed)."""
        return sum(h.nbytes for h in self._handles)

    def close(self, local: bool = False) -> None:
        """Free the node heap's allocations and the heap (collective over the node's ranks, or
        ``local`` after the group failed), then release the node subgroup (every rank of the EP
        group, the last user destroys it; only forgets it when the frees failed, as after a failed
        group: a node peer is gone, and destroying a group with its failed free pending can wait for
        the group's own timeout). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        heap, self.heap = self.heap, None
        self.peer = {}
        self.buf = {}
        try:
            if heap is not None:
                if local:
                    heap.teardown_locally()  # peers may be gone: release local memory only
                handles, self._handles = self._handles[::-1], []
                try:
                    try:
                        heap.free_all(*handles)
                    finally:
                        heap.close(force=True)
                except MoonEPCollectiveTimeout:
                    local = True
                    raise
        finally:
            if self._uses_subgroup:
                self._uses_subgroup = False
                release_node_subgroup(self.group, self.nodes, local=local)
