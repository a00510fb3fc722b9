"""What the plugin puts in vLLM's place on the workers (``seams.py`` rebinds vLLM's names to these).

- ``MoonEPAll2AllManager``: the EP group's all2all manager; checks what only a worker can know
  (engine, heap, kernel: ``checks.check_worker``; with CUDA graphs kept, that the engine and, at
  the first step, the transport are the graph-safe ones: ``cudagraphs.check_worker_graphs``) when
  it is built, that is when the EP group is built, before weights load. On CUDA vLLM's
  ``CudaCommunicator`` builds it; on platforms whose communicator has none (CPU) it is attached
  right after the EP group is made.
- ``PluginBufferPool``: its handle; logs the start-up line at the first MoE step.
- ``build_weight_layout``: the layer's replicated or symmetric layout after loading, added to
  the process's ``LayoutSet`` (``vllm_moonep.layouts``).
- ``MoonEPExperts`` / ``MoonEPPrepareAndFinalize``: ``vllm_moonep.common.vllm_modular``'s classes
  with the plugin's ``impl`` and the optional per-step log (``step_log_interval``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import torch

from vllm_moonep.engine import MoonEPStateError
from vllm_moonep.engine.teardown import each
from vllm_moonep.vllm_plugin.checks import check_worker, resolve_heap, resolve_kernel
from vllm_moonep.vllm_plugin.cudagraphs import check_worker_graphs, graphs_mode
from vllm_moonep.vllm_plugin.options import MoonEPOptions, options_from_vllm_config

if TYPE_CHECKING:  # the layouts are imported when the first layer is built
    from vllm_moonep.layouts import LayoutSet

# under the "vllm" logger so the lines show in vLLM's own log format and level
log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["STATE", "StepStats", "build_weight_layout", "summary_line", "worker_device"]


# ------------------------------------------------------------------------------------ state
class StepStats:
    """Slot use and row balance of the MoE steps, logged every ``interval`` steps (EP rank 0).

    A step is counted when the first MoE layer's prepare runs; every layer's prepare adds its
    plan: slots used (all ranks), and max/mean rows per rank without the plan (all rows of each
    rank's home experts), with it (real rows) and padded. Reading the plan costs one host
    synchronization per layer on GPU, which is why this is off by default."""

    def __init__(self):
        self.steps = 0
        self.first_step = 1
        self.last: dict | None = None  # the last logged window, for tests and scrapers
        self._reset()

    def _reset(self):
        self.calls = 0
        self.used = 0
        self.total = 0
        self.ratios = {"without plan": [], "with plan": [], "padded": []}

    @staticmethod
    def _ratio(x: torch.Tensor) -> float:
        x = x.double()
        m = x.mean()
        return float(x.max() / m) if m > 0 else 1.0

    def record(self, layer_index: int, plan, interval: int, rank: int) -> None:
        if layer_index == 0:
            if self.steps and self.steps % interval == 0:
                self.emit(rank)
            self.steps += 1
        etc = plan.experts_to_copy
        R = int(etc.shape[0])
        self.calls += 1
        self.used += int((etc >= 0).sum())
        self.total += int(etc.numel())
        gp = getattr(plan, "global_plan", None)
        if gp is not None:
            self.ratios["without plan"].append(self._ratio(gp.tpe.sum(0).view(R, -1).sum(1)))
            self.ratios["with plan"].append(self._ratio(gp.seg_len.sum(1)))
            self.ratios["padded"].append(self._ratio(gp.cu_seqlens[:, -1]))

    def emit(self, rank: int) -> None:
        if self.calls == 0:
            return
        per_call = self.total / self.calls
        summary = {
            "steps": (self.first_step, self.steps), "layer_calls": self.calls,
            "slots_used_mean": self.used / self.calls, "slots_per_call": per_call,
            **{k: (sum(v) / len(v), max(v)) for k, v in self.ratios.items() if v},
        }
        self.last = summary
        if rank == 0:
            rows = ", ".join(f"{k} {m:.2f} (worst {w:.2f})" for k, (m, w) in
                             ((k, summary[k]) for k in self.ratios if k in summary))
            log.info(
                "vllm-moonep steps %d-%d (%d MoE layer calls): slots used %.1f of %d per layer and step (all EP ranks); "
                "rows per rank, max/mean: %s", self.first_step, self.steps, self.calls, summary["slots_used_mean"],
                int(per_call), rows or "n/a (the engine exposes no plan tables)",
            )
        self.first_step = self.steps + 1
        self._reset()


class _PluginState:
    """Per-process objects shared by every MoE layer: the ``LayoutSet`` (the layers' layouts, their
    heap and shared slot pool), made at the first layer."""

    def __init__(self):
        self.layouts: LayoutSet | None = None
        self.summary_logged = False
        self.last_summary = ""
        self.worker: dict | None = None  # what check_worker resolved on this worker
        self.num_pf = 0
        self.stats = StepStats()

    def reset(self) -> None:
        try:
            if self.layouts is not None:
                self.layouts.destroy()  # layouts and slot pools newest first, then the heap (collective)
        finally:
            self.__init__()  # type: ignore[misc]  # reset in place: other modules hold STATE itself

    def built_layouts(self) -> list:
        """The layouts built so far in this process (in layer order)."""
        return self.layouts.layouts if self.layouts is not None else []


STATE = _PluginState()


def _ep_group():
    from vllm.distributed import get_ep_group

    return get_ep_group()


def worker_device() -> torch.device:
    """This worker's device: the current CUDA device on a CUDA platform, else the CPU."""
    from vllm.platforms import current_platform

    from vllm_moonep.engine import current_cuda_device

    if current_platform.device_type == "cuda" and torch.cuda.is_available():
        return current_cuda_device()
    return torch.device("cpu")


# ------------------------------------------------------------------------------------ start-up line
def _transport_text(opts: MoonEPOptions, engine: str, device: torch.device, buffer=None) -> str:
    """The transport part of the start-up line. With a ``buffer``: what the built-in engine chose.
    Before one exists, ``auto`` on CUDA is resolved from the symmetric layout's heap when there is
    one: every peer addressable -> symmetric; else from the heap's ``nodes`` (simulated nodes from
    ``VLLM_MOONEP_RANKS_PER_NODE``: hybrid when some node holds several ranks, as the buffer will
    pick); else, nodes unknown (peers on other real hosts), "hybrid or collective", which only the
    buffer's all-gathered hosts decide. (No test covers the pre-buffer CUDA path: CI's start-up line
    runs on CPU ranks, where auto is collective.)"""
    from vllm_moonep.engine import resolve_transport

    if engine != "builtin":
        return f"transport=the {engine} engine's own"
    chosen = getattr(buffer, "transport_name", None)
    if chosen is not None:  # what the built-in engine picked (it knows whether every peer is on this host)
        why = resolve_transport(opts.transport, device.type, peers_addressable=chosen == "symmetric",
                                nodes=getattr(buffer, "nodes", None))[1]
        return f"transport={chosen} ({'auto: ' if opts.transport == 'auto' else ''}{why})"
    if opts.transport == "auto" and device.type == "cuda":
        heap = STATE.layouts.heap if STATE.layouts is not None else None
        if heap is None:  # addressability is known only to a heap
            return ("transport=symmetric if every EP peer is a GPU of this node, else hybrid (several ranks on a "
                    "node) or collective (auto)")
        nodes = getattr(heap, "nodes", None)
        if heap.peers_addressable:
            name, why = resolve_transport("auto", "cuda", True)
        elif nodes is not None and nodes.num_nodes > 1:  # the heap's nodes (simulated ones): the buffer's too
            name, why = resolve_transport("auto", "cuda", nodes=nodes)
        else:
            return ("transport=hybrid (several EP ranks on a node) or collective (every rank alone on its node) "
                    "(auto: some EP peers are not addressable from this heap)")
    else:
        name, why = resolve_transport(opts.transport, device.type)
    return f"transport={name} ({'auto: ' if opts.transport == 'auto' else ''}{why})"


def _kernel_text(opts: MoonEPOptions, device: torch.device) -> str:
    kernels = Counter(resolve_kernel(opts.impl, device, getattr(lay, "dense_weights", True),
                                     (lay.hidden_size, lay.intermediate_size) if hasattr(lay, "hidden_size") else None)
                      for lay in STATE.built_layouts())
    if not kernels:
        kernels[resolve_kernel(opts.impl, device)] = 0
    src = "requested" if opts.impl != "auto" else "impl=auto"
    if len(kernels) == 1:
        return f"kernel={next(iter(kernels))} ({src})"
    return "kernel=" + ", ".join(f"{k} on {n} layer(s)" for k, n in kernels.most_common()) + f" ({src})"


def summary_line(opts: MoonEPOptions | None = None, buffer=None) -> str:
    """The start-up line: what was resolved (layout, engine, transport, heap, kernel, slots) and
    the per-rank expert memory of the layers built so far. ``buffer``: the first engine buffer
    (its transport is the one chosen)."""
    from vllm_moonep.common.memory import MemoryReport
    from vllm_moonep.engine import resolve_engine

    opts = opts or options_from_vllm_config()
    engine, why = STATE.worker["engine"] if STATE.worker else resolve_engine(opts.engine)
    device = (STATE.layouts.device if STATE.layouts is not None else None) or worker_device()
    rep = STATE.layouts.memory_report() if STATE.layouts is not None else MemoryReport()
    gib = 1024.0**3
    slots = f"{opts.num_prefetch_slots} " + ("(one pool shared by all layers)" if opts.shared_slot_pool else "per layer")
    heap = ""
    if opts.weight_layout == "symmetric":
        kind, hwhy = resolve_heap(opts, device)
        heap = f", heap={kind} ({hwhy})"
    return (
        f"vllm-moonep: weight_layout={opts.weight_layout}, engine={engine} ({why}), "
        f"{_transport_text(opts, engine, device, buffer)}{heap}, {_kernel_text(opts, device)}, slots={slots}, "
        f"token_padding={opts.token_padding}; per-rank expert memory {rep.resident / gib:.3f} GiB "
        f"resident over {len(STATE.built_layouts())} MoE layer(s) (home {rep.home_rows / gib:.3f}, replicated "
        f"{rep.replicated_rows / gib:.3f}, slots {rep.slots / gib:.3f}; load-time transient {rep.transient / gib:.3f})"
    )


def _log_summary_once(buffer=None) -> None:
    if STATE.summary_logged:
        return
    if STATE.worker and buffer is not None:  # the first step: the transport the engine chose is known
        check_worker_graphs(STATE.worker.get("cudagraphs"), getattr(getattr(buffer, "device", None), "type", None),
                            transport=getattr(buffer, "transport_name", None))
    STATE.summary_logged = True
    STATE.last_summary = summary_line(buffer=buffer)
    log.info(STATE.last_summary)


# ------------------------------------------------------------------------------------ our objects
def make_pool_class():
    from vllm_moonep.common.pool import MoonEPBufferPool

    class PluginBufferPool(MoonEPBufferPool):
        """The all2all handle: a ``MoonEPBufferPool`` that logs the start-up line at its first step
        (vLLM's profiling run), when every layer's layout and the first engine buffer exist."""

        def get(self, num_tokens: int):
            cap, buf = super().get(num_tokens)
            _log_summary_once(buf)
            return cap, buf

    return PluginBufferPool


def make_manager_class():
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache

    pool_cls = make_pool_class()

    class MoonEPAll2AllManager(All2AllManagerBase):
        """vllm-moonep's all2all manager: its handle is our ``MoonEPBufferPool`` on the engine the
        options select (built-in, or the real ``moonep`` where usable). No NVLink multicast.

        Built with the EP group: it checks there (before weights load) that the engine, the heap
        and the expert kernel the options ask for can run on this worker."""

        is_vllm_moonep = True

        def __init__(self, cpu_group, tcp_store_group=None, device_group=None, **_extra):
            super().__init__(cpu_group, tcp_store_group)
            self._device_group = device_group
            self.options = options_from_vllm_config()
            self.device = worker_device()
            resolved = check_worker(self.options, self.device)
            self.engine, self.engine_reason = resolved["engine"]
            resolved["cudagraphs"] = graphs_mode(get_current_vllm_config_or_none())
            check_worker_graphs(resolved["cudagraphs"], self.device.type, engine=self.engine)
            STATE.worker = resolved
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
                # vLLM's platform decides (a CPU platform beside visible GPUs keeps tensors on the
                # CPU); the real moonep's Buffer takes no device and make_buffer drops it there
                device=self.device,
            )
            if self.engine == "builtin":  # the real moonep's Buffer has no transport choice
                buffer_kwargs["transport"] = opts.transport

            def make_pool(**kw):
                pool = pool_cls(dict(kw), max_tokens_per_rank=S, engine=opts.engine)
                self._pools.append(pool)
                return pool

            return self.handle_cache.get_or_create(dict(buffer_kwargs, S=S), make_pool)

        def destroy(self):
            # vLLM destroys the all2all manager before the process group: the buffers, then the
            # layouts, slot pools and heaps (collective, LIFO) go with it; each is tried after an error
            try:
                with self.handle_cache._lock:
                    pools, self._pools = self._pools, []
                    self.handle_cache._cache.clear()
                    each(lambda pool: pool.destroy(), pools, Exception)  # each pool tries every buffer too
            finally:
                STATE.reset()

    return MoonEPAll2AllManager


