"""`python -m vllm_moonep.tools.profile_step` on CPU ranks: the per-op table of a real MoE step."""

from __future__ import annotations

import pytest

from vllm_moonep.testing.launch import launched_world_size
from vllm_moonep.tools import profile_step

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="the tool spawns its own ranks")


def test_profile_step_prints_a_table_per_token_count(capsys):
    """A profile that times nothing (an empty table) or loses a token count, on the symmetric
    layout over gloo: every op of the step's collectives and expert compute shows up."""
    assert profile_step.main(["--preset", "tiny", "--ranks", "2", "--tokens", "3", "5", "--steps", "1",
                              "--iters", "2", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "tiny (H=256, I=256, E=32, K=4, B=16), one layer, symmetric layout, 2 rank(s) on cpu" in out
    for t in (3, 5):
        assert f"### tokens/rank {t}: eager step" in out
    assert out.count("eager: span") == 2 and "gloo:all_to_all" in out
