"""Every rebinding of vLLM 0.33's MoonEP seams, in one place, each checked before anything changes.

vLLM 0.33 has no registry for all2all backends; ``--all2all-backend moonep`` is wired by name to
in-tree classes. We keep the flag value and rebind the names vLLM looks up *at call time*:

=====================================================================================  ==============================================
seam (module.attribute)                                                                 what vLLM does with it
=====================================================================================  ==============================================
vllm.distributed.device_communicators.all2all.MoonEPAll2AllManager                     CudaCommunicator builds it for the EP group
vllm.model_executor.layers.fused_moe.all2all_utils.get_ep_all2all_manager              maybe_make_prepare_finalize gets the manager
vllm.model_executor.layers.fused_moe.all2all_utils.MoonEPPrepareAndFinalize            maybe_make_prepare_finalize builds the P/F
vllm.model_executor.layers.fused_moe.all2all_utils.MOONEP_DEFAULT_{NUM_PREFETCH_SLOTS,
  TOKEN_PADDING,NUM_SMS}                                                                handle kwargs (imported there only with CUDA
                                                                                        and the real moonep; we define them)
vllm.model_executor.layers.fused_moe.experts.moonep_experts.MoonEPExperts              oracle.unquantized.backend_to_kernel_cls
vllm.model_executor.layers.fused_moe.prepare_finalize.moonep.gather_moonep_weight_layout  convert_to_unquantized_kernel_format: the
                                                                                        weight layout after loading
=====================================================================================  ==============================================

``get_ep_all2all_manager`` is wrapped (not replaced): on platforms whose EP communicator has no
MoonEP manager (CPU, or an unknown platform) it attaches ours, then defers to vLLM's function.

``apply_patches()`` first verifies every seam (the attribute exists, and the vLLM function that
uses it still reads it by that name); on any mismatch it raises ``MoonEPSeamError`` naming the
vLLM version and the seam, and patches nothing. It is idempotent.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from typing import Any

import torch

from vllm_moonep.engine import MoonEPError
from vllm_moonep.vllm_plugin.options import MoonEPOptions, options_from_vllm_config

# under the "vllm" logger so the line shows in vLLM's own log format and level
log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["MoonEPSeamError", "SEAMS", "apply_patches", "patched", "vllm_version"]

A2A = "vllm.distributed.device_communicators.all2all"
CUDA_COMM = "vllm.distributed.device_communicators.cuda_communicator"
A2A_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
PF_MOONEP = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"
ORACLE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"

#: (module, attribute) pairs this plugin rebinds
SEAMS = [
    (A2A, "MoonEPAll2AllManager"),
    (A2A_UTILS, "get_ep_all2all_manager"),
    (A2A_UTILS, "MoonEPPrepareAndFinalize"),
    (A2A_UTILS, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS"),
    (A2A_UTILS, "MOONEP_DEFAULT_TOKEN_PADDING"),
    (A2A_UTILS, "MOONEP_DEFAULT_NUM_SMS"),
    (EXPERTS, "MoonEPExperts"),
    (PF_MOONEP, "gather_moonep_weight_layout"),
]

_lock = threading.Lock()
_applied = False
_originals: dict[tuple[str, str], Any] = {}


class MoonEPSeamError(MoonEPError):
    """vLLM's internals do not look like the 0.33 seams this plugin rebinds."""


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as exc:  # pragma: no cover
        return f"unimportable ({exc})"


def _fail(seam: str, why: str) -> MoonEPSeamError:
    return MoonEPSeamError(
        f"vllm-moonep cannot hook vLLM {vllm_version()}: seam {seam} {why}. This plugin supports vLLM 0.33 "
        "(pip install 'vllm>=0.33,<0.34'); set VLLM_MOONEP_PLUGIN=0 (or leave 'moonep' out of VLLM_PLUGINS) "
        "to run vLLM without it."
    )


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise _fail(name, f"does not import ({type(exc).__name__}: {exc})") from exc


def _source(obj, seam: str) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise _fail(seam, f"has no readable source to verify ({exc})") from exc


def _need_names(fn, names: list[str], seam: str) -> None:
    """``fn`` must still read each of ``names`` (global or local import) at call time."""
    src = _source(fn, seam)
    missing = [n for n in names if n not in src]
    if missing:
        raise _fail(seam, f"is no longer used the way 0.33 uses it ({fn.__qualname__} does not reference {missing})")


