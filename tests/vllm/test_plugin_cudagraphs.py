"""CUDA graphs with ``--all2all-backend moonep``, through vLLM 0.33's own config build.

vLLM 0.33 switches CUDA graphs off for every moonep run; the plugin undoes that where the MoE
step is graph-safe (built-in engine, symmetric transport, every EP rank on one node:
``vllm_plugin/cudagraphs.py``) and leaves it everywhere else.

The reference is independent of the plugin: vLLM's own choice for the SAME engine args with the
graph-capable ``allgather_reducescatter`` backend (0.33 remaps ``naive`` to it). vLLM's CPU
platform never captures, so the builds run on it told that it does
(``workers.graph_capable_platform``): ``VllmConfig.__post_init__`` then picks the graph mode and
capture sizes as on a GPU platform. Config builds only: nothing here runs vLLM on a GPU (the
step's capture itself is ``tests/distributed/test_graph_step.py``).
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import ranks
from tests.vllm import workers as W
from tests.vllm.test_plugin_options import MOONEP_ARGS, TINY_MOE, _configure_vllm_logging, _engine_config

pytestmark = pytest.mark.vllm

REFERENCE_BACKEND = "allgather_reducescatter"
KEPT = "MoonEP: CUDA graphs kept (symmetric transport, one node): "
OFF = "MoonEP: CUDA graphs stay off as vLLM 0.33 sets for --all2all-backend moonep: "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-moe-graphs")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def _argv(moonep: dict | None, extra: list[str], backend: str = "moonep") -> list[str]:
    argv = [a if a != "moonep" else backend for a in MOONEP_ARGS] + extra
    return argv + (["--additional-config", json.dumps({"moonep": moonep})] if moonep is not None else [])


# ---------------------------------------------------------------------------- rank side
class _Lines(logging.Handler):
    """The graph lines of the plugin's logger."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "CUDA graphs" in msg:
            self.lines.append(msg)


def _graphs(cfg) -> dict:
    """The graph settings, and the whole compilation config as vLLM prints it (every field)."""
    cc = cfg.compilation_config
    return {"cudagraph_mode": cc.cudagraph_mode.name, "capture_sizes": list(cc.cudagraph_capture_sizes or []),
            "max_capture_size": cc.max_cudagraph_capture_size, "compile_mode": int(cc.mode),
            "splitting_ops": list(cc.splitting_ops or []), "compilation_config": repr(cc)}


def rk_graph_configs(model_dir: str, cases: list[tuple[list[str], list[str], dict]]):
    """Each case: (moonep argv, reference argv, env) -> (reference graphs, moonep graphs, graph lines)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    from vllm.plugins import load_general_plugins

    from tests.vllm.workers import graph_capable_platform
    from vllm_moonep.engine import defaults

    _configure_vllm_logging()
    load_general_plugins()
    out = []
    lg = logging.getLogger("vllm.vllm_moonep")
    with graph_capable_platform():
        for argv, ref_argv, env in cases:
            defaults._SAID.clear()  # each case says its line
            handler = _Lines()
            lg.addHandler(handler)
            try:
                ref = _graphs(_engine_config(model_dir, ref_argv, env))
                ours = _graphs(_engine_config(model_dir, argv, env))
            finally:
                lg.removeHandler(handler)
            out.append((ref, ours, handler.lines))
    return out


def rk_graph_seam_mismatch(model_dir: str):
    """A vLLM whose ``VllmConfig.__post_init__`` does not frame the moonep switch as 0.33 does."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    from tests.vllm.test_plugin_options import _Capture
    from tests.vllm.workers import graph_capable_platform
    from vllm_moonep.vllm_plugin import seams, state

    _configure_vllm_logging()
    load_general_plugins()
    original = VllmConfig.__dict__["__post_init__"]

    def __post_init__(self):  # the same behaviour, another source: the switch cannot be verified
        return original(self)

    res = {}
    try:
        seams.undo_seams()
        VllmConfig.__post_init__ = __post_init__
        with _Capture() as cap:
            res["hooked"] = seams.apply_seams()
        res["warnings"] = cap.ours("WARNING")
        res["patched"] = state.patched()
        with graph_capable_platform():
            res["moonep"] = _graphs(_engine_config(model_dir, _argv(None, []), {}))
            res["reference"] = _graphs(_engine_config(model_dir, _argv(None, [], REFERENCE_BACKEND), {}))
    finally:
        VllmConfig.__post_init__ = original
        seams.undo_seams()
        seams.apply_seams()
    return res


