"""``tools.timing``'s alternated rounds (``round_orders``, ``round_order``, ``alternated_times``): the order in which an
A/B's candidates are timed. Nothing is timed here: ``time_one`` is a clock that charges each call by its place in
the round, or by the call timed just before it, the two effects the rounds' orders exist to cancel (an H100 read
the same tiles 4-10% apart by their place, and the Triton call 3-10% apart where one copy always followed the
PoC's column)."""

import statistics

import pytest

from vllm_moonep.tools.timing import (MIN_TIMED_CALLS, ROUNDS, alternated_times, pooled_ratio, round_order,
                                      round_orders, timed_calls)

NAMES = ["committed", "w13i", "w13i_bn_half", "control"]
#: bench_experts' columns at a 4096-token point, in the order it builds them (the PoC's heavy column second)
EXPERT_COLUMNS = ["triton", "poc", "control", "read", "read_phased", "deepgemm", "deepgemm_down"]


def _repeats(orders) -> tuple[int, int]:
    """(times a candidate followed the same predecessor again, times a candidate took the same place again)."""
    after: dict = {}
    place: dict = {}
    for order in orders:
        for i, c in enumerate(order):
            place[(i, c)] = place.get((i, c), 0) + 1
            if i:
                after[(order[i - 1], c)] = after.get((order[i - 1], c), 0) + 1
    return sum(v - 1 for v in after.values()), sum(v - 1 for v in place.values())


def test_four_rounds_of_four_take_every_place_and_follow_every_neighbour_once():
    """A candidate always timed first in its round carries its place's bias into its ratio as if it were the lever's;
    one always timed right after the same neighbour carries that neighbour's load (the rotated list did that)."""
    orders = [round_order(NAMES, r, 4) for r in range(4)]
    assert orders[0] == NAMES, "round 0 is not the caller's order"
    assert all(sorted(o) == sorted(NAMES) for o in orders), "a round left a name out or timed one twice"
    for place in range(4):
        assert sorted(o[place] for o in orders) == sorted(NAMES), f"place {place} is not taken by every name"
    for name in NAMES:
        before = [o[o.index(name) - 1] for o in orders if o.index(name)]
        assert sorted(before) == sorted(set(NAMES) - {name}), f"{name} follows {before}, not each other name once"
    assert round_order(NAMES, 4) == NAMES and round_order([], 3) == [] and round_order([], 0, 2) == []


@pytest.mark.parametrize("n", [2, 4, 6, 8, 10, 12])
def test_even_counts_repeat_neither_a_neighbour_nor_a_place(n):
    """The Williams square: up to n rounds, no candidate after the same one twice or in the same place twice, and
    as many leaders as rounds (a rotation by one per round gave eight columns in four rounds only four leaders,
    always the list's first four)."""
    for rounds in range(1, n + 1):
        orders = round_orders(n, rounds)
        assert orders[0] == tuple(range(n)), "round 0 is not the caller's order"
        assert all(sorted(o) == list(range(n)) for o in orders)
        assert _repeats(orders) == (0, 0), (rounds, orders)
        assert len({o[0] for o in orders}) == rounds


@pytest.mark.parametrize("n", [3, 5, 7, 9, 11, 13])
def test_odd_counts_keep_leaders_and_neighbours_distinct(n):
    """No single square balances the neighbours of an odd count; up to n - 1 rounds the design still gives no
    candidate the same predecessor twice, and up to n rounds never lets a candidate lead twice."""
    for rounds in range(1, n + 1):
        orders = round_orders(n, rounds)
        assert orders[0] == tuple(range(n)), "round 0 is not the caller's order"
        assert all(sorted(o) == list(range(n)) for o in orders)
        assert len({o[0] for o in orders}) == rounds, (rounds, orders)
        if rounds < n:
            assert _repeats(orders)[0] == 0, (rounds, orders)


def test_round_orders_refuses_no_rounds():
    """Zero rounds read as 'as many rounds as names' by one entry and refused by the other."""
    with pytest.raises(ValueError, match="rounds >= 1"):
        round_orders(4, 0)
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        round_order(NAMES, 0, 0)
    assert round_order(NAMES, 5, 4) == round_order(NAMES, 1, 4)  # past the last round: wraps round
    assert round_orders(0, 2) == ((), ())


def _clock(place_bias: float = 0.0, after: str | None = None, after_bias: float = 0.0):
    """A clock that reads 100 for every candidate, plus ``place_bias`` for each place it sits after the first in its
    round (the power-bound GPU: later in a round reads slower), plus ``after_bias`` when the call timed just before
    it was ``after`` (a heavy kernel's load carried into the next); records the calls."""
    calls: list[str] = []
    state = {"place": 0, "round_len": None}

    def time_one(name):
        t = 100.0 + place_bias * state["place"] + (after_bias if calls and calls[-1] == after else 0.0)
        calls.append(name)
        state["place"] = (state["place"] + 1) % state["round_len"]
        return t

    return time_one, calls, state