def verify_seams() -> dict:
    """Check every seam; returns the modules. Raises ``MoonEPSeamError`` naming the first mismatch."""
    mods = {n: _module(n) for n in (A2A, CUDA_COMM, A2A_UTILS, EXPERTS, PF_MOONEP, ORACLE)}
    base = importlib.import_module("vllm.distributed.device_communicators.base_device_communicator")
    mk = importlib.import_module("vllm.model_executor.layers.fused_moe.modular_kernel")
    if not hasattr(base, "All2AllManagerBase"):
        raise _fail(f"{base.__name__}.All2AllManagerBase", "is missing")
    for cls in ("FusedMoEPrepareAndFinalizeModular", "FusedMoEExpertsModular"):
        if not hasattr(mk, cls):
            raise _fail(f"{mk.__name__}.{cls}", "is missing")
    if not inspect.isclass(getattr(mods[A2A], "MoonEPAll2AllManager", None)) and not _applied:
        raise _fail(f"{A2A}.MoonEPAll2AllManager", "is missing")
    _need_names(mods[CUDA_COMM].CudaCommunicator.__init__, ["MoonEPAll2AllManager", '"moonep"'],
                f"{A2A}.MoonEPAll2AllManager")
    mmpf = getattr(mods[A2A_UTILS], "maybe_make_prepare_finalize", None)
    if mmpf is None:
        raise _fail(f"{A2A_UTILS}.maybe_make_prepare_finalize", "is missing")
    if not callable(getattr(mods[A2A_UTILS], "get_ep_all2all_manager", None)):
        raise _fail(f"{A2A_UTILS}.get_ep_all2all_manager", "is missing")
    _need_names(mmpf, ["use_moonep_kernels", "get_ep_all2all_manager", "MoonEPPrepareAndFinalize",
                       "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", "MOONEP_DEFAULT_TOKEN_PADDING", "MOONEP_DEFAULT_NUM_SMS",
                       "buffer_pool=", "get_handle"], f"{A2A_UTILS}.MoonEPPrepareAndFinalize")
    if not inspect.isclass(getattr(mods[EXPERTS], "MoonEPExperts", None)):
        raise _fail(f"{EXPERTS}.MoonEPExperts", "is missing")
    _need_names(mods[ORACLE].backend_to_kernel_cls, ["moonep_experts", "MoonEPExperts"], f"{EXPERTS}.MoonEPExperts")
    _need_names(mods[ORACLE].select_unquantized_moe_backend, ["use_moonep_kernels", "MOONEP"],
                f"{ORACLE}.select_unquantized_moe_backend")
    if not callable(getattr(mods[PF_MOONEP], "gather_moonep_weight_layout", None)):
        raise _fail(f"{PF_MOONEP}.gather_moonep_weight_layout", "is missing")
    _need_names(mods[ORACLE].convert_to_unquantized_kernel_format,
                ["gather_moonep_weight_layout", "_moonep_weight_layout", "full_gate_weight", "full_down_weight"],
                f"{PF_MOONEP}.gather_moonep_weight_layout")
    return mods


# ------------------------------------------------------------------------------------ state
class _PluginState:
    """Per-process objects shared by every MoE layer: heaps, the shared slot pool, the layouts."""

    def __init__(self):
        self.heaps: dict[tuple, Any] = {}
        self.slot_pools: dict[tuple, Any] = {}
        self.layouts: list = []
        self.summary_logged = False
        self.last_summary = ""

    def reset(self) -> None:
        from vllm_moonep.symmetric import destroy_in_order

        objs = [lay for lay in self.layouts] + list(self.slot_pools.values())
        syms = [o for o in objs if hasattr(o, "first_index")]
        others = [o for o in objs if not hasattr(o, "first_index")]
        if syms:
            destroy_in_order(*syms)
        for o in others:
            o.destroy()
        for h in self.heaps.values():
            h.close()
        self.__init__()


STATE = _PluginState()


def _ep_group():
    from vllm.distributed import get_ep_group

    return get_ep_group()


def summary_line(opts: MoonEPOptions | None = None) -> str:
    """The start-up line: layout, engine, slots and per-rank expert memory of the layers built so far."""
    from vllm_moonep.common.memory import MemoryReport
    from vllm_moonep.engine import resolve_engine

    opts = opts or options_from_vllm_config()
    engine, why = resolve_engine(opts.engine)
    rep = MemoryReport()
    for lay in STATE.layouts:
        rep = rep + lay.memory_report()
    for pool in STATE.slot_pools.values():
        rep = rep + pool.memory_report()
    gib = 1024.0**3
    slots = f"{opts.num_prefetch_slots} " + ("(one pool shared by all layers)" if opts.shared_slot_pool else "per layer")
    heap = f", heap={opts.heap}" if opts.weight_layout == "symmetric" else ""
    return (
        f"vllm-moonep: weight_layout={opts.weight_layout}, engine={engine} ({why}), slots={slots}{heap}, "
        f"impl={opts.impl}, token_padding={opts.token_padding}; per-rank expert memory {rep.resident / gib:.3f} GiB "
        f"resident over {len(STATE.layouts)} MoE layer(s) (home {rep.home_rows / gib:.3f}, replicated "
        f"{rep.replicated_rows / gib:.3f}, slots {rep.slots / gib:.3f}; load-time transient {rep.transient / gib:.3f})"
    )


