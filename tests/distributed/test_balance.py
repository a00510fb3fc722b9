"""``moonep-balance`` on 2 spawned ranks: its measured figures against an independent computation
of the same routing (the generator's output, counted here, through the contract planner's
loop-by-loop transcription), not against the formulas that produced them."""

from __future__ import annotations

import math

import pytest

from tests.reference_planner import reference_plan
from vllm_moonep.testing.launch import launched_world_size
from vllm_moonep.testing.routing import route
from vllm_moonep.tools import balance

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="the balance tool spawns its own ranks")

R, S, E, K, H, SEED = 2, 64, 16, 4, 128, 3


def _ratio(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean


def check_rows_independently(rows, ranks, tokens, experts, topk, seed, token_padding=balance.DEFAULT_TOKEN_PADDING):
    """Each row's figures from the routing each rank drew, counted and planned here."""
    epn = experts // ranks
    for row in rows:
        tpe = [[0] * experts for _ in range(ranks)]
        for r in range(ranks):
            ids, _ = route(tokens, experts, topk, sigma=row["sigma"], seed=seed, rank=r)
            for e in ids.reshape(-1).tolist():
                tpe[r][e] += 1
        count = [sum(tpe[r][e] for r in range(ranks)) for e in range(experts)]
        home = [sum(count[d * epn:(d + 1) * epn]) for d in range(ranks)]
        plan = reference_plan(tpe, tokens, topk, epn, token_padding)
        padded = [plan["cu"][d][-1] for d in range(ranks)]
        padded_home = [sum(-(-c // token_padding) * token_padding for c in count[d * epn:(d + 1) * epn])
                       for d in range(ranks)]
        per_rank = row["per_rank"]
        assert [p["rows_without_plan"] for p in per_rank] == home
        assert [p["padded_rows"] for p in per_rank] == padded, "the padded rows are not what the plan gives"
        assert [p["padded_rows_without_plan"] for p in per_rank] == padded_home
        assert [p["rows_with_plan"] for p in per_rank] == [tokens * topk] * ranks
        assert math.isclose(row["imbalance_without_plan"], _ratio(home), rel_tol=1e-9)
        assert math.isclose(row["padded_imbalance_with_plan"], _ratio(padded), rel_tol=1e-9)
        assert math.isclose(row["maxvio"], max(count) / (sum(count) / experts) - 1, rel_tol=1e-9)
        assert row["slots_used"] == sum(1 for d in range(ranks) for e in plan["etc"][d] if e >= 0)
        for key in ("without_plan", "with_plan"):  # measured per rank; the ratio is of those measurements
            times = [p[f"expert_s_{key}"] for p in per_rank]
            assert all(0 < t < 60 for t in times), times
            assert math.isclose(row[f"expert_time_imbalance_{key}"], _ratio(times), rel_tol=1e-9)
            assert row[f"slowest_expert_s_{key}"] == max(times)


def test_balance_report_matches_an_independent_count_and_plan():
    """moonep-balance printed S*K rows under the plan (1.00 by construction): its padded rows and
    expert times must be what each rank really ran, and the no-plan rows what the routing sends."""
    rows = balance.report(R, S, E, K, H, [0.0, 3.0], SEED, intermediate=128, repeats=2)
    check_rows_independently(rows, R, S, E, K, SEED)
    assert rows[-1]["imbalance_without_plan"] > 1.1, "the skewed row must be imbalanced without the plan"
    assert rows[-1]["slots_used"] > 0
    text = balance.format_report(rows, R, S, E, K)
    assert "padded rows, MoonEP" in text and "expert time, MoonEP" in text
    assert f"expert compute: impl={rows[0]['impl']}" in text
