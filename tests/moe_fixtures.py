"""Shared inputs for end-to-end MoE tests: global expert weights from a seed, local slices,
per-rank routing, and the comparison against the dense float32 reference."""

from __future__ import annotations

import torch

from vllm_moonep.common.reference import dense_moe, random_expert_weights, relative_error
from vllm_moonep.common.routing import route


def global_weights(E: int, H: int, I: int, seed: int = 0):
    """``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]`` in bf16, scaled so outputs are O(1)."""
    return random_expert_weights(E, H, I, seed)


def local_experts(w13, w2, rank: int, world: int):
    epn = w13.shape[0] // world
    return w13[rank * epn:(rank + 1) * epn].clone(), w2[rank * epn:(rank + 1) * epn].clone()


def rank_inputs(num_tokens: int, E: int, K: int, H: int, *, sigma: float, seed: int, rank: int):
    ids, w = route(num_tokens, E, K, sigma=sigma, seed=seed, rank=rank)
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    return x, ids, w


def check_against_dense(out, x, ids, w, w13, w2, *, tol: float = 2e-2):
    """Relative Frobenius error against the dense float32 MoE; bf16 weights, activations and
    output each round once (~4e-3 each), so 2e-2 leaves room without hiding a wrong row."""
    ref = dense_moe(x, ids, w, w13, w2)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all()
    if ref.numel() == 0:
        return 0.0
    err = relative_error(out, ref)
    assert err < tol, f"relative error {err:.3e} against the dense reference"
    # no token may be badly wrong even if the average is fine
    per_tok = (out.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-3)
    assert float(per_tok.max()) < 10 * tol, f"worst token relative error {float(per_tok.max()):.3e}"
    return err
