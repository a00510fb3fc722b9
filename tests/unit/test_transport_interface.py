"""The engine's transports behind one interface, and the capability flags of ``MoonEPBuffer``."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_moonep.engine import Buffer, MoonEPBuffer, dispatched_rows, make_buffer
from vllm_moonep.engine import select as engine_select
from vllm_moonep.engine.transports.base import Transport

S, H, K, E, B, TP = 8, 16, 2, 8, 4, 4


def _step_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (S, K), generator=g, dtype=torch.int32)
    w = torch.rand(S, K, generator=g)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    return x, w, ids, tpe


@pytest.mark.parametrize("name", ["collective", "symmetric", "hybrid"])
def test_every_transport_is_a_transport_and_keeps_its_own_step_state(name):
    """A transport the Buffer drives outside the one interface, or a Plan that carries another
    transport's private fields (the collective one's send order and splits once rode in every plan)."""
    buf = Buffer(S, H, K, E, 1, B=B, token_padding=TP, device="cpu", transport=name)
    try:
        assert isinstance(buf.transport, Transport) and buf.transport.name == buf.transport_name == name
        x, w, ids, tpe = _step_inputs(1)
        xn, wn, cu, plan = buf.dispatch(x, w, ids, tpe)
        state = plan.transport_state
        assert type(state).__module__ == type(buf.transport).__module__, type(state)
        assert not any(hasattr(plan, f) for f in ("send_order", "send_splits", "recv_splits", "recv_rows"))
        out, rw, _ = buf.combine(plan, xn, wn)
        assert torch.equal(rw, w)  # each entry's weight came home to its place
    finally:
        buf.destroy()
    assert buf.heap_bytes == 0 and buf.row_programs is None


class _FakeRealBuffer:
    """The real ``moonep`` package's Buffer as far as a test can know it: the contract's calls, NvS in _ctx."""

    def __init__(self, *args, **kwargs):
        self.calls: list[str] = []
        self._ctx = {"NvS": 77}
        self.S, self.B = 128, 4

    def dispatch(self, hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert):
        self.calls.append("dispatch")
        return hidden_sh, route_weights_sk, tokens_per_expert, types.SimpleNamespace(experts_to_copy=None)

    def destroy(self):
        self.calls.append("destroy")


def test_the_real_moonep_buffer_declares_neither_extension(monkeypatch):
    """The step read the capability flags with getattr defaults: a buffer of the real moonep was
    handed back bare, so reading the flags from the protocol directly would fail on it (or, worse,
    an engine that never said so was treated as taking num_tokens)."""
    fake = types.ModuleType("moonep")
    fake.Buffer = _FakeRealBuffer
    monkeypatch.setattr(engine_select, "real_moonep_status", lambda: (fake, ""))
    buf = make_buffer(128, 16, 2, 8, 1, engine="moonep")
    assert isinstance(buf, MoonEPBuffer)
    assert buf.accepts_num_tokens is False and buf.combine_reads_entry_rows_only is False
    assert dispatched_rows(buf) == buf.num_dispatched_rows == 77 and buf._ctx == {"NvS": 77}
    x = torch.zeros(1)
    assert buf.dispatch(x, x, x, x)[0] is x and buf.inner.calls == ["dispatch"]
    buf.destroy()
    assert buf.inner.calls == ["dispatch", "destroy"]


def test_the_capability_flags_are_part_of_the_protocol():
    """An engine buffer that says nothing about num_tokens or what its combine reads passed for a
    MoonEPBuffer, so the step had to guess (getattr) instead of reading what the protocol promises."""

    class Silent:  # every other member of the protocol
        num_dispatched_rows, S, B = 1, 1, 1

        def dispatch(self, *a):
            pass

        def prefetch_weight(self, *a, **k):
            pass

        def combine(self, *a):
            pass

        def destroy(self):
            pass

    class Says(Silent):
        accepts_num_tokens = combine_reads_entry_rows_only = False

    assert not isinstance(Silent(), MoonEPBuffer)
    assert isinstance(Says(), MoonEPBuffer)
    buf = Buffer(S, H, K, E, 1, B=B, token_padding=TP, device="cpu")
    try:
        assert buf.accepts_num_tokens is True and buf.combine_reads_entry_rows_only is True
    finally:
        buf.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("S,K,H,dtype", [(0, 8, 7168, torch.float32), (1, 3, 8, torch.float32),
                                         (37, 8, 7168, torch.float32), (64, 3, 100, torch.float32),
                                         (19, 1, 2048, torch.bfloat16), (130, 6, 4096, torch.bfloat16),
                                         (600, 8, 7168, torch.float32)])
def test_sum_entries_kernel_matches_the_written_order_gpu(S, K, H, dtype):
    """The combine's K-sum on CUDA (the reduce kernel) in another order than the CPU path's k-ascending adds,
    starting from anything but +0, rounding other than once, or missing columns past a power of two: the
    bits must equal ``sum_entries_torch``'s. Token 0's rows are 1e8, -1e8, 1, then zeros (exactly 1 only k
    ascending) where K >= 3, and token 1's rows are all -0 (+0 from a sum that starts at +0). S = 0 (no
    tokens) gives an empty result, not an error; 600 tokens of 7168 columns are 2400 work items, past the
    kernel's 1056 programs (its grid-stride loop)."""
    from vllm_moonep.engine.transports import base
    from vllm_moonep.engine.transports.base import sum_entries, sum_entries_torch

    assert base.reduce_launcher() is not None, "on CUDA the sum must run the kernel (else torch meets torch)"

    rows = torch.randn(S * K, H, generator=torch.Generator().manual_seed(S + K)).to(dtype)
    if S and K >= 3:
        rows[0:K] = 0.0
        rows[0:3] = torch.tensor([1e8, -1e8, 1.0]).to(dtype)[:, None]
    if S > 1:
        rows[K:2 * K] = -0.0
    want = sum_entries_torch(rows, S, K, torch.bfloat16)
    got = sum_entries(rows.cuda(), S, K, torch.bfloat16).cpu()
    assert got.shape == (S, H)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} sums differ"
    if S > 1:  # torch.equal takes -0 for +0
        assert not torch.signbit(got[1]).any() and not torch.signbit(want[1]).any(), "a sum of -0 rows must be +0"
    if S and K >= 3 and dtype == torch.float32:
        assert got[0].eq(1).all(), "1e8, -1e8, 1 summed k ascending is exactly 1"
