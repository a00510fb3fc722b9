"""Rank-side helpers of the vLLM tests (module-level, so spawned ranks can unpickle them).

Every rank builds the same seeded global weights, keeps its own ``E/R`` experts, routes its own
seeded tokens, and compares its output against ``dense_moe`` in float32 on the full weights.

Tolerance (``close``): |out - ref| <= ATOL + RTOL * |ref| with ATOL = RTOL = 2e-2. The MoonEP
path rounds to bf16 three times where the float32 reference does not (the SiLU*up activation, each
expert's output row, the combined token), each a relative error <= 2**-8 ~ 3.9e-3 of values that
are O(1) here (x ~ N(0,1), weights ~ N(0, 1/fan_in)); 2e-2 covers their sum with a margin while
staying below vLLM's own 6e-2 for bf16 MoE tests, and is far below any real mistake (a dropped
or doubled expert changes the output by O(1)).

Device: ``VLLM_MOONEP_TEST_DEVICE=cuda`` (read once, at import) puts the tokens, buffer pool,
layouts (symmetric ones on the ``torch`` heap), vLLM's workspace and ``FusedMoEConfig`` on this
rank's GPU (``tests/conftest.py`` ``ranks()`` then gives one GPU per rank over NCCL); the dense
reference stays on the CPU and ``close`` compares on the CPU. Anything else: all on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from vllm_moonep.testing.vllm_harness import LayoutHolder, vllm_moe_config
from vllm_moonep.testing.vllm_harness import ensure_workspace as ensure_workspace_on
from vllm_moonep.testing.weights import local_rows

ATOL = RTOL = 2e-2
#: ``VLLM_MOONEP_TEST_DEVICE=cuda``: the MoonEP objects and their tensors on this rank's GPU
ON_CUDA = os.environ.get("VLLM_MOONEP_TEST_DEVICE", "cpu") == "cuda"


#: how the config-level cases (options, front end, CUDA-graph config builds) launch their ranks:
#: under vLLM's CPU platform on CPU gloo ranks; with ``VLLM_MOONEP_TEST_DEVICE=cuda``, under vLLM's
#: own platform choice (CUDA there) on gloo ranks sharing the GPU (they build configs and parse
#: options: vLLM's platform matters to them, one GPU per rank does not)
PLATFORM: dict = dict(env={}, backend="gloo") if ON_CUDA else dict(env={"VLLM_TARGET_DEVICE": "cpu"})


def device() -> torch.device:
    """This rank's device: its current GPU (with the index) under ``ON_CUDA``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")


# ---------------------------------------------------------------------------- data
def global_weights(E: int, H: int, I: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]`` in bf16, same on every rank."""
    from vllm_moonep.testing.reference import random_expert_weights

    return random_expert_weights(E, H, I, 1000 + seed)


def tokens(n: int, H: int, E: int, K: int, *, sigma: float, seed: int, rank: int):
    """This rank's ``(x [n,H] bf16, ids [n,K] int32, weights [n,K] fp32)`` on ``device()``."""
    from vllm_moonep.testing.routing import route

    ids, w = route(n, E, K, sigma=sigma, seed=seed, rank=rank)
    g = torch.Generator().manual_seed(77 + 131 * seed + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    dev = device()
    return x.to(dev), ids.to(dev), w.to(dev)


def close(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> float:
    """Assert the tolerance above (compared on the CPU); returns the max abs error."""
    assert out.shape == ref.shape, f"{what}: shape {list(out.shape)} != {list(ref.shape)}"
    out, ref = out.detach().cpu(), ref.detach().cpu()
    diff = (out.float() - ref.float()).abs()
    bound = ATOL + RTOL * ref.float().abs()
    bad = diff > bound
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values out of tolerance; max abs err "
            f"{float(diff.max()):.4g}, first bad flat index {i}: got {float(out.reshape(-1)[i]):.5g}, "
            f"want {float(ref.reshape(-1)[i]):.5g}"
        )
    return float(diff.max()) if diff.numel() else 0.0


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------------------- MoonEP objects
def make_pool(R: int, H: int, K: int, E: int, B: int, max_tokens: int, tp: int = 128):
    from vllm_moonep.common import MoonEPBufferPool

    return MoonEPBufferPool(
        dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=tp, device=device()), max_tokens, engine="builtin"
    )


