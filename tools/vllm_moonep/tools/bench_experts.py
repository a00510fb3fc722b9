"""Benchmark of the expert compute on one GPU: fused Triton grouped GEMM vs the vLLM 0.33 PoC path.

``python -m vllm_moonep.tools.bench_experts [--tune] [--shapes qwen3-30b-a3b,kimi-k2] [--tokens 1,16,...]``

One run measures the ceilings (bf16 8192^3 matmul TFLOP/s, device copy GB/s counting bytes read
plus written, and a plain read's GB/s), then for each shape, tokens per rank and routing (balanced, skewed) builds rank
0's realistic ``cu_seqlens`` of an EP=8 deployment: eight ranks' routing
(``vllm_moonep.testing.routing.route``) gives ``tpe[8, E]``, the real planner
(``vllm_moonep.engine.planning.planner.plan_global``, ``B = E/8`` slots, padding 128) gives
``cu_seqlens[0]`` over ``E+B`` groups; real rows carry random hidden states and weights,
padding rows zeros (the dispatch contract). Timed as CUDA-graph replays (as vLLM runs the
layer; eager launches are timed too and kept in the JSON): median, CUDA events, L2 flushed and left
clean before each run (``timing.flushed_median_ms``). A point's columns are captured first, each in its own
graph and buffers, then timed in ``--rounds`` alternated rounds, each round's order from a Williams
design (``timing.alternated_times``: every column in every place and after every other column as evenly as the
rounds allow); each time is the median of the rounds. At the power-bound points a kernel's place in a
fixed order alone moved its time 4-10%, and the column timed before it 3-10% (docs/PERFORMANCE.md), more
than the margins the library regimes are chosen on:

- ``control``: the Triton call again, as a column of its own: ``control/Triton`` is the point's noise
  band, and a library is named faster only where it wins by more than that (``noise_band``);
- ``triton``: ``expert_ffn_triton`` (tile configs from tuning.json, or the tuned ones with --tune), as the
  layer runs it on the built-in engine: over ``w13 [E+B, 2I, H]`` stored as the symmetric layout stores it
  (gate and up interleaved: the gate/up tiles read one weight), given each segment's end of entries as the
  GPU dispatch hands them over (``row_ends``, ``entry_ends``: no trim launch), padding tails not written
  (``zero_tail=False``: that combine never reads them); the untimed check call writes every row;
- ``poc``: three ``torch._grouped_mm`` over ``E+B`` groups plus elementwise ops, as vLLM 0.33's
  ``MoonEPExperts.apply`` does, on gate and up as the halves of a second ``w13`` (vLLM's order, gate rows
  first: views, the same values);
- ``quack``: ``expert_ffn_quack`` (quack-kernels' varlen GEMM, the optional extra) over the same interleaved
  ``w13`` (one GEMM with the fused ``silu(gate) * up * route_w`` epilogue, then down), on the same rows; where
  quack cannot run (not installed, compile error) the column reads ``-`` and the reason is printed.
  quack's own tiles unless ``--quack-tuned`` (its autotuner: minutes per new shape);
- ``deepgemm``: ``expert_ffn_deepgemm`` (DeepGEMM's contiguous grouped bf16 GEMMs, vLLM's bundled
  copy or a standalone ``deep_gemm``) over the same interleaved ``w13``: gate/up GEMM, our ``swiglu_route``
  activation, down GEMM, grouped by the segments' ends (``--deepgemm-layout``); and, at points up to
  ``MASKED_MAX_TOKENS`` tokens per rank, ``deepgemm masked``: its masked form (the low-latency decode
  form: every group a fixed ``[max_m, H]`` block with a row count) with the same three steps, on the
  point's rows copied into those blocks before timing (what MoonEP's contiguous segments would have to
  be copied into: the copy is not in the time). Where DeepGEMM cannot run the columns read ``-`` and
  the reason is printed;
- ``deepgemm_down``: ``expert_ffn_deepgemm_down`` (``impl="deepgemm_down"``, which ``auto`` takes at some points:
  the Triton gate/up tiles, ``zero_tails``, then DeepGEMM's down GEMM), given what the ``triton`` column is given
  (the point's ``tokens``, ``row_ends``, ``zero_tail=False``, ``padded=False``): the gate/up tiles of the same
  tile entry, which ``tokens`` picks from the table in use (the tuning passes' tiles go to the ``triton`` column
  alone; at a one-launch entry the ``triton`` column runs them fused with its down tiles). It runs where DeepGEMM
  does, and writes every row up to the last segment's end whatever ``zero_tail``: the timed call is the checked one;
- ``vllm``: vLLM 0.33's own ``fused_experts`` (its Triton fused-MoE path: what a user gets without
  our backend; ``vllm_moonep.testing.vllm_fused.vllm_fused_experts`` says how it is called), on the
  same rows and weights: the point's real rows as top-1 tokens (``topk_ids`` = the row's group,
  ``topk_weights`` = its route weight) over ``w13 [E+B, 2I, H]`` (gate rows first, the same values)
  and ``w_down``, so both compute the same ``sum of route_w * FFN_group(row)``; padding rows are not
  given to it. Its time includes what it does beyond our kernels: grouping its rows by expert
  (``moe_align_block_size``; skipped where rows x 4 <= groups, as at decode: vLLM then reads
  weights per row) and the top-1 K-sum (``moe_sum``), which dispatch and combine do for ours. Its tiles are vLLM's choice for ``E+B``
  groups (vLLM ships no tuned file for these group counts: its default tiles; the JSON records them).
  Where vLLM cannot run here (not installed, compiled ops missing, ``--no-vllm``) the column reads
  ``-`` and the reason is printed;
- ``read``, ``read_phased``: the touched weight bytes (the floor's) read by a plain kernel that does nothing
  else (``weight_read``: one launch; gate and up then down, two launches), the fastest of its tiles: the
  time those bytes take with a launch, the DRAM's ramp and the last programs' tail, which the floor does
  not count;
- ``floor`` = max(useful FLOP / measured matmul rate, touched weight bytes / measured copy rate),
  useful FLOP = ``6*H*I`` per real row (never padding), touched bytes = ``3*H*I*2`` per non-empty
  group;
- ``launch``: an empty one-kernel CUDA graph timed the same way (``launch_floor_us``), printed with
  the ceilings: it is in every time and in no floor, so the table also gives Triton/(floor+launch),
  which is what a decode point of a few microseconds of work can approach.

``--tune`` times candidate tile configs for each kernel at each point, keeps per ``(shape, NvS)``
the one with the least total time over both routings, then times the whole compute with those
tiles as three launches and as one (``triton_fused``, ``FUSED_CANDIDATES``, ``FUSED_TILES``) and
keeps one launch where it is faster at both routings; each kernel's ``STREAMK_TRIES`` best tiles are
also timed cut by stream-K (``"streamk"``) and kept cut where faster at both routings.
``--tune-streamk`` is the quick pass of that last step alone, on the shipped tiles; ``--tune-fused`` the
quick pass of the one-launch step alone: the shipped entry as it runs against one launch of its tiles and of
``FUSED_TILES``, one launch kept where faster at both routings. The candidates of these sweeps are timed one
after another; what a sweep would put in the table in place of the shipped entry is then timed against it
in an alternated A/B (``--rounds`` rounds, the shipped tiles twice: the second is the control), and replaces it
only where faster at both routings by more than the control's band. Each writes
``tuning.json`` (to ``$OUT`` if set, else the current directory; a GPU without a section of its own gets one,
starting from the tiles and ``auto`` regimes it borrowed) and uses it for the table. A point the table runs
as one launch is also timed as three launches of the same tiles (the ``three launches`` column). Prints a
markdown table; writes ``bench_experts.json`` to ``$OUT`` if set.

After the table it names, per library and shape ``(H, I)``, the runs of measured tokens per rank where
the library beat Triton at both routings by more than the point's control band (CUDA-graph times): the
``auto`` regimes of this GPU's section of ``tuning.json`` (``vllm_moonep.common.grouped_gemm.policy``;
``impl=auto`` then takes the library there, for callers that pass the step's tokens), in ``auto_entries``' order:
quack, ``deepgemm_down``, DeepGEMM (``auto`` takes the first that runs).
"""

from __future__ import annotations

import argparse
import functools
import datetime
import json
import math
import os
import platform
import statistics
import sys

import torch

from vllm_moonep.engine import default_num_slots
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING
from vllm_moonep.testing.models import model
from vllm_moonep.testing.reference import relative_error
from vllm_moonep.tools.timing import ROUNDS, alternated_times, capture_graph, flushed_median_ms

#: the shapes it sweeps by default (vllm_moonep.testing.models)
SHAPES = {key: model(key).dims() for key in ("qwen3-30b-a3b", "kimi-k2")}
R = 8
#: the segments' padding of the rank-0 cases (the engine's default), handed to the DeepGEMM paths' checks
PAD = DEFAULT_TOKEN_PADDING
SKEW_SIGMA = 1.0

