"""Checks of the ``moonep`` options, as early as each fact is known.

- ``check_engine_config(vllm_config)``: in the front-end process, right after vLLM's
  ``EngineArgs.create_engine_config`` built the config (before any engine core or worker starts).
  With ``--all2all-backend moonep`` it takes the config's options (``options_from_vllm_config``:
  parsed once, so unknown keys, bad values and bounds raise here if not already), checks
  them against the model (``E`` divisible by the EP size, ``num_prefetch_slots <= E``, the
  dispatch shard's row bound, ``impl='grouped_mm'`` with overflow reads) and logs every option
  with where its value came from. It refuses what would fail at the first MoE forward: DP size > 1
  without expert parallelism, whose fallback path calls a dispatch no moonep manager has (vLLM
  refuses microbatching with moonep itself). It warns when moonep
  is requested but will not run (no EP at DP size 1, DP size 1, a dense model), when options are
  set but moonep is not requested, when a setting has no effect with the others, and when a
  top-level ``--additional-config`` key looks like ours.
- ``check_worker(opts, device)``: on each worker when its EP group is built (before weights
  load): the engine, the heap and the expert kernel must be able to run on this device.

vLLM objects are only read (attributes of the config); nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

import torch

from vllm_moonep.engine import MoonEPInputError, MoonEPUnavailableError, resolve_engine
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING, say_once, slots_beyond_experts
from vllm_moonep.vllm_plugin.options import (
    CONFIG_KEY,
    ENV_VARS,
    OPTION_NAMES,
    MoonEPOptions,
    MoonEPOptionsError,
    options_from_vllm_config,
)

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["available_kernels", "check_engine_config", "check_worker", "lookalike_keys", "moonep_inactive_reason",
           "moonep_unrunnable_reason", "resolve_heap", "resolve_kernel"]

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def lookalike_keys(additional_config: Mapping[str, Any] | None) -> list[str]:
    """Top-level ``--additional-config`` keys that look like ours but are not the ``moonep`` block."""
    if not isinstance(additional_config, Mapping):
        return []
    out = []
    for key in additional_config:
        if not isinstance(key, str) or key == CONFIG_KEY:
            continue
        norm = re.sub(r"[^a-z0-9]", "", key.lower())
        if norm.startswith("moonep") or key.lower() in OPTION_NAMES:
            out.append(key)
    return out


def _ep_size(pc) -> int:
    return int(pc.data_parallel_size) * int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1))


def moonep_inactive_reason(vllm_config) -> str | None:
    """Why ``--all2all-backend moonep`` will not run MoonEP with this config (``None``: it will).

    vLLM 0.33 uses the all2all kernels when expert parallelism is on and the DP (or prefill
    context-parallel) size is above 1 (``FusedMoEParallelConfig.use_all2all_kernels``), for MoE
    models only."""
    pc = vllm_config.parallel_config
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None:
        try:
            if not mc.is_moe:
                return "the model is not a mixture of experts"
        except Exception:  # a model config without an architecture table: leave it to vLLM
            pass
    if not pc.enable_expert_parallel:
        return "--enable-expert-parallel is not set"
    if pc.data_parallel_size <= 1 and getattr(pc, "prefill_context_parallel_size", 1) <= 1:
        return "--data-parallel-size is 1 (MoonEP runs with data parallelism: --data-parallel-size > 1)"
    return None


def moonep_unrunnable_reason(vllm_config) -> str | None:
    """Why ``--all2all-backend moonep`` makes this config fail at its first MoE forward (``None``: it does not).

    A MoE model at data-parallel size > 1 without expert parallelism: vLLM 0.33 still builds the backend's
    all2all manager for the EP group (``ParallelConfig.use_all2all``) and falls back to its all-gather /
    reduce-scatter DP path, which calls that manager's ``dispatch``; a moonep manager (vLLM's or ours) has none,
    so the first forward raises ``NotImplementedError``."""
    pc = vllm_config.parallel_config
    if pc.enable_expert_parallel or pc.data_parallel_size <= 1:
        return None
    mc = getattr(vllm_config, "model_config", None)
    try:
        if mc is not None and not mc.is_moe:
            return None
    except Exception:  # a model config without an architecture table: the config is refused as if MoE
        pass
    return (f"--all2all-backend moonep with --data-parallel-size {pc.data_parallel_size} needs "
            "--enable-expert-parallel: without it vLLM 0.33 runs its all-gather/reduce-scatter data-parallel MoE "
            "path through the EP group's all2all manager, and a moonep manager has no dispatch for it (the first "
            "forward would raise NotImplementedError). Add --enable-expert-parallel to run MoonEP, or use "
            "--all2all-backend allgather_reducescatter")


def _model_shape(vllm_config) -> dict | None:
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    try:
        return {"E": int(mc.get_num_experts()), "K": int(mc.get_num_experts_per_tok()), "H": int(mc.get_hidden_size())}
    except Exception as exc:  # the model's checks are then the workers' (said, not silent)
        say_once(f"vllm-moonep: the model's expert shape is unknown here ({type(exc).__name__}: {exc}); the "
                 "checks that need it (E divisible by the EP size, num_prefetch_slots <= E, the kernel's limits) "
                 "run on the workers", log.name, logging.WARNING)
        return None


def _check_against_model(opts: MoonEPOptions, vllm_config) -> str:
    """Errors that need the model's shape; returns a short description of what was checked."""
    from vllm_moonep.engine import validate_config

    shape = _model_shape(vllm_config)
    pc = vllm_config.parallel_config
    R = _ep_size(pc)
    if shape is None or shape["E"] <= 0:
        return f"EP size {R}"
    E, K, H = shape["E"], shape["K"], shape["H"]
    sizes = f"--data-parallel-size {pc.data_parallel_size} x --tensor-parallel-size {pc.tensor_parallel_size}"
    if getattr(pc, "prefill_context_parallel_size", 1) > 1:
        sizes += f" x --prefill-context-parallel-size {pc.prefill_context_parallel_size}"
    if E % R:
        raise MoonEPOptionsError(
            f"moonep needs the model's {E} routed experts divisible by the EP size {R} ({sizes}); "
            f"choose sizes whose product divides {E}"
        )
    B = opts.num_prefetch_slots
    too_many = slots_beyond_experts(B, E, R)
    if too_many:
        raise MoonEPOptionsError(f"moonep option num_prefetch_slots={B} {too_many}")
    epn = E // R
    if opts.impl == "grouped_mm" and opts.weight_layout == "symmetric" and R > 1 and B < epn:
        raise MoonEPOptionsError(
            f"moonep option impl='grouped_mm' needs one dense weight tensor, but with weight_layout='symmetric' and "
            f"num_prefetch_slots={B} < E/R={epn} a rank also reads overflow rows from its peers; use impl='auto', "
            f"'triton' or 'reference', or num_prefetch_slots >= {epn}"
        )
    S = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
    if S > 0:
        try:
            validate_config(S, H, K, E, R, B, opts.token_padding)
        except MoonEPInputError as exc:
            raise MoonEPOptionsError(
                f"moonep options do not fit this model and batch size (max_num_batched_tokens={S}): {exc}"
            ) from None
    return f"E={E} experts, top-{K}, H={H}, EP size {R} ({E // R} experts per rank)"


