"""vLLM 0.33's own fused-MoE path as an implementation we did not write, and the per-token comparison.

- ``vllm_fused_experts(device)``: vLLM's ``fused_experts``
  (``vllm/model_executor/layers/fused_moe/fused_moe.py``), its Triton fused-MoE path: what a user
  gets without our backend (vLLM's unquantized oracle prefers Triton on Hopper,
  ``oracle/unquantized.py``). Returns ``(fn, info)``, ``fn(x, w13, w2, topk_weights, topk_ids)``
  with ``w13 [E, 2I, H]`` (gate rows first: ``torch.ops._C.silu_and_mul`` is ``silu(x[:, :I]) *
  x[:, I:]``), ``w2 [E, H, I]``, ``topk_weights [T, K]`` float32 and ``topk_ids [T, K]`` int32; it
  applies the top-k weights itself (in float32, inside the down GEMM) and sums over K
  (``torch.ops._moe_C.moe_sum``). Needs no vLLM config or forward context. Under vLLM's CUDA
  platform it calls the public ``fused_experts`` (the custom op ``torch.ops.vllm.fused_experts``);
  under another platform (``VLLM_TARGET_DEVICE=cpu`` beside a GPU) that op is registered for the
  CPU dispatch key only, so it calls ``fused_experts_impl`` (the op's body) directly, loading the
  compiled ``_C`` / ``_moe_C`` extensions itself, and makes vLLM's tuned-config lookup read the
  GPU's name (the CPU platform has none). ``VllmFusedUnavailable`` (with the reason) where it
  cannot run.
- ``fused_experts_torch``: the same computation in plain torch with vLLM's rounding points (gate
  and up rounded to bf16, the activation rounded, each weighted expert output rounded, the K-sum
  rounded); the stand-in on machines without a GPU, so the comparison logic runs there too.
- ``contribution_norms``, ``row_budget``, ``compare``, ``check``: how close two MoE outputs must be.
  A token's *rounding budget* is ``2**-8 * (|ref_t| + sum_k |c_tk|)`` with ``c_tk = w_tk *
  FFN_{ids_tk}(x_t)`` (``tests/moe_fixtures.py`` explains it); a token's error in budgets is its
  *ratio*. A contribution that is mis-routed or lost moves its token by about ``sqrt(2) * w_tk *
  |FFN|``, hundreds of budgets for the router weights drawn here, while the Frobenius error over
  thousands of tokens moves by about ``1/sqrt(T)`` of that: the per-token ratio is what catches a
  mis-route of one token.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

from vllm_moonep.testing.models import model

__all__ = [
    "BF16_UNIT_ROUNDOFF",
    "SHAPES",
    "VllmFusedUnavailable",
    "check",
    "compare",
    "contribution_norms",
    "draw_expert_weights",
    "fused_experts_torch",
    "row_budget",
    "vllm_fused_experts",
    "vllm_moe_config_used",
]

#: real model widths (per expert; ``E`` routed experts, top-``K``): ``vllm_moonep.testing.models``
SHAPES: dict[str, dict[str, int]] = {key: model(key).dims() for key in ("qwen3-30b-a3b", "kimi-k2")}
#: bf16 keeps 8 significant bits: one round-to-nearest moves a value by at most 2**-8 of its size
BF16_UNIT_ROUNDOFF = 2.0**-8


class VllmFusedUnavailable(RuntimeError):
    """vLLM's ``fused_experts`` cannot run here; the message says why."""


