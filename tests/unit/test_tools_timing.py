"""``tools.timing``'s alternated, rotated rounds (``round_order``, ``rotated_times``): the order in which an A/B's
candidates are timed. Nothing is timed here: ``time_one`` is a clock that charges each call by its place in the
round, the effect the rotation exists to cancel (an H100 read the same tiles 4-10% apart by their place)."""

import statistics

import pytest

from vllm_moonep.tools.timing import ROUNDS, round_order, rotated_times

NAMES = ["committed", "w13i", "w13i_bn_half", "control"]


def test_rounds_rotate_so_every_name_takes_every_place():
    """A candidate always timed first in its round (or always after the same one) carries its place's bias into its
    ratio as if it were the lever's."""
    orders = [round_order(NAMES, r, 4) for r in range(4)]
    assert all(sorted(o) == sorted(NAMES) for o in orders), "a round left a name out or timed one twice"
    for place in range(4):
        assert sorted(o[place] for o in orders) == sorted(NAMES), f"place {place} is not taken by every name"
    assert round_order(NAMES, 4) == NAMES and round_order([], 3) == [] and round_order([], 0, 2) == []


@pytest.mark.parametrize("n,rounds", [(8, 4), (8, 3), (9, 4), (4, 8), (2, 3)])
def test_fewer_rounds_than_names_spread_the_first_place(n, rounds):
    """With fewer rounds than names, rotating by one per round gave the first places to the first few names only
    (eight columns, four rounds: names 5-8 never led a round); the rotations must spread over the whole list."""
    names = [f"c{i}" for i in range(n)]
    firsts = [round_order(names, r, rounds)[0] for r in range(rounds)]
    assert len(set(firsts)) == min(n, rounds), firsts
    starts = [names.index(f) for f in firsts]
    if rounds <= n:  # evenly spread: consecutive starts at most ceil(n / rounds) apart, wrapping round
        gaps = [(starts[(i + 1) % rounds] - starts[i]) % n for i in range(rounds)]
        assert max(gaps) <= -(-n // rounds), (starts, gaps)


def _place_clock(bias_per_place: float):
    """A clock that reads 100 for every candidate plus ``bias_per_place`` for each place it sits after the first
    in its round (the power-bound GPU: later in a round reads slower), and records the calls."""
    calls: list[str] = []
    state = {"place": 0, "round_len": None}

    def time_one(name):
        calls.append(name)
        t = 100.0 + bias_per_place * state["place"]
        state["place"] = (state["place"] + 1) % state["round_len"]
        return t

    return time_one, calls, state


def test_rotated_times_cancels_a_place_bias():
    """Identical candidates timed in a fixed order read apart by their place (the bug the rotation fixes): with the
    rotation their medians over ROUNDS rounds agree exactly, and each is timed once per round."""
    time_one, calls, state = _place_clock(5.0)
    state["round_len"] = len(NAMES)
    got = rotated_times(NAMES, time_one, ROUNDS)
    assert list(got) == NAMES and all(len(v) == ROUNDS for v in got.values())
    assert len(calls) == ROUNDS * len(NAMES)
    for r in range(ROUNDS):  # each round times every name once, in round_order
        assert calls[r * len(NAMES):(r + 1) * len(NAMES)] == round_order(NAMES, r, ROUNDS)
    means = {k: statistics.mean(v) for k, v in got.items()}
    assert len(set(means.values())) == 1, f"place bias left in the means: {means}"
    # the same clock in a fixed order: the first name reads 15 us faster than the last (what the rotation removes)
    time_one, calls, state = _place_clock(5.0)
    state["round_len"] = len(NAMES)
    fixed = {k: [] for k in NAMES}
    for _ in range(ROUNDS):
        for k in NAMES:
            fixed[k].append(time_one(k))
    assert statistics.median(fixed[NAMES[-1]]) - statistics.median(fixed[NAMES[0]]) == 15.0


def test_rotated_times_passes_whatever_time_one_returns_and_refuses_no_rounds():
    """bench_levers times two scopes per candidate in one call (a tuple per round); zero rounds gave empty lists
    whose median raised only after minutes of device time."""
    got = rotated_times(["a", "b"], lambda k: (k, 1.0), 3)
    assert got == {"a": [("a", 1.0)] * 3, "b": [("b", 1.0)] * 3}
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        rotated_times(["a"], lambda k: 1.0, 0)
