"""The end-to-end comparison of ``tests/moe_fixtures.py`` catches what it is meant to: a real
MoonEP step (world of one, built-in engine) passes; the same step with one low-weight
contribution mis-routed, lost or scaled fails, where the former tolerances passed it."""

from __future__ import annotations

import pytest
import torch

from tests.moe_fixtures import (
    REL_TOL,
    ROW_SLACK,
    check_against_dense,
    check_rows_against_dense,
    dense_contributions,
    global_weights,
    rank_inputs,
)
from vllm_moonep.common import MoonEPBufferPool, MoonEPMoE
from vllm_moonep.replicated import ReplicatedWeightLayout
from vllm_moonep.testing.reference import dense_moe, relative_error

E, H, I, K, B = 16, 128, 256, 4, 4
TOKENS = 96


@pytest.fixture(scope="module")
def step():
    """A real step's inputs and a function that runs the step on other routing."""
    w13, w2 = global_weights(E, H, I, seed=3)
    layout = ReplicatedWeightLayout(w13.clone(), w2.clone(), E, B)
    pool = MoonEPBufferPool(dict(H=H, K=K, E=E, num_ep_ranks=1, B=B, device="cpu"), 128, engine="builtin")
    moe = MoonEPMoE(pool, layout, impl="reference")
    x, ids, w = rank_inputs(TOKENS, E, K, H, sigma=1.5, seed=21, rank=0)
    yield x, ids, w, w13, w2, moe.forward
    pool.destroy()
    layout.destroy()


def _lowest_weight_entry(w):
    t, k = divmod(int(w.argmin()), w.shape[1])
    return t, k


def _former_check_passes(out, x, ids, w, w13, w2) -> bool:
    """The tolerance this module replaced: Frobenius 2e-2, each token within 10 x 2e-2 of its norm."""
    ref = dense_moe(x, ids, w, w13, w2)
    per_tok = (out.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-3)
    return relative_error(out, ref) < 2e-2 and float(per_tok.max()) < 0.2


def test_correct_step_passes_both_checks(step):
    """A tolerance tighter than the bf16 numerics would fail correct steps (flaky end-to-end tests)."""
    x, ids, w, w13, w2, forward = step
    out = forward(x, ids, w)
    assert check_against_dense(out, x, ids, w, w13, w2) < REL_TOL / 2
    assert check_rows_against_dense(out, x, ids, w, w13, w2) < ROW_SLACK / 1.5


def test_misrouted_low_weight_contribution_is_caught(step):
    """One token's lowest-weight entry sent to the wrong expert passed the former 10x2e-2 per-token bound."""
    x, ids, w, w13, w2, forward = step
    t, k = _lowest_weight_entry(w)
    assert float(w[t, k]) < 0.05, "the case must be a low-weight contribution"
    wrong = ids.clone()
    wrong[t, k] = next(e for e in range(E) if e not in ids[t].tolist())
    out = forward(x, wrong, w)
    assert _former_check_passes(out, x, ids, w, w13, w2)
    with pytest.raises(AssertionError, match=f"token {t}:"):
        check_against_dense(out, x, ids, w, w13, w2)
    with pytest.raises(AssertionError, match=f"token {t}:"):
        check_rows_against_dense(out, x, ids, w, w13, w2)


def test_lost_or_misweighted_low_weight_contribution_is_caught(step):
    """A dropped row (weight 0) or a route weight applied twice to one small entry went unnoticed."""
    x, ids, w, w13, w2, forward = step
    t, k = _lowest_weight_entry(w)
    for factor in (0.0, 2.0):
        bad_w = w.clone()
        bad_w[t, k] *= factor
        out = forward(x, ids, bad_w)
        assert _former_check_passes(out, x, ids, w, w13, w2)
        with pytest.raises(AssertionError, match=f"token {t}:"):
            check_against_dense(out, x, ids, w, w13, w2)


def test_contributions_sum_to_the_dense_moe_and_skip_invalid_ids():
    """The per-token budget must be built from the same contributions the dense reference sums."""
    w13, w2 = global_weights(8, 128, 128, seed=1)
    x, ids, w = rank_inputs(10, 8, 2, 128, sigma=0.0, seed=2, rank=0)
    ids = ids.clone()
    ids[0, 1] = -1
    c = dense_contributions(x, ids, w, w13, w2)
    assert c.shape == (10, 2, 128) and bool((c[0, 1] == 0).all())
    torch.testing.assert_close(c.sum(dim=1), dense_moe(x, ids, w, w13, w2), rtol=1e-5, atol=1e-6)
