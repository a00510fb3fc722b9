"""The bytes-only anchor of ``bench_experts``: a plain streaming read of the expert weights a point touches.

    groups [n] (the point's non-empty groups)
        -> one program per (chunk, matrix, group): CHUNK contiguous elements of gate[g], up[g] or down[g]
           (each group's block contiguous; gate and up may be the halves of one w13),
           read in BLOCK-wide loads and summed in float32
        -> sums [n * matrices * chunks] (one float per program: the loads cannot be dropped)

It does no work beyond the read, so its CUDA-graph replay is what any kernel that reads the same bytes
takes, its launch, the DRAM ramp and the last programs' tail included. ``bench_experts``' floor counts the
same bytes at the rate of a 2 GB copy and none of those, so at a memory-bound point of a few tens of
megabytes the read shows how much of the distance to the floor no kernel can close:

- ``read``: every touched matrix in one launch;
- ``phased``: gate and up in one launch, then down in a second, the order the expert compute has to read
  them in (the down GEMM needs the activations the gate/up GEMM writes).

Each point takes the fastest of ``READ_CONFIGS`` (it is a floor); ``read_rates`` is the same read of one
large buffer, the read-only counterpart of the copy rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["READ_CONFIGS", "WeightRead", "fastest", "launch_read", "read_rates"]

#: the read's tiles, each tried at every point (the fastest is the anchor): elements per load (BLOCK), per
#: program (CHUNK), and warps; every load 16 bytes a thread. From 1 KB to 16 KB per load, 16 KB to 256 KB per
#: program (on an H100, 2 KB loads and 16-64 KB programs read fastest at every point of bench_experts).
READ_CONFIGS = (
    {"BLOCK": 512, "CHUNK": 8192, "num_warps": 2},
    {"BLOCK": 1024, "CHUNK": 8192, "num_warps": 4},
    {"BLOCK": 1024, "CHUNK": 16384, "num_warps": 4},
    {"BLOCK": 1024, "CHUNK": 32768, "num_warps": 4},
    {"BLOCK": 2048, "CHUNK": 32768, "num_warps": 4},
    {"BLOCK": 4096, "CHUNK": 65536, "num_warps": 8},
    {"BLOCK": 8192, "CHUNK": 131072, "num_warps": 8},
)

#: the matrices of a group, in the order the kernel numbers them
MATRICES = ("gate", "up", "down")


@triton.jit
def _read_kernel(gate, up, down, groups, sums, numel, first, s_gate, s_up, s_down, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, EVEN: tl.constexpr):
    c = tl.program_id(0)  # chunk of the matrix: consecutive programs stream consecutive bytes
    m = tl.program_id(1) + first  # 0 gate, 1 up, 2 down
    g = tl.load(groups + tl.program_id(2)).to(tl.int64)
    lo = c.to(tl.int64) * CHUNK
    if m == 0:
        base = gate + g * s_gate + lo
    elif m == 1:
        base = up + g * s_up + lo
    else:
        base = down + g * s_down + lo
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK):
        if EVEN:
            v = tl.load(base + k + offs)
        else:
            v = tl.load(base + k + offs, mask=lo + k + offs < numel, other=0.0)
        acc += v.to(tl.float32)
    slot = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + c
    tl.store(sums + slot, tl.sum(acc, axis=0))


def _chunks(numel: int, cfg: dict) -> int:
    return -(-numel // cfg["CHUNK"])


def launch_read(mats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], groups: torch.Tensor, sums: torch.Tensor,
                first: int, count: int, cfg: dict) -> None:
    """Read matrices ``first .. first+count-1`` (0 gate, 1 up, 2 down) of every group in ``groups`` (int32) in
    one launch; ``sums[(gi * count + m) * chunks + c]`` gets the float32 sum of chunk ``c`` of matrix
    ``first + m`` of group ``groups[gi]``. ``mats``: three ``[G, ...]`` tensors of one element count per group,
    each group's block contiguous (the layouts' gate ``[G, I, H]``, up ``[G, I, H]``, down ``[G, H, I]``; gate and
    up may be the halves of one ``w13``)."""
    numel = mats[0][0].numel()
    for name, t in zip(MATRICES, mats):
        if t.dim() < 1 or not t[0].is_contiguous() or t[0].numel() != numel or t.dtype != mats[0].dtype:
            raise ValueError(f"launch_read: {name} must be contiguous within each group: [G, ...] of {mats[0].dtype} "
                             f"with {numel} elements per group like gate, got {tuple(t.shape)} {t.dtype} strides "
                             f"{t.stride()}")
    if not (0 <= first and count >= 1 and first + count <= len(MATRICES)):
        raise ValueError(f"launch_read: matrices {first}..{first + count - 1} are not within 0..2 (gate, up, down)")
    if cfg["CHUNK"] % cfg["BLOCK"]:
        raise ValueError(f"launch_read: CHUNK {cfg['CHUNK']} is not a whole number of BLOCK {cfg['BLOCK']} loads "
                         "(the last load would read into the next chunk)")
    n = groups.numel()
    chunks = _chunks(numel, cfg)
    if sums.numel() < n * count * chunks:
        raise ValueError(f"launch_read: sums holds {sums.numel()} floats, the read writes {n * count * chunks}")
    if n == 0:
        return
    _read_kernel[(chunks, count, n)](*mats, groups, sums, numel, first, *(t.stride(0) for t in mats),
                                     CHUNK=cfg["CHUNK"], BLOCK=cfg["BLOCK"], EVEN=numel % cfg["CHUNK"] == 0,
                                     num_warps=cfg["num_warps"])


class WeightRead:
    """The reads of one point: ``one(cfg)`` (every matrix of every touched group, one launch) and
    ``phased(cfg)`` (gate and up, then down: two launches), each a call to capture in a graph; ``cfg`` one of
    ``configs``, which size the sums."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, groups: torch.Tensor,
                 configs=READ_CONFIGS):
        self.mats = (gate, up, down)
        self.groups = groups.to(device=gate.device, dtype=torch.int32)
        numel = gate[0].numel()
        most = max(_chunks(numel, c) for c in configs)  # sums for the tiles with the most chunks
        self.sums = torch.empty(self.groups.numel() * len(MATRICES) * most, device=gate.device, dtype=torch.float32)

    def one(self, cfg: dict):
        return lambda: launch_read(self.mats, self.groups, self.sums, 0, 3, cfg)

    def phased(self, cfg: dict):
        def run():
            launch_read(self.mats, self.groups, self.sums, 0, 2, cfg)
            launch_read(self.mats, self.groups, self.sums, 2, 1, cfg)
        return run


