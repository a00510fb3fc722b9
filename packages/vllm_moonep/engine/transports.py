"""The built-in engine's transports, and how ``transport="auto"`` picks one.

- ``symmetric`` (``symmetric_transport.py``): one-sided writes into peers' receive buffers on a
  symmetric heap, device-side signals, no host synchronization; the fast path between GPUs of
  one node (NVLink/P2P), and CPU ranks over the host heap (how CI tests it).
- ``collective`` (``collective.py``): ``torch.distributed`` all-gather and all-to-all (gloo on
  CPU, NCCL on GPUs); works across nodes.

``auto`` takes ``symmetric`` on CUDA when every peer runs on this host, else ``collective``.
"""

from __future__ import annotations

from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["TRANSPORTS", "resolve_transport"]

TRANSPORTS = ("auto", "symmetric", "collective")


def resolve_transport(requested: str, device_type: str, peers_addressable: bool = True) -> tuple[str, str]:
    """``(name, reason)``: the transport ``requested`` selects on ``device_type`` (``cpu``/``cuda``);
    ``peers_addressable`` says whether every peer's memory can be mapped (one node)."""
    if requested not in TRANSPORTS:
        raise MoonEPInputError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    if requested != "auto":
        return requested, "requested"
    if device_type != "cuda":
        return "collective", "CPU ranks move rows with gloo all-to-all (transport='symmetric' runs over the host heap)"
    if not peers_addressable:
        return "collective", "some peers' memory is not addressable from here (ranks on other nodes)"
    return "symmetric", "every peer is a GPU of this node: one-sided writes over NVLink/P2P"
