"""Padding a step to the buffer's capacity, and sanitizing router output for the planner."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.common.pool import as_int
from vllm_moonep.engine import MoonEPInputError

_INT32_MAX = 2**31 - 1


def _check_ids_dtype(topk_ids: torch.Tensor) -> None:
    if not isinstance(topk_ids, torch.Tensor):
        raise MoonEPInputError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise MoonEPInputError(f"topk_ids must be an integer tensor (expert ids), got {topk_ids.dtype}")


def _check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    _check_ids_dtype(topk_ids)
    if not isinstance(topk_weights, torch.Tensor):
        raise MoonEPInputError(f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
    if topk_ids.shape != topk_weights.shape:
        raise MoonEPInputError(
            f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must have the same shape"
        )
    if topk_ids.dim() != 2:
        raise MoonEPInputError(f"topk_ids and topk_weights must be [s, K], got {list(topk_ids.shape)}")
    if topk_ids.device != topk_weights.device:
        raise MoonEPInputError(f"topk_ids is on {topk_ids.device}, topk_weights on {topk_weights.device}")
    # the cast to int32 would wrap a wider id into [0, E) (2**32 + 3 -> 3); refused where the ids are
    # on the host (free); on CUDA (a host synchronization per step) _sanitize and the pad kernel keep
    # such an id past E instead, where dispatch's own checks see it
    if (topk_ids.device.type == "cpu" and topk_ids.dtype != torch.int32 and topk_ids.element_size() >= 4
            and topk_ids.numel() and int(topk_ids.max()) > _INT32_MAX):
        raise MoonEPInputError(
            f"topk_ids must be expert ids, which fit int32 (they are cast to it), got max {int(topk_ids.max())} "
            f"({topk_ids.dtype})"
        )


def _check_pad_expert(pad_expert: int, num_experts: int | None) -> int:
    """``pad_expert`` as an int: an expert id, in ``[0, num_experts)`` where that is known."""
    pe = as_int(pad_expert)
    if pe is None or pe < 0 or (num_experts is not None and pe >= num_experts):
        want = "a non-negative int (an expert id)" if num_experts is None else f"an expert id in [0, E={num_experts})"
        raise MoonEPInputError(f"pad_expert must be {want}, got {pad_expert!r}")
    return pe


def _check_rows(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capacity: int) -> int:
    """The step's token count ``s``, after checking the routing, that it fits ``capacity`` and matches the
    hidden states' rows and device."""
    _check_routing(topk_ids, topk_weights)
    s = hidden.shape[0]
    if s > capacity:
        raise MoonEPInputError(f"MoonEP buffer capacity exceeded: {s} tokens > S={capacity}")
    if topk_ids.shape[0] != s:
        raise MoonEPInputError(f"topk_ids has {topk_ids.shape[0]} rows, hidden states {s}")
    if topk_ids.device != hidden.device:
        raise MoonEPInputError(
            f"topk_ids and topk_weights are on {topk_ids.device}, the hidden states on {hidden.device}"
        )
    return s


