"""``bench_experts``' ``deepgemm_down`` column (``impl="deepgemm_down"``, which the H100's ``auto`` takes): its call,
its ratios, its table cells and its ``auto`` regimes, on CPU with a stand-in for the GPU call and synthetic rows."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_moonep.common.grouped_gemm import deepgemm_impl
from vllm_moonep.common.grouped_gemm.policy import DevicePolicy, Regime, policy_for
from vllm_moonep.tools import bench_experts as be

CEIL = {"matmul_tflops": 800.0, "copy_gbs": 3000.0, "launch_us": 2.0}


def _row(**times):
    """A table row as main builds it (floors and ratios from ``set_floor``); ``times``: the library columns'."""
    row = {"shape": "kimi-k2", "tokens": 4096, "routing": "balanced", "rows": 33024, "real_rows": 32768,
           "busy_groups": 288, "flop": 6.0 * 7168 * 2048 * 32768, "weight_bytes": 3.0 * 7168 * 2048 * 2 * 288,
           "triton_us": 5000.0, "poc_us": 9000.0, "triton_three_launches_us": None, "read_us": 2000.0,
           "read_phased_us": 2100.0, "triton_over_read": 2.5, "triton_over_read_phased": 2.38, "control_ratio": 1.004,
           "triton_tflops_useful": 700.0, "triton_weight_gbs": 1200.0, "quack_us": None, "deepgemm_us": None,
           "deepgemm_down_us": None, "deepgemm_masked_us": None, "vllm_us": None, **times}
    be.set_floor(row, CEIL)
    return row


def test_deepgemm_down_cells_and_ratios():
    """The deepgemm_down time missing from the table, a header cell without a row cell under it (every later
    column shifted one to the left), or its ratios to the floor and to Triton not taken."""
    with_down, without = _row(deepgemm_us=4900.0, deepgemm_down_us=4750.0), _row()
    assert with_down["deepgemm_down_over_floor"] == pytest.approx(4750.0 / with_down["floor_us"])
    assert "deepgemm_down_over_floor" not in without
    head, rule, *lines = be.markdown_table([with_down, without])
    names = [c.strip() for c in head.strip("|").split("|")]
    assert rule.count("|") == head.count("|")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert all(len(c) == len(names) for c in cells)
    got, empty = (dict(zip(names, c, strict=True)) for c in cells)
    assert got["DeepGEMM down us"] == "4750.0" and got["DeepGEMM us"] == "4900.0"
    assert got["down/floor"] == f"{with_down['deepgemm_down_over_floor']:.2f}"
    assert got["down/Triton"] == "0.95" and got["DeepGEMM/Triton"] == "0.98"
    assert got["weight GB/s"] == "1200" and got["control/Triton"] == "1.004"  # the last columns still in place
    assert empty["DeepGEMM down us"] == empty["down/floor"] == empty["down/Triton"] == "-"
    assert be._deepgemm_down_note(with_down).startswith(f" x{with_down['deepgemm_down_over_floor']:.2f} err ")
    assert be._deepgemm_down_note(without) == ""


def test_deepgemm_down_regimes_come_before_deepgemm_as_auto_takes_them():
    """The bench's auto regimes without deepgemm_down (auto's column could not be named), or with it after DeepGEMM's
    whole compute at the same points: auto takes the first regime covering a step, so the section written from them
    would run DeepGEMM where the H100's shipped section runs deepgemm_down."""
    kimi = be.SHAPES["kimi-k2"]
    rows = [{"shape": "kimi-k2", "tokens": t, "routing": r, "triton_us": 100.0,
             "deepgemm_us": 97.0 if t == 4096 else 110.0, "deepgemm_down_us": 95.0 if t >= 1024 else 101.0}
            for t in (256, 1024, 4096) for r in ("balanced", "skewed")]
    entries = be.auto_entries(rows)
    assert [(e["impl"], e["from_tokens"], e["to_tokens"]) for e in entries] == [
        ("deepgemm_down", 1024, None), ("deepgemm", 4096, None)]
    H, I = kimi["H"], kimi["I"]
    written = DevicePolicy("GPU", regimes=tuple(Regime(e["impl"], e["H"], e["I"], e["from_tokens"], e["to_tokens"])
                                                for e in entries))
    shipped = policy_for("NVIDIA H100 80GB HBM3", (9, 0))
    assert [r.impl for r in written.regimes_at(H, I, 4096)] == ["deepgemm_down", "deepgemm"]
    assert [r.impl for r in shipped.regimes_at(H, I, 4096)] == ["deepgemm_down", "deepgemm"]


