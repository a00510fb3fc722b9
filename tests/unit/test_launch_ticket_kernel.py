"""The launch ticket of the symmetric transport's row kernels (``signals.last_to_arrive``) under Triton's CPU
interpreter: exactly one program of a launch is the last, and it knows whether every program found the group live
when it started (so wrote all of its rows) before it signals the peers. Each case names the bug it catches.
"""

from __future__ import annotations

import pytest

from tests.interpreter_child import interpreter_report, print_report

try:  # the probe lives at module level: a @triton.jit function resolves the helpers it calls in its globals
    import triton
    import triton.language as tl

    from vllm_moonep.engine.signals import last_to_arrive

    @triton.jit
    def _probe(ticket, live_in, out, n_prog):
        pid = tl.program_id(0)
        last, all_live = last_to_arrive(ticket, n_prog, tl.load(live_in + pid) != 0)
        tl.store(out + 2 * pid, last.to(tl.int32))
        tl.store(out + 2 * pid + 1, all_live.to(tl.int32))
except ImportError:  # no Triton: the interpreter report skips
    _probe = None

# (programs, programs that found the group given up, launches on one ticket): the bug each catches
CASES = {
    # no program or two programs taken for the last: no signal, or two signals for one launch
    "all_live": (5, (), 1),
    # a program that skipped its rows early, before the last: the launch signalled rows that never came
    "first_skipped": (5, (0,), 1),
    # the last program itself found the group given up
    "last_skipped": (4, (3,), 1),
    # several skipped: the count of skips spilling into the count of programs (last never found)
    "many_skipped": (6, (1, 2, 4), 1),
    # a ticket not reset after a launch with skips: the next launch's last program missed, or told of old skips
    "reset_after_skips": (3, (1,), 2),
}


def _run(name: str):
    import torch

    n, skipped, launches = CASES[name]
    ticket = torch.zeros(1, dtype=torch.int32)
    for launch in range(launches):
        live = torch.ones(n, dtype=torch.int32)
        if launch == 0:
            live[list(skipped)] = 0
        out = torch.full((n, 2), -1, dtype=torch.int32)
        _probe[(n, 1, 1)](ticket, live, out, n)
        lasts = out[:, 0].nonzero().flatten().tolist()
        if len(lasts) != 1:
            return f"launch {launch}: programs {lasts} took themselves for the last"
        want = launch > 0 or not skipped
        if bool(out[lasts[0], 1]) != want:
            return f"launch {launch}: the last program said all_live={bool(out[lasts[0], 1])}, want {want}"
        if int(ticket) != 0:
            return f"launch {launch}: the ticket reads {int(ticket)} after the launch, not 0"
    return None


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_launch_ticket(report, case):
    assert report[case]["err"] is None, report[case]["err"]


if __name__ == "__main__":
    print_report(list(CASES), _run)
