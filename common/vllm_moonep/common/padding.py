"""Padding a step to the buffer's capacity, and sanitizing router output for the planner."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.engine import MoonEPInputError


def _check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if topk_ids.shape != topk_weights.shape:
        raise MoonEPInputError(
            f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must have the same shape"
        )
    if topk_ids.is_floating_point():
        raise MoonEPInputError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")


def _check_rows(hidden: torch.Tensor, topk_ids: torch.Tensor, capacity: int) -> int:
    """The step's token count ``s``, after checking it fits ``capacity`` and matches the routing."""
    s = hidden.shape[0]
    if s > capacity:
        raise MoonEPInputError(f"MoonEP buffer capacity exceeded: {s} tokens > S={capacity}")
    if topk_ids.shape[0] != s:
        raise MoonEPInputError(f"topk_ids has {topk_ids.shape[0]} rows, hidden states {s}")
    return s


def sanitize_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     pad_expert: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ids and float32 weights; negative (invalid) ids become ``pad_expert`` with weight 0.

    MoonEP's planner has no sentinel for invalid ids, so such slots cost a little compute and
    contribute nothing.
    """
    _check_routing(topk_ids, topk_weights)
    ids = topk_ids.to(torch.int32)
    w = topk_weights.to(torch.float32)
    invalid = ids < 0
    ids = torch.where(invalid, torch.full_like(ids, int(pad_expert)), ids).contiguous()
    w = torch.where(invalid, torch.zeros_like(w), w).contiguous()
    return ids, w


def pad_to_capacity(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capacity: int, pad_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Sanitize and zero-pad ``[s, ...]`` inputs to ``capacity`` rows; returns ``(..., s)``.

    Padding rows route to ``pad_expert`` with weight 0 and hidden 0. Give each rank one of its own
    home experts (``MoonEPBufferPool.pad_expert``): padding then stays on its rank. Sent to one
    expert for all ranks, a decode step's ~``capacity*K`` padding entries per rank overfill that
    expert's home, and the plan prefetches it to every other rank each step.
    """
    s = _check_rows(hidden, topk_ids, capacity)
    ids, w = sanitize_routing(topk_ids, topk_weights, pad_expert)
    hidden = hidden.contiguous()
    pad = capacity - s
    if pad:
        hidden = F.pad(hidden, (0, 0, 0, pad))
        ids = F.pad(ids, (0, 0, 0, pad), value=int(pad_expert))
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
        s = _check_rows(hidden, topk_ids, capacity)
        _check_routing(topk_ids, topk_weights)
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
    x, ids, w, s = pad_to_capacity(hidden, topk_ids, topk_weights, capacity, pad_expert)
    return x, ids, w, tokens_per_expert(ids, num_experts), s


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Local bincount of the (sanitized) ids, int32 ``[E]``.

    On CPU, ids ``>= num_experts`` are rejected here (the bincount's length shows them for free).
    On CUDA the count stays on the device (``torch.bincount`` would read its length on the host):
    out-of-range ids are counted in a spill bin that is dropped, and the engine's device-side
    placement check reports them.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.device.type == "cuda":
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat.clamp(0, num_experts), torch.ones_like(flat, dtype=torch.int32))
        return counts[:num_experts]
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() > num_experts:
        raise MoonEPInputError(
            f"topk_ids must be in [0, {num_experts}) (negative ids are sanitized to expert 0), "
            f"got max {counts.numel() - 1}"
        )
    return counts.to(torch.int32)
