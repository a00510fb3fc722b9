"""A step's inputs padded, sanitized and counted on the device in one launch (after one memset).

    hidden [s, H], topk_ids [s, K] (any int), topk_weights [s, K] (any float)
        ──► _pad_kernel, grid cap/ROWS, program = ROWS token rows:
              rows < s:  hidden row copied; ids to int32 (past int32: 2**31 - 1), an id < 0 becomes
                         pad_expert with weight 0
              rows >= s: hidden 0, ids pad_expert, weight 0
              counts of its ids in [0, E) added to tpe (one histogram, then one atomic per used bin)
        ──► x [cap, H], ids [cap, K] int32, w [cap, K] f32, tpe [E] int32: the staging tensors

Why: the same step in torch ops (``padding.pad_to_capacity`` + ``tokens_per_expert``: casts,
``where``s, three pads, a scatter-add) is about fifteen launches, 0.3-1 ms of host time per eager
MoE step on an H200 host (moonep-ab's "pad" phase) and fifteen graph nodes under a CUDA graph.
Writing into the pool's staging tensors also gives dispatch the same input addresses every step,
so its eager graph reads them in place instead of copying (``engine/transports/eager_graphs.py``).

Same values as the torch path (``tests/unit/test_pad_kernel.py`` compares every output); ids at
or above ``E`` are kept and not counted, as there (the engine's placement reports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where the kernel is made: CPU-only installs have no Triton
    from vllm_moonep.engine.launch import Launcher

__all__ = ["pad_and_count_on_device"]

_ROWS = 4  # token rows per program


def _kernel() -> "Launcher":
    global _launcher
    if _launcher is not None:
        return _launcher
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["s", "pad_expert"])
    def pad_kernel(x, sx0, sx1, ids, si0, si1, w, sw0, sw1, xo, io, wo, tpe, s, cap, H, K, E, pad_expert,
                   ROWS: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows = t < cap
        real = t < s
        t64 = t.to(tl.int64)
        k = tl.arange(0, K_P)
        src = real[:, None] & (k < K)[None, :]
        dst = rows[:, None] & (k < K)[None, :]
        raw = tl.load(ids + t64[:, None] * si0 + k[None, :] * si1, mask=src, other=-1)
        wv = tl.load(w + t64[:, None] * sw0 + k[None, :] * sw1, mask=src, other=0.0).to(tl.float32)
        bad = raw < 0  # padding rows and invalid ids: the rank's own expert, weight 0 (before the cast)
        # an id past int32 stays past E (the cast alone wrapped 2**32 + 3 to expert 3)
        e = tl.minimum(raw, 2147483647).to(tl.int32)
        e = tl.where(bad, pad_expert, e)
        wv = tl.where(bad, 0.0, wv)
        tl.store(io + t64[:, None] * K + k[None, :], e, mask=dst)
        tl.store(wo + t64[:, None] * K + k[None, :], wv, mask=dst)
        counted = dst & (e < E)
        hist = tl.histogram(tl.reshape(tl.where(counted, e, 0), [ROWS * K_P]), E_P,
                            mask=tl.reshape(counted, [ROWS * K_P]))
        b = tl.arange(0, E_P)
        tl.atomic_add(tpe + b, hist, mask=(b < E) & (hist > 0), sem="relaxed")
        hcol = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hm = (h0 + hcol < H)[None, :]
            v = tl.load(x + t64[:, None] * sx0 + (h0 + hcol)[None, :] * sx1, mask=real[:, None] & hm, other=0.0)
            tl.store(xo + t64[:, None] * H + (h0 + hcol)[None, :], v, mask=rows[:, None] & hm)

    from vllm_moonep.engine.launch import Launcher

    _launcher = Launcher(pad_kernel)
    return _launcher


_launcher: "Launcher | None" = None


def pad_and_count_on_device(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            pad_expert: int, staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
                            ) -> None:
    """Fill ``staging = (x [cap, H], ids [cap, K] int32, w [cap, K] f32, tpe [E] int32)`` (see the
    module doc); shapes are the caller's to check (``padding.pad_and_count``)."""
    import triton

    x, ids, w, tpe = staging
    cap, H = x.shape
    K = ids.shape[1]
    E = tpe.shape[0]
    s = hidden.shape[0]
    tpe.zero_()
    _kernel()(
        (triton.cdiv(cap, _ROWS), 1, 1),
        hidden, hidden.stride(0), hidden.stride(1), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), x, ids, w, tpe, s, cap, H, K, E, int(pad_expert),
        ROWS=_ROWS, K_P=max(2, triton.next_power_of_2(K)), E_P=max(2, triton.next_power_of_2(E)),
        BLOCK_H=min(2048, max(16, triton.next_power_of_2(H))), num_warps=4,
    )
