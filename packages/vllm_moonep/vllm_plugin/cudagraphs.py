"""CUDA graphs with ``--all2all-backend moonep``: kept where the MoE step is graph-safe.

vLLM 0.33's ``VllmConfig.__post_init__`` sets ``compilation_config.cudagraph_mode = NONE`` whenever
``all2all_backend == "moonep"`` and ``parallel_config.use_all2all`` ("MoonEP: Disabling CUDA
Graphs since the MoonEP integration is currently eager-only"): its proof of concept is eager-only.
The built-in engine's step on GPUs of one node (symmetric transport, Triton kernels) has no host
synchronization and no allocation that outlives it, and a whole step is captured and replayed in
``tests/distributed/test_graph_step.py``. There the plugin undoes vLLM's switch and vLLM keeps the
graphs it would have chosen for any graph-capable all2all backend.

``graph_rule(opts, parallel_config)`` says whether the step is graph-safe, and why not:

- ``cuda_graphs='off'`` (option or ``VLLM_MOONEP_CUDA_GRAPHS``): the user keeps eager;
- the engine must be the built-in one: ``engine='moonep'``, or ``engine='auto'`` where the real
  ``moonep`` may be taken (``VLLM_MOONEP_ALLOW_MULTICAST=1`` and it is installed), keep eager;
- the transport must resolve to ``symmetric`` on CUDA: ``transport='collective'`` or ``'hybrid'``
  keeps eager (host-sized collectives), so does ``VLLM_MOONEP_RANKS_PER_NODE`` when it splits the
  EP group into several simulated nodes (or is no positive integer; equal to the EP group's size
  it is one node, symmetric, and keeps the graphs),
  and so does any placement where EP ranks may sit on several nodes
  (``--nnodes`` > 1, ``--data-parallel-size-local`` below ``--data-parallel-size``: other hosts,
  external or hybrid load balancing, Ray's ``span``; the Ray DP backend; an executor other than
  ``mp``/``uni``, which may place workers anywhere);
- what the engine's graph test does not cover keeps eager: ``step_log_interval`` > 0 (reads the
  plan on the host), ``impl`` other than ``auto``/``triton`` (``reference`` reads ``cu_seqlens`` on
  the host; ``grouped_mm`` is untested under capture), the symmetric layout on a heap other than
  ``auto``/``torch``, a shared slot pool.

``--enforce-eager`` (or ``-cc.cudagraph_mode=NONE``) needs nothing: vLLM has set ``NONE`` before
its moonep switch and there is nothing to undo.

How (the seams, verified at load in ``seams.verify_graph_seams``): in 0.33 the switch is the only
write of ``cudagraph_mode`` between ``VllmConfig._set_compile_ranges()`` and
``CompilationConfig.set_splitting_ops_for_v1(...)``, both called once, in that order, from
``__post_init__``. ``hook_set_compile_ranges`` notes the mode right before the switch and
decides; ``hook_set_splitting_ops`` puts the noted mode back right after it, so the rest of
``__post_init__`` (splitting ops, checks) runs as for a graph-capable backend. The capture sizes
were computed before the switch and are left as vLLM made them. Either way one INFO line says what
was decided (``MoonEP: CUDA graphs kept (symmetric transport, one node): ...`` or ``... stay
off ...``), once per process.

``check_worker_graphs`` is the worker's guard: with graphs kept, a worker that resolves another
engine or transport than the rule assumed stops at start-up instead of capturing a step that
synchronizes the host.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from vllm_moonep.engine import MoonEPUnavailableError
from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.nodes import RANKS_PER_NODE_ENV, parse_ranks_per_node
from vllm_moonep.vllm_plugin.checks import moonep_inactive_reason
from vllm_moonep.vllm_plugin.options import MoonEPOptions, MoonEPOptionsError, options_from_vllm_config
from vllm_moonep.vllm_plugin.state import LOAD

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["GRAPH_SAFE", "check_worker_graphs", "ep_group_size", "graph_rule", "graphs_mode",
           "hook_set_compile_ranges", "hook_set_splitting_ops", "one_node", "simulated_split"]

#: what the rule says when it keeps the graphs
GRAPH_SAFE = "symmetric transport, one node"

#: executors that place every worker of a DP replica on this host (with --nnodes 1)
_LOCAL_EXECUTORS = (None, "mp", "uni")


def _say_once(msg: str) -> None:
    say_once(msg, log.name)


# ------------------------------------------------------------------------------------ the rule
def one_node(parallel_config) -> str | None:
    """``None`` when every EP rank of this vLLM run is on this host, else why they may not be."""
    pc = parallel_config
    if pc.nnodes > 1:
        return f"--nnodes {pc.nnodes}"
    if pc.data_parallel_size_local != pc.data_parallel_size:
        return (f"{pc.data_parallel_size_local} of --data-parallel-size {pc.data_parallel_size} DP ranks run on this "
                "host (the others on other hosts, or placed by an external load balancer)")
    if pc.data_parallel_backend != "mp":
        return f"--data-parallel-backend {pc.data_parallel_backend} may place DP ranks on other nodes"
    backend = pc.distributed_executor_backend
    if backend not in _LOCAL_EXECUTORS:
        return f"--distributed-executor-backend {getattr(backend, '__name__', backend)!r} may place workers on other nodes"
    return None


def ep_group_size(parallel_config) -> int:
    """Ranks of vLLM's EP group: data parallel x prefill context parallel x tensor parallel (as
    ``vllm.distributed.parallel_state`` builds it)."""
    pc = parallel_config
    return (int(pc.data_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
            * int(pc.tensor_parallel_size))


def simulated_split(parallel_config) -> str | None:
    """Why ``VLLM_MOONEP_RANKS_PER_NODE`` keeps eager, or ``None`` where it does not: unset, or equal
    to the EP group's size (one simulated node: every peer addressable, the symmetric transport)."""
    raw = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not raw:
        return None
    k = parse_ranks_per_node(raw)
    size = ep_group_size(parallel_config)
    if k == size:
        return None
    if k < 0:
        return f"{RANKS_PER_NODE_ENV}={raw!r} is no positive integer (the engine refuses it)"
    return (f"{RANKS_PER_NODE_ENV}={k} splits the {size} EP ranks into simulated nodes: the transport is then hybrid "
            "or collective, sized on the host")


