"""The device pad-and-count kernel (common/pad_kernel.py) against the torch path it replaces on CUDA
(``pad_to_capacity`` + the counts of ids in ``[0, E)``): every output equal, bit for bit.

On CPU the kernel runs under Triton's interpreter in a child process (tests/interpreter_child.py);
the ``gpu`` test runs the same cases natively, with staging tensors from a real pool.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import interpreter_report, print_report

SENTINEL = 77  # staging starts full of it: a row or count the kernel forgets to write shows


def _inputs(name):
    """(hidden, topk_ids, topk_weights, capacity, E, pad_expert) of a case."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    s, cap, H, K, E, pad = dict(
        partial=(5, 8, 96, 4, 12, 6), full=(8, 8, 64, 2, 8, 0), empty_rank=(0, 4, 32, 2, 8, 4),
        top1=(3, 4, 32, 1, 6, 3), odd_k=(7, 8, 40, 3, 10, 5), kimi_like=(33, 128, 7168, 8, 384, 192),
    )[name.split("-")[0]]
    x = torch.randn(s, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (s, K), generator=g)
    w = torch.rand(s, K, generator=g)
    if "invalid" in name and s:  # router output marked invalid (-1), and ids past E (kept, not counted)
        ids.view(-1)[::3] = -1
        ids.view(-1)[1::5] = E + 2
        ids.view(-1)[2::7] = 10**6  # past the padded histogram too
    if "strided" in name:  # a hidden view with a row stride, transposed ids, bf16 weights
        x = torch.randn(s, 2 * H, generator=g).to(torch.bfloat16)[:, ::2]
        ids = ids.T.contiguous().T
        w = w.to(torch.bfloat16)
    if "int32" in name:
        ids = ids.to(torch.int32)
    if "wide" in name and s:  # int64 ids past int32 either way: the cast alone wrapped them into [0, E)
        ids.view(-1)[3::11] = 2**32 + 3
        ids.view(-1)[4::13] = -(2**32) + 2
    return x, ids, w, cap, E, pad


def _past_int32_as_max(ids):
    """The ids the kernel must write (and count) for ``ids``: one past int32 becomes 2**31 - 1, past E."""
    return ids.clamp(max=2**31 - 1) if ids.dtype == torch.int64 else ids


CASES = ["partial", "partial-invalid", "full", "full-strided-int32", "empty_rank", "top1-invalid", "odd_k-strided",
         "kimi_like-invalid", "odd_k-wide"]


def _expected(x, ids, w, cap, E, pad):
    from vllm_moonep.common.padding import pad_to_capacity

    px, pid, pw, s = pad_to_capacity(x, ids, w, cap, pad)
    flat = pid.reshape(-1).long()
    tpe = torch.bincount(flat[(flat >= 0) & (flat < E)], minlength=E).to(torch.int32)
    return px, pid, pw, tpe, s


def run_case(name, device):
    from vllm_moonep.common.pad_kernel import pad_and_count_on_device
    from vllm_moonep.common.padding import pad_and_count

    x, ids, w, cap, E, pad = _inputs(name)
    want = _expected(x, _past_int32_as_max(ids), w, cap, E, pad)
    H, K = x.shape[1], ids.shape[1]
    staging = (torch.full((cap + 3, H), SENTINEL, dtype=torch.bfloat16, device=device)[:cap],
               torch.full((cap, K), SENTINEL, dtype=torch.int32, device=device),
               torch.full((cap, K), SENTINEL, dtype=torch.float32, device=device),
               torch.full((E,), SENTINEL, dtype=torch.int32, device=device))
    if device.type == "cuda":  # the selection too: CUDA bf16 with staging takes the kernel
        got = pad_and_count(x.to(device), ids.to(device), w.to(device), cap, E, pad, staging)
        if any(g.data_ptr() != t.data_ptr() for g, t in zip(got[:4], staging)):
            return "pad_and_count did not write the staging tensors (torch path taken on CUDA)"
    else:  # the interpreter runs the kernel on CPU tensors
        pad_and_count_on_device(x, ids, w, pad, staging)
        got = (*staging, x.shape[0])
    errs = []
    for what, g, e in zip(("hidden", "ids", "weights", "tokens_per_expert"), got[:4], want[:4]):
        if g.dtype != e.dtype or not torch.equal(g.cpu(), e):
            errs.append(f"{what} differs ({g.dtype} vs {e.dtype})")
    if got[4] != want[4]:
        errs.append(f"s {got[4]} vs {want[4]}")
    return "; ".join(errs) or None


def _child_main() -> None:
    print_report(CASES, lambda name: run_case(name, torch.device("cpu")))


@pytest.fixture(scope="module")
def report():
    return interpreter_report(__file__)


_DOCS = {
    "partial": "padding rows not zero / not routed to the rank's own expert, or counts missing them",
    "partial-invalid": "an invalid id (-1) kept or its weight kept; an id past E counted (or dropped from ids)",
    "full": "a step at exactly the capacity (no padding rows) written wrong",
    "full-strided-int32": "strides of a hidden view / transposed ids ignored; int32 ids or bf16 weights mis-cast",
    "empty_rank": "a DP rank with no tokens: every row padding, counts all on the pad expert",
    "top1-invalid": "top-1 routing (K=1, padded tile) with invalid ids",
    "odd_k-strided": "K=3 (masked columns of the padded K tile) with strided inputs",
    "kimi_like-invalid": "Kimi-K2 sizes: H=7168 over several column blocks, E=384 bins, 128-row capacity",
    "odd_k-wide": "int64 ids past int32 wrapped by the cast to a valid expert (2**32 + 3 -> 3) and counted there",
}


@pytest.mark.parametrize("case", CASES)
def test_interpreter_pad_kernel(report, case):
    """The device padding kernel's outputs differ from the torch path's (see _DOCS for each case's bug)."""
    assert report[case]["err"] is None, f"{case} ({_DOCS[case]}): {report[case]['err']}"


@pytest.mark.gpu
def test_gpu_pad_kernel_cases():
    """The same cases natively on CUDA (codegen, atomics and histogram the interpreter cannot show)."""
    errs = {name: run_case(name, torch.device("cuda")) for name in CASES}
    assert not any(errs.values()), errs


if __name__ == "__main__":
    _child_main()