def make_layouts(kind: str, w13_local, w2_local, E: int, B: int):
    """A one-layer ``LayoutSet`` of ``kind`` (symmetric kinds on the host heap; on CUDA, the torch one)."""
    from vllm_moonep.layouts import build_layouts

    heap = {} if kind == "replicated" else {"heap_kind": "torch" if ON_CUDA else "host"}
    return build_layouts(kind, [(w13_local, w2_local)], E, B, **heap)


def moe_config(E: int, K: int, H: int, I: int, R: int, rank: int, max_tokens: int):
    """A vLLM ``FusedMoEConfig`` for DP=EP=R with the moonep backend (no distributed state needed)."""
    return vllm_moe_config(E, K, H, I, R, rank, max_tokens, device())


def ensure_workspace() -> None:
    """vLLM's workspace manager on ``device()`` (the modular kernel asks it for scratch on non-CPU platforms)."""
    ensure_workspace_on(device())


def build(kind: str, E: int, K: int, H: int, I: int, B: int, max_tokens: int, seed: int = 0, tp: int = 128):
    """Pool (segments padded to ``tp``), layout, P/F, experts and the vLLM ``FusedMoEKernel`` for this rank."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from vllm_moonep.common.vllm_modular import MoonEPExperts, MoonEPPrepareAndFinalize

    rank, R = rank_world()
    w13, w2 = global_weights(E, H, I, seed)
    dev = device()  # the global w13 / w2 stay on the CPU for the dense reference
    w13_l, w2_l = local_rows(w13, rank, R).to(dev), local_rows(w2, rank, R).to(dev)
    pool = make_pool(R, H, K, E, B, max_tokens, tp)
    layouts = make_layouts(kind, w13_l, w2_l, E, B)
    layout = layouts.layouts[0]
    pf = MoonEPPrepareAndFinalize(pool, max_tokens_per_rank=max_tokens, num_dispatchers=R, num_global_experts=E)
    experts = MoonEPExperts(moe_config(E, K, H, I, R, rank, max_tokens), FUSED_MOE_UNQUANTIZED_CONFIG)
    ensure_workspace()
    kernel = mk.FusedMoEKernel(pf, experts)  # calls pf.post_init_setup(experts)
    experts.process_weights_after_loading(LayoutHolder(layout))
    return dict(w13=w13, w2=w2, w13_l=w13_l, w2_l=w2_l, pool=pool, layouts=layouts, layout=layout, pf=pf,
                experts=experts, kernel=kernel, E=E, K=K, H=H, I=I, R=R, rank=rank)


def teardown(o) -> None:
    """Free what ``build`` made, in the documented order: the buffer pool, then the layouts (collective
    for the symmetric kinds: every rank calls it)."""
    o["pool"].destroy()
    o["layouts"].destroy()


def run_bare(o, x, ids, w, *, apply_on_input: bool = False, wr=None):
    """prepare -> experts.apply -> finalize, by hand (no FusedMoEKernel)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    pf, ex = o["pf"], o["experts"]
    a1q, scale, meta, ids2, w_nvs = pf.prepare(x, w, ids, o["E"], None, apply_on_input, FUSED_MOE_UNQUANTIZED_CONFIG)
    assert scale is None and ids2 is None and w_nvs.dim() == 1
    # what our experts pick their kernels by travels in prepare's metadata (tiles, quack, tile skip)
    st = pf.last
    assert meta.step_tokens is not None and meta.step_tokens >= x.shape[0], meta
    assert meta.padded == (st.num_tokens < st.capacity), (meta, st)
    # the segments' padding travels too: without it the DeepGEMM paths would take a pool's 64-row segments for 128s
    assert meta.token_padding == o["pool"].token_padding, (meta.token_padding, o["pool"].token_padding)
    # dispatch's cu_seqlens travel beside the counts (apply runs no cumsum): a stale or mismatched pair
    # would group the rows wrongly
    cu = meta.cu_seqlens
    assert cu is not None and cu.dtype == torch.int32 and cu.shape == meta.expert_num_tokens.shape
    assert torch.equal(torch.cumsum(meta.expert_num_tokens, 0, dtype=torch.int32), cu), "counts and cu_seqlens disagree"
    # two sentinels: a row that combine reads and neither apply writes still differs between them
    y = torch.full_like(a1q, float("nan"))
    ex.apply(y, a1q, o["w13_l"], o["w2_l"], w_nvs, ids, MoEActivation.SILU, o["E"], None, None, None,
             torch.empty(0, device=x.device), torch.empty(0, device=x.device), meta, apply_on_input)
    # the same metadata without cu_seqlens (as another prepare's would be): apply counts them itself, same output
    plain = dataclasses.replace(meta, cu_seqlens=None)
    y2 = torch.full_like(a1q, -7.0)
    ex.apply(y2, a1q, o["w13_l"], o["w2_l"], w_nvs, ids, MoEActivation.SILU, o["E"], None, None, None,
             torch.empty(0, device=x.device), torch.empty(0, device=x.device), plain, apply_on_input)
    read = rows_combine_reads(cu, meta.row_ends, meta.zero_tail, y.shape[0])
    assert torch.equal(y2[read], y[read]), "apply on counts-only metadata differs from apply on our prepare's"
    out = torch.empty_like(x)
    pf.finalize(out, y, w, ids, apply_on_input, wr if wr is not None else ex.finalize_weight_and_reduce_impl())
    return out