def _real_moonep_possible() -> bool:
    """Whether ``engine='auto'`` may take the real ``moonep`` on the workers (without importing it here)."""
    from vllm_moonep.engine.multicast import multicast_opted_in

    return multicast_opted_in() and importlib.util.find_spec("moonep") is not None


def graph_rule(opts: MoonEPOptions, parallel_config) -> tuple[bool, str]:
    """``(keep, why)``: whether vLLM may keep CUDA graphs for this moonep run (see the module doc)."""
    from vllm_moonep.engine.multicast import OPT_IN_VAR

    if opts.cuda_graphs == "off":
        return False, f"moonep option cuda_graphs='off' ({opts.source('cuda_graphs')})"
    if opts.engine == "moonep":
        return False, "engine='moonep': the real moonep's kernels are not known to be capturable"
    if opts.engine == "auto" and _real_moonep_possible():
        return False, (f"engine='auto' may take the real moonep ({OPT_IN_VAR}=1 and it is installed), whose kernels "
                       "are not known to be capturable; engine='builtin' keeps the graphs")
    if opts.transport in ("collective", "hybrid"):
        return False, f"transport={opts.transport!r}: its collectives are sized on the host every step"
    where = one_node(parallel_config)
    if where is not None:
        return False, (f"EP ranks may span nodes ({where}): the transport is then hybrid or collective, sized on the "
                       "host")
    split = simulated_split(parallel_config)
    if split is not None:
        return False, split
    if opts.step_log_interval:
        return False, f"step_log_interval={opts.step_log_interval} reads the plan on the host"
    if opts.impl not in ("auto", "triton"):
        return False, (f"impl={opts.impl!r}: only the Triton kernels (impl='auto' or 'triton') are captured by the "
                       "engine's graph test")
    if opts.weight_layout == "symmetric" and opts.heap not in ("auto", "torch"):
        return False, f"heap={opts.heap!r}: only the torch heap is captured by the engine's graph test"
    if opts.shared_slot_pool:
        return False, "shared_slot_pool: a shared slot pool is not captured by the engine's graph test yet"
    return True, GRAPH_SAFE


# ------------------------------------------------------------------------------------ the hooks
@dataclass
class _Noted:
    """What ``_set_compile_ranges`` noted for the ``set_splitting_ops_for_v1`` call that follows it."""

    compilation_config: Any
    mode: Any  # cudagraph_mode right before vLLM's moonep switch
    keep: bool
    why: str


_pending = threading.local()