GU_CANDIDATES = [
    {"BM": 16, "BN": 32, "BK": 256, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 16, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 5, "progs_per_sm": 3},
    {"BM": 16, "BN": 16, "BK": 256, "num_warps": 4, "num_stages": 4, "progs_per_sm": 4},
    {"BM": 32, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1},
    {"BM": 128, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 1},
    # tensor-descriptor (TMA) loads, and the warp-specialized loop ("ws"): the regimes from 256
    # tokens per rank gained 4-20% on an H200 in a probe (docs/PERFORMANCE.md#tile-options)
    {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True},
    {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True, "ws": True},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True, "ws": True},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 1, "tma": True},
    {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True},
    {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True},
    # two 64-row tiles of a group as one of 128 rows where both hold rows ("pair": each weight block loaded
    # once for both): 0.5-2.4% less at Kimi-K2 1024 tokens on an H100, slower at Qwen3-30B-A3B 256 and Kimi-K2
    # 4096 (docs/PERFORMANCE.md#tile-options)
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True, "pair": True},
    # one wave: tiles whose shared memory lets 3-4 programs share an SM, so that a launch of a few
    # hundred tiles runs them all at once (no second round for a few programs): 2-4% less for gate/up
    # at 16-64 tokens of Qwen3 on an H200 (docs/PERFORMANCE.md#tile-options)
    {"BM": 16, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4},
    {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 3},
    {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4},
    {"BM": 32, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 3},
    {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 3, "tma": True},
    # swap-AB ("swap": weights on the MMA's M side): within 4% either way of the same tiles unswapped
    # (docs/PERFORMANCE.md#tile-options); kept where a point's sweep finds it faster
    {"BM": 32, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "swap": True},
    {"BM": 16, "BN": 64, "BK": 256, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2, "swap": True},
]
DOWN_CANDIDATES = [
    {"BM": 16, "BN": 64, "BK": 256, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 16, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 16, "BN": 32, "BK": 256, "num_warps": 4, "num_stages": 4, "progs_per_sm": 4},
    {"BM": 32, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2},
    {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 2},
    {"BM": 64, "BN": 64, "BK": 256, "num_warps": 4, "num_stages": 3, "progs_per_sm": 2},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True, "ws": True},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True},
    {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True, "ws": True},
    {"BM": 16, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True},
    # the persistent tile loop flattened ("flat": the next tile's loads overlap this one's epilogue): 1-3%
    # less at 256-4096 tokens on an H200 for these down tiles, slower for every gate_up tile tried
    # (docs/PERFORMANCE.md#tile-options)
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "tma": True, "flat": True},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "progs_per_sm": 1, "tma": True, "flat": True},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3, "progs_per_sm": 1, "tma": True, "flat": True},
    # one wave (see GU_CANDIDATES): 8-12% less for the down kernel at 16-64 tokens of Qwen3 on an H200
    {"BM": 16, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4},
    {"BM": 16, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 3},
    {"BM": 32, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4},
    {"BM": 32, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4, "tma": True},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 3, "tma": True},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "progs_per_sm": 4, "tma": True},
    # swap-AB (see GU_CANDIDATES)
    {"BM": 16, "BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "swap": True},
    {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "progs_per_sm": 2, "swap": True},
]

#: launch settings tried for the one-launch kernel (``triton_fused``) with a point's best gate_up and
#: down tiles, and with ``FUSED_TILES``; its warps are the gate_up tiles' (both compile into one kernel)
FUSED_CANDIDATES = [{"num_stages": s, "progs_per_sm": p} for p in (1, 2, 3, 4) for s in (3, 4)]
#: one launch replaces three, or stream-K tiles uncut ones, only when faster by more than this at every
#: routing (ties are noise)
KEEP_MARGIN = 0.01
#: the best candidates of each kernel that ``--tune`` also times cut by stream-K (``"streamk"``)
STREAMK_TRIES = 3
def _one_launch(gate_up: dict, down: dict, progs_per_sm: int, num_stages: int) -> dict:
    """A tile config run as one launch (``triton_fused``): both kernels' tiles with the launch's stages and
    programs per SM (so that the same tiles as three launches, the ``three launches`` column, run alike)."""
    run = {"num_warps": 4, "num_stages": num_stages, "progs_per_sm": progs_per_sm}
    return {"gate_up": {**gate_up, **run}, "down": {**down, **run}, "fused": run}


#: tile configs tried as one launch beside a point's own tiles (``--tune``, where its gate/up tiles have at most
#: 64 rows, and ``--tune-fused``): 16- and 32-column decode items (16 columns even out Qwen3's 7 busy groups over
#: 132 SMs at 1 token, 336 items of 128 KB instead of 168 of 256 KB, yet measured 12-23% slower on an H200: the
#: item's fixed cost), and row tiles of 32-64 for the middle, where a launch's items are one row tile each
#: (``triton_fused``, given the engine's ends; docs/PERFORMANCE.md#tried-and-not-kept)
FUSED_TILES = [
    _one_launch({"BM": 16, "BN": 16, "BK": 256}, {"BM": 16, "BN": 64, "BK": 128}, 2, 4),
    _one_launch({"BM": 16, "BN": 16, "BK": 256}, {"BM": 16, "BN": 64, "BK": 128}, 3, 3),
    _one_launch({"BM": 16, "BN": 16, "BK": 256}, {"BM": 16, "BN": 32, "BK": 256}, 2, 4),
    _one_launch({"BM": 16, "BN": 16, "BK": 256}, {"BM": 16, "BN": 32, "BK": 256}, 3, 3),
    _one_launch({"BM": 16, "BN": 16, "BK": 128}, {"BM": 16, "BN": 64, "BK": 128}, 2, 4),
    _one_launch({"BM": 16, "BN": 16, "BK": 128}, {"BM": 16, "BN": 64, "BK": 128}, 4, 4),
    _one_launch({"BM": 16, "BN": 32, "BK": 128}, {"BM": 16, "BN": 64, "BK": 128}, 2, 4),
    _one_launch({"BM": 16, "BN": 32, "BK": 128}, {"BM": 16, "BN": 128, "BK": 128}, 2, 4),
    _one_launch({"BM": 16, "BN": 32, "BK": 128}, {"BM": 16, "BN": 32, "BK": 256}, 3, 3),
    _one_launch({"BM": 32, "BN": 32, "BK": 128}, {"BM": 32, "BN": 64, "BK": 128}, 2, 4),
    _one_launch({"BM": 32, "BN": 32, "BK": 128}, {"BM": 32, "BN": 64, "BK": 128}, 3, 3),
    _one_launch({"BM": 64, "BN": 64, "BK": 64}, {"BM": 64, "BN": 128, "BK": 64}, 1, 4),
    _one_launch({"BM": 64, "BN": 64, "BK": 64}, {"BM": 64, "BN": 128, "BK": 64}, 2, 3),
]
def one_launch_tries(tiles: dict) -> list[dict]:
    """``tiles`` (gate_up and down) as one launch with each of ``FUSED_CANDIDATES``' stages and programs per SM
    (its warps are the gate_up tiles': both compile into one kernel)."""
    tiles = {k: v for k, v in tiles.items() if k != "fused"}
    return [{**tiles, "fused": {"num_warps": tiles["gate_up"]["num_warps"], **fc}} for fc in FUSED_CANDIDATES]


#: the largest gate/up row tile for which ``--tune`` also tries ``FUSED_TILES`` (from 1024 tokens per rank the
#: tiles are 128 rows and these narrow one-launch tiles lost everywhere: docs/PERFORMANCE.md#tried-and-not-kept)
FUSED_TILES_MAX_BM = 64


#: whether each timing's L2 flush leaves L2 clean (``timing.flushed_median_ms``); ``--flush dirty`` clears it
CLEAN_FLUSH = True


def _bench(fn, warmup=25, rep=100):
    return flushed_median_ms(fn, warmup=warmup, rep=rep, clean=CLEAN_FLUSH)  # ms


def add_flush_option(ap: argparse.ArgumentParser) -> None:
    """``--flush clean|dirty`` (this tool's and ``bench_levers``'): the L2 flush before each timing."""
    ap.add_argument("--flush", choices=("clean", "dirty"), default="clean",
                    help="the L2 flush before each timing: written then read back (clean, the default), or only "
                         "written, as triton.testing.do_bench flushes (dirty: its write-back lands in the timed call; "
                         "the method of the figures in docs/PERFORMANCE.md that name no flush)")


def use_flush(flush: str) -> None:
    """Time with the ``--flush`` given (``CLEAN_FLUSH``)."""
    global CLEAN_FLUSH
    CLEAN_FLUSH = flush == "clean"


def _graphed(fn):
    """Capture ``fn`` in a CUDA graph (after two warm-up calls on a side stream); returns replay."""
    g = capture_graph(fn, warm_calls=2)
    return g.replay, g


#: ceiling method: seconds of matmuls before timing (clocks ramp up, power state settles), then the
#: best of this many medians. A cold or unlucky ceiling reads low and flatters every ratio to it
#: (a cold 8192^3 read 692 TFLOP/s where a warm one on the same kind reads 769-798).
CEILING_WARM_S = 3.0
CEILING_ROUNDS = 5