def fastest(make, time_fn) -> tuple[dict, object, float]:
    """``(cfg, made, time)`` of the fastest of ``READ_CONFIGS``: ``made = make(cfg)`` timed by ``time_fn(made)``
    for each (``made``: a call, or its captured graph), the fastest one kept."""
    best = None
    for cfg in READ_CONFIGS:
        made = make(cfg)
        t = time_fn(made)
        if best is None or t < best[2]:
            best = (cfg, made, t)
        del made
    assert best is not None
    return best


def read_rates(dev, nbytes: int, time_fn, rounds: int) -> tuple[list[float], dict]:
    """``([GB/s per round], cfg)``: the read of one ``nbytes`` buffer (one group of one matrix) with the
    fastest of ``READ_CONFIGS``, timed ``rounds`` times; ``time_fn(fn)`` gives seconds."""
    flat = torch.randn(1, nbytes // 2, device=dev, dtype=torch.bfloat16)
    read = WeightRead(flat, flat, flat, torch.zeros(1, dtype=torch.int32))
    make = lambda cfg: (lambda: launch_read(read.mats, read.groups, read.sums, 0, 1, cfg))  # noqa: E731
    cfg, _, _ = fastest(make, time_fn)
    return [nbytes / time_fn(make(cfg)) / 1e9 for _ in range(rounds)], cfg