def test_alternated_times_cancels_a_place_bias():
    """Identical candidates timed in a fixed order read apart by their place: over ROUNDS rounds of the design their
    means agree exactly, and each round times every name once in round_order."""
    time_one, calls, state = _clock(place_bias=5.0)
    state["round_len"] = len(NAMES)
    got = alternated_times(NAMES, time_one, ROUNDS)
    assert list(got) == NAMES and all(len(v) == ROUNDS for v in got.values())
    assert len(calls) == ROUNDS * len(NAMES)
    for r in range(ROUNDS):
        assert calls[r * len(NAMES):(r + 1) * len(NAMES)] == round_order(NAMES, r, ROUNDS)
    means = {k: statistics.mean(v) for k, v in got.items()}
    assert len(set(means.values())) == 1, f"place bias left in the means: {means}"
    # the same clock in a fixed order: the first name reads 15 us faster than the last (what the rounds remove)
    time_one, calls, state = _clock(place_bias=5.0)
    state["round_len"] = len(NAMES)
    fixed = {k: [] for k in NAMES}
    for _ in range(ROUNDS):
        for k in NAMES:
            fixed[k].append(time_one(k))
    assert statistics.median(fixed[NAMES[-1]]) - statistics.median(fixed[NAMES[0]]) == 15.0


def test_alternated_times_cancels_the_load_of_the_call_before():
    """The Triton call and its control are the same call: timed after the PoC's heavy column in at most one round
    each, their medians over ROUNDS rounds agree. A rotated list put the control right after the PoC in every round
    but the one it led, and read it 10% slow (what an H100 showed at Kimi-K2 4096 tokens)."""
    time_one, calls, state = _clock(after="poc", after_bias=10.0)
    state["round_len"] = len(EXPERT_COLUMNS)
    got = alternated_times(EXPERT_COLUMNS, time_one, ROUNDS)
    med = {k: statistics.median(v) for k, v in got.items()}
    assert med["control"] == med["triton"] == 100.0, med
    # the rotated list, as the rounds were ordered before: control after poc in three of four rounds
    time_one, calls, state = _clock(after="poc", after_bias=10.0)
    state["round_len"] = len(EXPERT_COLUMNS)
    rotated = {k: [] for k in EXPERT_COLUMNS}
    n = len(EXPERT_COLUMNS)
    for r in range(ROUNDS):
        k = r * n // ROUNDS
        for name in EXPERT_COLUMNS[k:] + EXPERT_COLUMNS[:k]:
            rotated[name].append(time_one(name))
    assert statistics.median(rotated["control"]) == 110.0


def test_alternated_times_passes_whatever_time_one_returns_and_refuses_no_rounds():
    """bench_levers times two scopes per candidate in one call (a tuple per round); zero rounds gave empty lists
    whose median raised only after minutes of device time."""
    got = alternated_times(["a", "b"], lambda k: (k, 1.0), 3)
    assert got == {"a": [("a", 1.0)] * 3, "b": [("b", 1.0)] * 3}
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        alternated_times(["a"], lambda k: 1.0, 0)


def test_pooled_ratio_sets_the_candidate_against_incumbent_and_control_together():
    """One unlucky incumbent column (its four rounds all slow: 0.88 of its control at an H100's Kimi-K2 4096 point)
    read a candidate 12% faster against it alone; against the incumbent's and the control's timings together it
    reads the middle of the two."""
    incumbent, control, candidate = [112.0, 110.0, 114.0, 111.0], [98.0, 100.0, 99.0, 101.0], [100.0, 101.0, 99.0, 100.0]
    assert statistics.median(candidate) / statistics.median(incumbent) == pytest.approx(100.0 / 111.5)
    assert pooled_ratio(candidate, incumbent, control) == pytest.approx(100.0 / statistics.median(incumbent + control))
    assert pooled_ratio(candidate, incumbent, control) == pytest.approx(100.0 / 105.5)
    with pytest.raises(ValueError, match="at least one timing"):
        pooled_ratio([], incumbent, control)


def test_a_long_call_is_still_timed_enough_times():
    """A 5 ms call in a 30 ms budget was six timed calls, a median one slow call can move; a short call keeps the
    budget's count (the floor must not shrink it), and a bad estimate is refused rather than timed zero times."""
    assert timed_calls(30, 5.2) == MIN_TIMED_CALLS, "a long call fell below the fewest timed calls"
    assert timed_calls(100, 0.05) == 2000, "a short call's count is no longer the budget's"
    assert timed_calls(100, 10) == MIN_TIMED_CALLS
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive time"):
            timed_calls(30, bad)
