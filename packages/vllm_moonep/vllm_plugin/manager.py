"""The EP group's all2all manager vLLM builds with ``--all2all-backend moonep``, and its handle.

Importing this module imports vLLM (``MoonEPAll2AllManager`` subclasses vLLM's
``All2AllManagerBase``): ``seams.py`` imports it only after ``verify_seams`` has found vLLM 0.33's
classes, and nothing imports it at entry-point load.

    EP group built --> MoonEPAll2AllManager(cpu_group, device_group)   checks the worker (engine,
        |                                                              heap, kernel, graph guard)
        |  CUDA: vLLM's CudaCommunicator builds it; CPU and other platforms: init_model_parallel_group
        |  (wrapped) attaches it right after the group is made, replacing vLLM's fallback manager
    a layer's prepare/finalize --get_handle(kwargs)--> PluginBufferPool (one per buffer shape)
        --get(num_tokens)--> engine buffer; the first call logs the start-up line (``startup.py``)
    vLLM tears the group down --destroy()--> pools and buffers, then STATE.reset() (layouts, heap)
"""

from __future__ import annotations

import logging

from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache

from vllm_moonep.common.pool import MoonEPBufferPool
from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.faults.teardown import each
from vllm_moonep.vllm_plugin.checks import check_worker
from vllm_moonep.vllm_plugin.cudagraphs import check_worker_graphs, graphs_mode
from vllm_moonep.vllm_plugin.options import options_from_vllm_config
from vllm_moonep.vllm_plugin.startup import log_summary_once, worker_device
from vllm_moonep.vllm_plugin.state import LOAD, STATE
from vllm_moonep.vllm_plugin.weights import vllm_ep_group

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["MoonEPAll2AllManager", "PluginBufferPool", "attach_manager", "wrap_get_ep_all2all_manager",
           "wrap_init_model_parallel_group"]


class PluginBufferPool(MoonEPBufferPool):
    """The all2all handle: a ``MoonEPBufferPool`` that makes every capacity at its first step (vLLM's
    profiling run, whose memory profile then counts them before the KV cache is sized: made later, at
    each size's first step or graph capture, they would have to fit in what the KV cache left) and logs
    the start-up line then, when every layer's layout and the engine buffers exist."""

    def __init__(self, buffer_kwargs, max_tokens_per_rank: int, engine: str = "auto"):
        super().__init__(buffer_kwargs, max_tokens_per_rank, engine, make_all_at_first_use=True)

    def get(self, num_tokens: int):
        first = not self._made_all  # (a first get that failed midway says it at the one that completes)
        cap, buf = super().get(num_tokens)
        if first:
            heap = sum(int(getattr(b, "heap_bytes", 0) or 0) for b in self.buffers.values())
            caps = self.capacities
            say_once(f"vllm-moonep: the MoonEP buffer pool made all {len(caps)} of its capacities ({caps[0]} to "
                     f"{caps[-1]} tokens per rank; {heap / 2**20:.0f} MiB of symmetric heap on this rank) at its first "
                     "step, vLLM's profiling run, so that the memory profile counts them before the KV cache is "
                     "sized", log.name)
        log_summary_once(buf)
        return cap, buf


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
        if LOAD.worker_seams is not None:  # the step check before each of this worker's steps (seams.py)
            LOAD.worker_seams()
        self.handle_cache = Cache()
        self._pools: list = []

    def get_handle(self, kwargs):
        """The layer's buffer pool, one per buffer shape (vLLM passes the layer's sizes in ``kwargs``)."""
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
            pool = PluginBufferPool(dict(kw), max_tokens_per_rank=S, engine=opts.engine)
            self._pools.append(pool)
            return pool

        return self.handle_cache.get_or_create(dict(buffer_kwargs, S=S), make_pool)

    def destroy(self):
        """Free what this manager made: vLLM destroys it before the process group."""
        # the buffers, then the layouts, slot pools and heaps (collective, LIFO) go with it; each is
        # tried after an error
        try:
            with self.handle_cache._lock:
                pools, self._pools = self._pools, []
                self.handle_cache._cache.clear()
                each(lambda pool: pool.destroy(), pools, Exception)  # each pool tries every buffer too
        finally:
            STATE.reset()


def attach_manager(comm) -> bool:
    """Give a moonep EP communicator that has no MoonEP manager (CPU and other platforms) ours."""
    if comm is None or getattr(comm, "all2all_backend", None) != "moonep":
        return False
    old = getattr(comm, "all2all_manager", None)
    if getattr(old, "is_vllm_moonep", False):
        return False
    comm.all2all_manager = MoonEPAll2AllManager(comm.cpu_group, device_group=comm.device_group)
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


def wrap_init_model_parallel_group(orig):
    """vLLM's ``init_model_parallel_group``; for the moonep EP group, our manager is attached (and
    checks the worker) as soon as the group exists, before any weight is loaded."""

    def init_model_parallel_group(*args, **kwargs):
        group = orig(*args, **kwargs)
        comm = getattr(group, "device_communicator", None)
        if comm is not None and getattr(comm, "is_ep_communicator", False) and getattr(comm, "use_all2all", False):
            try:
                attach_manager(comm)
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


def wrap_get_ep_all2all_manager(orig):
    """vLLM's ``get_ep_all2all_manager``, after attaching our manager to a moonep EP group made
    another way than through ``init_model_parallel_group``."""

    def get_ep_all2all_manager(ep_group=None):
        if ep_group is None:
            ep_group = vllm_ep_group()
        attach_manager(ep_group.device_communicator)
        return orig(ep_group)

    get_ep_all2all_manager.__wrapped__ = orig
    get_ep_all2all_manager.__vllm_moonep__ = True
    return get_ep_all2all_manager
