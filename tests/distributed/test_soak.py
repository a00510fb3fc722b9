"""The short soak: ``vllm_moonep.tools.soak`` for 600 steps on 2 gloo ranks, every capacity of
the pool (1 token and the maximum included), a new routing skew every step, 2 layers, the
replicated layout (and the symmetric one when it imports), each step checked against the dense
reference and bitwise against the first run of the same inputs; the pool stays bounded and RSS is
flat after warm-up. (The long run: ``python -m vllm_moonep.tools.soak --steps 3000 --ranks 2``.)"""

from __future__ import annotations

import pytest

from vllm_moonep.testing.launch import launched_world_size
from vllm_moonep.tools.soak import DEFAULTS, pool_capacities, run, step_schedule

pytestmark = [pytest.mark.skipif(launched_world_size() is not None, reason="the soak spawns its own ranks"),
              pytest.mark.slow]  # 600 steps: scripts/test.sh runs it in its slow stage

CFG = dict(steps=600, ranks=2, layers=2, experts=8, hidden=128, intermediate=128, topk=2, slots=2,
           token_padding=8, max_tokens=256, min_capacity=8, period=97, warmup=150, mem_every=10,
           timeout_s=60.0, layouts="auto")


def test_schedule_covers_every_capacity_one_token_and_the_maximum():
    """A soak schedule that skips a pool capacity, 1 token or the maximum, or keeps one skew, so its checks never see
    them."""
    caps = pool_capacities(CFG["max_tokens"], CFG["min_capacity"])
    assert caps == [8, 16, 32, 64, 128, 256]
    sched = [step_schedule({**DEFAULTS, **CFG}, s) for s in range(CFG["steps"])]
    n_max = [n for n, _, _, _ in sched]
    assert 1 in n_max and CFG["max_tokens"] in n_max
    hit = {min(c for c in caps if c >= n) for n in n_max}
    assert hit == set(caps)
    sigmas = [sg for _, _, sg, _ in sched[: CFG["period"]]]
    assert len(set(sigmas)) == len(sigmas), "the skew changes every step"
    for n, counts, _, _ in sched:
        assert max(counts) == n and min(counts) >= 0


def test_short_soak_bounded_pools_flat_memory():
    """What shows only over hundreds of steps: a wrong or unrepeatable output, buffers made without bound, memory
    growing after warm-up."""
    s = run(CFG)
    assert s["errors"] == 0, s["error_samples"]
    assert s["steps"] == CFG["steps"] and not s["ranks_lost"]
    assert s["capacities_seen"] == s["capacities"]
    assert s["dense_checks"] >= CFG["steps"] * CFG["layers"] * 2
    assert s["bitwise_checks"] > 0 and s["slots_used"] > 0
    assert s["layout_mismatches"] == 0
    assert s["max_buffers_seen"] <= s["max_buffers"] == len(s["capacities"])
    for m in s["per_rank_mib"]:
        assert m["rss_warm"] is not None
        assert m["rss_growth_after_warmup"] < 8.0, m  # MiB over ~450 steps: flat, not leaking
        assert m["py_objects_end"] - m["py_objects_warm"] < 500, m