def measure_ceilings(dev, warm_s: float = CEILING_WARM_S, rounds: int = CEILING_ROUNDS) -> dict:
    """bf16 8192^3 matmul TFLOP/s, device copy GB/s (bytes read plus written) and plain-read GB/s
    (``weight_read``, the same 2 GB), each the best of ``rounds`` medians after ``warm_s`` seconds of
    warm-up; every round's figure is kept."""
    import time

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t0 = time.monotonic()
    while time.monotonic() - t0 < warm_s:
        for _ in range(20):
            torch.mm(a, b)
        torch.cuda.synchronize()
    mm = [2 * n**3 / (_bench(functools.partial(torch.mm, a, b), warmup=20, rep=300) * 1e-3) / 1e12 for _ in range(rounds)]
    del a, b
    nbytes = 2 << 30
    src = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    cp = [2 * nbytes / (_bench(functools.partial(dst.copy_, src), warmup=20, rep=200) * 1e-3) / 1e9 for _ in range(rounds)]
    del src, dst
    torch.cuda.empty_cache()
    from vllm_moonep.tools.weight_read import read_rates

    rd, rd_cfg = read_rates(dev, nbytes, lambda fn: _bench(fn, warmup=20, rep=200) * 1e-3, rounds)
    torch.cuda.empty_cache()
    return {"matmul_tflops": max(mm), "copy_gbs": max(cp), "matmul_rounds": mm, "copy_rounds": cp,
            "read_gbs": max(rd), "read_rounds": rd, "read_config": rd_cfg, "rate_bytes": nbytes,
            "warm_s": warm_s, "launch_us": launch_floor_us(dev)}


def launch_floor_us(dev) -> float:
    """What timing one kernel costs with nothing to do: a CUDA graph of a single 1-element add,
    replayed and timed exactly as the rows are (``_bench``, L2 flushed). Every graph-replay time
    of the table includes it; the floor does not (it is work, not launch), so a decode point's
    Triton/floor can never read below ``(floor + launch) / floor``."""
    one = torch.zeros(1, device=dev)
    replay, _ = _graphed(functools.partial(one.add_, 1.0))
    return _bench(replay) * 1e3


def _ceiling_line(ceil: dict, where: str) -> str:
    """The ceilings every ratio of a table is taken against, printed beside each table."""
    return (f"Ceilings ({where}): bf16 8192^3 matmul {ceil['matmul_tflops']:.1f} TFLOP/s (best of "
            f"{len(ceil['matmul_rounds'])} medians after {ceil['warm_s']:.0f} s warm-up; rounds "
            f"{', '.join(f'{v:.0f}' for v in ceil['matmul_rounds'])}), device copy {ceil['copy_gbs']:.0f} GB/s "
            f"(read+write); a plain read {ceil.get('read_gbs', float('nan')):.0f} GB/s (weight_read, "
            f"{ceil.get('rate_bytes', 0) >> 30} GB); an empty one-kernel graph replay, timed as the rows are: "
            f"{ceil.get('launch_us', float('nan')):.1f} us (in every time below, in no floor)")


def rank0_case(shape: dict, tokens: int, sigma: float, seed: int = 0):
    """Rank 0's cu_seqlens [E+B] int32, real rows per segment [E+B], NvS, maxvio."""
    from vllm_moonep.engine.buffer import nvs_rows
    from vllm_moonep.engine.planning.planner import plan_global
    from vllm_moonep.testing.routing import maxvio, route

    E, K = shape["E"], shape["K"]
    B = default_num_slots(E, R)
    tpe = torch.zeros(R, E, dtype=torch.int64)
    for r in range(R):
        ids, _ = route(tokens, E, K, sigma=sigma, seed=seed, rank=r)
        tpe[r] = torch.bincount(ids.reshape(-1).long(), minlength=E)
    gp = plan_global(tpe, tokens, K, B, PAD)
    cu = gp.cu_seqlens[0].to(torch.int32)
    real = gp.seg_len[0].to(torch.int64)
    return cu, real, nvs_rows(tokens, K, E, R, PAD), maxvio(tpe)


def entry_ends(cu: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each segment's end of entries (int32): its start plus its real rows, what the engine's GPU dispatch
    hands the layer (``Plan.live_ends``), so that the expert kernels launch no trim."""
    starts = torch.cat([cu.new_zeros(1), cu[:-1]]).to(torch.int64)
    return (starts + real.to(torch.int64)).to(torch.int32)


def make_weights(H, I, G, dev):
    """``(gate [G,I,H], up [G,I,H], down [G,H,I])`` bf16, seeded: every point and the profiled case
    run the same weights."""
    gen = torch.Generator(device=dev).manual_seed(1234)
    return (torch.randn(G, I, H, device=dev, generator=gen, dtype=torch.bfloat16) * H**-0.5,
            torch.randn(G, I, H, device=dev, generator=gen, dtype=torch.bfloat16) * H**-0.5,
            torch.randn(G, H, I, device=dev, generator=gen, dtype=torch.bfloat16) * I**-0.5)


def make_inputs(H, cu, real, nvs, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.zeros(nvs, H, device=dev, dtype=torch.bfloat16)
    rw = torch.zeros(nvs, device=dev, dtype=torch.float32)
    mask = torch.zeros(nvs, dtype=torch.bool)
    start = 0
    for end, r in zip(cu.tolist(), real.tolist()):
        mask[start : start + r] = True
        start = end
    mask = mask.to(dev)
    n = int(mask.sum())
    x[mask] = torch.randn(n, H, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    rw[mask] = torch.rand(n, device=dev, generator=g) * 0.25 + 0.01
    return x, rw


def poc_experts(x, rw, cu, w_gate, w_up, w_down, out):
    """vLLM 0.33 MoonEPExperts.apply's compute (three grouped GEMMs over E+B groups + elementwise)."""
    gate = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=cu)
    up = torch._grouped_mm(x, w_up.transpose(1, 2), offs=cu)
    act = torch.nn.functional.silu(gate)
    act.mul_(up)
    act.mul_(rw.to(act.dtype).unsqueeze(-1))
    out.copy_(torch._grouped_mm(act, w_down.transpose(1, 2), offs=cu))
    return out


def set_floor(row: dict, ceil: dict) -> None:
    """A row's floor from its useful FLOP and touched weight bytes at ``ceil``'s rates, and the
    ratios to it (set once per row, again if a better ceiling is read after the sweep)."""
    t_fl = row["flop"] / (ceil["matmul_tflops"] * 1e12) * 1e6
    t_by = row["weight_bytes"] / (ceil["copy_gbs"] * 1e9) * 1e6
    row.update(floor_flop_us=t_fl, floor_bytes_us=t_by, floor_us=max(t_fl, t_by),
               floor_kind="flop" if t_fl >= t_by else "bytes")
    row.update(triton_over_floor=row["triton_us"] / row["floor_us"], poc_over_floor=row["poc_us"] / row["floor_us"],
               triton_over_floor_launch=row["triton_us"] / (row["floor_us"] + ceil.get("launch_us", 0.0)))
    if row.get("quack_us") is not None:
        row["quack_over_floor"] = row["quack_us"] / row["floor_us"]
    if row.get("vllm_us") is not None:
        row["vllm_over_floor"] = row["vllm_us"] / row["floor_us"]
    for name in ("deepgemm", "deepgemm_down", "deepgemm_masked"):
        if row.get(f"{name}_us") is not None:
            row[f"{name}_over_floor"] = row[f"{name}_us"] / row["floor_us"]


#: the largest tokens per rank the masked DeepGEMM form is timed at (its regime: decode)
MASKED_MAX_TOKENS = 256


def _deepgemm_point(x, rw, cu, weights, out_p, n, args, replays):
    """The DeepGEMM contiguous column at one point: ``(fields, error)`` as ``_quack_point``."""
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import expert_ffn_deepgemm

    out_d = torch.full_like(x, float("nan"))

    def f_d():
        return expert_ffn_deepgemm(x, rw, cu, weights, out=out_d, layout=args.deepgemm_layout, token_padding=PAD)

    return _checked_column("deepgemm", f_d, out_d, out_p, n, args, replays)


def _deepgemm_down_point(x, rw, cu, ends, tokens, weights, out_p, n, args, replays):
    """``impl="deepgemm_down"`` at one point, through its entry with the Triton column's arguments (the same tile
    entry's gate/up tiles): ``(fields, error)`` as ``_quack_point``."""
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import expert_ffn_deepgemm_down

    out_dd = torch.full_like(x, float("nan"))
    act = torch.empty(x.shape[0], weights.intermediate, device=x.device, dtype=x.dtype)

    def f_dd():
        return expert_ffn_deepgemm_down(x, rw, cu, weights, out=out_dd, tokens=tokens, padded=False, row_ends=ends,
                                        zero_tail=False, act=act, token_padding=PAD)

    return _checked_column("deepgemm_down", f_dd, out_dd, out_p, n, args, replays)


