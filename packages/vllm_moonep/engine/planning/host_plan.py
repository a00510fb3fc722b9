"""The plan made on the host from the all-gathered counts (the collective and hybrid transports).

    tokens_per_expert [E] ─► all-gather (bounded) ─► tpe [R, E] on the host ─► every rank refuses
                             bad counts together ─► plan_global(tpe, S, K, B, tp)

The plan comes from the small ``[R, E]`` table, the one host read of the step; an all-to-all
needs its split sizes on the host anyway, and they come from the same plan. The symmetric
transport plans on the device instead (``device_planner.py``), inside its dispatch launch.
"""

from __future__ import annotations

import torch

from vllm_moonep.engine.errors import MoonEPInputError
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.planning.planner import GlobalPlan, plan_global

__all__ = ["plan_on_host"]


def plan_on_host(collectives: BoundedCollectives, tokens_per_expert: torch.Tensor, S: int, K: int, E: int, B: int,
                 token_padding: int) -> GlobalPlan:
    """All-gather every rank's counts over ``collectives`` and plan on the host (the same plan on
    every rank). ``MoonEPInputError`` on every rank together, before any row moves, when some
    rank's counts do not sum to ``S*K``."""
    tpe_all = collectives.all_gather(tokens_per_expert.to(torch.int64), "dispatch: all_gather(tokens_per_expert)")
    tpe_host = tpe_all.cpu()
    # every rank sees the same table, so all refuse together (nothing moved yet): counts that
    # do not sum to S*K mean ids outside [0, E) were dropped from the count (CUDA counts them
    # on the device) or a count that is not the ids' bincount
    short = [r for r, n in enumerate(tpe_host.sum(dim=1).tolist()) if n != S * K]
    if short:
        raise MoonEPInputError(
            f"dispatch: tokens_per_expert of rank(s) {short} does not sum to S*K = {S * K} "
            f"(sums {tpe_host.sum(dim=1).tolist()}): expert ids outside [0, {E}) or counts that are not "
            "the bincount of the ids; sanitize invalid ids first"
        )
    return plan_global(tpe_host, S, K, B, token_padding)