@pytest.fixture
def no_gpu_timing(monkeypatch):
    """``_deepgemm_down_point`` without a GPU: no synchronize, and its graph column replaced by one more call."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def column(name, f, args, replays):
        f()
        replays[name] = "graph"
        return {f"{name}_eager_us": 1.0, f"{name}_us": None}

    monkeypatch.setattr(be, "_column_graph", column)


def test_deepgemm_down_column_runs_the_product_entry_as_the_triton_column_runs(monkeypatch, no_gpu_timing):
    """The column timed with other arguments than the Triton column (the tails zeroed, a trim launch, padded tiles,
    or tiles for the buffer's rows rather than the step's tokens; the cases' padding not handed to DeepGEMM's check),
    on an output that was not NaN first (rows the call never wrote read as written), or a first call that raised
    timed on."""
    calls = []
    n, H, I = 6, 4, 3
    x, rw = torch.randn(8, H), torch.rand(8)
    cu, ends = torch.tensor([4, 8], dtype=torch.int32), torch.tensor([3, 6], dtype=torch.int32)
    out_p = torch.randn(8, H)
    weights = types.SimpleNamespace(intermediate=I)

    def entry(x_, rw_, cu_, w_, *, out, act, **kw):
        calls.append(kw)
        assert x_ is x and rw_ is rw and cu_ is cu and w_ is weights and act.shape == (8, I)
        assert torch.isnan(out).all() or len(calls) > 1  # NaN-filled before the first call
        out[: n - 1] = out_p[: n - 1] * 1.01  # one row up to the last segment's end left unwritten
        return out

    monkeypatch.setattr(deepgemm_impl, "expert_ffn_deepgemm_down", entry)
    replays: dict = {}
    fields, err = be._deepgemm_down_point(x, rw, cu, ends, 4096, weights, out_p, n, None, replays)
    assert err is None and replays == {"deepgemm_down": "graph"}
    assert calls[0] == {"tokens": 4096, "padded": False, "row_ends": ends, "zero_tail": False,
                        "token_padding": be.PAD} and len(calls) == 2
    assert fields["deepgemm_down_unwritten"] == H  # the row's elements, as the other columns count them
    assert fields["deepgemm_down_eager_us"] == 1.0 and fields["deepgemm_down_us"] is None

    def fails(*a, **kw):
        raise RuntimeError("DeepGEMM JIT: nvcc not found")

    monkeypatch.setattr(deepgemm_impl, "expert_ffn_deepgemm_down", fails)
    replays = {}
    fields, err = be._deepgemm_down_point(x, rw, cu, ends, 4096, weights, out_p, n, None, replays)
    assert fields == {"deepgemm_down_us": None} and err == "RuntimeError: DeepGEMM JIT: nvcc not found"
    assert replays == {}


def test_deepgemm_down_error_against_the_poc(monkeypatch, no_gpu_timing):
    """The column's error against the PoC not taken on the PoC's rows, or taken over the rows past the last
    segment's end, which the column leaves NaN (an error of NaN at every point)."""
    n, H = 6, 4
    out_p = torch.randn(8, H)

    def entry(x_, rw_, cu_, w_, *, out, act, **kw):
        out[:n] = out_p[:n] * 1.01
        return out

    monkeypatch.setattr(deepgemm_impl, "expert_ffn_deepgemm_down", entry)
    fields, err = be._deepgemm_down_point(torch.zeros(8, H), torch.zeros(8), torch.tensor([8], dtype=torch.int32),
                                          torch.tensor([6], dtype=torch.int32), 1,
                                          types.SimpleNamespace(intermediate=2), out_p, n, None, {})
    assert err is None and fields["deepgemm_down_unwritten"] == 0
    assert fields["err_deepgemm_down_vs_poc"] == pytest.approx(0.01, rel=1e-4)