def _deepgemm_masked_point(x, rw, cu_h, real, w13, w_down, out_p, args, replays):
    """DeepGEMM's masked form at one point: each group's live rows copied (untimed) into a
    ``[G, max_m, H]`` block, then the gate/up GEMM, the activation and the down GEMM as the masked
    kernels run them. ``(fields, error)``; the check scatters the blocks back onto the rows."""
    from vllm_moonep.common.grouped_gemm.deepgemm_act import swiglu_route
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import deep_gemm

    dg = deep_gemm()
    G, I2, H = w13.shape
    I = I2 // 2
    starts = [0] + cu_h.tolist()[:-1]
    counts = real.tolist()
    max_m = max(128, -(-max(counts) // 128) * 128)
    expected = max(1, -(-sum(counts) // max(1, sum(1 for c in counts if c))))
    a = torch.zeros(G, max_m, H, dtype=x.dtype, device=x.device)
    w = torch.zeros(G, max_m, dtype=torch.float32, device=x.device)
    src, dst = [], []
    for g, (s0, c) in enumerate(zip(starts, counts)):
        src.extend(range(s0, s0 + c))
        dst.extend(g * max_m + j for j in range(c))
    src_t = torch.tensor(src, dtype=torch.int64, device=x.device)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=x.device)
    a.view(-1, H)[dst_t] = x[src_t]
    w.view(-1)[dst_t] = rw[src_t].float()
    masked_m = torch.tensor(counts, dtype=torch.int32, device=x.device)
    h = torch.empty(G, max_m, I2, dtype=x.dtype, device=x.device)
    act = torch.empty(G * max_m, I, dtype=x.dtype, device=x.device)
    y = torch.empty(G, max_m, H, dtype=x.dtype, device=x.device)
    hv = h.view(-1, I2)
    wv = w.view(-1)

    def f_m():
        dg.m_grouped_bf16_gemm_nt_masked(a, w13, h, masked_m, expected)
        swiglu_route(hv[:, 0::2], hv[:, 1::2], wv, act)  # w13 interleaved: gate and up columns alternate
        dg.m_grouped_bf16_gemm_nt_masked(act.view(G, max_m, I), w_down, y, masked_m, expected)
        return y

    _, err = _first_call(f_m)
    if err:
        return {"deepgemm_masked_us": None}, err
    return {
        "deepgemm_masked_max_m": max_m,
        "err_deepgemm_masked_vs_poc": relative_error(y.view(-1, H)[dst_t], out_p[src_t]),
        **_column_graph("deepgemm_masked", f_m, args, replays),
    }, None


def _quack_point(expert_ffn_quack, x, rw, cu, weights, out_p, n, args, replays):
    """The quack column at one point: ``(fields, error)``. ``error`` (the exception text) when quack
    failed to compile or run here (then no further quack runs); a CUDA-graph capture that fails
    leaves ``quack_us`` empty with the reason and keeps the eager time."""
    out_q = torch.full_like(x, float("nan"))

    def f_q():
        return expert_ffn_quack(x, rw, cu, weights, out=out_q, tuned=args.quack_tuned)

    return _checked_column("quack", f_q, out_q, out_p, n, args, replays)


def _checked_column(name: str, f, out: torch.Tensor, out_p: torch.Tensor, n: int, args, replays: dict):
    """A library column at one point, ``f`` writing ``out`` (NaN-filled before): ``(fields, None)`` with its
    unwritten count and error against the PoC's output over the first ``n`` rows (the first call, which
    compiles, is the checked one) and its timings (``_column_graph``); ``({<name>_us: None}, why)`` where
    the first call failed."""
    _, err = _first_call(f)
    if err:
        return {f"{name}_us": None}, err
    return {
        f"{name}_unwritten": int(torch.isnan(out[:n]).sum()),
        f"err_{name}_vs_poc": relative_error(out[:n], out_p[:n]),
        **_column_graph(name, f, args, replays),
    }, None


def _first_call(f):
    """``(output, None)`` after ``f``'s first call (it compiles), or ``(None, why)`` when it failed."""
    try:
        out = f()
        torch.cuda.synchronize()
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    return out, None


def _column_graph(name: str, f, args, replays: dict) -> dict:
    """A column at one point: ``<name>_eager_us`` timed now, and ``f`` captured as a CUDA graph into
    ``replays[name]`` (its ``<name>_us`` is timed later, in the point's alternated rounds with every other
    column); where the capture fails, ``<name>_us`` stays ``None`` with ``<name>_graph_error`` (the eager
    time stays)."""
    fields = {f"{name}_eager_us": _bench(f, rep=args.rep) * 1e3, f"{name}_us": None}
    try:
        replays[name] = _graphed(f)
    except Exception as e:
        fields[f"{name}_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return fields


def real_rows_as_tokens(x, rw, cu_h, real, dev):
    """A point's real rows as vLLM's top-1 tokens: ``(hidden [n, H], topk_weights [n, 1] float32,
    topk_ids [n, 1] int32 = the row's group, row index [n] into the buffer)``; padding rows left out."""
    idx, gid = [], []
    start = 0
    for g, (end, r) in enumerate(zip(cu_h.tolist(), real.tolist())):
        idx.extend(range(start, start + r))
        gid.extend([g] * r)
        start = end
    rows = torch.tensor(idx, dtype=torch.int64, device=dev)
    return (x[rows].contiguous(), rw[rows].float().unsqueeze(1).contiguous(),
            torch.tensor(gid, dtype=torch.int32, device=dev).unsqueeze(1), rows)


def _vllm_point(vllm_fn, x, rw, cu_h, real, w13, w_down, out_t, args, replays):
    """The vLLM column at one point: ``(fields, error)``. ``error`` (the exception text) when vLLM's
    fused_experts failed to compile or run here (then no further vLLM runs); a CUDA-graph capture that
    fails leaves ``vllm_us`` empty with the reason and keeps the eager time. ``err_vllm_vs_triton``:
    its output against the Triton rows of the same point."""
    from vllm_moonep.testing.vllm_fused import vllm_moe_config_used

    hv, tw, tid, rows = real_rows_as_tokens(x, rw, cu_h, real, x.device)
    if hv.shape[0] == 0:
        return {"vllm_us": None, "vllm_note": "no real rows"}, None

    def f_v():
        return vllm_fn(hv, w13, w_down, tw, tid)

    out_v, err = _first_call(f_v)
    if err:
        return {"vllm_us": None}, err
    fields = {
        "err_vllm_vs_triton": relative_error(out_v, out_t[rows]),
        "vllm_rows": int(hv.shape[0]),
        "vllm_config": vllm_moe_config_used(w13, w_down, 1, int(hv.shape[0])),
        **_column_graph("vllm", f_v, args, replays),
    }
    return fields, None


def noise_band(control_ratio: float | None, margin: float = KEEP_MARGIN) -> float:
    """The fraction a candidate must win by at a point: ``margin``, or more where the point's control (the
    incumbent timed again in the same rounds) read farther from the incumbent than that."""
    if control_ratio is None or not math.isfinite(control_ratio):
        return margin
    return max(margin, abs(control_ratio - 1.0))


def tuned_wins(tuned: list, shipped: list, control: list, margin: float = KEEP_MARGIN) -> bool:
    """Whether a tuning pass may replace the shipped entry: from an alternated A/B's times per routing (the
    tuned tiles, the shipped ones, the shipped ones again as the control), the tuned tiles run and are
    faster at every routing by more than ``noise_band`` of that routing's control; where the shipped tiles
    cannot run (``inf``), tuned tiles that run win."""
    if not tuned or not all(math.isfinite(v) for v in tuned):
        return False
    if not all(math.isfinite(v) for v in shipped + control):
        return True
    return all(a < b * (1 - noise_band(c / b, margin)) for a, b, c in zip(tuned, shipped, control, strict=True))


def tile_entry(shape: str, H: int, I: int, max_rows: int, tokens: int, cfg: dict) -> dict:
    """The ``tuning.json`` tile entry of a point: its keys (``policy.TILE_KEYS``, the shape's name, its tokens
    per rank) and the tiles ``cfg`` as ``select_config`` hands them back (gate_up, down, and fused where one launch)."""
    return {"H": H, "I": I, "max_rows": max_rows, "shape": shape, "tokens_per_rank": tokens,
            **{k: cfg[k] for k in ("gate_up", "down", "fused") if k in cfg}}


def faster_regimes(rows: list, column: str, margin: float = KEEP_MARGIN) -> dict:
    """Per ``(H, I)``: the runs of consecutive measured tokens per rank where ``column``'s graph time beat
    Triton's at every routing by more than ``margin`` and by more than the row's control read apart from
    Triton (``noise_band``: a tie within noise keeps our kernels), as ``[(from_tokens, to_tokens), ...]``
    (``to_tokens`` ``None`` where the run reaches the largest measured point): the ``auto`` regimes
    ``tuning.json`` may take for it."""
    wins: dict = {}
    for r in rows:
        shp = SHAPES[r["shape"]]
        band = noise_band(r.get("control_ratio"), margin)
        won = r.get(f"{column}_us") is not None and r[f"{column}_us"] < r["triton_us"] * (1 - band)
        by_tokens = wins.setdefault((shp["H"], shp["I"]), {})
        by_tokens[r["tokens"]] = by_tokens.get(r["tokens"], True) and won
    out = {}
    for key, by_tokens in wins.items():
        points = sorted(by_tokens)
        runs, start = [], None
        for i, t in enumerate(points):
            if by_tokens[t] and start is None:
                start = t
            if start is not None and (not by_tokens[t] or i == len(points) - 1):
                last = i == len(points) - 1 and by_tokens[t]
                runs.append((start, None if last else (t if by_tokens[t] else points[i - 1])))
                start = None
        if runs:
            out[key] = runs
    return out


def auto_entries(rows: list, columns=("quack", "deepgemm_down", "deepgemm")) -> list:
    """The ``auto`` regimes of a policy section from a sweep's rows (``faster_regimes`` per library), library
    by library in ``columns``' order: ``auto`` takes the first regime covering a step that can run there, so where
    both DeepGEMM columns won it takes ``deepgemm_down``, as the H100's section does (measured faster there than
    DeepGEMM's whole compute)."""
    return [{"H": H, "I": I, "impl": col, "from_tokens": lo, "to_tokens": hi}
            for col in columns for (H, I), runs in sorted(faster_regimes(rows, col).items()) for lo, hi in runs]


def merged_tuning(shipped: list, tuned: list) -> list:
    """The tile entries ``--tune`` writes for this GPU: the shipped ones with every point it measured
    replaced (same ``H``, ``I`` and tokens per rank) or added, ordered by shape and tokens; points
    it did not measure keep their tiles."""
    key = lambda e: (e["H"], e["I"], e.get("tokens_per_rank", e["max_rows"]))  # noqa: E731
    table = {key(e): e for e in shipped}
    table.update({key(e): e for e in tuned})
    return [table[k] for k in sorted(table)]


def tile_text(c: dict) -> str:
    """One kernel's tiles in a few characters: ``BMxBNxBK`` and the options it sets."""
    return f"{c['BM']}x{c['BN']}x{c['BK']}" + "".join(f" {k}" for k in ("tma", "ws", "flat", "streamk", "swap",
                                                                                "pair") if c.get(k))


def _tiles_note(conf: dict) -> str:
    """A tile config in one line: each kernel's tiles, warps, stages and programs per SM, and the launch."""
    def one(c):
        return f"{tile_text(c)} w{c['num_warps']} s{c['num_stages']} p{c['progs_per_sm']}"
    f = conf.get("fused")
    launch = f" | one launch w{f['num_warps']} s{f['num_stages']} p{f['progs_per_sm']}" if f else ""
    return f"gate_up {one(conf['gate_up'])} | down {one(conf['down'])}{launch}"


def _three_note(t_three) -> str:
    return "" if t_three is None else f" (one launch; three: {t_three:.1f} us)"


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _ratio(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _column_note(row: dict, name: str, detail: str) -> str:
    """A library column's note beside a row: ``detail`` once it has a graph time, the eager time and
    why where the graph capture failed, else nothing."""
    if row.get(f"{name}_graph_error"):
        return f" (eager {row[f'{name}_eager_us']:.1f} us; graph capture failed: {row[f'{name}_graph_error'][:120]})"
    return "" if row.get(f"{name}_us") is None else detail


def _quack_note(row: dict) -> str:
    return _column_note(row, "quack", f" x{row.get('quack_over_floor', 0):.2f} err {row.get('err_quack_vs_poc', 0):.1e} "
                                      f"unw {row.get('quack_unwritten')}")


def _vllm_note(row: dict) -> str:
    return _column_note(row, "vllm", f" x{row.get('vllm_over_floor', 0):.2f} err {row.get('err_vllm_vs_triton', 0):.1e}")


def markdown_table(rows: list) -> list[str]:
    """The table's lines: a header, then one line per row, a cell under every header (``-`` where a row has no
    time for a column)."""
    head = ["shape", "tokens/rank", "routing", "rows (real)", "busy groups", "Triton us", "three launches us", "PoC us",
            "quack us", "DeepGEMM us", "DeepGEMM down us", "DeepGEMM masked us", "vLLM us", "floor us", "read us",
            "phased read us", "Triton/floor", "Triton/(floor+launch)", "Triton/read", "Triton/phased read", "PoC/floor",
            "quack/floor", "DeepGEMM/floor", "down/floor", "masked/floor", "vLLM/floor", "DeepGEMM/Triton",
            "down/Triton", "vLLM/Triton", "control/Triton", "useful TFLOP/s", "weight GB/s"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]

    def over_triton(r, name):
        return None if r.get(f"{name}_us") is None else r[f"{name}_us"] / r["triton_us"]

    for r in rows:
        cells = [
            r["shape"], str(r["tokens"]), r["routing"], f"{r['rows']} ({r['real_rows']})", str(r["busy_groups"]),
            f"{r['triton_us']:.1f}", _us(r.get("triton_three_launches_us")), f"{r['poc_us']:.1f}",
            _us(r.get("quack_us")), _us(r.get("deepgemm_us")), _us(r.get("deepgemm_down_us")),
            _us(r.get("deepgemm_masked_us")), _us(r.get("vllm_us")), f"{r['floor_us']:.1f} ({r['floor_kind']})",
            f"{r['read_us']:.1f}", f"{r['read_phased_us']:.1f}", f"{r['triton_over_floor']:.2f}",
            f"{r['triton_over_floor_launch']:.2f}", f"{r['triton_over_read']:.2f}",
            f"{r['triton_over_read_phased']:.2f}", f"{r['poc_over_floor']:.2f}", _ratio(r.get("quack_over_floor")),
            _ratio(r.get("deepgemm_over_floor")), _ratio(r.get("deepgemm_down_over_floor")),
            _ratio(r.get("deepgemm_masked_over_floor")), _ratio(r.get("vllm_over_floor")),
            _ratio(over_triton(r, "deepgemm")), _ratio(over_triton(r, "deepgemm_down")), _ratio(over_triton(r, "vllm")),
            _ratio(r.get("control_ratio"), ".3f"), f"{r['triton_tflops_useful']:.0f}", f"{r['triton_weight_gbs']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _deepgemm_version() -> str | None:
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import deep_gemm

    try:
        return str(getattr(deep_gemm(), "__version__", "?"))
    except Exception:
        return None


def _deepgemm_note(row: dict) -> str:
    note = _column_note(row, "deepgemm", f" x{row.get('deepgemm_over_floor', 0):.2f} err "
                                         f"{row.get('err_deepgemm_vs_poc', 0):.1e} unw {row.get('deepgemm_unwritten')}")
    if row.get("deepgemm_masked_us") is not None:
        note += (f"; masked {row['deepgemm_masked_us']:.1f} us x{row.get('deepgemm_masked_over_floor', 0):.2f} err "
                 f"{row.get('err_deepgemm_masked_vs_poc', 0):.1e}")
    return note


def _deepgemm_down_note(row: dict) -> str:
    return _column_note(row, "deepgemm_down", f" x{row.get('deepgemm_down_over_floor', 0):.2f} err "
                                              f"{row.get('err_deepgemm_down_vs_poc', 0):.1e} "
                                              f"unw {row.get('deepgemm_down_unwritten')}")


def _quack_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("quack-kernels")
    except metadata.PackageNotFoundError:
        return None


def _profile_case(shape: str, tokens: int) -> int:
    """One point of the sweep (rank 0 of EP=8, balanced), its Triton kernels run four times with the
    tiles the sweep uses, nothing timed: what ``--profile-case`` hands a profiler."""
    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk

    dev = torch.device("cuda")
    shp = SHAPES[shape]
    H, I, E = shp["H"], shp["I"], shp["E"]
    G = E + default_num_slots(E, R)
    w_gate, w_up, w_down = make_weights(H, I, G, dev)
    weights = GroupedWeights.of_w13(interleave_gate_up(w_gate, w_up), w_down, interleaved=True)  # the layout's order
    del w_gate, w_up
    cu_h, real, nvs, _ = rank0_case(shp, tokens, 0.0)
    x, rw = make_inputs(H, cu_h, real, nvs, dev, seed=tokens * 7)
    conf = tk.select_config(H, I, nvs, G)
    print(f"# {shape}, {tokens} tokens/rank: NvS {nvs}, real rows {int(real.sum())}, busy groups "
          f"{int((real > 0).sum())}; tiles {conf}", flush=True)
    out, act, cu = torch.empty_like(x), torch.empty(nvs, I, device=dev, dtype=torch.bfloat16), cu_h.to(dev)
    ends = entry_ends(cu_h, real).to(dev)
    for _ in range(4):
        tk.expert_ffn_triton(x, rw, cu, weights, out=out, config=conf, act=act, padded=False, row_ends=ends,
                             zero_tail=False)
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    tune = ap.add_mutually_exclusive_group()  # --tune already times its best tiles cut by stream-K
    tune.add_argument("--tune", action="store_true")
    tune.add_argument("--tune-fused", action="store_true",
                      help="the one-launch step alone: the shipped tiles as they run against one launch of them "
                           "and of FUSED_TILES; writes tuning.json like --tune")
    tune.add_argument("--tune-streamk", action="store_true",
                    help="time the shipped tiles of each point also cut by stream-K (\"streamk\"), per kernel, and write "
                         "tuning.json with stream-K where it was faster at every routing (a quick pass; --tune does it "
                         "for its best candidates)")
    ap.add_argument("--rep", type=int, default=100, help="ms of timed calls per timing (timing.flushed_median_ms)")
    add_flush_option(ap)
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="alternated rounds in which a point's columns (and --tune's final A/B) are timed, each "
                         "round's order from a Williams design (timing.round_orders); each time is the median of "
                         "the rounds (default: %(default)s)")
    ap.add_argument("--quack-tuned", action="store_true",
                    help="quack column: quack's autotuner (compiles and times its config space per new shape: minutes)")
    ap.add_argument("--no-deepgemm", action="store_true", help="leave out the DeepGEMM columns")
    ap.add_argument("--deepgemm-layout", choices=("psum", "rows"), default=None,
                    help="the grouped layout handed to DeepGEMM's contiguous GEMMs (default: deepgemm_impl.ROW_LAYOUT)")
    ap.add_argument("--no-vllm", action="store_true",
                    help="leave out the vLLM column (vLLM's own fused_experts on the same rows and weights)")
    ap.add_argument("--profile-case", metavar="SHAPE:TOKENS", default=None,
                    help="only run that point's Triton kernels (balanced routing) four times, untimed, and exit: "
                         "the program a profiler wraps (ncu -k regex:_gate_up_kernel|_down_kernel --launch-skip 3 ...)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be a positive number of rounds, got {args.rounds}")
    use_flush(args.flush)
    case = None
    if args.profile_case is not None:
        shape, _, tok = args.profile_case.partition(":")
        if shape not in SHAPES or not tok.isdigit() or int(tok) < 1:
            ap.error(f"--profile-case must be SHAPE:TOKENS with SHAPE in {sorted(SHAPES)}, got {args.profile_case!r}")
        case = (shape, int(tok))
    if not torch.cuda.is_available():
        print("bench_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    if case is not None:
        return _profile_case(*case)
    import triton

    from vllm_moonep.common.grouped_gemm import GroupedWeights, interleave_gate_up
    from vllm_moonep.common.grouped_gemm import triton_kernels as tk
    from vllm_moonep.common.grouped_gemm import policy
    from vllm_moonep.common.grouped_gemm.deepgemm_impl import ROW_LAYOUT, deepgemm_unusable
    from vllm_moonep.common.grouped_gemm.quack_impl import expert_ffn_quack, quack_unusable
    from vllm_moonep.tools.weight_read import WeightRead, fastest

    if args.deepgemm_layout is None:
        args.deepgemm_layout = ROW_LAYOUT

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    out_dir = os.environ.get("OUT")
    ceil = measure_ceilings(dev)
    print(f"# device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    print("# " + _ceiling_line(ceil, "measured first"), flush=True)
    # vLLM's own fused_experts (the vllm column), imported after the ceilings are measured
    vllm_info: dict = {}
    vllm_fn, vllm_error = None, None  # vllm_error: why the column is empty (then no vLLM runs)
    if args.no_vllm:
        vllm_error = "left out (--no-vllm)"
    else:
        from vllm_moonep.testing.vllm_fused import VllmFusedUnavailable, vllm_fused_experts

        try:
            vllm_fn, vllm_info = vllm_fused_experts(dev)
        except VllmFusedUnavailable as e:
            vllm_error = str(e)
    print(f"# vllm: {vllm_info.get('call')} (vLLM {vllm_info.get('vllm')}, platform {vllm_info.get('platform')})"
          if vllm_error is None else f"# vllm: - ({vllm_error})", flush=True)

    rows = []
    tuned_entries = []
    resources = {}
    quack_absent: dict[str, str] = {}  # shape -> why the quack column is empty
    quack_error = None  # the first error quack raised: no further quack runs
    deepgemm_absent: dict[str, str] = {}  # shape (or "masked", "down") -> why the DeepGEMM column is empty
    deepgemm_error = "left out (--no-deepgemm)" if args.no_deepgemm else None
    masked_error = down_error = deepgemm_error
    tokens_list = [int(t) for t in args.tokens.split(",")]
    for sname in args.shapes.split(","):
        shp = SHAPES[sname]
        H, I, E = shp["H"], shp["I"], shp["E"]
        B = default_num_slots(E, R)
        G = E + B
        # the weights as the symmetric layout stores them (gate and up interleaved in one w13: the Triton tiles read
        # one weight, DeepGEMM and quack one operand) and in halves (vLLM's w13, gate rows first: its fused_experts,
        # the PoC and the plain read take views of it); the same values, built without a third copy
        w_gate, w_up, w_down = make_weights(H, I, G, dev)
        w13h = torch.empty(G, 2 * I, H, device=dev, dtype=torch.bfloat16)
        w13h[:, :I].copy_(w_gate)
        w13h[:, I:].copy_(w_up)
        del w_gate, w_up
        w_gate, w_up = w13h[:, :I], w13h[:, I:]
        w13i = interleave_gate_up(w_gate, w_up)
        weights = GroupedWeights.of_w13(w13i, w_down, interleaved=True)
        prep = tk.prepare_weights(weights, dev)
        why_q = quack_error or quack_unusable(torch.zeros(1, H, device=dev, dtype=torch.bfloat16), weights)
        why_d = deepgemm_error or deepgemm_unusable(torch.zeros(1, H, device=dev, dtype=torch.bfloat16), weights, PAD)
        if why_d is not None:
            deepgemm_absent[sname] = why_d
            print(f"# deepgemm: - ({why_d})", flush=True)
        if why_q is not None:
            quack_absent[sname] = why_q
            print(f"# quack: - ({why_q})", flush=True)
        for tokens in tokens_list:
            cases = []
            for routing, sigma in (("balanced", 0.0), ("skewed", SKEW_SIGMA)):
                cu_h, real, nvs, mv = rank0_case(shp, tokens, sigma)
                cu = cu_h.to(dev)
                x, rw = make_inputs(H, cu_h, real, nvs, dev, seed=tokens * 7 + int(sigma * 10))
                cases.append((routing, cu_h, cu, real, nvs, mv, x, rw, entry_ends(cu_h, real).to(dev)))
            nvs = cases[0][4]
            cfg = None

            def quick(replay):  # one timing of a sweep (ms): shorter than the table's
                return _bench(replay, warmup=10, rep=max(20, args.rep // 3))

            def kernel_times(kind, c):
                """One kernel with tile config ``c``, per routing (ms; inf where it cannot run)."""
                times = []
                try:
                    for routing, cu_h, cu, real, nvs_, mv, x, rw, ends in cases:
                        eff = torch.empty(G, dtype=torch.int32, device=dev)
                        tk._launch_trim(cu, rw, eff)
                        act = torch.randn(nvs_, I, device=dev, dtype=torch.bfloat16)
                        o = torch.empty_like(x)
                        if kind == "gate_up":
                            fn = lambda: tk._launch_gate_up(x, rw, cu, eff, prep, act, c, False)  # noqa: E731
                        else:
                            fn = lambda: tk._launch_down(act, rw, cu, eff, prep, o, c, False)  # noqa: E731
                        replay, _g = _graphed(fn)
                        times.append(quick(replay))
                except Exception as e:  # out of resources etc.
                    print(f"#   {sname} t={tokens} {kind} {c}: skipped ({type(e).__name__}: {str(e)[:80]})")
                    times = [math.inf] * len(cases)
                return times

            def with_streamk(kind, tiles, known=None):
                """The best of ``tiles`` (``known``: their times) as they are and cut by stream-K, where cut
                is faster at every routing by more than KEEP_MARGIN (else the best as it is)."""
                times = known or [kernel_times(kind, c) for c in tiles]
                j = min(range(len(tiles)), key=lambda i: sum(times[i]))
                best_c, best_t = tiles[j], times[j]
                won = None
                for c, t in zip(tiles, times):
                    if c.get("streamk") or c.get("pair") or not math.isfinite(sum(t)):  # stream-K refuses pairs
                        continue
                    ck = {**c, "streamk": True}
                    tk_ = kernel_times(kind, ck)
                    print(f"#   {sname} t={tokens} {kind} {c}: stream-K {sum(tk_)*1e3:.1f} us against "
                          f"{sum(t)*1e3:.1f} us (both routings)", flush=True)
                    if (all(a < b * (1 - KEEP_MARGIN) for a, b in zip(tk_, best_t))
                            and (won is None or sum(tk_) < sum(won[1]))):
                        won = (ck, tk_)
                return (best_c, best_t) if won is None else won

            def whole_graph(conf, case):
                """The whole compute with tiles ``conf`` on one routing's rows, as the layer runs it, in a
                graph of its own (own output and act buffers): ``(replay, graph)``."""
                routing, cu_h, cu, real, nvs_, mv, x, rw, ends = case
                o = torch.empty_like(x)
                act = torch.empty(nvs_, I, device=dev, dtype=torch.bfloat16)
                return _graphed(lambda: tk.expert_ffn_triton(x, rw, cu, weights, out=o, config=conf, act=act,
                                                             padded=False, row_ends=ends, zero_tail=False))

            def _whole(conf):  # the whole compute with tiles ``conf``, per routing (ms)
                return [quick(whole_graph(conf, case)[0]) for case in cases]

            def alternated_whole(confs: dict) -> dict:
                """The whole compute with each of ``confs`` (name -> tiles), per routing (ms): the median of
                ``--rounds`` alternated rounds (timing.round_orders), every config in its own graph and buffers
                (``inf`` where one cannot run)."""
                got: dict = {k: [] for k in confs}
                for case in cases:
                    graphs = {}
                    for k, conf in confs.items():
                        try:
                            graphs[k] = whole_graph(conf, case)
                        except Exception as e:  # out of resources etc.
                            print(f"#   {sname} t={tokens} {k} {_tiles_note(conf)}: skipped "
                                  f"({type(e).__name__}: {str(e)[:80]})")
                    t = alternated_times(list(graphs), lambda k: quick(graphs[k][0]), args.rounds)
                    del graphs
                    for k in confs:
                        got[k].append(statistics.median(t[k]) if k in t else math.inf)
                return got

            def confirmed(label, tuned, shipped):
                """``tuned`` where an alternated A/B (``alternated_whole``) finds it faster than ``shipped`` at every
                routing by more than ``noise_band`` (the shipped tiles are timed twice: the second is the
                control), else ``shipped``: the sweep timed its candidates one after another, and at the
                power-bound points a place in that order alone moved a time 4-10%; the table must not change
                on that."""
                if tuned == shipped:
                    return tuned
                t = alternated_whole({"tuned": tuned, "shipped": shipped, "control": {k: dict(v) for k, v in shipped.items()}})
                won = tuned_wins(t["tuned"], t["shipped"], t["control"])
                if not all(math.isfinite(v) for v in t["shipped"] + t["control"]):
                    print(f"#   {label} {sname} t={tokens}: the shipped tiles cannot run here; tuned "
                          + ("taken" if won else "cannot either: shipped kept"), flush=True)
                    return tuned if won else shipped
                print(f"#   {label} {sname} t={tokens} alternated A/B ({args.rounds} rounds): tuned "
                      f"{' / '.join(f'{v*1e3:.1f}' for v in t['tuned'])} us, shipped "
                      f"{' / '.join(f'{v*1e3:.1f}' for v in t['shipped'])}, control x"
                      f"{' / '.join(f'{c / s_:.3f}' for c, s_ in zip(t['control'], t['shipped']))}: "
                      + ("tuned taken" if won else "shipped kept"), flush=True)
                return tuned if won else shipped

            def best_one_launch(tries, against):
                """The fastest of the one-launch configs ``tries`` that beats ``against`` (ms per routing) at every
                routing by more than KEEP_MARGIN, and its time over both routings; ``(None, inf)`` if none does
                (the table must never make a point slower, and a tie within noise keeps what runs)."""
                won, won_t = None, math.inf
                for conf in tries:
                    try:
                        tf = _whole(conf)
                    except Exception as e:  # out of resources etc.
                        print(f"#   {sname} t={tokens} one launch {_tiles_note(conf)}: skipped "
                              f"({type(e).__name__}: {str(e)[:80]})")
                        continue
                    print(f"#   {sname} t={tokens} one launch {_tiles_note(conf)}: "
                          f"{' / '.join(f'{v*1e3:.1f}' for v in tf)} us", flush=True)
                    if sum(tf) < won_t and all(a < b * (1 - KEEP_MARGIN) for a, b in zip(tf, against)):
                        won, won_t = conf, sum(tf)
                return won, won_t

            if args.tune:
                # time each kernel's candidates on both routings; keep the least total, then the
                # STREAMK_TRIES best cut by stream-K where that is faster at every routing
                best = {}
                for kind, cands in (("gate_up", GU_CANDIDATES), ("down", DOWN_CANDIDATES)):
                    per = [kernel_times(kind, c) for c in cands]
                    scores = [sum(t) for t in per]
                    i = min(range(len(cands)), key=lambda j: scores[j])
                    top = sorted(range(len(cands)), key=lambda j: scores[j])[:STREAMK_TRIES]
                    best[kind], _t = with_streamk(kind, [cands[j] for j in top], [per[j] for j in top])
                    # the tiles the shipped table gives this point, timed in the same sweep: the anchor
                    was = tk.select_config(H, I, nvs, G, tokens=tokens)[kind]
                    was_s = next((f"{scores[j]*1e3:.1f} us" for j, c in enumerate(cands) if c == was), "not a candidate")
                    print(f"#   tune {sname} t={tokens} {kind}: best {best[kind]} ({sum(_t)*1e3:.1f} us over both "
                          f"routings; best uncut {scores[i]*1e3:.1f} us; shipped tiles {was_s})", flush=True)
                # the whole compute: three launches with these tiles, against one launch of them and of FUSED_TILES
                three = _whole(best)
                tries = one_launch_tries(best)
                tries += FUSED_TILES if best["gate_up"]["BM"] <= FUSED_TILES_MAX_BM else []
                fused_best, fused_t = best_one_launch(tries, three)
                won = "slower at some routing" if fused_best is None else f"{fused_best} ({fused_t*1e3:.1f} us)"
                print(f"#   tune {sname} t={tokens} one launch: {won}; three launches {sum(three)*1e3:.1f} us "
                      "over both routings", flush=True)
                if fused_best is not None:
                    best = fused_best
                cfg = confirmed("tune", best, tk.select_config(H, I, nvs, G, tokens=tokens))
            elif args.tune_fused:
                # the shipped entry as it runs, against one launch of its tiles and of FUSED_TILES
                shipped = tk.select_config(H, I, nvs, G, tokens=tokens)
                now = _whole(shipped)
                tries = [c for c in one_launch_tries(shipped) if c != shipped] + FUSED_TILES
                won, won_t = best_one_launch(tries, now)
                cfg = shipped if won is None else confirmed("tune-fused", won, shipped)
                print(f"#   tune-fused {sname} t={tokens}: shipped ({'one launch' if shipped.get('fused') else 'three launches'}) "
                      f"{' / '.join(f'{v*1e3:.1f}' for v in now)} us; "
                      + ("kept" if won is None else f"one launch {_tiles_note(won)} {won_t*1e3:.1f} us over both routings"
                         + ("" if cfg is won else "; not confirmed by the alternated A/B: shipped kept")),
                      flush=True)
            elif args.tune_streamk:
                # the shipped tiles, each kernel cut by stream-K where that is faster at every routing
                shipped = tk.select_config(H, I, nvs, G, tokens=tokens)
                if shipped.get("fused"):
                    print(f"#   tune-streamk {sname} t={tokens}: one launch (its tiles are whole); kept", flush=True)
                else:
                    cfg = confirmed("tune-streamk", {**shipped, **{kind: with_streamk(kind, [shipped[kind]])[0]
                                                                   for kind in ("gate_up", "down")}}, shipped)
                    print(f"#   tune-streamk {sname} t={tokens}: gate_up {'cut' if cfg['gate_up'].get('streamk') else 'whole'},"
                          f" down {'cut' if cfg['down'].get('streamk') else 'whole'}", flush=True)
            if cfg is not None:  # what a tuning pass settled on (the alternated A/B's choice): the entry it writes
                tuned_entries.append(tile_entry(sname, H, I, nvs, tokens, cfg))
            for routing, cu_h, cu, real, nvs_, mv, x, rw, ends in cases:
                n = int(cu_h[-1])
                real_rows = int(real.sum())
                busy = int((real > 0).sum())
                flop = 6.0 * H * I * real_rows
                wbytes = 3.0 * H * I * 2 * busy
                out_t = torch.full_like(x, float("nan"))
                act = torch.empty(nvs_, I, device=dev, dtype=torch.bfloat16)
                conf = cfg or tk.select_config(H, I, nvs_, G, tokens=tokens)
                tk.expert_ffn_triton(x, rw, cu, weights, out=out_t, config=conf, act=act, padded=False, row_ends=ends)
                out_p = torch.empty_like(x)
                poc_experts(x, rw, cu, w_gate, w_up, w_down, out_p)
                torch.cuda.synchronize()
                unwritten = int(torch.isnan(out_t[:n]).sum())
                err_tp = relative_error(out_t[:n], out_p[:n])
                f_tri = lambda: tk.expert_ffn_triton(x, rw, cu, weights, out=out_t, config=conf, act=act,  # noqa: E731
                                                     padded=False, row_ends=ends, zero_tail=False)
                f_poc = lambda: poc_experts(x, rw, cu, w_gate, w_up, w_down, out_p)  # noqa: E731
                t_tri_eager = _bench(f_tri, rep=args.rep) * 1e3
                t_poc_eager = _bench(f_poc, rep=args.rep) * 1e3
                # every column's graph, captured now and timed below in alternated rounds (timing.alternated_times);
                # each graph holds its buffers until then (capture_graph)
                replays: dict = {"triton": _graphed(f_tri), "poc": _graphed(f_poc)}
                out_c = torch.empty_like(x)  # the control: the Triton call again, its own graph and buffers
                act_c = torch.empty_like(act)
                replays["control"] = _graphed(lambda: tk.expert_ffn_triton(x, rw, cu, weights, out=out_c, config=conf,
                                                                           act=act_c, padded=False, row_ends=ends,
                                                                           zero_tail=False))
                if conf.get("fused"):  # a one-launch point: the same tiles as three launches
                    conf3 = {k: v for k, v in conf.items() if k != "fused"}
                    out_3 = torch.empty_like(x)
                    replays["three"] = _graphed(lambda: tk.expert_ffn_triton(x, rw, cu, weights, out=out_3,
                                                                             config=conf3, act=act, padded=False,
                                                                             row_ends=ends, zero_tail=False))
                # the bytes-only anchors: the point's touched weights read by a plain kernel, in one launch and in
                # the gate/up-then-down order (weight_read), each with its fastest tiles
                reader = WeightRead(w_gate, w_up, w_down, (real > 0).nonzero().flatten())
                read_cfg = {}
                for col, make in (("read", reader.one), ("read_phased", reader.phased)):
                    read_cfg[col], replays[col], _ = fastest(lambda c: _graphed(make(c)),  # noqa: B023
                                                             lambda g: _bench(g[0], rep=args.rep))
                del reader, make  # views of the weights: not held past the point (the graphs keep theirs)
                drow: dict = {"deepgemm_us": None, "deepgemm_down_us": None, "deepgemm_masked_us": None}
                if why_d is None and deepgemm_error is None:
                    dfields, deepgemm_error = _deepgemm_point(x, rw, cu, weights, out_p, n, args, replays)
                    drow.update(dfields)
                    if deepgemm_error is not None:
                        deepgemm_absent[sname] = deepgemm_error
                        print(f"# deepgemm: - ({deepgemm_error}); no further DeepGEMM runs", flush=True)
                if why_d is None and down_error is None:
                    dfields, down_error = _deepgemm_down_point(x, rw, cu, ends, tokens, weights, out_p, n, args,
                                                               replays)
                    drow.update(dfields)
                    if down_error is not None:
                        deepgemm_absent["down"] = down_error
                        print(f"# deepgemm down: - ({down_error}); no further deepgemm_down runs", flush=True)
                if why_d is None and masked_error is None and tokens <= MASKED_MAX_TOKENS:
                    mfields, masked_error = _deepgemm_masked_point(x, rw, cu_h, real, w13i, w_down, out_p, args,
                                                                   replays)
                    drow.update(mfields)
                    if masked_error is not None:
                        deepgemm_absent["masked"] = masked_error
                        print(f"# deepgemm masked: - ({masked_error}); no further masked runs", flush=True)
                qrow = {"quack_us": None}
                if why_q is None and quack_error is None:
                    qrow, quack_error = _quack_point(expert_ffn_quack, x, rw, cu, weights, out_p, n, args, replays)
                    if quack_error is not None:
                        quack_absent[sname] = quack_error
                        print(f"# quack: - ({quack_error}); no further quack runs", flush=True)
                vrow: dict = {"vllm_us": None}
                if vllm_fn is not None and vllm_error is None:
                    vrow, vllm_error = _vllm_point(vllm_fn, x, rw, cu_h, real, w13h, w_down, out_t, args, replays)
                    if vllm_error is not None:
                        print(f"# vllm: - ({vllm_error}); no further vLLM runs", flush=True)
                times = alternated_times(list(replays), lambda k: _bench(replays[k][0], rep=args.rep) * 1e3, args.rounds)
                del replays
                med = {k: statistics.median(v) for k, v in times.items()}
                t_tri, t_poc, t_three = med["triton"], med["poc"], med.get("three")
                for lib, fields in (("deepgemm", drow), ("deepgemm_down", drow), ("deepgemm_masked", drow),
                                    ("quack", qrow), ("vllm", vrow)):
                    if lib in med:
                        fields[f"{lib}_us"] = med[lib]
                row = {
                    "shape": sname, "tokens": tokens, "routing": routing, "maxvio": mv, "NvS": nvs_,
                    "rows": n, "real_rows": real_rows, "busy_groups": busy,
                    "flop": flop, "weight_bytes": wbytes,
                    "triton_us": t_tri, "poc_us": t_poc, "triton_three_launches_us": t_three,
                    "triton_control_us": med["control"], "control_ratio": med["control"] / t_tri,
                    "times_us": times, "rounds": args.rounds,
                    "triton_eager_us": t_tri_eager, "poc_eager_us": t_poc_eager,
                    "read_us": med["read"], "read_phased_us": med["read_phased"], "read_configs": read_cfg,
                    "triton_over_read": t_tri / med["read"], "triton_over_read_phased": t_tri / med["read_phased"],
                    "read_gbs": wbytes / (med["read"] * 1e-6) / 1e9,
                    "triton_tflops_useful": flop / (t_tri * 1e-6) / 1e12,
                    "triton_weight_gbs": wbytes / (t_tri * 1e-6) / 1e9,
                    "err_vs_poc": err_tp, "unwritten": unwritten, "config": conf,
                    "groups": G, "rows_per_group": nvs_ / G,
                    **qrow, **vrow, **drow,
                }
                set_floor(row, ceil)
                rows.append(row)
                floor_us = row["floor_us"]
                print(
                    f"# {sname:14s} t={tokens:5d} {routing:8s} rows={n:6d} real={real_rows:6d} busy={busy:3d} "
                    f"triton {t_tri:9.1f} us  poc {t_poc:9.1f} us  floor {floor_us:9.1f} us ({row['floor_kind']}) "
                    f"x{row['triton_over_floor']:.2f}{_three_note(t_three)}  control x{row['control_ratio']:.3f}  "
                    f"read {row['read_us']:.1f} / phased {row['read_phased_us']:.1f} us (x{row['triton_over_read']:.2f}"
                    f" / x{row['triton_over_read_phased']:.2f})  "
                    f"{row['triton_tflops_useful']:.0f} TF/s  err {err_tp:.1e} unw {unwritten}  "
                    f"quack {_us(row['quack_us'])} us{_quack_note(row)}  deepgemm {_us(row['deepgemm_us'])} us{_deepgemm_note(row)}  "
                    f"deepgemm_down {_us(row['deepgemm_down_us'])} us{_deepgemm_down_note(row)}  "
                    f"vllm {_us(row['vllm_us'])} us{_vllm_note(row)}",
                    flush=True,
                )
            # resource report of the kernels used at this point
            try:
                eff = torch.empty(G, dtype=torch.int32, device=dev)
                routing, cu_h, cu, real, nvs_, mv, x, rw, ends = cases[0]
                tk._launch_trim(cu, rw, eff)
                act = torch.empty(nvs_, I, device=dev, dtype=torch.bfloat16)
                conf = cfg or tk.select_config(H, I, nvs_, G)
                k1 = tk._launch_gate_up(x, rw, cu, eff, prep, act, conf["gate_up"], False)
                k2 = tk._launch_down(act, rw, cu, eff, prep, torch.empty_like(x), conf["down"], False)
                resources[f"{sname}/t{tokens}"] = {
                    name: {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                           "shared": getattr(getattr(k, "metadata", None), "shared", None)}
                    for name, k in (("gate_up", k1), ("down", k2))
                }
            except Exception as e:
                resources[f"{sname}/t{tokens}"] = {"error": str(e)[:200]}
        del w_gate, w_up, w_down, weights, prep, w13h, w13i
        tk._CACHE.clear()
        torch.cuda.empty_cache()

    # the ceilings again after the sweep: the floors use the better of the two readings
    after = measure_ceilings(dev, warm_s=0.5)
    if after["matmul_tflops"] > ceil["matmul_tflops"] or after["copy_gbs"] > ceil["copy_gbs"]:
        ceil = {**ceil, "matmul_tflops": max(ceil["matmul_tflops"], after["matmul_tflops"]),
                "copy_gbs": max(ceil["copy_gbs"], after["copy_gbs"]), "after_sweep": after}
        for r in rows:
            set_floor(r, ceil)
    print()
    print(_ceiling_line(ceil, f"{props.name}, best before/after the sweep"))
    print()
    print(f"Times: CUDA-graph replay, median of {args.rounds} alternated rounds of every column, each round's order "
          "from a Williams design (eager launches in the JSON); control = the Triton call timed again as a column of its own: a "
          f"ratio between columns no farther from 1 than control/Triton is noise. L2 flushed before each timing "
          f"({'written, then read back: left clean' if CLEAN_FLUSH else 'written only (--flush dirty): its write-back is in each time'}).")
    print()
    print("Triton us: one launch where the tiles say so (then its tiles as three launches beside it, same run).")
    print()
    print("read us: the point's touched weight bytes (the floor's) read by a plain kernel with no other work "
          "(weight_read), one launch; phased read: gate and up, then down, two launches (the order the compute "
          "needs); each the fastest of weight_read.READ_CONFIGS, launch included like every time.")
    print()
    print("vLLM us: vLLM's own fused_experts on the same real rows and weights (rows as top-1 tokens; its time includes "
          "its grouping of rows by expert and the K-sum).")
    print()
    print("DeepGEMM down us: impl=\"deepgemm_down\" given the Triton column's arguments: the gate/up tiles of the "
          "point's tile entry, zero_tails, then DeepGEMM's down GEMM.")
    print()
    print("\n".join(markdown_table(rows)))
    print()
    if vllm_error is not None:
        print(f"# vllm column: - ({vllm_error})")
    for sname, why in quack_absent.items():
        print(f"# quack column for {sname}: - ({why})")
    for name, why in deepgemm_absent.items():
        print(f"# deepgemm column for {name}: - ({why})")
    regimes = auto_entries(rows)
    print(f"# library kernels faster than Triton at both routings over these tokens per rank (tuning.json's auto "
          f"regimes for {props.name}): {regimes or 'none'}")
    for k, v in resources.items():
        print(f"# resources {k}: {v}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": props.name, "capability": [props.major, props.minor], "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "ceilings": ceil, "flush": args.flush,
        "rows": rows, "resources": resources, "argv": sys.argv,
        "vllm": {**vllm_info, "absent": vllm_error,
                 "method": "vLLM's fused_experts on the point's real rows as top-1 tokens over w13 [E+B, 2I, H] and "
                           "w_down: the same weights and route weights as the Triton column"},
        "quack": {"version": _quack_version(), "tuned": args.quack_tuned, "absent": quack_absent},
        "deepgemm": {"version": _deepgemm_version(), "layout": args.deepgemm_layout, "absent": deepgemm_absent,
                     "masked_max_tokens": MASKED_MAX_TOKENS},
        "auto_regimes": regimes,
    }
    if out_dir:
        with open(os.path.join(out_dir, "bench_experts.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.tune or args.tune_fused or args.tune_streamk:
        path = os.path.join(out_dir or ".", "tuning.json")
        own_tiles = list(policy.policy_for(props.name, (props.major, props.minor)).tiles)
        table = policy.with_tiles(policy.load_table(), props.name, merged_tuning(own_tiles, tuned_entries),
                                  (props.major, props.minor))
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
