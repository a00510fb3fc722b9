"""The expert compute's shared types: where each group's weights live (``GroupedWeights``), the two
orders a ``w13`` holds gate and up in, and the padding-tail argument rule every implementation follows.
A leaf: the dispatcher (``api``) and every implementation import it; it imports none of them.

A ``w13 [N, 2I, H]`` holds each expert's gate and up rows in one of two orders::

    halves       rows [0, I): gate, [I, 2I): up         (vLLM's w13; gate = w13[:, :I], up = w13[:, I:])
    interleaved  row 2j: gate row j, row 2j + 1: up row j (gate = w13[:, 0::2], up = w13[:, 1::2])

Both reach the implementations as ``gate``/``up`` views of one storage, no copy. Interleaved is the order
the symmetric layout stores (``interleave_w13`` converts once, at load): the Triton gate/up tiles then
read one ``[2BN, BK]`` block per step and run one MMA twice as wide (``triton_tiles.gate_up_acc``,
``W13I``): the whole compute 2-4% faster at Qwen3-30B-A3B 64-4096 tokens per rank and Kimi-K2 1024-4096,
within noise below (docs/PERFORMANCE.md, "Tile options"); the library GEMMs run it as one
``[N, 2I, H]`` operand whose output columns alternate gate and up (``gate_up_interleaved``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from vllm_moonep.engine.errors import MoonEPInputError


#: where ``gate_up_as_one``, ``gate_up_interleaved`` and ``interleaved`` keep what they found, beside the device copies
_GATE_UP_KEY = "gate_up_as_one"
_W13I_VIEW_KEY = "gate_up_interleaved"
_INTERLEAVED_KEY = "interleaved"


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, 2I, H]`` with gate and up interleaved row by row (row ``2j``: ``gate[:, j]``, ``2j + 1``:
    ``up[:, j]``) from ``gate``, ``up`` ``[N, I, H]`` (the halves of a ``w13``: ``w13[:, :I]``,
    ``w13[:, I:]``). Written into ``out`` when given (no temporary; ``out`` must not overlap the inputs)."""
    if gate.dim() != 3 or gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise MoonEPInputError(f"interleave_gate_up: gate and up must be [N, I, H] of one dtype and device, got "
                               f"{list(gate.shape)} {gate.dtype} {gate.device} and {list(up.shape)} {up.dtype} "
                               f"{up.device}")
    n, i, h = gate.shape
    if out is None:
        out = torch.empty((n, 2 * i, h), dtype=gate.dtype, device=gate.device)
    elif tuple(out.shape) != (n, 2 * i, h) or out.dtype != gate.dtype or out.device != gate.device:
        raise MoonEPInputError(f"interleave_gate_up: out must be [{n}, {2 * i}, {h}] {gate.dtype} on {gate.device}, "
                               f"got {list(out.shape)} {out.dtype} {out.device}")
    out[:, 0::2].copy_(gate)
    out[:, 1::2].copy_(up)
    return out


