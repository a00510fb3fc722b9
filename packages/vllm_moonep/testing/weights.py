"""Weight helpers: a rank's share of seeded global expert weights.

Every rank draws the same global ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``
(``reference.random_expert_weights``) and keeps the rows of its home experts: rank ``r`` of
``R`` owns experts ``[r*E/R, (r+1)*E/R)``, the owner rule of the MoonEP contract. The slices are
copies, so a layout that adopts or frees them leaves the global weights (the reference) intact.
"""

from __future__ import annotations

import torch

__all__ = ["interleaved", "local_experts", "local_rows"]


def local_rows(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A copy of rank ``rank``'s ``E/R`` home rows of the global ``w [E, ...]``."""
    E = w.shape[0]
    if world_size <= 0 or E % world_size or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size} cannot own E/R of {E} experts")
    epn = E // world_size
    return w[rank * epn:(rank + 1) * epn].clone()


def local_experts(w13: torch.Tensor, w2: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(w13 [E/R, 2I, H], w2 [E/R, H, I])``, copies of its home experts' rows."""
    return local_rows(w13, rank, world_size), local_rows(w2, rank, world_size)


def interleaved(w):
    """The same experts as the ``GroupedWeights`` ``w``, each pool's gate and up stored interleaved in one ``w13``
    (the symmetric layout's order: the Triton gate/up tiles then read one weight), the group map unchanged."""
    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up

    w13s = [interleave_gate_up(g, u) for g, u in zip(w.gate, w.up)]
    return GroupedWeights([t[:, 0::2] for t in w13s], [t[:, 1::2] for t in w13s], list(w.down), w.group_pool,
                          w.group_row, w.dense_groups)
