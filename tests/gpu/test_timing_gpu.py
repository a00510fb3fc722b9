"""``tools.timing.flushed_median_ms``, the timer of ``bench_experts`` and ``bench_levers``, times the call and only the
call. Its flush (256 MB written, then read back) takes far longer than the calls it precedes, so events recorded
around the flush as well would show in any short call; and a call of a known least duration reading shorter
would mean the events do not wait for it."""

from __future__ import annotations

import pytest
import torch

from vllm_moonep.tools.timing import flushed_median_ms

pytestmark = pytest.mark.gpu


def test_flush_is_not_in_the_time():
    """A one-element add timed with the flush's 256 MB of writes and reads (hundreds of microseconds) in it."""
    one = torch.zeros(1, device="cuda")
    ms = flushed_median_ms(lambda: one.add_(1.0), warmup=5, rep=20)
    assert 0 < ms < 0.05, f"a one-element add read {ms * 1e3:.1f} us: the flush is timed with it"


def test_a_call_is_timed_to_its_end():
    """A spin of 2e6 GPU cycles (at least 0.95 ms below 2.1 GHz) timed shorter than it runs."""
    ms = flushed_median_ms(lambda: torch.cuda._sleep(2_000_000), warmup=5, rep=20)
    assert ms >= 0.9, f"a spin of 2e6 cycles read {ms:.3f} ms"
