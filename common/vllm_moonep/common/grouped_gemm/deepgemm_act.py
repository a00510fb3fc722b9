"""The activation between DeepGEMM's two grouped GEMMs: ``act = bf16(silu(g) * u * route_w)`` per row,
exactly 0 where the row's route weight is 0 (the padding tail, whose ``g``/``u`` rows may hold anything);
and ``zero_tails``, which gives DeepGEMM's down GEMM the same zeros behind the Triton gate/up tiles
(``impl="deepgemm_down"``: those tiles write each segment's rows up to its live end only).

    g [M, I], u [M, I] (bf16, any strides)  --one Triton launch-->  act [M, I] (dense)
    act, cu_seqlens [G], ends [G]           --one Triton launch-->  act[ends[g]:cu_seqlens[g]] = 0

``g`` and ``u`` are the two halves of DeepGEMM's ``[M, 2I]`` output (weights stored in halves) or its even and
odd columns (stored interleaved: ``h[:, 0::2]``, ``h[:, 1::2]``), which the kernel reads as contiguous pairs
(``PAIRED``: one 16-byte-wide load of both, split in registers, where strided loads of each would not vectorize).

On CPU tensors (outside Triton's interpreter) the same arithmetic runs in torch: what the plumbing
tests on CPU exercise; the kernel itself is checked against it under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moonep.engine.launch import interpreting

#: columns per program at most
BLOCK = 1024
#: ``zero_tails``: rows per store, and columns per program at most (a segment's tail is under the padding,
#: 128 rows, wherever its ends are the live ends the engine's dispatch writes)
ZERO_ROWS = 16
ZERO_BLOCK = 256


@triton.jit
def swiglu_route_kernel(g_ptr, u_ptr, rw_ptr, act_ptr, I, stride_g, stride_u, stride_a, col_g, col_u,
                        BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    w = tl.load(rw_ptr + row).to(tl.float32)
    if PAIRED:  # g and u alternate in one row (u at g + 1): one contiguous load of 2 * BLOCK, split in pairs
        pair = 2 * tl.program_id(1) * BLOCK + tl.arange(0, 2 * BLOCK)
        h = tl.load(g_ptr + row * stride_g + pair, mask=pair < 2 * I, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(h, (BLOCK, 2)))
    else:
        g = tl.load(g_ptr + row * stride_g + cols * col_g, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols * col_u, mask=m, other=0.0).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u * w
    a = tl.where(w != 0.0, a, 0.0)
    tl.store(act_ptr + row * stride_a + cols, a.to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def zero_tails_kernel(act_ptr, cu_ptr, ends_ptr, I, stride_a, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seg_end = tl.load(cu_ptr + g).to(tl.int64)
    seg_start = tl.load(cu_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    first = tl.minimum(tl.maximum(tl.load(ends_ptr + g).to(tl.int64), seg_start), seg_end)
    zeros = tl.zeros((ROWS, BLOCK), dtype=act_ptr.dtype.element_ty)
    for r0 in range(first, seg_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tl.store(act_ptr + rows[:, None] * stride_a + cols[None, :], zeros,
                 mask=(rows < seg_end)[:, None] & (cols < I)[None, :])


def zero_tails_torch(act: torch.Tensor, cu_seqlens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The kernel's stores in torch (reads the ends on the host)."""
    start = 0
    for end, live in zip(cu_seqlens.tolist(), ends.tolist()):
        act[min(max(live, start), end):end] = 0
        start = end
    return act


def zero_tails(act: torch.Tensor, cu_seqlens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``act[r] = 0`` for the rows of each segment ``g`` from ``ends[g]`` (clamped into the segment) to its end
    ``cu_seqlens[g]``; every other row untouched. No host synchronisation on CUDA."""
    G, I = cu_seqlens.numel(), act.shape[1]
    if G == 0:
        return act
    if act.device.type != "cuda" and not interpreting():
        return zero_tails_torch(act, cu_seqlens, ends)
    if act.stride(1) != 1:
        raise ValueError("zero_tails: act needs a unit column stride")
    blk = min(ZERO_BLOCK, triton.next_power_of_2(I))
    zero_tails_kernel[(G, triton.cdiv(I, blk))](act, cu_seqlens, ends, I, act.stride(0), ROWS=ZERO_ROWS, BLOCK=blk)
    return act


def swiglu_route_torch(g: torch.Tensor, u: torch.Tensor, route_w: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: float32 from the bf16 inputs, rounded once, 0 where the weight is."""
    w = route_w.float()[:, None]
    a = torch.nn.functional.silu(g.float()) * u.float() * w
    act.copy_(torch.where(w != 0, a, torch.zeros((), dtype=a.dtype, device=a.device)))
    return act


def swiglu_route(g: torch.Tensor, u: torch.Tensor, route_w: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """``act[r] = bf16(silu(g[r]) * u[r] * route_w[r])``, 0 where ``route_w[r] == 0``; ``act`` dense."""
    M, I = act.shape
    if M == 0:
        return act
    if act.device.type != "cuda" and not interpreting():
        return swiglu_route_torch(g, u, route_w, act)
    if act.stride(1) != 1:
        raise ValueError("swiglu_route: act needs a unit column stride")
    blk = min(BLOCK, triton.next_power_of_2(I))
    # the even and odd columns of one tensor (an interleaved w13's output): read as pairs, 16-byte loads
    paired = (g.stride(1) == u.stride(1) == 2 and g.stride(0) == u.stride(0)
              and u.data_ptr() == g.data_ptr() + g.element_size())
    # the kernel reads route_w[r] at unit stride (a column of a [T, K] tensor would scale rows by other rows' weights)
    swiglu_route_kernel[(M, triton.cdiv(I, blk))](g, u, route_w.contiguous(), act, I, g.stride(0), u.stride(0), act.stride(0),
                                                 g.stride(1), u.stride(1), BLOCK=blk, PAIRED=paired)
    return act
