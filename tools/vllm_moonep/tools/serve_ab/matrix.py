"""The configurations of the serving A/B: five EP backends, each eager and with vLLM's CUDA graphs.

    BACKENDS x MODES --matrix()--> [Config]  --engine_argv()--> the `vllm serve` arguments of each

Every configuration runs DP=2, EP=2 (``--data-parallel-size 2 --enable-expert-parallel``), one GPU
per DP rank, behind one API server (``--api-server-count 1``: vLLM's stat logger, and its CUDA-graph
table, then sees both engines). vLLM's own backends run with ``VLLM_MOONEP_PLUGIN=0`` (vLLM as a user
runs it today); the moonep ones with the plugin and the layout in ``--additional-config``'s
``moonep`` block (``vllm_plugin/options.py``).

``naive``: vLLM 0.33 removed it; ``ParallelConfig.__post_init__`` (vllm/config/parallel.py) logs
"The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'." and runs
``AgRsAll2AllManager``. Its row is therefore a second, independent run of the reference backend: the
run-to-run spread of vLLM's own EP path, the noise floor the moonep rows are judged against.

A graphs configuration of moonep that the plugin's own graph rule (``cudagraphs.graph_rule``) calls
not graph-safe (the shared slot pool) is a row that says why, not a run: vLLM would run it eager,
the same as its eager row.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any

__all__ = ["BACKENDS", "DP", "MODES", "Backend", "Config", "config_names", "engine_argv", "matrix", "select"]

#: data-parallel size = EP size (one GPU per DP rank)
DP = 2
MODES = ("graphs", "eager")
#: what a row's backend is for in the comparison
ROLES = ("reference", "noise_floor", "candidate")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    all2all: str  # --all2all-backend
    moonep: dict[str, Any] | None  # the --additional-config moonep block (None: not moonep)
    plugin: bool  # the moonep plugin loaded (VLLM_MOONEP_PLUGIN unset) or not (=0)
    role: str


BACKENDS = (
    Backend("allgather_reducescatter", "allgather_reducescatter", None, False, "reference"),
    Backend("naive", "naive", None, False, "noise_floor"),
    Backend("moonep-replicated", "moonep", {"weight_layout": "replicated"}, True, "candidate"),
    Backend("moonep-symmetric", "moonep", {"weight_layout": "symmetric"}, True, "candidate"),
    Backend("moonep-symmetric-shared", "moonep", {"weight_layout": "symmetric", "shared_slot_pool": True}, True,
            "candidate"),
)
REFERENCE = next(b.name for b in BACKENDS if b.role == "reference")
NOISE_FLOOR = next(b.name for b in BACKENDS if b.role == "noise_floor")


@dataclasses.dataclass(frozen=True)
class Config:
    backend: Backend
    mode: str  # graphs | eager
    moonep: dict[str, Any] | None  # the block as passed (with --slots)
    not_applicable: str | None = None  # why this configuration is a row without a run

    @property
    def name(self) -> str:
        return f"{self.backend.name}-{self.mode}"


def _one_node_dp() -> Any:
    """The parallel config the graph rule reads, as these runs make it: one host, every DP rank local,
    the mp DP backend, vLLM's default executor."""
    return types.SimpleNamespace(nnodes=1, data_parallel_size=DP, data_parallel_size_local=DP,
                                 data_parallel_backend="mp", distributed_executor_backend=None,
                                 tensor_parallel_size=1, prefill_context_parallel_size=1)


def graphs_not_allowed(block: dict[str, Any] | None) -> str | None:
    """Why the plugin keeps a moonep configuration eager under CUDA graphs (None: it keeps the graphs);
    the plugin's own rule on these runs' placement, with the environment of this process."""
    if block is None:
        return None
    from vllm_moonep.vllm_plugin.cudagraphs import graph_rule
    from vllm_moonep.vllm_plugin.options import parse_options

    keep, why = graph_rule(parse_options({"moonep": block}), _one_node_dp())
    return None if keep else f"the plugin keeps this configuration eager ({why})"


def matrix(backends: tuple[Backend, ...] = BACKENDS, modes: tuple[str, ...] = MODES,
           slots: int | None = None) -> list[Config]:
    """Every (mode, backend), graphs first (each mode's reference first); ``slots`` sets
    ``num_prefetch_slots`` of every moonep block (None: the plugin's default)."""
    out = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        for b in backends:
            block = None if b.moonep is None else {**b.moonep, **({"num_prefetch_slots": slots} if slots else {})}
            why = graphs_not_allowed(block) if mode == "graphs" else None
            out.append(Config(b, mode, block, why))
    return out


def config_names() -> list[str]:
    return [f"{b.name}-{m}" for m in MODES for b in BACKENDS]


def select(configs: list[Config], names: list[str] | None) -> list[Config]:
    """``configs`` in the order of ``names`` (None or ``all``: all, in matrix order); a backend name
    alone selects both its modes. Unknown names raise ValueError listing the valid ones."""
    if not names or names == ["all"]:
        return list(configs)
    by = {c.name: c for c in configs}
    picked: list[Config] = []
    for n in names:
        hits = [by[n]] if n in by else [c for c in configs if c.backend.name == n]
        if not hits:
            raise ValueError(f"unknown configuration {n!r}; valid: {', '.join(by)} (or a backend name: "
                             f"{', '.join(dict.fromkeys(c.backend.name for c in configs))}, or all)")
        picked += [c for c in hits if c not in picked]
    return picked


def engine_argv(cfg: Config, model_dir: str, *, max_model_len: int, max_num_seqs: int, gpu_mem: float, seed: int,
                attention_backend: str, compile_mode: str, graph_mode: str, capture_sizes: list[int],
                extra: list[str] | None = None) -> list[str]:
    """The `vllm serve` engine arguments of ``cfg`` (``vllm_model_check.engine_argv`` with DP=2, EP,
    the backend, its moonep block, one API server, vLLM's CUDA-graph metrics)."""
    from vllm_moonep.tools.vllm_model_check import engine_argv as base_argv

    more = ["--api-server-count", "1", "--cudagraph-metrics"]
    if cfg.moonep is not None:
        more += ["--additional-config", json.dumps({"moonep": cfg.moonep}, separators=(",", ":"))]
    return base_argv(model_dir, mode=cfg.mode, dp=DP, ep=True, backend=cfg.backend.all2all,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs, gpu_mem=gpu_mem, seed=seed,
                     attention_backend=attention_backend, compile_mode=compile_mode, graph_mode=graph_mode,
                     capture_sizes=capture_sizes, extra=more + list(extra or []))