def _log_summary_once() -> None:
    if STATE.summary_logged:
        return
    STATE.summary_logged = True
    STATE.last_summary = summary_line()
    log.info(STATE.last_summary)


# ------------------------------------------------------------------------------------ our objects
def _make_pool_class():
    from vllm_moonep.common.pool import MoonEPBufferPool

    class PluginBufferPool(MoonEPBufferPool):
        """The all2all handle: a ``MoonEPBufferPool`` that logs the start-up line at its first step
        (vLLM's profiling run), when every layer's layout exists."""

        def get(self, num_tokens: int):
            _log_summary_once()
            return super().get(num_tokens)

    return PluginBufferPool


def _make_manager_class():
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache

    from vllm_moonep.engine import resolve_engine

    pool_cls = _make_pool_class()

    class MoonEPAll2AllManager(All2AllManagerBase):
        """vllm-moonep's all2all manager: its handle is our ``MoonEPBufferPool`` on the engine the
        options select (built-in, or the real ``moonep`` where usable). No NVLink multicast."""

        is_vllm_moonep = True

        def __init__(self, cpu_group, tcp_store_group=None, device_group=None, **_extra):
            super().__init__(cpu_group, tcp_store_group)
            self._device_group = device_group
            self.options = options_from_vllm_config()
            # fail at start-up (not at the first step) if the requested engine cannot run here
            self.engine, self.engine_reason = resolve_engine(self.options.engine)
            self.handle_cache = Cache()
            self._pools: list = []

        def get_handle(self, kwargs):
            opts = options_from_vllm_config()  # the config of the model being built
            S = int(kwargs["max_num_tokens_per_dp_rank"])
            buffer_kwargs = dict(
                H=int(kwargs["token_hidden_size"]),
                K=int(kwargs["num_topk"]),
                E=int(kwargs["num_global_experts"]),
                num_ep_ranks=self.world_size,
                num_sms=kwargs.get("num_sms"),
                token_padding=opts.token_padding,
                B=opts.num_prefetch_slots,
                group=self._device_group if self._device_group is not None else self.cpu_group,
                explicitly_destroy=True,
            )

            def make_pool(**kw):
                pool = pool_cls(dict(kw), max_tokens_per_rank=S, engine=opts.engine)
                self._pools.append(pool)
                return pool

            return self.handle_cache.get_or_create(dict(buffer_kwargs, S=S), make_pool)

        def destroy(self):
            with self.handle_cache._lock:
                for pool in self._pools:
                    pool.destroy()
                self._pools.clear()
                self.handle_cache._cache.clear()
            # vLLM destroys the all2all manager before the process group: the layouts, slot pools
            # and heaps (collective, LIFO) go with it
            STATE.reset()

    return MoonEPAll2AllManager


def _group_for_heap(kind: str, device: torch.device):
    from vllm_moonep.engine.heaps import resolve_heap_kind

    ep = _ep_group()
    which = resolve_heap_kind(kind, device)
    return which, (ep.cpu_group if which == "host" else ep.device_group)


def build_weight_layout(w13_local: torch.Tensor, w2_local: torch.Tensor, num_global_experts: int,
                        num_prefetch_slots: int | None = None, **_extra):
    """Our ``gather_moonep_weight_layout``: the layer's layout from its local ``[E/R]`` parameters.

    vLLM passes the layer's ``w13_weight`` / ``w2_weight`` parameters and then rebinds them to
    the returned object's ``full_gate_weight`` / ``full_down_weight``:

    - replicated: all-gather into ``[E+B]`` gate/up/down (vLLM's PoC memory model); the layer's
      parameters become the ``[E+B]`` gate and down tensors (its ``[E/R]`` storage is released).
    - symmetric: the layer's parameters are adopted onto the symmetric heap (no all-gather, no
      copy kept); ``full_gate_weight`` / ``full_down_weight`` are those same heap views, so vLLM's
      rebinding is a no-op and the parameters keep their ``[E/R]`` shapes.

    ``num_prefetch_slots`` from vLLM is ignored: the plugin's option is the one source of ``B``.
    """
    opts = options_from_vllm_config()
    B = opts.num_prefetch_slots
    ep = _ep_group()
    if opts.weight_layout == "replicated":
        from vllm_moonep.replicated import ReplicatedWeightLayout

        layout = ReplicatedWeightLayout(w13_local.data, w2_local.data, num_global_experts, B, ep.device_group,
                                        keeps_local_params=False)
    else:
        from vllm_moonep.symmetric import SharedSlotPool, SymmetricWeightLayout, make_heap

        kind, group = _group_for_heap(opts.heap, w13_local.device)
        hkey = (kind, str(w13_local.device))
        heap = STATE.heaps.get(hkey)
        if heap is None:
            heap = STATE.heaps[hkey] = make_heap(kind, group, device=w13_local.device)
        slot_pool = None
        if opts.shared_slot_pool:
            I, H = w2_local.shape[2], w2_local.shape[1]
            pkey = hkey + (H, I)
            slot_pool = STATE.slot_pools.get(pkey)
            if slot_pool is None:
                slot_pool = STATE.slot_pools[pkey] = SharedSlotPool(B, H, I, group, heap=heap)
        layout = SymmetricWeightLayout(w13_local.data, w2_local.data, num_global_experts,
                                       num_slots=None if slot_pool is not None else B, group=group, heap=heap,
                                       slot_pool=slot_pool)
        layout.adopt_parameters(w13_local, w2_local, copy=False)
        layout.full_gate_weight = w13_local.data  # vLLM rebinds the parameters to these: a no-op
        layout.full_down_weight = w2_local.data
    STATE.layouts.append(layout)
    log.debug("vllm-moonep: built %r", layout)
    return layout


