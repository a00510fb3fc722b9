"""CUDA graphs of several expert-kernel forms replayed in turn, each case in a child process.

The fault it catches: an illegal address while replaying, as graphs in turn,
Qwen3-30B-A3B's tiles for 1024 tokens per rank as three launches and the same tiles as one launch at 3
and 4 stages; any two of the three forms, and each alone, ran clean. The kernels were not at fault:
the harness captured each form with ``act`` held only by the captured callable, which it then dropped,
and each capture (``torch.cuda.graph``) empties the allocator's cache, handing a dropped ``act`` back
to the driver under the graph that still wrote it. ``capture_graph`` now holds what it captured.
A fault ends the process's CUDA context, so every case runs in a child (this file as a script) and
the parent names the last step the child reached::

    child FORM[,FORM...]:  for 1024 then 4096 tokens, balanced then skewed routing (bench_experts' rank-0 rows):
        three launches eager  -> float64 reference          (a wrong answer shared by every form)
        each form eager       -> bit-equal to three launches (the form itself wrong)
        each form captured (capture_graph; its buffers held by nothing else)
        2 rounds x each form x REPLAYS replays, a 256 MB flush before each
                              -> bit-equal, counters at 0    (a replay reading another graph's memory,
                                                              or memory freed under it)
    tests:  the forms in turn (the sequence that faulted); each form alone

``three``: the three launches of tuning.json's H200 entry (TMA rows, the down loop flattened);
``three_noflat``: the same without ``flat``; ``one_s3``/``one_s4``: its tiles as one launch, down rows
through tensor descriptors.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

pytestmark = pytest.mark.gpu

#: replays per form and round (the fault above came within the first form's first 400)
REPLAYS = 400
ROUNDS = 2
POINTS = ((1024, False), (1024, True), (4096, False), (4096, True))  # (tokens per rank, skewed)
CHILD_TIMEOUT_S = 300


def _forms() -> dict:
    from tests.gpu.test_triton_grouped_gemm import Q_BIG_ONE_TILES, Q_BIG_TILES

    one = {s: {**Q_BIG_ONE_TILES, "fused": {"num_warps": 8, "num_stages": s, "progs_per_sm": 1}} for s in (3, 4)}
    return {"three": Q_BIG_TILES, "three_noflat": Q_BIG_ONE_TILES, "one_s3": one[3], "one_s4": one[4]}


def _child(names: list[str]) -> dict:
    from vllm_moonep.common.grouped_gemm import GroupedWeights
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk
    from vllm_moonep.engine import default_num_slots
    from vllm_moonep.testing.reference import expert_ffn_float64, relative_error
    from vllm_moonep.tools.bench_experts import R, SHAPES, SKEW_SIGMA, entry_ends, make_inputs, make_weights, rank0_case
    from vllm_moonep.tools.timing import capture_graph

    every = _forms()
    forms = {n: every[n] for n in names}
    shape = SHAPES["qwen3-30b-a3b"]
    H, I, E = shape["H"], shape["I"], shape["E"]
    w = GroupedWeights.contiguous(*make_weights(H, I, E + default_num_slots(E, R), "cuda"))
    sync = tk.prepare_weights(w).sync
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    report = {}
    for tokens, skewed in POINTS:
        sigma = SKEW_SIGMA if skewed else 0.0
        where = f"{tokens} tokens {'skewed' if skewed else 'balanced'}"
        cu_h, real, nvs, _ = rank0_case(shape, tokens, sigma)
        x, rw = make_inputs(H, cu_h, real, nvs, "cuda", seed=tokens + int(10 * sigma))
        cu, ends, n = cu_h.cuda(), entry_ends(cu_h, real).cuda(), int(cu_h[-1])
        want = torch.full_like(x, float("nan"))
        tk.expert_ffn_triton(x, rw, cu, w, out=want, config=every["three"], padded=False, row_ends=ends)
        err = relative_error(want[:n], expert_ffn_float64(x, rw, cu, w)[:n])
        assert err < 1e-2, f"{where}: three launches against float64: relative error {err:.2e}"
        runs = {}
        for name, conf in forms.items():
            out = torch.full_like(x, float("nan"))
            act = torch.empty(nvs, I, dtype=x.dtype, device="cuda")
            tk.expert_ffn_triton(x, rw, cu, w, out=out, config=conf, act=act, padded=False, row_ends=ends)
            torch.cuda.synchronize()
            assert torch.equal(out[:n], want[:n]), f"{where}: {name}'s eager call differs from three launches"
            call = functools.partial(tk.expert_ffn_triton, x, rw, cu, w, out=out, config=conf, act=act,
                                     padded=False, row_ends=ends, zero_tail=False)
            # act is held by the graph alone, and the next form's is made before this one's is dropped: the
            # allocation pattern that faulted while capture_graph did not hold what it captured
            runs[name] = (out, capture_graph(call, warm_calls=2))
        for r in range(ROUNDS):
            for name, (out, graph) in runs.items():
                print(f"PROGRESS {where}: round {r}, {name}: {REPLAYS} replays", flush=True)
                for _ in range(REPLAYS):
                    flush.zero_()
                    graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out[:n], want[:n]), f"{where}: {name}'s replays in turn changed the output"
        assert int(sync.abs().sum()) == 0, f"{where}: counters not restored: {sync.nonzero().flatten().tolist()}"
        report[where] = {"rows": nvs, "replays": ROUNDS * REPLAYS * len(runs), "float64_err": err}
        del runs
    return report


def _run_child(names: list[str]) -> dict:
    """The child's report; on a failure the last step it reached and its error."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), ",".join(names)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # a wait that never ends (the one launch's counters) shows here
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        reached = [ln for ln in out.splitlines() if ln.startswith("PROGRESS ")]
        last = reached[-1] if reached else "no replay"
        pytest.fail(f"{'+'.join(names)}: no end within {CHILD_TIMEOUT_S} s, after {last}")
    reached = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROGRESS ")]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (
        f"{'+'.join(names)} (rc={proc.returncode}) after {reached[-1] if reached else 'no replay'}:\n"
        f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("REPORT "):])


