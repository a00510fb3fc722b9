"""The grouped GEMM API on CPU: the reference path against float64, row sources, validation."""

import logging

import pytest
import torch

from vllm_moonep.common.grouped_gemm import GroupedWeights, expert_ffn
from vllm_moonep.engine import MoonEPInputError
from vllm_moonep.testing.reference import expert_ffn_float64


def _weights(G, I, H, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    up = (torch.randn(G, I, H, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(G, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    return gate, up, down


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("lens", [[5, 0, 0, 17, 3], [0, 0, 64, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 40]])
def test_reference_matches_float64(lens):
    """The reference expert compute drifting from float64, leaving rows of a segment unwritten, or writing past the
    last segment."""
    G, I, H = len(lens), 32, 48
    gate, up, down = _weights(G, I, H, 1)
    cu = torch.tensor(lens).cumsum(0).to(torch.int32)
    n = int(cu[-1]) + 7  # rows past the end must be ignored
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    rw = torch.rand(n, generator=g)
    w = GroupedWeights.contiguous(gate, up, down)
    out = torch.full((n, H), float("nan"), dtype=torch.bfloat16)
    expert_ffn(x, rw, cu, w, impl="reference", out=out)
    ref = expert_ffn_float64(x, rw, cu, w)
    assert torch.isfinite(out).all(), "every row must be written"
    assert _rel(out[: int(cu[-1])], ref[: int(cu[-1])]) < 1e-2
    assert bool((out[int(cu[-1]):] == 0).all())


def test_pointer_table_rows_from_several_tensors():
    """A group reading the wrong pool or row of a multi-pool row table, or rows for a group with no weights (-1)
    accepted."""
    I, H = 16, 32
    pools = [_weights(3, I, H, s) for s in (10, 11)]
    # group 0 -> pool 1 row 2; group 1 -> empty/no weights; group 2 -> pool 0 row 0; group 3 -> pool 1 row 0
    gp = torch.tensor([1, -1, 0, 1])
    gr = torch.tensor([2, 0, 0, 0])
    w = GroupedWeights([p[0] for p in pools], [p[1] for p in pools], [p[2] for p in pools], gp, gr)
    w.validate()
    cu = torch.tensor([4, 4, 9, 12], dtype=torch.int32)
    x = torch.randn(12, H).to(torch.bfloat16)
    rw = torch.rand(12)
    out = expert_ffn(x, rw, cu, w, impl="reference")
    # the same result from a contiguous copy of the rows each group reads
    dense = [torch.stack([pools[1][k][2], pools[0][k][0], pools[0][k][0], pools[1][k][0]]) for k in range(3)]
    out2 = expert_ffn(x, rw, cu, GroupedWeights.contiguous(*dense), impl="reference")
    assert torch.equal(out, out2)
    with pytest.raises(MoonEPInputError, match="no weights"):
        expert_ffn(x, rw, torch.tensor([4, 5, 9, 12], dtype=torch.int32), w, impl="reference")


def test_expert_ffn_validation():
    """expert_ffn accepting rows, route weights, cu_seqlens, an impl or a dtype it would compute wrong, or grouped_mm
    without one dense tensor."""
    gate, up, down = _weights(3, 16, 32, 0)
    w = GroupedWeights.contiguous(gate, up, down)
    x = torch.randn(8, 32).to(torch.bfloat16)
    cu = torch.tensor([2, 4, 8], dtype=torch.int32)
    with pytest.raises(MoonEPInputError, match="x must be"):
        expert_ffn(x[:, :16], torch.rand(8), cu, w)
    with pytest.raises(MoonEPInputError, match="route_w"):
        expert_ffn(x, torch.rand(7), cu, w)
    with pytest.raises(MoonEPInputError, match="one entry per group"):
        expert_ffn(x, torch.rand(8), cu[:2], w)
    with pytest.raises(MoonEPInputError, match="impl must be"):
        expert_ffn(x, torch.rand(8), cu, w, impl="cutlass")
    table = GroupedWeights([gate], [up], [down], torch.zeros(3, dtype=torch.int64), torch.arange(3))
    with pytest.raises(MoonEPInputError, match="cannot run here"):
        expert_ffn(x, torch.rand(8), cu, table, impl="grouped_mm")  # no dense tensor to hand it
    with pytest.raises(MoonEPInputError, match="weights are"):
        expert_ffn(x.float(), torch.rand(8), cu, w)
    # row_ends (the engine's ends of each segment's entries): one int32 per group, on the rows' device
    for bad in (cu[:2], cu.to(torch.int64), cu.reshape(3, 1)):
        with pytest.raises(MoonEPInputError, match="row_ends must be"):
            expert_ffn(x, torch.rand(8), cu, w, row_ends=bad)
    # zero_tail=False without the ends: a weight-0 entry (which combine reads) would pass for padding tail
    with pytest.raises(MoonEPInputError, match="zero_tail=False needs row_ends"):
        expert_ffn(x, torch.rand(8), cu, w, zero_tail=False)


def test_grouped_mm_path_on_cpu_matches_float64():
    """The PoC's three-grouped-GEMM path, where this torch runs ``_grouped_mm`` on CPU."""
    from vllm_moonep.common.grouped_gemm.torch_grouped_mm import _cpu_grouped_mm_works

    if not _cpu_grouped_mm_works():
        pytest.skip("this torch build has no CPU torch._grouped_mm")
    gate, up, down = _weights(5, 32, 64, 3)
    w = GroupedWeights.contiguous(gate, up, down)
    cu = torch.tensor([7, 7, 20, 20, 33], dtype=torch.int32)
    x = torch.randn(40, 64).to(torch.bfloat16)
    rw = torch.rand(40)
    out = torch.full((40, 64), float("nan"), dtype=torch.bfloat16)
    expert_ffn(x, rw, cu, w, impl="grouped_mm", out=out)
    ref = expert_ffn_float64(x, rw, cu, w)
    assert torch.isfinite(out[:33]).all()
    assert _rel(out[:33], ref[:33]) < 1e-2


def test_tiles_follow_the_steps_tokens_not_the_buffers_slack():
    """At world size 1 a 128-token buffer of Kimi-K2 has NvS = 1024 + 2*127*384 rows, more than
    every entry tuned at EP=8: keyed by NvS, a 1-token decode step ran the 4096-token prefill tiles
    (282 us of expert compute on an H200 instead of ~170). Keyed by the step's tokens it gets the
    decode entry; without them, the NvS rule as before."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.common.grouped_gemm import policy

    table = list(policy.policy_for("NVIDIA H200", (9, 0)).tiles)
    entries = [e for e in table if e["H"] == 7168 and e["I"] == 2048]
    by_tokens = {e["tokens_per_rank"]: e for e in entries}
    assert {1, 4096} <= set(by_tokens), "the packaged table tunes Kimi-K2 at 1 and 4096 tokens per rank"
    nvs_ws1 = 128 * 8 + 2 * 127 * 384

    def tiles(e):  # the entry's tiles, and its one-launch settings where it has them
        return {k: e[k] for k in ("gate_up", "down", "fused") if k in e}

    assert tk.select_config(7168, 2048, nvs_ws1, 388, entries=table) == tiles(by_tokens[4096])
    assert tk.select_config(7168, 2048, nvs_ws1, 388, tokens=1, entries=table) == tiles(by_tokens[1])
    assert tk.select_config(7168, 2048, nvs_ws1, 388, tokens=3000, entries=table) == tiles(by_tokens[4096])
    # more tokens than any entry: the NvS rule (the largest entry here)
    assert tk.select_config(7168, 2048, nvs_ws1, 388, tokens=10**6, entries=table) == tiles(by_tokens[4096])


def test_generic_tiles_follow_the_steps_tokens(caplog):
    """A shape with no tile entry (Qwen3-235B-A22B's experts) took its generic tiles by rows per group, NvS over
    the groups: at decode the buffer's padding slack alone (4072 rows for 8 real at EP=8) made that 64 rows, and
    every decode step ran the 64-row "mid" tiles, where the 16-row "stream" tiles take 0.89-0.96x of their time,
    and so did 256 and 1024 tokens, where the 128-row "compute" tiles take 0.68-0.94x (one H100).
    With the step's tokens known, the generic regime follows them; without, the rows rule as before. The choice
    is said once."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    from vllm_moonep.engine import defaults

    table = [{"H": 7168, "I": 2048, "max_rows": 1 << 20, "tokens_per_rank": 4096, "gate_up": {}, "down": {}}]
    generic = {id(c): name for name, c in tk.DEFAULT_CONFIGS.items()}
    nvs, groups = 1 * 8 + 2 * 127 * 16, 32  # EP=8, E=128: 16 home groups and 16 slots

    def pick(**kw):
        return generic[id(tk.select_config(4096, 1536, nvs, groups, entries=table, **kw))]

    defaults._SAID.clear()
    with caplog.at_level(logging.INFO):
        picked = {t: pick(tokens=t) for t in (1, 16, 17, 64, 65, 256, 4096)}
        assert pick() == "mid"  # tokens not known: rows per group (4072 / 32 = 127)
    assert picked == {1: "stream", 16: "stream", 17: "mid", 64: "mid", 65: "compute", 256: "compute", 4096: "compute"}
    said = [r.getMessage() for r in caplog.records if "no tile entry for H=4096, I=1536" in r.getMessage()]
    assert len(said) == 1 and "stream up to 16, mid up to 64, compute above" in said[0], said
    # a shape the table has: its entry, whatever the tokens
    assert tk.select_config(7168, 2048, nvs, groups, entries=table, tokens=1) == {"gate_up": {}, "down": {}}


def test_one_launch_counters_survive_a_table_rebuild():
    """The one-launch kernel's counters (triton_fused) are written by every launch: a CUDA graph captured
    before the pointer table is rebuilt (a pool changed in place) must not be left atomically adding into
    freed memory, so a rebuild keeps the same counter tensor (at rest it is all zeros)."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    g = torch.Generator().manual_seed(3)
    w = GroupedWeights.contiguous(*(torch.randn(4, 16, 32, generator=g).to(torch.bfloat16) for _ in range(2)),
                                  torch.randn(4, 32, 16, generator=g).to(torch.bfloat16))
    first = tk.prepare_weights(w, "cpu")
    assert first.sync.numel() == 2 + 4 and int(first.sync.abs().sum()) == 0
    w.gate[0].mul_(1)  # in place: the version counter moves, the table is rebuilt
    second = tk.prepare_weights(w, "cpu")
    assert second is not first, "the table was not rebuilt (the check below would be vacuous)"
    assert second.sync is first.sync, "a rebuild replaced the counters a captured graph writes to"


def test_one_table_per_device_whatever_its_name():
    """A table prepared for one device under two names (``"cpu"`` and ``"cpu:0"``; on a GPU ``"cuda"`` and the
    layer's ``x.device``, ``cuda:0``) built twice: new counters under a graph captured with the first. The two
    names must find the same table."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    g = torch.Generator().manual_seed(5)
    w = GroupedWeights.contiguous(*(torch.randn(3, 16, 32, generator=g).to(torch.bfloat16) for _ in range(2)),
                                  torch.randn(3, 32, 16, generator=g).to(torch.bfloat16))
    first = tk.prepare_weights(w, "cpu")
    for name in ("cpu:0", torch.device("cpu", 0), None):
        assert tk.prepare_weights(w, name) is first, f"the table was built again for {name!r}"


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first byte, one past the last)`` of the memory ``t`` can reach."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@pytest.mark.parametrize("which", [0, 1])
def test_pointer_table_points_into_live_memory(which):
    """A weight pool given with a non-unit last stride (a checkpoint stored ``[G, H, I]`` passed transposed) is copied
    to contiguous memory; a copy not kept with the table is freed when ``prepare_weights`` returns, and the kernels
    then read whatever the allocator puts there next (NaN or another tensor's values as weights). Every pointer of
    the table must lie in a pool the caller holds or in a copy the table keeps. ``which``: the pool given transposed
    (pool 0 decides the inner strides; a later pool is brought to them)."""
    tk = pytest.importorskip("vllm_moonep.common.grouped_gemm.triton_kernels")
    I, H = 16, 32
    pools = [_weights(3, I, H, s) for s in (20, 21)]
    gate = [p[0] for p in pools]
    gate[which] = gate[which].transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(2) == I
    assert gate[which].stride(2) != 1
    gp, gr = torch.tensor([0, 1, 1, 0]), torch.tensor([2, 0, 1, 0])
    w = GroupedWeights(gate, [p[1] for p in pools], [p[2] for p in pools], gp, gr)
    with pytest.warns(UserWarning, match="copying"):
        prep = tk.prepare_weights(w, "cpu")
    live = [_storage_span(t) for t in (*w.gate, *w.up, *w.down, *prep.keep)]
    for g, row in enumerate(prep.table.tolist()):
        for proj, ptr in zip(("gate", "up", "down"), row):
            assert any(lo <= ptr < hi for lo, hi in live), f"group {g}: the {proj} pointer is in no live tensor"
    # and the kept copy holds the caller's values
    kept = [t for t in prep.keep if t.shape == gate[which].shape]
    assert kept and torch.equal(kept[0], gate[which]), "the kept copy is not the transposed pool's values"
