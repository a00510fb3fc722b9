"""Which ranks of an EP group share a node: defined here, once, for the transports and the heaps.

A *node* is a set of ranks whose memory can be mapped by each other (GPUs of one host over
NVLink/P2P, CPU ranks of one machine over ``/dev/shm``). Two sources, one answer (``NodeMap``):

- real nodes: the host each rank runs on (``host_id``), all-gathered by the caller;
- simulated nodes: ``VLLM_MOONEP_RANKS_PER_NODE=k`` (``RANKS_PER_NODE_ENV``) makes group rank
  ``r`` live on node ``r // k``, so ranks of one host behave as several nodes (tests on CPU
  ranks, processes sharing one GPU, one node per GPU of a two-GPU host). ``k`` must divide the
  group size and no block of ``k`` ranks may span real hosts.

What follows from it: a heap addresses only peers of its own node (``heaps.base``: ``peer_view``
refuses the others, ``copy_from_peer`` reads them by RMA), ``transport="auto"`` takes the
symmetric transport on one node and the hybrid one across nodes (``transports/select.py``), and the
hybrid transport allocates its receive buffers on a heap over its node's ranks
(``acquire_node_subgroup``: made by every rank of the group, destroyed with the
last buffer that uses it)::

    ranks    0 1 | 2 3        (VLLM_MOONEP_RANKS_PER_NODE=2, 4 ranks)
    node     0 0 | 1 1
    heap     [0 1] [2 3]      one heap per node (subgroup), peers addressable inside it only

The choice is said once per process at INFO (``defaults.say_once``).
"""

from __future__ import annotations

import datetime
import os
import socket
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPInputError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RANKS_PER_NODE_ENV", "NodeMap", "acquire_node_subgroup", "host_id", "parse_ranks_per_node",
           "ranks_per_node_from_env", "ranks_per_node_text", "refuse_bad_ranks_per_node", "release_node_subgroup",
           "resolve_nodes"]

#: ranks per simulated node (unset or empty: nodes are the real hosts)
RANKS_PER_NODE_ENV = "VLLM_MOONEP_RANKS_PER_NODE"


def host_id() -> int:
    """A number that differs between hosts (peers on another host are not addressable)."""
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def ranks_per_node_text() -> str:
    """``$VLLM_MOONEP_RANKS_PER_NODE`` as set (stripped; ``""`` when unset)."""
    return os.environ.get(RANKS_PER_NODE_ENV, "").strip()


def parse_ranks_per_node(raw: str) -> int:
    """``raw`` as ranks per simulated node: ``k > 0``; ``0`` when empty (unset); ``-1`` when it is no
    positive integer. The sentinels travel in the all-gathers that make ranks agree, so a bad value
    on one rank is refused on every rank (``refuse_bad_ranks_per_node``), not only where it is set."""
    if not raw:
        return 0
    try:
        k = int(raw)
    except ValueError:
        return -1
    return k if k >= 1 else -1


def refuse_bad_ranks_per_node(raws: Sequence[str], what: str) -> None:
    """``MoonEPInputError`` (the same on every rank that passes the same ``raws``, one per rank) when
    some rank's value is not a positive integer, naming those ranks and every rank's value."""
    bad = [r for r, raw in enumerate(raws) if parse_ranks_per_node(raw) < 0]
    if bad:
        table = ", ".join(f"rank {r}: {raw!r}" for r, raw in enumerate(raws))
        raise MoonEPInputError(
            f"{what}: ${RANKS_PER_NODE_ENV} must be a positive integer (ranks per simulated node) or unset; "
            f"rank(s) {bad} have {[raws[r] for r in bad]} (per rank: {table})")


