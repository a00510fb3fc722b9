"""The worker's start-up line: what was resolved, and the per-rank expert memory.

Logged once per process at the first MoE step (vLLM's profiling run), when every layer's layout
and the first engine buffer exist (``manager.PluginBufferPool.get`` calls ``log_summary_once``):

    vllm-moonep: weight_layout=..., engine=... (why), transport=... (why), heap=... (why),
    kernel=... (impl=auto | requested), slots=..., token_padding=...; per-rank expert memory ...

It names what was resolved, not what was requested (``auto`` appears only as the reason). At the
same first step, with CUDA graphs kept, the worker's guard checks the transport the engine chose
(``cudagraphs.check_worker_graphs``). ``worker_device()``: the device this worker's tensors live on.

No vLLM import at module level.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from vllm_moonep.vllm_plugin.checks import resolve_heap, resolve_kernel
from vllm_moonep.vllm_plugin.cudagraphs import check_worker_graphs
from vllm_moonep.vllm_plugin.options import MoonEPOptions, options_from_vllm_config
from vllm_moonep.vllm_plugin.state import STATE

# under the "vllm" logger so the lines show in vLLM's own log format and level
log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["log_summary_once", "summary_line", "worker_device"]


def worker_device() -> torch.device:
    """This worker's device: the current CUDA device on a CUDA platform, else the CPU."""
    from vllm.platforms import current_platform

    from vllm_moonep.engine import current_cuda_device

    if current_platform.device_type == "cuda" and torch.cuda.is_available():
        return current_cuda_device()
    return torch.device("cpu")


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
    import vllm.envs as envs

    invariant = bool(envs.VLLM_BATCH_INVARIANT)
    kernels = Counter(resolve_kernel(opts.impl, device, getattr(lay, "dense_weights", True),
                                     (lay.hidden_size, lay.intermediate_size) if hasattr(lay, "hidden_size") else None,
                                     batch_invariant=invariant, token_padding=opts.token_padding)
                      for lay in STATE.built_layouts())
    if not kernels:
        kernels[resolve_kernel(opts.impl, device, batch_invariant=invariant, token_padding=opts.token_padding)] = 0
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


def log_summary_once(buffer=None) -> None:
    """At the first MoE step (``buffer``: its engine buffer): the worker's graph guard against the
    transport the engine chose, then the start-up line, once per process."""
    if STATE.summary_logged:
        return
    if STATE.worker and buffer is not None:  # the first step: the transport the engine chose is known
        check_worker_graphs(STATE.worker.get("cudagraphs"), getattr(getattr(buffer, "device", None), "type", None),
                            transport=getattr(buffer, "transport_name", None))
    STATE.summary_logged = True
    STATE.last_summary = summary_line(buffer=buffer)
    log.info(STATE.last_summary)
