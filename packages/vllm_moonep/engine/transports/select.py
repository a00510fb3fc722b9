"""Which transport a buffer uses: the names, and how ``transport="auto"`` picks one.

- ``symmetric`` (``symmetric.py``): one-sided writes into peers' receive buffers on a
  symmetric heap, device-side signals, no host synchronization; the fast path between GPUs of
  one node (NVLink/P2P), and CPU ranks over the host heap (how CI tests it). Needs every peer on
  this node.
- ``collective`` (``collective.py``): ``torch.distributed`` all-gather and all-to-all (gloo on
  CPU, NCCL on GPUs); works across nodes.
- ``hybrid`` (``hybrid.py``): per peer, in the same dispatch and combine: one-sided
  writes into the receive buffers of peers on this node (a heap over the node's ranks), one
  all-to-all for peers on other nodes. For groups that span nodes with several ranks per node.

Nodes are real hosts, or simulated ones (``VLLM_MOONEP_RANKS_PER_NODE``; ``engine/nodes.py``).
``auto``: on CUDA, ``symmetric`` when every peer is on this node, ``hybrid`` when the group spans
nodes and some node holds several ranks, ``collective`` when every rank is alone on its node; on
CPU ranks ``collective`` (gloo's all-to-all is what a CPU deployment would run; ``symmetric`` and
``hybrid`` run there over the host heap when asked, which is how CI tests them). An explicit
choice is honoured, except ``symmetric`` across nodes, which is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_moonep.engine.errors import MoonEPInputError

if TYPE_CHECKING:
    from vllm_moonep.engine.nodes import NodeMap

__all__ = ["TRANSPORTS", "resolve_transport"]

TRANSPORTS = ("auto", "symmetric", "collective", "hybrid")


def resolve_transport(requested: str, device_type: str, peers_addressable: bool = True, *,
                      nodes: NodeMap | None = None) -> tuple[str, str]:
    """``(name, reason)``: the transport ``requested`` selects on ``device_type`` (``cpu``/``cuda``).

    ``nodes``: the group's nodes (``NodeMap``), which decide between ``symmetric``, ``hybrid`` and
    ``collective``. Without it, ``peers_addressable`` says whether every peer is on this node (a
    caller that knows no more than that: across nodes ``auto`` then names ``collective``).
    ``MoonEPInputError`` for an unknown name or ``symmetric`` asked across nodes."""
    if requested not in TRANSPORTS:
        raise MoonEPInputError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    one_node = nodes.num_nodes == 1 if nodes is not None else peers_addressable
    shares = nodes.shares_nodes if nodes is not None else False
    where = nodes.describe() if nodes is not None else "some peers on other nodes"
    if requested == "symmetric" and not one_node:
        raise MoonEPInputError(
            f"transport='symmetric' needs every peer's memory addressable, and the group spans nodes ({where}): use "
            "transport='hybrid' (one-sided inside a node, all-to-all across nodes), 'collective' or 'auto'")
    if requested != "auto":
        return requested, "requested"
    if device_type != "cuda":
        return "collective", ("CPU ranks move rows with gloo all-to-all (transport='symmetric' or 'hybrid' runs over "
                              "the host heap)")
    if one_node:
        return "symmetric", "every peer is a GPU of this node: one-sided writes over NVLink/P2P"
    if shares:
        return "hybrid", (f"the group spans nodes ({where}): one-sided writes to peers on this node, all-to-all to "
                          "peers on other nodes")
    return "collective", f"every rank is alone on its node ({where}): all-to-all to every peer"