def attach_manager(comm, manager_cls) -> bool:
    """Give a moonep EP communicator that has no MoonEP manager (CPU and other platforms) ours."""
    if comm is None or getattr(comm, "all2all_backend", None) != "moonep":
        return False
    old = getattr(comm, "all2all_manager", None)
    if getattr(old, "is_vllm_moonep", False):
        return False
    comm.all2all_manager = manager_cls(comm.cpu_group, device_group=comm.device_group)
    log.info(
        "vllm-moonep: vLLM's %s has no MoonEP all2all manager%s; vllm-moonep attached its MoonEPAll2AllManager "
        "to the EP group, so MoE dispatch and combine run on MoonEP (engine=%s)", type(comm).__name__,
        f" and built {type(old).__name__} (the 'Falling back to allgather_reducescatter' line above); that fallback "
        "is replaced" if old is not None else "", comm.all2all_manager.engine,
    )
    if old is not None and hasattr(old, "destroy"):
        try:
            old.destroy()
        except Exception:  # pragma: no cover - the fallback manager holds nothing of ours
            log.debug("vllm-moonep: destroying %s failed", type(old).__name__, exc_info=True)
    return True


def wrap_init_model_parallel_group(orig, manager_cls):
    """vLLM's ``init_model_parallel_group``; for the moonep EP group, our manager is attached (and
    checks the worker) as soon as the group exists, before any weight is loaded."""

    def init_model_parallel_group(*args, **kwargs):
        group = orig(*args, **kwargs)
        comm = getattr(group, "device_communicator", None)
        if comm is not None and getattr(comm, "is_ep_communicator", False) and getattr(comm, "use_all2all", False):
            try:
                attach_manager(comm, manager_cls)
            except BaseException:
                try:
                    group.destroy()
                except Exception:  # pragma: no cover
                    pass
                raise
        return group

    init_model_parallel_group.__wrapped__ = orig
    init_model_parallel_group.__vllm_moonep__ = True
    return init_model_parallel_group