def _note(vllm_config) -> _Noted | None:
    """The decision for a config vLLM is about to switch to eager for moonep (``None``: it will not)."""
    from vllm.config.compilation import CUDAGraphMode

    pc, cc = vllm_config.parallel_config, vllm_config.compilation_config
    if pc.all2all_backend != "moonep" or not pc.use_all2all or cc.cudagraph_mode == CUDAGraphMode.NONE:
        return None  # vLLM switches nothing off
    if not LOAD.applied or moonep_inactive_reason(vllm_config) is not None:
        return None  # our classes do not run: vLLM's choice stands
    try:
        opts = options_from_vllm_config(vllm_config)
    except MoonEPOptionsError:
        return None  # the front-end check raises it when the config is made
    keep, why = graph_rule(opts, pc)
    return _Noted(cc, cc.cudagraph_mode, keep, why)


def hook_set_compile_ranges(orig):
    """vLLM's ``VllmConfig._set_compile_ranges``, then the note of the mode its moonep switch meets."""

    @functools.wraps(orig)
    def _set_compile_ranges(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        _pending.noted = None
        try:
            _pending.noted = _note(self)
        except Exception as exc:  # never break vLLM's config: its own choice (eager) then stands
            say_once(f"vllm-moonep: the CUDA-graph rule failed ({type(exc).__name__}: {exc}); vLLM's switch to "
                     "eager for moonep stands", log.name, logging.WARNING)
        return out

    _set_compile_ranges.__vllm_moonep__ = True
    return _set_compile_ranges


def hook_set_splitting_ops(orig):
    """vLLM's ``CompilationConfig.set_splitting_ops_for_v1``, after putting back the mode vLLM's
    moonep switch set to ``NONE`` when the rule keeps the graphs."""

    @functools.wraps(orig)
    def set_splitting_ops_for_v1(self, *args, **kwargs):
        noted = getattr(_pending, "noted", None)
        _pending.noted = None
        if noted is None or noted.compilation_config is not self:
            return orig(self, *args, **kwargs)
        if not noted.keep:
            out = orig(self, *args, **kwargs)
            _say_once(f"MoonEP: CUDA graphs stay off as vLLM 0.33 sets for --all2all-backend moonep: {noted.why}")
            return out
        if getattr(self.cudagraph_mode, "name", None) == "NONE":  # vLLM's moonep switch: undo it
            self.cudagraph_mode = noted.mode
        out = orig(self, *args, **kwargs)
        sizes = list(self.cudagraph_capture_sizes or [])
        _say_once(
            f"MoonEP: CUDA graphs kept ({noted.why}): cudagraph_mode={self.cudagraph_mode.name}, "
            f"{len(sizes)} capture sizes up to {max(sizes, default=0)}; vLLM's 'Disabling CUDA Graphs' above is undone "
            "by vllm-moonep, whose built-in engine runs the step without host synchronization (moonep option "
            "cuda_graphs='off' or VLLM_MOONEP_CUDA_GRAPHS=off keeps eager)"
        )
        return out

    set_splitting_ops_for_v1.__vllm_moonep__ = True
    return set_splitting_ops_for_v1


# ------------------------------------------------------------------------------------ the worker's guard
def graphs_mode(vllm_config) -> str | None:
    """The CUDA-graph mode ``vllm_config`` runs with (``None``: eager, or no config)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    name = getattr(mode, "name", None)
    return None if name in (None, "NONE") else name


def check_worker_graphs(cudagraphs: str | None, device_type: str | None, *, engine: str | None = None,
                        transport: str | None = None) -> None:
    """Raise ``MoonEPUnavailableError`` when vLLM captures CUDA graphs (``cudagraphs``: the mode)
    but this worker resolved an engine or transport whose step synchronizes the host."""
    if cudagraphs is None or device_type != "cuda":
        return
    bad = None
    if engine is not None and engine != "builtin":
        bad = f"the {engine!r} engine"
    elif transport is not None and transport != "symmetric":
        bad = f"transport={transport!r} (some EP peer is not addressable from this worker)"
    if bad is not None:
        raise MoonEPUnavailableError(
            f"vLLM captures CUDA graphs (cudagraph_mode={cudagraphs}) because vllm-moonep judged the MoE step "
            f"graph-safe ({GRAPH_SAFE}), but this worker runs {bad}, whose step synchronizes the host; set moonep "
            "option cuda_graphs='off' (or VLLM_MOONEP_CUDA_GRAPHS=off), or --enforce-eager"
        )