def _sanitize(topk_ids: torch.Tensor, topk_weights: torch.Tensor, pad_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    invalid = topk_ids < 0  # before the cast, which could wrap a wide negative id to a valid one
    if topk_ids.dtype == torch.int64:  # an id past int32 stays past E (the cast alone wraps 2**32 + 3 to 3)
        topk_ids = topk_ids.clamp(max=_INT32_MAX)
    ids = topk_ids.to(torch.int32)
    w = topk_weights.to(torch.float32)
    ids = torch.where(invalid, torch.full_like(ids, pad_expert), ids).contiguous()
    w = torch.where(invalid, torch.zeros_like(w), w).contiguous()
    return ids, w


def sanitize_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     pad_expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ids and float32 weights; negative (invalid) ids become ``pad_expert`` with weight 0.

    MoonEP's planner has no sentinel for invalid ids, so such slots cost a little compute and
    contribute nothing.
    """
    _check_routing(topk_ids, topk_weights)
    return _sanitize(topk_ids, topk_weights, _check_pad_expert(pad_expert, None))


def pad_to_capacity(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capacity: int, pad_expert: int = 0,
    *, num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Sanitize and zero-pad ``[s, ...]`` inputs to ``capacity`` rows; returns ``(..., s)``.

    Padding rows route to ``pad_expert`` with weight 0 and hidden 0. Give each rank one of its own
    home experts (``MoonEPBufferPool.pad_expert``): padding then stays on its rank. Sent to one
    expert for all ranks, a decode step's ~``capacity*K`` padding entries per rank overfill that
    expert's home, and the plan prefetches it to every other rank each step. ``num_experts``: where
    given, ``pad_expert`` must be below it.
    """
    s = _check_rows(hidden, topk_ids, topk_weights, capacity)
    pad_expert = _check_pad_expert(pad_expert, num_experts)
    ids, w = _sanitize(topk_ids, topk_weights, pad_expert)
    hidden = hidden.contiguous()
    pad = capacity - s
    if pad:
        hidden = F.pad(hidden, (0, 0, 0, pad))
        ids = F.pad(ids, (0, 0, 0, pad), value=pad_expert)
        w = F.pad(w, (0, 0, 0, pad))
    return hidden, ids, w, s


def pad_and_count(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capacity: int, num_experts: int,
    pad_expert: int = 0, staging: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``pad_to_capacity`` then ``tokens_per_expert``: ``(x, ids, w, tpe, s)``.

    With ``staging`` (``MoonEPBufferPool.staging``: CUDA tensors sized for ``capacity``) and bf16
    hidden states, one device kernel writes all four into the staging tensors
    (``pad_kernel.py``: same values, two launches instead of about fifteen); otherwise torch ops.
    """
    if staging is not None and hidden.is_cuda and hidden.dtype == staging[0].dtype:
        s = _check_rows(hidden, topk_ids, topk_weights, capacity)
        pad_expert = _check_pad_expert(pad_expert, num_experts)
        x, ids, w, tpe = staging
        if (x.shape[0], x.shape[1], ids.shape[1], tpe.shape[0]) != (capacity, hidden.shape[1], topk_ids.shape[1],
                                                                      num_experts):
            raise MoonEPInputError(
                f"staging for [{x.shape[0]}, {x.shape[1]}] x top-{ids.shape[1]} over {tpe.shape[0]} experts, the step is "
                f"[{capacity}, {hidden.shape[1]}] x top-{topk_ids.shape[1]} over {num_experts}"
            )
        from vllm_moonep.common.pad_kernel import pad_and_count_on_device

        pad_and_count_on_device(hidden, topk_ids, topk_weights, pad_expert, (x, ids, w, tpe))
        return x, ids, w, tpe, s
    x, ids, w, s = pad_to_capacity(hidden, topk_ids, topk_weights, capacity, pad_expert, num_experts=num_experts)
    return x, ids, w, tokens_per_expert(ids, num_experts), s


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Local bincount of the sanitized ids (``sanitize_routing``: no negative ids), int32 ``[E]``.

    On CPU, ids outside ``[0, num_experts)`` are rejected here (the bincount's length shows those
    above for free). On CUDA the count stays on the device (``torch.bincount`` would read its length
    on the host) and the ids are not checked: those above are counted in a spill bin that is dropped,
    negative ones as expert 0, and the engine's device-side placement check reports them.
    """
    _check_ids_dtype(topk_ids)
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.device.type == "cuda":
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat.clamp(0, num_experts), torch.ones_like(flat, dtype=torch.int32))
        return counts[:num_experts]
    if flat.numel() and int(flat.min()) < 0:
        raise MoonEPInputError(
            f"topk_ids must be in [0, {num_experts}): negative (invalid) ids must be sanitized first "
            f"(sanitize_routing), got min {int(flat.min())}"
        )
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() > num_experts:
        raise MoonEPInputError(f"topk_ids must be in [0, {num_experts}), got max {counts.numel() - 1}")
    return counts.to(torch.int32)
