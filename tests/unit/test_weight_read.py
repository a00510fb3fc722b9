"""``bench_experts``' bytes-only anchor (``vllm_moonep.tools.weight_read``) reads exactly the touched weights.

The anchor is a floor: a read that skips bytes, reads a group twice or the wrong matrix would flatter it, and
every ``Triton / read`` ratio with it. Byte patterns: the touched groups' matrices hold small integers (exact in
bf16, their chunk sums exact in float32), each matrix its own; every untouched group is NaN, so a read of it
turns a sum NaN; ``sums`` starts at a sentinel, so a program writing past its slot shows. The kernel runs
natively where a GPU exists, else under Triton's CPU interpreter in a child process (``TRITON_INTERPRET`` must
be set before Triton is imported).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

triton = pytest.importorskip("triton")

from tests.interpreter_child import interpreter_report, print_report  # noqa: E402

#: the sentinel ``sums`` starts at (no chunk sum of the patterns below can equal it)
SENTINEL = -7777.0
#: the touched groups, out of order, of ``GROUPS`` groups; the rest are NaN
TOUCHED = (4, 0, 2)
GROUPS = 6
#: (name, rows, cols of gate/up per group, tiles): an element count that is a multiple of the chunk, one
#: that is not (the masked last chunk), and a chunk larger than a whole matrix
CASES = {
    "even chunks": (16, 64, {"BLOCK": 128, "CHUNK": 512, "num_warps": 4}),
    "ragged last chunk": (24, 40, {"BLOCK": 128, "CHUNK": 512, "num_warps": 4}),
    "chunk past the matrix": (8, 48, {"BLOCK": 256, "CHUNK": 2048, "num_warps": 4}),
}


def _mats(rows: int, cols: int, dev):
    import torch

    g = torch.Generator().manual_seed(rows * 1000 + cols)

    def pattern(shape, offset):
        t = torch.randint(-8, 9, (GROUPS, *shape), generator=g).double() + offset
        untouched = [i for i in range(GROUPS) if i not in TOUCHED]
        t[untouched] = float("nan")
        return t

    ref = (pattern((rows, cols), 0.0), pattern((rows, cols), 0.5), pattern((cols, rows), 0.25))
    return ref, tuple(r.to(device=dev, dtype=torch.bfloat16) for r in ref)


def _want(ref, cfg, first: int, count: int) -> list[float]:
    """The sums the read must write, in its slot order ``(group index, matrix, chunk)``, from float64."""
    out = []
    for g in TOUCHED:
        for m in range(first, first + count):
            flat = ref[m][g].reshape(-1)
            out += [float(flat[c : c + cfg["CHUNK"]].sum()) for c in range(0, flat.numel(), cfg["CHUNK"])]
    return out


def _run_case(name: str) -> str | None:
    import torch

    from vllm_moonep.tools.weight_read import WeightRead

    rows, cols, cfg = CASES[name]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref, mats = _mats(rows, cols, dev)
    w13 = torch.cat(mats[:2], dim=1)  # gate and up as the halves of one w13: groups 2 * rows * cols apart
    for form, read_mats in (("separate", mats), ("w13 halves", (w13[:, :rows], w13[:, rows:], mats[2]))):
        read = WeightRead(*read_mats, torch.tensor(TOUCHED), configs=(cfg,))
        err = _check_read(read, ref, cfg)
        if err is not None:
            return f"{form}: {err}"
    return None


def _check_read(read, ref, cfg) -> str | None:
    from vllm_moonep.tools.weight_read import launch_read

    for label, launches in (("one launch", [(0, 3)]), ("phased", [(0, 2), (2, 1)])):
        for first, count in launches:
            read.sums.fill_(SENTINEL)
            launch_read(read.mats, read.groups, read.sums, first, count, cfg)
            want = _want(ref, cfg, first, count)
            got = read.sums.double().cpu().tolist()
            if got[: len(want)] != want:
                return (f"{label}, matrices {first}..{first + count - 1}: sums {got[: len(want)]} want {want} (NaN: an "
                        "untouched group read; another value: a chunk skipped, read twice or from another matrix)")
            if any(v != SENTINEL for v in got[len(want):]):
                return f"{label}, matrices {first}..{first + count - 1}: a program wrote past the read's slots"
    return None


@pytest.fixture(scope="module")
def report():
    import torch

    if torch.cuda.is_available():
        return {name: {"err": _run_case(name)} for name in CASES}
    return interpreter_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_read_touches_exactly_the_touched_weights(report, case):
    """A read that skips a chunk, reads an untouched group or the wrong matrix (a group's block found at
    ``g * numel`` where gate and up are the halves of one w13), or writes past its slots."""
    assert report[case]["err"] is None, f"{case}: {report[case]['err']}"


def test_bad_input_is_named_and_leaves_the_sums():
    """A read of matrices of different sizes, of a matrix past down, or into too few sums: named, nothing written."""
    import torch

    from vllm_moonep.tools.weight_read import READ_CONFIGS, launch_read

    cfg = READ_CONFIGS[0]
    gate = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    sums = torch.full((64,), SENTINEL)
    groups = torch.tensor([1], dtype=torch.int32)
    for mats, first, count, n, words in (
        ((gate, gate, torch.zeros(2, 8, 8, dtype=torch.bfloat16)), 0, 3, 64, "down must be contiguous within"),
        ((gate, gate, gate.transpose(1, 2)), 0, 3, 64, "down must be contiguous"),
        ((gate, gate, gate), 2, 2, 64, "not within 0..2"),
        ((gate, gate, gate), 0, 3, 2, "sums holds 2 floats"),
        ((gate, gate, gate), 0, 1, 64, "CHUNK"),
    ):
        bad = dict(cfg, CHUNK=cfg["CHUNK"] + 1) if words == "CHUNK" else cfg
        with pytest.raises(ValueError, match=re.escape(words)):
            launch_read(mats, groups, sums[:n], first, count, bad)
        assert bool((sums == SENTINEL).all()), f"{words}: the refused read wrote its sums"


def test_tiles_cover_each_chunk_once():
    """A chunk that is not a whole number of loads would read into the next chunk (those bytes counted twice)."""
    from vllm_moonep.tools.weight_read import READ_CONFIGS

    for cfg in READ_CONFIGS:
        assert cfg["CHUNK"] % cfg["BLOCK"] == 0, cfg


@pytest.mark.parametrize("even", [True, False], ids=["even", "masked"])
def test_read_loads_16_bytes_per_instruction_on_hopper(even):
    """The anchor compiled to narrower loads than the kernels it measures read with (a slower read: a floor
    that flatters every ratio to it), with the specialization a launch gets (pointers and the element count
    divisible by 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_moonep.tools.weight_read import READ_CONFIGS, _read_kernel

    for cfg in READ_CONFIGS:
        sig = dict(gate="*bf16", up="*bf16", down="*bf16", groups="*i32", sums="*fp32", numel="i32", first="i32",
                   s_gate="i32", s_up="i32", s_down="i32", CHUNK="constexpr", BLOCK="constexpr", EVEN="constexpr")
        attrs = {(_read_kernel.arg_names.index(k),): [["tt.divisibility", 16]]
                 for k in ("gate", "up", "down", "groups", "sums", "numel", "s_gate", "s_up", "s_down")}
        src = ASTSource(fn=_read_kernel, signature=sig, attrs=attrs,
                        constexprs=dict(CHUNK=cfg["CHUNK"], BLOCK=cfg["BLOCK"], EVEN=even))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"])).asm["ptx"]
        loads = re.findall(r"ld\.global[\w.]*", ptx)
        narrow = [ld for ld in loads if ".v4." not in ld]
        # one narrow load is the group's index; every weight load moves 16 bytes
        assert len(narrow) == 1 and len(loads) > 1, (cfg, loads)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print_report(CASES, _run_case)
