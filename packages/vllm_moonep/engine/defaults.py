"""What the engine fills in when a caller leaves a choice open, each defined once.

- ``B=None``: ``default_num_slots(E, R)`` prefetch slots per rank; at most ``E``
  (``slots_beyond_experts``, the plugin's option check and the tools' ``--slots``).
- ``group=None``: the default process group, or a world of one without ``torch.distributed``
  (``group_rank_world``).
- ``device=None``: the current CUDA device, else the CPU; a bare ``cuda`` gets its index
  (``resolve_device``, ``current_cuda_device``).
- ``token_padding``: ``DEFAULT_TOKEN_PADDING`` rows (the buffer, the plugin's option, and the expert
  compute's assumption where its caller does not say).
- Whatever is chosen for the user is said once at INFO (``say_once``).

The buffer, the collective transport, the heaps, the pool, the layouts and the tools import
these, so the places that fill in the same default cannot drift apart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["DEFAULT_TOKEN_PADDING", "current_cuda_device", "default_num_slots", "group_rank_world", "resolve_device", "say_once",
           "slots_beyond_experts"]

_SAID: set[str] = set()

#: the multiple each group's segment of dispatched rows is padded to (and so starts at): DeepGEMM's grouped
#: GEMMs need their M alignment (128) to divide it, or one of their row blocks would straddle two groups
DEFAULT_TOKEN_PADDING = 128


def say_once(msg: str, logger: str = "vllm_moonep.engine", level: int = logging.INFO) -> None:
    """A choice made for the user (an ``auto`` resolved, a default filled in), said once per
    process at INFO (``level``: WARNING for a choice forced by a failure): once is enough to know
    it, and a per-step log would drown the rest."""
    if msg not in _SAID:
        _SAID.add(msg)
        logging.getLogger(logger).log(level, msg)


def default_num_slots(num_experts: int, num_ep_ranks: int) -> int:
    """``B`` when none is given: ``E // R``, one slot per home expert. A rank receives rows from
    at most one remote home group (``E/R`` experts), so with this many slots no remote expert
    ever misses a slot. Callers check that ``E`` and ``R`` are usable first."""
    return num_experts // num_ep_ranks


def slots_beyond_experts(num_slots: int, num_experts: int, num_ep_ranks: int) -> str | None:
    """Why ``num_slots`` prefetch slots per rank are too many for ``num_experts`` experts (``None``:
    they are not): the end of a refusal that starts with the setting's name. A rank never needs
    more redundant-expert slots than there are experts; the plugin's option check and the tools'
    ``--slots`` refuse with this one rule."""
    if num_slots <= num_experts:
        return None
    return (f"exceeds the model's {num_experts} experts: a rank never needs more redundant-expert slots than there "
            f"are experts (E/R = {num_experts // max(num_ep_ranks, 1)} per rank is a common choice)")


def group_rank_world(group: ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (``None``: the default group); ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise MoonEPInputError("a process group was given but torch.distributed is not initialised")
    return 0, 1


def current_cuda_device() -> torch.device:
    """The current CUDA device, with its index (tensors always report one, so comparisons need it)."""
    return torch.device("cuda", torch.cuda.current_device())


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None``: the current CUDA device if there is one, else CPU; a bare ``cuda`` gets its index and
    ``cpu:0`` loses it (each the way tensors report their device, so comparisons and cache keys agree)."""
    if device is None:
        return current_cuda_device() if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = current_cuda_device()
    elif device.type == "cpu":
        device = torch.device("cpu")
    return device
