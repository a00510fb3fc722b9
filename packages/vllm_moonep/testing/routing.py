"""Skewed routing, generated the way the field measures imbalance.

``maxvio = max_e(T_e / mean_e T) - 1`` over the global per-expert token counts ``T``. Expert
popularity is ``exp(N(0, sigma))`` drawn from a seed shared by every rank (so hot experts line up
across ranks, as they do in real traffic); each token's K experts are drawn without replacement
from that popularity with a per-rank seed. ``sigma_for_maxvio`` inverts the relation.
"""

from __future__ import annotations

import torch

__all__ = ["expert_popularity", "maxvio", "route", "sample_topk", "sigma_for_maxvio"]


def maxvio(counts: torch.Tensor) -> float:
    """``max(T) / mean(T) - 1`` of per-expert counts (any shape whose last dim is experts)."""
    t = counts.reshape(-1, counts.shape[-1]).sum(dim=0).double()
    mean = t.mean()
    return float(t.max() / mean - 1.0) if mean > 0 else 0.0


def expert_popularity(num_experts: int, sigma: float, seed: int = 0) -> torch.Tensor:
    """Normalised popularity ``exp(N(0, sigma))`` of each expert (float64, sums to 1)."""
    g = torch.Generator().manual_seed(int(seed))
    logits = torch.randn(num_experts, generator=g, dtype=torch.float64) * float(sigma)
    p = torch.exp(logits - logits.max())
    return p / p.sum()


def sample_topk(num_tokens: int, k: int, popularity: torch.Tensor, seed: int) -> torch.Tensor:
    """``[num_tokens, k]`` int32 expert ids, each row without replacement from ``popularity``."""
    if k > popularity.numel():
        raise ValueError(f"top-k {k} exceeds the number of experts {popularity.numel()}")
    if num_tokens == 0:
        return torch.empty(0, k, dtype=torch.int32)
    g = torch.Generator().manual_seed(int(seed))
    probs = popularity.to(torch.float64).expand(num_tokens, -1)
    return torch.multinomial(probs, k, replacement=False, generator=g).to(torch.int32)


def route(
    num_tokens: int,
    num_experts: int,
    k: int,
    *,
    sigma: float = 0.0,
    seed: int = 0,
    rank: int = 0,
    device: torch.device | str = "cpu",
    popularity_seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's router output: ``(topk_ids [s,k] int32, topk_weights [s,k] float32)``.

    Popularity uses ``popularity_seed`` (shared; ``None``: ``seed``), so steps that draw fresh tokens
    from the popularity ``sigma_for_maxvio`` calibrated keep its skew; ids and weights use
    ``(seed, rank)`` (per rank). Weights are positive and sum to 1 per token, like a softmax router
    renormalised over its top-k.
    """
    pop = expert_popularity(num_experts, sigma, seed if popularity_seed is None else popularity_seed)
    rank_seed = (int(seed) * 1_000_003 + 7919 * (int(rank) + 1)) % (2**62)
    ids = sample_topk(num_tokens, k, pop, rank_seed)
    g = torch.Generator().manual_seed(rank_seed + 1)
    w = torch.rand(num_tokens, k, generator=g, dtype=torch.float32) + 0.05
    w = w / w.sum(dim=1, keepdim=True)
    return ids.to(device), w.to(device)


def sigma_for_maxvio(
    target: float, num_experts: int, k: int, num_tokens: int, *, seed: int = 0, iters: int = 40
) -> float:
    """The ``sigma`` whose routing of ``num_tokens`` tokens (all ranks together) has ``maxvio ~= target``.

    Bisection with common random numbers, so the measured curve is monotone in practice. Targets
    below the sampling noise of uniform routing give 0; targets above what top-k without
    replacement allows (``E/k - 1``) give the largest sigma tried.
    """
    if target < 0:
        raise ValueError(f"maxvio target must be >= 0, got {target}")

    def measure(sigma: float) -> float:
        ids = sample_topk(num_tokens, k, expert_popularity(num_experts, sigma, seed), seed + 12345)
        return maxvio(torch.bincount(ids.reshape(-1).long(), minlength=num_experts))

    lo, hi = 0.0, 8.0
    if measure(lo) >= target:
        return 0.0
    if measure(hi) <= target:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if measure(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