# ---------------------------------------------------------------------------- tests
KEPT_CASES = {
    "defaults": (None, []),
    "piecewise": (None, ["-cc.cudagraph_mode=PIECEWISE"]),
    "full-decode-only": (None, ["-cc.cudagraph_mode=FULL_DECODE_ONLY"]),
    "own-capture-sizes": (None, ["--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 16]})]),
    "symmetric-layout": ({"weight_layout": "symmetric", "engine": "builtin", "transport": "symmetric",
                          "impl": "triton", "num_prefetch_slots": 16}, []),
}


def test_graphs_kept_as_vllm_chooses_for_a_graph_capable_backend(model_dir):
    """vLLM 0.33 forced eager for every moonep run, though the built-in engine's one-node step is capturable;
    or the plugin restored a mode or capture sizes other than vLLM's own for a graph-capable backend."""
    cases = [(_argv(moonep, extra), _argv(moonep, extra, REFERENCE_BACKEND), {}) for moonep, extra in KEPT_CASES.values()]
    res = ranks(2, rk_graph_configs, model_dir, cases, **W.PLATFORM)[0]
    modes = set()
    for name, (ref, ours, lines) in zip(KEPT_CASES, res):
        assert ref["cudagraph_mode"] != "NONE" and ref["capture_sizes"], (name, ref)  # the comparison means something
        assert ours == ref, (name, ours, ref)
        assert len(lines) == 1 and lines[0].startswith(f"{KEPT}cudagraph_mode={ref['cudagraph_mode']}, "
                                                       f"{len(ref['capture_sizes'])} capture sizes"), (name, lines)
        modes.add(ref["cudagraph_mode"])
    assert modes == {"FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY"}, modes


OFF_CASES = {
    "collective": ({"transport": "collective"}, [], {}, "transport='collective'"),
    "two-nodes": (None, ["--nnodes", "2"], {}, "EP ranks may span nodes (--nnodes 2)"),
    "dp-ranks-on-other-hosts": (None, ["--data-parallel-size-local", "1"], {}, "1 of --data-parallel-size 2 DP ranks"),
    "real-moonep": ({"engine": "moonep"}, [], {}, "engine='moonep'"),
    "option-off": ({"cuda_graphs": "off"}, [], {}, "cuda_graphs='off' (--additional-config)"),
    "env-off": (None, [], {"VLLM_MOONEP_CUDA_GRAPHS": "off"}, "cuda_graphs='off' (VLLM_MOONEP_CUDA_GRAPHS)"),
    "step-log": ({"step_log_interval": 10}, [], {}, "step_log_interval=10 reads the plan on the host"),
    "reference-kernel": ({"impl": "reference"}, [], {}, "impl='reference'"),
    "host-heap": ({"weight_layout": "symmetric", "heap": "host"}, [], {}, "heap='host'"),
    "shared-slot-pool": ({"weight_layout": "symmetric", "shared_slot_pool": True}, [], {}, "shared_slot_pool"),
}


def test_graphs_stay_off_where_the_step_is_not_graph_safe(model_dir):
    """Graphs kept for a step that synchronizes the host or is not known capturable (collective transport,
    ranks on other nodes, the real moonep, the step log, the reference kernel, a heap or a shared slot pool the
    graph test does not capture), or despite cuda_graphs='off'."""
    cases = [(_argv(moonep, extra), _argv(moonep, extra, REFERENCE_BACKEND), env)
             for moonep, extra, env, _ in OFF_CASES.values()]
    res = ranks(2, rk_graph_configs, model_dir, cases, **W.PLATFORM)[0]
    for (name, (_, _, _, why)), (ref, ours, lines) in zip(OFF_CASES.items(), res):
        assert ref["cudagraph_mode"] != "NONE", (name, ref)  # vLLM would capture with a graph-capable backend
        assert ours["cudagraph_mode"] == "NONE", (name, ours)  # vLLM's switch to eager stands
        assert len(lines) == 1 and lines[0].startswith(OFF) and why in lines[0], (name, lines)


def test_enforce_eager_stays_eager_without_a_graph_line(model_dir):
    """--enforce-eager with moonep got graphs back (or a 'kept' line) because the plugin restored a mode vLLM
    never chose."""
    cases = [(_argv(None, ["--enforce-eager"]), _argv(None, ["--enforce-eager"], REFERENCE_BACKEND), {})]
    (ref, ours, lines), = ranks(2, rk_graph_configs, model_dir, cases, **W.PLATFORM)[0]
    assert ref["cudagraph_mode"] == "NONE" and ours == ref and lines == [], (ref, ours, lines)


def test_graph_seam_mismatch_leaves_vllm_eager(model_dir):
    """A vLLM whose __post_init__ no longer frames the moonep switch as 0.33 does got its cudagraph mode
    rewritten blindly, or lost the MoonEP seams with it."""
    res = ranks(2, rk_graph_seam_mismatch, model_dir, **W.PLATFORM)[0]
    assert res["patched"] is True and len(res["hooked"]) == 10, res["hooked"]  # the MoonEP and config seams stand
    assert any("seam vllm.config.vllm.VllmConfig._set_compile_ranges" in w and "switch to eager for --all2all-backend "
               "moonep then stands" in w for w in res["warnings"]), res["warnings"]
    assert res["reference"]["cudagraph_mode"] != "NONE" and res["moonep"]["cudagraph_mode"] == "NONE", res


def test_worker_guard_refuses_graphs_over_a_host_synchronizing_step():
    """A worker whose engine or transport differed from what the front-end rule assumed (the real moonep, the
    collective transport) captured a step that synchronizes the host."""
    from vllm_moonep.engine import MoonEPUnavailableError
    from vllm_moonep.vllm_plugin.cudagraphs import check_worker_graphs

    check_worker_graphs("FULL_AND_PIECEWISE", "cuda", engine="builtin")
    check_worker_graphs("FULL_AND_PIECEWISE", "cuda", transport="symmetric")
    check_worker_graphs(None, "cuda", engine="moonep", transport="collective")  # eager: nothing to guard
    check_worker_graphs("PIECEWISE", "cpu", transport="collective")  # no CUDA graph on a CPU worker
    with pytest.raises(MoonEPUnavailableError, match="transport='collective'.*cuda_graphs='off'"):
        check_worker_graphs("PIECEWISE", "cuda", transport="collective")
    with pytest.raises(MoonEPUnavailableError, match="the 'moonep' engine"):
        check_worker_graphs("FULL", "cuda", engine="moonep")