# ---------------------------------------------------------------------------- data
def draw_expert_weights(E: int, H: int, I: int, seed: int, device: torch.device | str,
                        chunk_bytes: int = 1 << 31) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]`` bf16 on ``device``, std
    ``1/sqrt(fan_in)`` so a layer's output is O(1); drawn a few experts at a time (float32 draws of at
    most ``chunk_bytes``), so a full Kimi-K2 layer (34 GB bf16) never needs its float32 copy."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)
    step = max(1, chunk_bytes // (4 * 2 * I * H))
    for e0 in range(0, E, step):
        n = min(step, E - e0)
        w13[e0:e0 + n] = (torch.randn(n, 2 * I, H, generator=g, device=device) * H**-0.5).to(torch.bfloat16)
        w2[e0:e0 + n] = (torch.randn(n, H, I, generator=g, device=device) * I**-0.5).to(torch.bfloat16)
    return w13, w2


# ---------------------------------------------------------------------------- vLLM's fused_experts
def _op_present(ns: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, ns), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def vllm_fused_experts(device: torch.device | str) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
    """``(fn, info)``: vLLM's ``fused_experts`` on ``device`` (module doc), ``info`` says which entry
    point, the platform and the versions. Raises ``VllmFusedUnavailable`` with the reason (vLLM not
    importable, a non-CUDA device, a compiled op missing, its signature changed)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise VllmFusedUnavailable(f"vLLM's fused_experts is a Triton/CUDA path; device is {device}")
    try:
        import vllm
        import vllm.model_executor.layers.fused_moe.fused_moe as fm
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a torch-version mismatch surfacing at import
        raise VllmFusedUnavailable(f"importing vLLM's fused_moe failed: {type(e).__name__}: {str(e)[:300]}") from e
    import inspect

    want = ["hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation"]
    have = list(inspect.signature(fm.fused_experts).parameters)
    if have[: len(want)] != want or not hasattr(fm, "fused_experts_impl"):
        raise VllmFusedUnavailable(f"vLLM's fused_experts signature changed: {have} (this helper reads vLLM 0.33's)")
    info: dict[str, Any] = {"vllm": getattr(vllm, "__version__", "?"), "torch": torch.__version__,
                            "platform": type(current_platform).__name__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    on_cuda = bool(current_platform.is_cuda())
    # the compiled ops come from vLLM's CUDA extensions: its CUDA platform loads them (a failure there is
    # only a warning), the CPU platform does not; load them here and keep why one did not load
    import_errors = []
    for mod in ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
        try:
            __import__(mod)
        except (ImportError, OSError) as e:
            import_errors.append(f"{mod}: {type(e).__name__}: {str(e)[:160]}")
    missing = [f"torch.ops.{ns}.{op}" for ns, op in (("_C", "silu_and_mul"), ("_moe_C", "moe_align_block_size"),
                                                      ("_moe_C", "moe_sum")) if not _op_present(ns, op)]
    if missing:
        raise VllmFusedUnavailable(f"vLLM's compiled ops are missing: {', '.join(missing)} (platform "
                                   f"{info['platform']}" + (f"; {'; '.join(import_errors)}" if import_errors else "")
                                   + ")")
    if on_cuda:
        info["call"] = "vllm...fused_moe.fused_experts (torch.ops.vllm.fused_experts), activation SILU"

        def fn(x, w13, w2, topk_weights, topk_ids):
            return fm.fused_experts(x, w13, w2, topk_weights, topk_ids, activation=MoEActivation.SILU)
    else:
        # the custom op is registered for the platform's dispatch key (CPU here): call its body.
        # vLLM's tuned-config lookup names the file after current_platform.get_device_name(), which the
        # CPU platform does not have: let it read the GPU's name (fused_moe's own global, this process only)
        name = re.sub(r"[\s/]+", "_", torch.cuda.get_device_name(device))
        fm.get_device_name_as_file_name = lambda device_id=0: name
        fm.get_moe_configs.cache_clear()
        info["call"] = (f"vllm...fused_moe.fused_experts_impl (the op's body: platform {info['platform']} registers "
                        f"torch.ops.vllm.fused_experts for CPU only), activation 'silu'; config lookup reads device "
                        f"name {name!r}")

        def fn(x, w13, w2, topk_weights, topk_ids):
            return fm.fused_experts_impl(x, w13, w2, topk_weights, topk_ids, activation="silu")
    return fn, info


def vllm_moe_config_used(w13: torch.Tensor, w2: torch.Tensor, top_k: int, M: int) -> dict[str, Any]:
    """The tile config vLLM's ``fused_experts`` picks for ``M`` tokens and whether it came from one of
    vLLM's tuned files (``E=..,N=..,device_name=...json``) or its default (call after
    ``vllm_fused_experts``)."""
    import vllm.model_executor.layers.fused_moe.fused_moe as fm

    try:
        tuned = fm.get_moe_configs(int(w2.shape[0]), int(w2.shape[2]), None) is not None
        cfg = fm.try_get_optimal_moe_config(tuple(w13.shape), tuple(w2.shape), top_k, None, M)
        return {"config": dict(cfg), "from": "tuned file" if tuned else "vLLM's default (no tuned file for this E, N)"}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's ``fused_experts`` in plain torch with its rounding points (module doc): the stand-in
    where its Triton kernels cannot run. bf16 ``[T, H]`` out."""
    T, K = topk_ids.shape
    I = w13.shape[1] // 2
    dt = x.dtype
    y = torch.zeros(T, K, w2.shape[1], dtype=dt, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        h = (x[tok].float() @ w13[e].float().T).to(dt)  # intermediate_cache1: gate | up, bf16
        act = (F.silu(h[:, :I].float()) * h[:, I:].float()).to(dt)  # silu_and_mul: gate first
        y[tok, k] = ((act.float() @ w2[e].float().T) * topk_weights[tok, k].float()[:, None]).to(dt)
    return y.float().sum(dim=1).to(dt)  # moe_sum


# ---------------------------------------------------------------------------- comparison
def contribution_norms(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` float32 on ``x``'s device: ``|c_tk| = |w_tk * FFN_{ids_tk}(x_t)|`` on the given
    weights (float32, used experts only; 0 for negative ids)."""
    xf = x.float()
    I = w13.shape[1] // 2
    out = torch.zeros(topk_ids.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        xe = xf[tok]
        h = F.silu(xe @ w13[e, :I].float().T) * (xe @ w13[e, I:].float().T)
        out[tok, k] = (h @ w2[e].float().T).norm(dim=1) * topk_weights[tok, k].float().abs()
    return out


def row_budget(ref: torch.Tensor, cnorm: torch.Tensor) -> torch.Tensor:
    """Each token's bf16 rounding budget ``2**-8 * (|ref_t| + sum_k |c_tk|)`` (float32 ``[T]``)."""
    return BF16_UNIT_ROUNDOFF * (ref.float().norm(dim=1) + cnorm.float().sum(dim=1))


def compare(out: torch.Tensor, truth: torch.Tensor, budget: torch.Tensor) -> dict[str, Any]:
    """``out`` against ``truth`` (both ``[T, H]``): max abs difference, relative Frobenius difference,
    the worst token's error in rounding budgets and which token that is; ``finite`` is False if
    ``out`` has a NaN or Inf."""
    if tuple(out.shape) != tuple(truth.shape):
        raise AssertionError(f"shape {list(out.shape)} != {list(truth.shape)}")
    d = out.float() - truth.float()
    finite = bool(torch.isfinite(out.float()).all())
    if d.numel() == 0:
        return {"max_abs": 0.0, "rel_fro": 0.0, "worst_ratio": 0.0, "worst_token": -1, "finite": finite}
    err = d.norm(dim=1)
    zero = torch.where(err > 0, torch.full_like(err, float("inf")), torch.zeros_like(err))
    ratio = torch.where(budget > 0, err / budget.float().clamp_min(1e-30), zero)
    ratio = torch.nan_to_num(ratio, nan=float("inf"))
    worst = int(ratio.argmax())
    return {
        "max_abs": float(d.abs().max()),
        "rel_fro": float(d.norm() / truth.float().norm().clamp_min(1e-12)),
        "worst_ratio": float(ratio[worst]),
        "worst_token": worst,
        "finite": finite,
    }


def check(what: str, m: dict[str, Any], *, rel_tol: float, slack: float) -> str | None:
    """``None`` if ``m`` (``compare``'s) is within ``rel_tol`` (relative Frobenius) and ``slack``
    budgets on every token, else a sentence saying which bound failed."""
    if not m["finite"]:
        return f"{what}: NaN or Inf in the output"
    bad = []
    if not m["rel_fro"] < rel_tol:
        bad.append(f"relative Frobenius difference {m['rel_fro']:.3e} >= {rel_tol:.1e}")
    if not m["worst_ratio"] <= slack:
        bad.append(f"token {m['worst_token']} is {m['worst_ratio']:.2f} bf16 rounding budgets off (allowed {slack})")
    return f"{what}: " + "; ".join(bad) if bad else None