def interleave_w13(w13: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w13 [N, 2I, H]`` in halves (gate rows first: vLLM's order) interleaved (``interleave_gate_up``), into
    ``out`` when given (which must not overlap ``w13``)."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise MoonEPInputError(f"interleave_w13: w13 must be [N, 2I, H], got {list(w13.shape)}")
    I = w13.shape[1] // 2
    return interleave_gate_up(w13[:, :I], w13[:, I:], out=out)


def interleaved_views(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``gate`` and ``up`` ``[N, I, H]`` are ``w13[:, 0::2]`` and ``w13[:, 1::2]`` of one ``[N, 2I, H]``
    storage with unit column stride (the interleaved order), from their strides and offsets alone."""
    if gate.dim() != 3 or gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return False
    n, I, H = gate.shape
    return bool(gate.stride() == up.stride() and gate.stride(2) == 1 and gate.stride(1) == 2 * H
                and (n <= 1 or gate.stride(0) >= 2 * I * H)
                and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
                and up.storage_offset() - gate.storage_offset() == H)


@dataclass(frozen=True)
class GroupedWeights:
    """Where each ``cu_seqlens`` group's expert weights live.

    Attributes:
        gate, up: pools of rows, each ``[N_p, I, H]``; ``down``: pools ``[N_p, H, I]`` (same
            pool count; pool ``p`` of each projection holds the same experts).
        group_pool, group_row: ``[G]`` int64 on the host: group ``g`` reads row
            ``group_row[g]`` of pool ``group_pool[g]``; ``-1`` means the group has no weights
            and must be empty.
        dense_groups: optional ``[N_0]`` int64: when set, row ``j`` of pool 0 serves group
            ``dense_groups[j]`` and every other group is empty by construction, so pool 0 can
            be handed to ``torch._grouped_mm`` as one dense tensor.
    """

    gate: Sequence[torch.Tensor]
    up: Sequence[torch.Tensor]
    down: Sequence[torch.Tensor]
    group_pool: torch.Tensor
    group_row: torch.Tensor
    dense_groups: torch.Tensor | None = None
    _device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()  # at construction, once: every holder of a GroupedWeights may rely on it

    def dense_groups_on(self, device: torch.device) -> torch.Tensor:
        """``dense_groups`` on ``device``, copied once (not on every expert call)."""
        key = str(device)
        t = self._device_copies.get(key)
        if t is None:
            assert self.dense_groups is not None, "dense_groups_on: these weights are not dense"
            t = self._device_copies[key] = self.dense_groups.to(device)
        return t

    @staticmethod
    def contiguous(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> "GroupedWeights":
        """One ``[G, out, in]`` tensor per projection; group ``g`` reads row ``g``."""
        G = gate.shape[0]
        ar = torch.arange(G, dtype=torch.int64)
        return GroupedWeights([gate], [up], [down], torch.zeros(G, dtype=torch.int64), ar, ar)

    @staticmethod
    def of_w13(w13: torch.Tensor, down: torch.Tensor, *, interleaved: bool) -> "GroupedWeights":
        """``w13 [G, 2I, H]`` (gate and up in the order ``interleaved`` says: the module doc) and ``down
        [G, H, I]``; group ``g`` reads row ``g``. Views of ``w13``, no copy."""
        if w13.dim() != 3 or w13.shape[1] % 2:
            raise MoonEPInputError(f"GroupedWeights.of_w13: w13 must be [G, 2I, H], got {list(w13.shape)}")
        I = w13.shape[1] // 2
        if interleaved:
            return GroupedWeights.contiguous(w13[:, 0::2], w13[:, 1::2], down)
        return GroupedWeights.contiguous(w13[:, :I], w13[:, I:], down)

    @property
    def num_groups(self) -> int:
        return int(self.group_pool.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.gate[0].dtype

    @property
    def hidden(self) -> int:
        return int(self.gate[0].shape[2])

    @property
    def intermediate(self) -> int:
        return int(self.gate[0].shape[1])

    def rows(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [I,H], up [I,H], down [H,I])`` of group ``g``."""
        p = int(self.group_pool[g])
        if p < 0:
            raise MoonEPInputError(f"group {g} has rows but no weights (its row source is -1)")
        r = int(self.group_row[g])
        return self.gate[p][r], self.up[p][r], self.down[p][r]

    def gate_up_as_one(self) -> torch.Tensor | None:
        """Pool 0's gate and up as one ``[N, 2I, H]`` view (gate rows, then up rows, per expert: vLLM's
        ``w13``) when up's rows follow gate's in one storage with the same strides; ``None`` otherwise
        (separate tensors: the replicated layout). The libraries' grouped GEMMs run gate and up as one
        operand through it. Found once per weights object (a view: no memory)."""
        if _GATE_UP_KEY not in self._device_copies:
            g, u = self.gate[0], self.up[0]
            n, I, H = g.shape
            one = None
            if (g.stride() == u.stride() and g.stride(2) == 1 and g.stride(1) == H
                    and (n <= 1 or g.stride(0) >= 2 * I * H)
                    and g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
                    and u.storage_offset() - g.storage_offset() == I * H):
                one = g.as_strided((n, 2 * I, H), (g.stride(0), H, 1))
            self._device_copies[_GATE_UP_KEY] = one
        return self._device_copies[_GATE_UP_KEY]

    @property
    def interleaved(self) -> bool:
        """Every pool holds gate and up interleaved in one storage (``interleaved_views``): the Triton
        gate/up tiles then read both as one weight (``W13I``). Metadata only; found once."""
        if _INTERLEAVED_KEY not in self._device_copies:
            self._device_copies[_INTERLEAVED_KEY] = all(interleaved_views(g, u) for g, u in zip(self.gate, self.up))
        return bool(self._device_copies[_INTERLEAVED_KEY])

    def gate_up_interleaved(self) -> torch.Tensor | None:
        """Pool 0's gate and up as the one interleaved ``[N, 2I, H]`` view they are rows of (row ``2j`` gate row
        ``j``, ``2j + 1`` up row ``j``) when they are (``interleaved_views``); ``None`` otherwise. A grouped GEMM on
        it writes gate and up in alternating columns. Found once per weights object (a view: no memory)."""
        if _W13I_VIEW_KEY not in self._device_copies:
            g, u = self.gate[0], self.up[0]
            n, I, H = g.shape
            one = g.as_strided((n, 2 * I, H), (g.stride(0), H, 1)) if interleaved_views(g, u) else None
            self._device_copies[_W13I_VIEW_KEY] = one
        return self._device_copies[_W13I_VIEW_KEY]

    def validate(self) -> None:
        """``MoonEPInputError`` naming the first inconsistent pool; metadata only (shapes, dtypes, devices: no
        device read). Run at construction."""
        n = len(self.gate)
        if not (n == len(self.up) == len(self.down)) or n == 0:
            raise MoonEPInputError("GroupedWeights: gate, up and down need the same, non-zero number of pools")
        if self.group_pool.dim() != 1 or self.group_row.shape != self.group_pool.shape:
            raise MoonEPInputError(f"GroupedWeights: group_pool and group_row must be [G], got "
                                   f"{list(self.group_pool.shape)}, {list(self.group_row.shape)}")
        I, H = self.intermediate, self.hidden
        device = self.gate[0].device
        for p in range(n):
            g, u, d = self.gate[p], self.up[p], self.down[p]
            if g.dim() != 3 or tuple(g.shape[1:]) != (I, H) or tuple(u.shape) != tuple(g.shape):
                raise MoonEPInputError(f"GroupedWeights pool {p}: gate/up must be [N, I={I}, H={H}], got {list(g.shape)}, {list(u.shape)}")
            if d.dim() != 3 or tuple(d.shape[1:]) != (H, I) or d.shape[0] != g.shape[0]:
                raise MoonEPInputError(f"GroupedWeights pool {p}: down must be [N={g.shape[0]}, H={H}, I={I}], got {list(d.shape)}")
            if len({g.dtype, u.dtype, d.dtype, self.dtype}) != 1:
                raise MoonEPInputError(f"GroupedWeights pool {p}: all weights must share one dtype, got gate "
                                       f"{g.dtype}, up {u.dtype}, down {d.dtype}")
            if not g.device == u.device == d.device == device:
                raise MoonEPInputError(f"GroupedWeights pool {p}: all weights must be on one device ({device}), got "
                                       f"gate on {g.device}, up on {u.device}, down on {d.device}")


def check_tail_args(row_ends: torch.Tensor | None, zero_tail: bool, who: str) -> None:
    """``zero_tail=False`` only with ``row_ends``: without each segment's end of entries an entry row of
    weight 0 (a sanitized invalid id's), which combine reads, cannot be told from the padding tail."""
    if not zero_tail and row_ends is None:
        raise MoonEPInputError(f"{who}: zero_tail=False needs row_ends (each segment's end of entries): without "
                               "them an entry row of weight 0, which combine reads, cannot be told from the "
                               "padding tail")