def wrap_get_ep_all2all_manager(orig, manager_cls):
    def get_ep_all2all_manager(ep_group=None):
        if ep_group is None:
            ep_group = _ep_group()
        # normally attached when the EP group was made; this covers groups made another way
        attach_manager(ep_group.device_communicator, manager_cls)
        return orig(ep_group)

    get_ep_all2all_manager.__wrapped__ = orig
    get_ep_all2all_manager.__vllm_moonep__ = True
    return get_ep_all2all_manager


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
    The layout joins the process's ``LayoutSet`` (made at the first layer from the options), which
    makes the heap and the shared slot pool once and frees everything in order on ``STATE.reset``.
    """
    from vllm_moonep.layouts import layout_kind

    opts = options_from_vllm_config()
    if STATE.layouts is None:
        STATE.layouts = _layout_set(opts, num_global_experts, w13_local.device)
    layouts = STATE.layouts
    if layouts.kind != layout_kind(opts.weight_layout, opts.shared_slot_pool) or layouts.num_slots != opts.num_prefetch_slots:
        raise MoonEPStateError(
            f"vllm-moonep: this process's layouts are {layouts.kind} with B={layouts.num_slots}; a layer now asks for "
            f"weight_layout={opts.weight_layout} (shared_slot_pool={opts.shared_slot_pool}) with "
            f"B={opts.num_prefetch_slots}: destroy the EP group's all2all manager before building another model")
    layout = layouts.add_layer(w13_local, w2_local, num_global_experts)
    if layouts.symmetric:  # vLLM rebinds the parameters to these: a no-op (they were adopted onto the heap)
        layout.full_gate_weight = w13_local.data
        layout.full_down_weight = w2_local.data
    log.debug("vllm-moonep: built %r", layout)
    return layout


def _layout_set(opts: MoonEPOptions, num_experts: int, device: torch.device) -> LayoutSet:
    """The process's ``LayoutSet``: replicated layers all-gather over the EP device group and report
    no local copy (vLLM rebinds its parameters to the ``[E+B]`` tensors); symmetric layers adopt the
    parameters onto a heap over the group its kind needs."""
    from vllm_moonep.layouts import LayoutSet, layout_kind

    kind = layout_kind(opts.weight_layout, opts.shared_slot_pool)
    if kind == "replicated":
        return LayoutSet(kind, num_experts, opts.num_prefetch_slots, _ep_group().device_group,
                         keeps_local_params=False)
    heap_kind, group = _group_for_heap(opts.heap, device)
    return LayoutSet(kind, num_experts, opts.num_prefetch_slots, group, heap_kind=heap_kind, adopt_parameters=True)


def plugin_experts_class(base):
    class MoonEPExperts(base):
        """vllm-moonep's experts as vLLM's oracle builds them: ``impl`` from the plugin options."""

        def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None, **kw):
            kw.setdefault("impl", options_from_vllm_config().impl)
            super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers, **kw)

    MoonEPExperts.__module__ = base.__module__
    MoonEPExperts.__qualname__ = base.__qualname__
    return MoonEPExperts


def plugin_pf_class(base):
    class MoonEPPrepareAndFinalize(base):
        """vllm-moonep's prepare/finalize as vLLM builds it, with the optional per-step log."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self._log_interval = options_from_vllm_config().step_log_interval
            self._layer_index = STATE.num_pf
            STATE.num_pf += 1

        def prepare(self, *args, **kw):
            out = super().prepare(*args, **kw)
            if self._log_interval:
                st = self._state
                STATE.stats.record(self._layer_index, st.plan, self._log_interval, getattr(st.buffer, "rank", 0))
            return out

    MoonEPPrepareAndFinalize.__module__ = base.__module__
    MoonEPPrepareAndFinalize.__qualname__ = base.__qualname__
    return MoonEPPrepareAndFinalize