def rows_combine_reads(cu: torch.Tensor, row_ends: torch.Tensor | None, zero_tail: bool, nrows: int) -> torch.Tensor:
    """``bool [nrows]``: the rows that combine reads, which apply must write. With ``zero_tail``, every row
    before ``cu[-1]`` (the padding tails as zeros); without it (the built-in engine's GPU dispatch, which
    writes ``row_ends``), each segment's entry rows only: apply leaves the tails as the memory held them.
    Rows from ``cu[-1]`` on are undefined either way."""
    rows = torch.arange(nrows, device=cu.device)
    read = rows < cu[-1]
    if not zero_tail and row_ends is not None:  # segment g holds rows [cu[g-1], cu[g]), its entries end at row_ends[g]
        group = torch.searchsorted(cu, rows.to(cu.dtype), right=True).clamp_(max=cu.numel() - 1)
        read &= rows < row_ends.to(rows.dtype)[group]
    return read


def run_kernel(o, x, ids, w, *, apply_on_input: bool = False):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return o["kernel"].apply(x, o["w13_l"], o["w2_l"], w, ids, MoEActivation.SILU, o["E"], None, apply_on_input)


def dense_ref(o, x, ids, w, *, apply_on_input: bool = False):
    """``dense_moe`` on the CPU (inputs copied there), on the full CPU weights."""
    from vllm_moonep.testing.reference import dense_moe

    x, ids, w = x.cpu(), ids.cpu(), w.cpu()
    if apply_on_input:  # the router weight scales the (bf16) input, the expert output is unweighted
        x = (x * w.to(x.dtype))
        w = torch.ones_like(w)
    return dense_moe(x, ids, w, o["w13"], o["w2"])


def set_threads() -> None:
    torch.set_num_threads(max(1, int(os.environ.get("VLLM_MOONEP_THREADS_PER_RANK", "1"))))


# ---------------------------------------------------------------------------- a platform that captures
@contextlib.contextmanager
def graph_capable_platform():
    """vLLM's current (CPU) platform, for the duration, as one that captures CUDA graphs.

    vLLM's CPU platform never captures: ``support_static_graph_mode()`` is False (so
    ``VllmConfig.__post_init__`` sets ``cudagraph_mode=NONE`` and computes no capture sizes) and
    its ``check_and_update_config`` empties the capture sizes and lowers the compilation mode.
    Here the platform object (the one every vLLM module holds) says it supports graph mode and
    keeps the compilation mode and capture sizes that ``__post_init__`` computed, so a config
    build chooses graphs as on a GPU platform. Only config builds are meant to run inside."""
    from vllm.platforms import current_platform

    base = type(current_platform)

    class GraphCapable(base):
        @classmethod
        def support_static_graph_mode(cls) -> bool:
            return True

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            cc = vllm_config.compilation_config
            kept = (cc.mode, cc.cudagraph_capture_sizes)
            super().check_and_update_config(vllm_config)
            cc.mode, cc.cudagraph_capture_sizes = kept

    current_platform.__class__ = GraphCapable
    try:
        yield
    finally:
        current_platform.__class__ = base