def _wrap_get_ep_all2all_manager(orig, manager_cls):
    def get_ep_all2all_manager(ep_group=None):
        if ep_group is None:
            ep_group = _ep_group()
        comm = ep_group.device_communicator
        if (comm is not None and getattr(comm, "all2all_backend", None) == "moonep"
                and not getattr(comm.all2all_manager, "is_vllm_moonep", False)):
            # CPU (and unknown) platforms build no MoonEP manager (CpuCommunicator falls back to
            # allgather/reducescatter): attach ours the way CudaCommunicator would.
            comm.all2all_manager = manager_cls(comm.cpu_group, device_group=comm.device_group)
        return orig(ep_group)

    get_ep_all2all_manager.__wrapped__ = orig
    get_ep_all2all_manager.__vllm_moonep__ = True
    return get_ep_all2all_manager


def apply_patches() -> list[str]:
    """Verify then rebind every seam (idempotent). Returns the ``module.attribute`` names patched."""
    global _applied
    with _lock:
        if _applied:
            return [f"{m}.{a}" for m, a in SEAMS]
        mods = verify_seams()
        from vllm_moonep.common.vllm_modular import MoonEPExperts, MoonEPPrepareAndFinalize

        manager_cls = _make_manager_class()
        a2a_utils = mods[A2A_UTILS]
        orig_get = a2a_utils.get_ep_all2all_manager
        new = {
            (A2A, "MoonEPAll2AllManager"): manager_cls,
            (A2A_UTILS, "get_ep_all2all_manager"): _wrap_get_ep_all2all_manager(orig_get, manager_cls),
            (A2A_UTILS, "MoonEPPrepareAndFinalize"): MoonEPPrepareAndFinalize,
            (A2A_UTILS, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS"): getattr(mods[PF_MOONEP], "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", 4),
            (A2A_UTILS, "MOONEP_DEFAULT_TOKEN_PADDING"): getattr(mods[PF_MOONEP], "MOONEP_DEFAULT_TOKEN_PADDING", 128),
            (A2A_UTILS, "MOONEP_DEFAULT_NUM_SMS"): getattr(mods[PF_MOONEP], "MOONEP_DEFAULT_NUM_SMS", 32),
            (EXPERTS, "MoonEPExperts"): _plugin_experts_class(MoonEPExperts),
            (PF_MOONEP, "gather_moonep_weight_layout"): build_weight_layout,
        }
        assert set(new) == set(SEAMS)
        for (m, a), value in new.items():
            mod = mods[m]
            _originals[(m, a)] = getattr(mod, a, None)
            setattr(mod, a, value)
        _applied = True
        log.debug("vllm-moonep: patched %s", ", ".join(f"{m}.{a}" for m, a in SEAMS))
        return [f"{m}.{a}" for m, a in SEAMS]


def _plugin_experts_class(base):
    class MoonEPExperts(base):
        """vllm-moonep's experts as vLLM's oracle builds them: ``impl`` from the plugin options."""

        def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None, **kw):
            kw.setdefault("impl", options_from_vllm_config().impl)
            super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers, **kw)

    MoonEPExperts.__module__ = base.__module__
    MoonEPExperts.__qualname__ = base.__qualname__
    return MoonEPExperts


def patched() -> bool:
    return _applied


def undo_patches() -> None:
    """Restore vLLM's originals (tests only)."""
    global _applied
    with _lock:
        if not _applied:
            return
        for (m, a), value in _originals.items():
            mod = importlib.import_module(m)
            if value is None:
                if hasattr(mod, a):
                    delattr(mod, a)
            else:
                setattr(mod, a, value)
        _originals.clear()
        _applied = False
