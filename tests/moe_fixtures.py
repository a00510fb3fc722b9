"""Shared inputs for end-to-end MoE tests: global expert weights from a seed, per-rank routing,
and the comparison against the dense float32 reference (a rank's slice of the weights:
``vllm_moonep.testing.weights.local_experts``).

How close a MoonEP step must come to the dense reference (``check_against_dense``):

- A step rounds to bf16 where the reference stays in float32: each token's K expert outputs
  (the rows combine receives, after the activation was stored in bf16 too) and the combined
  output. One round-to-nearest moves a value by at most ``u = 2**-8`` of its size, so token
  ``t``'s *rounding budget* is ``u * (|ref_t| + sum_k |c_tk|)``, with ``c_tk = w_tk *
  FFN_{ids_tk}(x_t)`` its K contributions (norms over H).
- Row check: every token's error ``|out_t - ref_t|`` stays within ``ROW_SLACK`` budgets.
  Measured (CPU, 1 to 4 ranks, H=128..768, K=1..4, 2026-11-30): the worst token used 0.47 of
  its budget with the reference expert compute, 0.48 with ``torch._grouped_mm`` (which also
  rounds the gate and up projections), and 0.77 with the Triton kernels under Triton's
  interpreter, whose float-to-bf16 conversion truncates instead of rounding to nearest. A
  contribution that is mis-routed (another expert) or lost moves its token by about
  ``w * |FFN|``, which exceeds one budget from ``w`` of about 0.005: far below the smallest
  router weight the tests draw (about 0.02 at K=4). The previous per-token bound, 10 x 2e-2 of
  the token's norm, let such a contribution through up to ``w`` of about 0.1.
- Frobenius check: the relative error over the whole output stays below ``REL_TOL`` (1e-2).
  Measured 2.3e-3..3.2e-3 (reference compute), 3.6e-3..4.2e-3 (``torch._grouped_mm``),
  6.4e-3 (Triton interpreter, truncating), 5.1e-3 for vLLM's own classes in ``moonep-ab``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_moonep.testing.reference import dense_moe, random_expert_weights, relative_error
from vllm_moonep.testing.routing import route

#: bf16 keeps 8 significant bits: one round-to-nearest moves a value by at most 2**-8 of its size
BF16_UNIT_ROUNDOFF = 2.0**-8
#: bound on the relative Frobenius error of a whole step's output (see the module doc)
REL_TOL = 1e-2
#: bound on each token's error, in units of that token's bf16 rounding budget (module doc)
ROW_SLACK = 1.0


def global_weights(E: int, H: int, I: int, seed: int = 0):
    """``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]`` in bf16, scaled so outputs are O(1)."""
    return random_expert_weights(E, H, I, seed)


def rank_inputs(num_tokens: int, E: int, K: int, H: int, *, sigma: float, seed: int, rank: int):
    ids, w = route(num_tokens, E, K, sigma=sigma, seed=seed, rank=rank)
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    return x, ids, w


def dense_contributions(x, ids, w, w13, w2) -> torch.Tensor:
    """``c [s, K, H]`` float32 on the CPU: ``c[t, k] = w[t, k] * FFN_{ids[t, k]}(x[t])`` on the
    global weights (zero where the id is negative); ``c.sum(1)`` is the dense MoE."""
    x, ids, w = x.detach().cpu().float(), ids.detach().cpu().long(), w.detach().cpu().float()
    w13, w2 = w13.detach().cpu(), w2.detach().cpu()
    s, K = ids.shape
    I = w13.shape[1] // 2
    c = torch.zeros(s, K, w2.shape[1], dtype=torch.float32)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = F.silu(xe @ w13[e, :I].float().T) * (xe @ w13[e, I:].float().T)
        c[tok, k] = (h @ w2[e].float().T) * w[tok, k][:, None]
    return c


def _row_ratios(out: torch.Tensor, ref: torch.Tensor, contrib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio [s], budget [s])``: each token's error over its bf16 rounding budget (a token
    with no budget, all weights 0, must be exact: ratio 0 or inf)."""
    err = (out.detach().cpu().float() - ref).norm(dim=1)
    budget = BF16_UNIT_ROUNDOFF * (ref.norm(dim=1) + contrib.norm(dim=2).sum(dim=1))
    zero = torch.where(err > 0, torch.full_like(err, float("inf")), torch.zeros_like(err))
    return torch.where(budget > 0, err / budget.clamp_min(1e-30), zero), budget


def _assert_rows(ratio, budget, ids, w, slack: float) -> float:
    worst = int(ratio.argmax())
    r = float(ratio[worst])
    assert r <= slack, (
        f"token {worst}: error {r:.2f} x its bf16 rounding budget {float(budget[worst]):.3e} (allowed {slack}); "
        f"ids {ids[worst].tolist()}, weights {[round(v, 4) for v in w[worst].tolist()]}: "
        "a contribution is missing, mis-routed or scaled wrong"
    )
    return r


def check_rows_against_dense(out, x, ids, w, w13, w2, *, slack: float = ROW_SLACK) -> float:
    """Every token of ``out [s, H]`` against the dense float32 MoE within ``slack`` of its bf16
    rounding budget (module doc); returns the worst token's ratio."""
    contrib = dense_contributions(x, ids, w, w13, w2)
    assert out.shape == (contrib.shape[0], contrib.shape[2]), (tuple(out.shape), tuple(contrib.shape))
    if contrib.shape[0] == 0:
        return 0.0
    ratio, budget = _row_ratios(out, contrib.sum(dim=1), contrib)
    return _assert_rows(ratio, budget, ids, w, slack)


def check_against_dense(out, x, ids, w, w13, w2, *, tol: float = REL_TOL, slack: float = ROW_SLACK) -> float:
    """``out [s, H]`` against the dense float32 MoE: relative Frobenius error below ``tol`` and
    every token within ``slack`` of its bf16 rounding budget (module doc). Returns the relative
    error."""
    ref = dense_moe(x.detach().cpu(), ids.detach().cpu(), w.detach().cpu(), w13.detach().cpu(), w2.detach().cpu())
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all()
    if ref.numel() == 0:
        return 0.0
    err = relative_error(out.detach().cpu(), ref)
    assert err < tol, f"relative error {err:.3e} against the dense reference (allowed {tol:.1e})"
    ratio, budget = _row_ratios(out, ref, dense_contributions(x, ids, w, w13, w2))
    _assert_rows(ratio, budget, ids.detach().cpu(), w.detach().cpu(), slack)
    return err