def ranks_per_node_from_env() -> int | None:
    """``$VLLM_MOONEP_RANKS_PER_NODE`` as a positive int, ``None`` when unset or empty;
    ``MoonEPInputError`` on this rank for any other value (collective callers all-gather
    ``ranks_per_node_text()`` instead, so that every rank refuses together)."""
    raw = ranks_per_node_text()
    k = parse_ranks_per_node(raw)
    if k < 0:
        raise MoonEPInputError(f"${RANKS_PER_NODE_ENV}={raw!r}: must be a positive integer (ranks per simulated node)")
    return k or None


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of a group (``node_of[r]``; nodes numbered by their first rank).
    ``simulated``: made from ``VLLM_MOONEP_RANKS_PER_NODE``, not from the hosts."""

    node_of: tuple[int, ...]
    simulated: bool = False

    @classmethod
    def one_node(cls, world_size: int) -> NodeMap:
        return cls(tuple([0] * world_size))

    @classmethod
    def blocks(cls, world_size: int, ranks_per_node: int) -> NodeMap:
        """Simulated nodes: rank ``r`` on node ``r // ranks_per_node``."""
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise MoonEPInputError(
                f"{RANKS_PER_NODE_ENV}={ranks_per_node} does not divide the group's {world_size} ranks into nodes "
                f"(simulated nodes are blocks of equal size); use a divisor of {world_size}")
        return cls(tuple(r // ranks_per_node for r in range(world_size)), simulated=True)

    @classmethod
    def from_hosts(cls, hosts: Sequence[int]) -> NodeMap:
        """Real nodes: ranks with the same host id share a node."""
        first: dict[int, int] = {}
        return cls(tuple(first.setdefault(h, len(first)) for h in hosts))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    def members(self, node: int) -> tuple[int, ...]:
        """Ranks of ``node``, ascending."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def node_ranks(self, rank: int) -> tuple[int, ...]:
        """Ranks on ``rank``'s node (itself included), ascending."""
        return self.members(self.node_of[rank])

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    @property
    def shares_nodes(self) -> bool:
        """Whether some node holds more than one rank (the hybrid transport's one-sided part has work)."""
        return self.num_nodes < self.world_size

    def describe(self) -> str:
        """``2 nodes: [0, 1] [2, 3] (simulated, VLLM_MOONEP_RANKS_PER_NODE)``."""
        parts = " ".join(str(list(self.members(n))) for n in range(self.num_nodes))
        how = f"simulated, {RANKS_PER_NODE_ENV}" if self.simulated else "by host"
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}: {parts} ({how})"


def resolve_nodes(hosts: Sequence[int], ranks_per_node: int | None) -> NodeMap:
    """The group's nodes from every rank's host id and the ranks per simulated node (``None``:
    the hosts). A simulated node must not span real hosts (its ranks could not map each other)."""
    real = NodeMap.from_hosts(hosts)
    if ranks_per_node is None:
        return real
    nodes = NodeMap.blocks(len(hosts), ranks_per_node)
    for n in range(nodes.num_nodes):
        ranks = nodes.members(n)
        if len({real.node_of[r] for r in ranks}) > 1:
            raise MoonEPInputError(
                f"{RANKS_PER_NODE_ENV}={ranks_per_node}: simulated node {n} (ranks {list(ranks)}) spans real hosts "
                f"({real.describe()}); a simulated node must be part of one host")
    say_once(f"MoonEP: {nodes.describe()}: peers on other simulated nodes are treated as remote "
             f"(not addressable, reached by collectives or RMA)")
    return nodes


@dataclass
class _NodeGroups:
    """The node subgroups of one parent group and node map: this rank's (``None`` when alone on its
    node) and how many live users (hybrid transports) hold them."""

    mine: ProcessGroup | None
    users: int = 0


#: node subgroups in use, per parent group and node map
_SUBGROUPS: weakref.WeakKeyDictionary[ProcessGroup, dict[tuple[int, ...], _NodeGroups]] = weakref.WeakKeyDictionary()


def _parent(group: ProcessGroup | None) -> ProcessGroup:
    parent = group if group is not None else dist.group.WORLD
    if parent is None:
        raise MoonEPInputError("a node subgroup needs torch.distributed to be initialised")
    return parent


def acquire_node_subgroup(group: ProcessGroup | None, nodes: NodeMap, rank: int,
                          timeout_s: float | None = None) -> ProcessGroup | None:
    """The process group of ``rank``'s node inside ``group`` (``None``: the default group); ``None``
    when ``rank`` is alone on its node. Collective over ``group``: every rank of it calls this (ranks
    alone on their node too), in the same order as its other group creations.

    The first user makes the subgroup of every node of several ranks, in node order, with plain
    ``dist.new_group`` called by every rank of ``group`` (no ``use_local_synchronization``: there
    non-members return early and do not advance torch's group counter, so a later ordinary
    ``new_group`` would get different names on different ranks and hang). Every rank of the
    default group that is not in ``group`` takes no part, so when ``group`` is smaller than the
    world those ranks' counters fall behind, as for any group made by a subset of the ranks:
    make the next world-wide groups before the buffers, or from every rank's own groups.

    Lifetime: the subgroups live while some user holds them (``release_node_subgroup``, one call
    per acquire, from every rank of ``group`` in the same order); the last release destroys them.
    Buffers are destroyed before their process group (the contract), so a subgroup never outlives
    its parent and the cache never hands out one of a destroyed parent."""
    parent = _parent(group)
    known = _SUBGROUPS.setdefault(parent, {})
    entry = known.get(nodes.node_of)
    if entry is None:
        global_ranks = dist.get_process_group_ranks(parent)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        mine: ProcessGroup | None = None
        for n in range(nodes.num_nodes):  # the same calls, in the same order, on every rank of the group
            members = nodes.members(n)
            if len(members) == 1:  # no heap on a node of one rank (every rank skips it alike)
                continue
            made = dist.new_group([global_ranks[r] for r in members], timeout=timeout)
            if rank in members:
                if not isinstance(made, dist.ProcessGroup):  # not reachable: this rank is a member
                    raise MoonEPInputError(f"rank {rank} is not a member of its own node's subgroup {list(members)}")
                mine = made
        entry = known[nodes.node_of] = _NodeGroups(mine)
    entry.users += 1
    return entry.mine


def release_node_subgroup(group: ProcessGroup | None, nodes: NodeMap, local: bool = False) -> None:
    """One user of ``acquire_node_subgroup`` is done; the last one destroys this rank's subgroup
    (``local``, after the group failed: only forgets it, since peers may be gone; torch frees it
    with the default group)."""
    parent = _parent(group)
    known = _SUBGROUPS.get(parent, {})
    entry = known.get(nodes.node_of)
    if entry is None:
        return
    entry.users -= 1
    if entry.users > 0:
        return
    del known[nodes.node_of]
    if entry.mine is not None and not local:
        dist.destroy_process_group(entry.mine)