def test_capture_graph_holds_what_it_captured():
    """The bug behind the fault above: a buffer only the captured callable held was freed once the caller
    dropped the callable; the next capture emptied the allocator's cache and the first graph's replay wrote
    into memory handed back to the driver. Sentinel: the buffer's values after replays on both graphs."""
    from vllm_moonep.tools.timing import capture_graph

    buf = torch.zeros(8 << 20, device="cuda")  # 32 MB: a segment of its own, which the cache can hand back
    alive = weakref.ref(buf)
    first = capture_graph(functools.partial(buf.add_, 1.0), warm_calls=2)
    del buf
    gc.collect()
    assert alive() is not None, "capture_graph's graph does not hold the buffer its callable captured"
    other = torch.zeros(8 << 20, device="cuda")
    second = capture_graph(functools.partial(other.add_, 10.0))  # a capture: empties the cache first
    for _ in range(3):
        first.replay()
        second.replay()
    torch.cuda.synchronize()
    # warm-up calls count too: first 2 + 3 replays, second 1 + 3
    assert torch.equal(alive(), torch.full_like(alive(), 5.0)), "the first graph's buffer lost its replays"
    assert torch.equal(other, torch.full_like(other, 40.0)), "the second graph wrote into the first one's buffer"


def _needs_hopper():
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor-descriptor loads need a Hopper-class GPU")


def test_forms_in_turn():
    """The harness's sequence: three launches and both one-launch forms as graphs in turn."""
    _needs_hopper()
    report = _run_child(["three", "one_s3", "one_s4"])
    assert len(report) == len(POINTS)


@pytest.mark.parametrize("form", ["three", "three_noflat", "one_s3", "one_s4"])
def test_form_alone(form):
    """Each form's graph alone, as many replays: a fault here is that form's own."""
    _needs_hopper()
    report = _run_child([form])
    assert len(report) == len(POINTS)


if __name__ == "__main__":
    print("REPORT " + json.dumps(_child(sys.argv[1].split(","))), flush=True)