def check_engine_config(vllm_config, seam_error: Exception | None = None) -> MoonEPOptions | None:
    """The front-end check (see the module doc). Returns the options when moonep is requested."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, Mapping) else {}
    for key in lookalike_keys(extra):
        if key.lower() in OPTION_NAMES:
            why = (f"moonep options go inside the '{CONFIG_KEY}' block, e.g. --additional-config "
                   f"'{{\"{CONFIG_KEY}\": {{\"{key.lower()}\": ...}}}}'")
        else:
            why = f"vllm-moonep reads only the key '{CONFIG_KEY}' (lower case)"
        _warn_once(f"vllm-moonep: --additional-config key '{key}' has no effect: {why}")
    backend = vllm_config.parallel_config.all2all_backend
    env_set = [name for name in ENV_VARS.values() if os.environ.get(name, "").strip()]
    if backend != "moonep":
        if CONFIG_KEY in extra or env_set:
            given = ([f"--additional-config '{CONFIG_KEY}'"] if CONFIG_KEY in extra else []) + env_set
            _warn_once(
                f"vllm-moonep: moonep options are set ({', '.join(given)}) but --all2all-backend is {backend!r}: "
                "they have no effect (use --all2all-backend moonep with --enable-expert-parallel and "
                "--data-parallel-size > 1)"
            )
        return None
    if seam_error is not None:
        raise seam_error
    opts = options_from_vllm_config(vllm_config)
    unrunnable = moonep_unrunnable_reason(vllm_config)
    if unrunnable is not None:
        raise MoonEPOptionsError(unrunnable)
    why_not = moonep_inactive_reason(vllm_config)
    if why_not is not None:
        _warn_once(
            f"vllm-moonep: --all2all-backend moonep is set but MoonEP will not run: {why_not}. vLLM runs its "
            "default MoE path and the moonep options are not used"
        )
        return opts
    checked = _check_against_model(opts, vllm_config)
    explicit = {k for k in OPTION_NAMES if opts.source(k) != "default"}
    if opts.weight_layout == "replicated" and "heap" in explicit:
        _warn_once(
            f"vllm-moonep: moonep option heap={opts.heap!r} has no effect with weight_layout='replicated' (the heap "
            "holds the symmetric layout's experts)"
        )
    if opts.engine == "moonep" and "transport" in explicit:
        _warn_once(
            f"vllm-moonep: moonep option transport={opts.transport!r} has no effect with engine='moonep' "
            "(the transport is the built-in engine's; the real moonep uses its own kernels)"
        )
    log.info(
        "vllm-moonep: --all2all-backend moonep for %s; options: %s. Each worker checks the engine, heap and "
        "kernel when its EP group is built and logs what it resolved at its first MoE step",
        checked, ", ".join(f"{k}={v!r} ({opts.source(k)})" for k, v in opts.as_dict().items()),
    )
    return opts


# ------------------------------------------------------------------------------------ worker side
def resolve_heap(opts: MoonEPOptions, device: torch.device) -> tuple[str, str]:
    """``(kind, reason)`` of the symmetric heap ``opts.heap`` selects on ``device``; raises
    ``MoonEPUnavailableError`` when it cannot run there."""
    from vllm_moonep.engine.heaps import resolve_heap_kind

    kind = resolve_heap_kind(opts.heap, device)
    why = "requested" if opts.heap != "auto" else (
        "auto: PyTorch symmetric memory on CUDA" if kind == "torch" else f"auto: host memory on {device.type}")
    if kind in ("torch", "nvshmem") and device.type != "cuda":
        raise MoonEPUnavailableError(
            f"moonep option heap={opts.heap!r} selects the {kind!r} heap, which needs CUDA devices; this worker runs "
            f"on {device.type}: use heap='auto' or 'host'"
        )
    if kind == "nvshmem":
        from vllm_moonep.engine.heaps.nvshmem_heap import nvshmem_status

        mod, reason = nvshmem_status()
        if mod is None:
            raise MoonEPUnavailableError(f"moonep option heap='nvshmem' cannot run on this worker: {reason}")
    return kind, why


def available_kernels(device: torch.device, dense: bool = True, token_padding: int = DEFAULT_TOKEN_PADDING) -> list[str]:
    """The grouped-GEMM implementations that run on ``device`` (segments padded to ``token_padding``)."""
    from vllm_moonep.common.grouped_gemm import available_impls

    x, w = _dummy_weights(device, dense)
    return available_impls(x, w, token_padding)


def check_worker(opts: MoonEPOptions, device: torch.device) -> dict:
    """What only a worker can know: raises ``MoonEPUnavailableError`` (engine, heap, kernel) naming
    the option and what to use instead. Returns ``{"engine": (name, why), "heap": (kind, why) | None}``."""
    engine = resolve_engine(opts.engine)
    heap = resolve_heap(opts, device) if opts.weight_layout == "symmetric" else None
    if opts.impl != "auto":
        from vllm_moonep.common.grouped_gemm import impl_unusable

        x, w = _dummy_weights(device, True)
        reason = impl_unusable(opts.impl, x, w, opts.token_padding)
        if reason is not None:
            raise MoonEPUnavailableError(
                f"moonep option impl={opts.impl!r} cannot run on this worker ({device}) ({reason}); available here: "
                f"{', '.join(available_kernels(device, token_padding=opts.token_padding))}; use impl='auto' to take "
                "the best of them"
            )
    return {"engine": engine, "heap": heap}


def _dummy_weights(device: torch.device, dense: bool, H: int = 128, I: int = 128):
    """One expert of zeros as the kernels' probes see it: ``[1, I, H]`` views of one element (the
    probes read shapes, dtypes and devices, never the values), so a layer's real H and I cost no
    memory."""
    from vllm_moonep.common.grouped_gemm import GroupedWeights

    x = torch.zeros(1, H, dtype=torch.bfloat16, device=device)
    one = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    gate, down = one.expand(1, I, H), one.expand(1, H, I)
    gw = GroupedWeights.contiguous(gate, gate, down)
    if not dense:  # a row source of several pools (peers' rows, a shared slot pool): no dense tensor
        gw = GroupedWeights(gw.gate, gw.up, gw.down, gw.group_pool, gw.group_row, None)
    return x, gw


def resolve_kernel(impl: str, device: torch.device, dense: bool = True, shape: tuple[int, int] | None = None,
                   batch_invariant: bool = False, token_padding: int = DEFAULT_TOKEN_PADDING) -> str:
    """The grouped GEMM ``impl`` runs as on ``device`` (``dense``: the layer's weights are one
    tensor; ``shape``: its ``(H, I)``; ``token_padding``: the segments' padding). For ``impl="auto"``, where
    the choice depends on the step's tokens per rank (the GPU's ``auto`` regimes, ``grouped_gemm/policy.py``), each regime: ``"triton below 1024 tokens per
    rank, quack from 1024"``; ``batch_invariant`` (``VLLM_BATCH_INVARIANT=1``): the one implementation every step runs (no library kernel)."""
    from vllm_moonep.common.grouped_gemm import auto_regimes, resolve_impl

    x, w = _dummy_weights(device, dense, *(shape or (128, 128)))
    if batch_invariant:
        return f"{resolve_impl(impl, x, w, batch_invariant=True, token_padding=token_padding)}, batch invariant"
    if impl != "auto":
        return resolve_impl(impl, x, w, token_padding=token_padding)
    regimes = auto_regimes(x, w, token_padding)
    if len(regimes) == 1:
        return regimes[0][1]
    (_, first), *rest = regimes
    return f"{first} below {rest[0][0]} tokens per rank, " + ", ".join(f"{k} from {n}" for n, k in rest)
