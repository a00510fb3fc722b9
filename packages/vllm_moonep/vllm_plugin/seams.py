"""vLLM 0.33's seams: each verified against the installed vLLM, then rebound, and restored.

Every rebinding of vLLM's names happens here, each checked before anything changes; what the
names are rebound to lives elsewhere (``manager.py``: the all2all manager and the two wrappers
that attach it; ``modular.py``: the prepare/finalize and experts classes; ``weights.py``: the
weight-layout builder; ``hooks.py``: the front-end check; ``cudagraphs.py``: the graph rule's
hooks). ``manager.py`` and ``modular.py`` import vLLM: they are imported only after their seams
verify. What was hooked, and why not, is recorded in ``state.LOAD``.

vLLM 0.33 has no registry for all2all backends; ``--all2all-backend moonep`` is wired by name to
in-tree classes. We keep the flag value and rebind the names vLLM looks up *at call time*:

=====================================================================================  ==============================================
seam (module.attribute)                                                                 what vLLM does with it
=====================================================================================  ==============================================
vllm.distributed.device_communicators.all2all.MoonEPAll2AllManager                     CudaCommunicator builds it for the EP group
vllm.distributed.parallel_state.init_model_parallel_group                              initialize_model_parallel makes the EP group
                                                                                        with it (ours attaches our manager where the
                                                                                        platform's communicator has none: CPU)
vllm.model_executor.layers.fused_moe.all2all_utils.get_ep_all2all_manager              maybe_make_prepare_finalize gets the manager
vllm.model_executor.layers.fused_moe.all2all_utils.MoonEPPrepareAndFinalize            maybe_make_prepare_finalize builds the P/F
vllm.model_executor.layers.fused_moe.all2all_utils.MOONEP_DEFAULT_{NUM_PREFETCH_SLOTS,
  TOKEN_PADDING,NUM_SMS}                                                                handle kwargs (imported there only with CUDA
                                                                                        and the real moonep; we define them)
vllm.model_executor.layers.fused_moe.experts.moonep_experts.MoonEPExperts              oracle.unquantized.backend_to_kernel_cls
vllm.model_executor.layers.fused_moe.prepare_finalize.moonep.gather_moonep_weight_layout  convert_to_unquantized_kernel_format: the
                                                                                        weight layout after loading
vllm.engine.arg_utils.EngineArgs.create_engine_config                                  the front end builds the VllmConfig (ours
                                                                                        checks the moonep options right after)
vllm.config.vllm.VllmConfig._set_compile_ranges                                         VllmConfig.__post_init__, right before its
                                                                                        moonep switch to eager (ours notes the mode)
vllm.config.compilation.CompilationConfig.set_splitting_ops_for_v1                      VllmConfig.__post_init__, right after that
                                                                                        switch (ours puts the mode back where the
                                                                                        step is graph-safe: ``cudagraphs.py``)
vllm.v1.worker.gpu_worker.Worker.{execute_model,execute_dummy_batch}                    the worker runs each step with one of them (an
                                                                                        idle DP rank the dummy batch); ours first
                                                                                        raises what a MoonEP error board recorded
                                                                                        (``step_check.py``; hooked in the worker)
=====================================================================================  ==============================================

``apply_seams()`` never raises (vLLM calls it in every process, ``vllm serve --help`` included):

- it verifies the MoonEP seams (the attribute exists, and the vLLM function that uses it still
  reads it by that name). On a mismatch it patches none of them and logs a WARNING naming the vLLM
  version and the seam; vLLM runs unchanged, and a run that asks for ``--all2all-backend moonep``
  fails in the front end with that same error (``MoonEPSeamError``) when its config is made.
- the config seam is verified and hooked on its own; without it the options are checked on the
  workers only (a WARNING says so).
- the two graph seams are verified (``verify_graph_seams``: vLLM's moonep switch is the only write
  of ``cudagraph_mode`` between them) and hooked together, after the MoonEP seams; without them
  vLLM's eager-only switch for moonep stands (a WARNING says so).
- the step seams are checked to exist and hooked in the worker, by the all2all manager (``LOAD.worker_seams``),
  where vLLM has imported its worker class; without them a device-side failure is raised at the next eager MoonEP
  call only, not before the next step under CUDA graphs (a WARNING says so).
- it logs one INFO line: our version, vLLM's version and the seams hooked; and a WARNING when
  vLLM is not the tested 0.33.x. In the front end vLLM configures logging only when it builds
  the engine config, so the INFO line is logged then.

It is idempotent; ``undo_seams()`` restores vLLM's originals (tests).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import threading
from typing import Any

from vllm_moonep.vllm_plugin.hooks import emit_load_line, hook_create_engine_config
from vllm_moonep.vllm_plugin.state import LOAD, MoonEPSeamError

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["CONFIG_SEAM", "GRAPH_SEAMS", "SEAMS", "STEP_SEAMS", "TESTED_VLLM", "apply_seams", "apply_step_seam",
           "hooked_names", "undo_seams", "verify_config_seam", "verify_graph_seams", "verify_seams", "vllm_version"]

#: the vLLM minor series this plugin is tested with
TESTED_VLLM = "0.33"

A2A = "vllm.distributed.device_communicators.all2all"
CUDA_COMM = "vllm.distributed.device_communicators.cuda_communicator"
A2A_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
PF_MOONEP = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"
ORACLE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
PARALLEL_STATE = "vllm.distributed.parallel_state"
ARG_UTILS = "vllm.engine.arg_utils"
VLLM_CONFIG = "vllm.config.vllm"
COMPILATION = "vllm.config.compilation"
WORKER = "vllm.v1.worker.gpu_worker"

#: (module, attribute) pairs this plugin rebinds for the MoonEP path (all or none)
SEAMS = [
    (A2A, "MoonEPAll2AllManager"),
    (PARALLEL_STATE, "init_model_parallel_group"),
    (A2A_UTILS, "get_ep_all2all_manager"),
    (A2A_UTILS, "MoonEPPrepareAndFinalize"),
    (A2A_UTILS, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS"),
    (A2A_UTILS, "MOONEP_DEFAULT_TOKEN_PADDING"),
    (A2A_UTILS, "MOONEP_DEFAULT_NUM_SMS"),
    (EXPERTS, "MoonEPExperts"),
    (PF_MOONEP, "gather_moonep_weight_layout"),
]
#: the front-end check's seam (a method of vLLM's EngineArgs)
CONFIG_SEAM = (ARG_UTILS, "EngineArgs.create_engine_config")
#: the graph rule's seams (methods VllmConfig.__post_init__ calls around its moonep switch; both or none)
GRAPH_SEAMS = [
    (VLLM_CONFIG, "VllmConfig._set_compile_ranges"),
    (COMPILATION, "CompilationConfig.set_splitting_ops_for_v1"),
]

#: the step check's seams (vLLM's worker, whose CPU worker inherits them: hooked in the worker process only)
STEP_SEAMS = [(WORKER, "Worker.execute_model"), (WORKER, "Worker.execute_dummy_batch")]

_lock = threading.Lock()
#: (module, attribute path) -> vLLM's original, for undo_seams
_originals: dict[tuple[str, str], Any] = {}


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception as exc:  # pragma: no cover
        return f"unimportable ({exc})"


def our_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-moonep")
    except Exception:  # pragma: no cover - a source tree on PYTHONPATH, not installed
        return "unknown (not installed)"


def _fail(seam: str, why: str) -> MoonEPSeamError:
    return MoonEPSeamError(
        f"vllm-moonep cannot hook vLLM {vllm_version()}: seam {seam} {why}. This plugin supports vLLM {TESTED_VLLM} "
        f"(pip install 'vllm>={TESTED_VLLM},<0.{int(TESTED_VLLM.split('.')[1]) + 1}'); set VLLM_MOONEP_PLUGIN=0 (or "
        "leave 'moonep' out of VLLM_PLUGINS) to run vLLM without it."
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
    """Check every MoonEP seam; returns the modules. Raises ``MoonEPSeamError`` naming the first mismatch."""
    mods = {n: _module(n) for n in (A2A, CUDA_COMM, A2A_UTILS, EXPERTS, PF_MOONEP, ORACLE, PARALLEL_STATE)}
    base = importlib.import_module("vllm.distributed.device_communicators.base_device_communicator")
    mk = importlib.import_module("vllm.model_executor.layers.fused_moe.modular_kernel")
    if not hasattr(base, "All2AllManagerBase"):
        raise _fail(f"{base.__name__}.All2AllManagerBase", "is missing")
    for cls in ("FusedMoEPrepareAndFinalizeModular", "FusedMoEExpertsModular"):
        if not hasattr(mk, cls):
            raise _fail(f"{mk.__name__}.{cls}", "is missing")
    if not inspect.isclass(getattr(mods[A2A], "MoonEPAll2AllManager", None)) and not LOAD.applied:
        raise _fail(f"{A2A}.MoonEPAll2AllManager", "is missing")
    _need_names(mods[CUDA_COMM].CudaCommunicator.__init__, ["MoonEPAll2AllManager", '"moonep"'],
                f"{A2A}.MoonEPAll2AllManager")
    ps = mods[PARALLEL_STATE]
    if not callable(getattr(ps, "init_model_parallel_group", None)):
        raise _fail(f"{PARALLEL_STATE}.init_model_parallel_group", "is missing")
    if not callable(getattr(ps, "initialize_model_parallel", None)):
        raise _fail(f"{PARALLEL_STATE}.initialize_model_parallel", "is missing")
    _need_names(ps.initialize_model_parallel, ["init_model_parallel_group(", '"ep"', "use_all2all"],
                f"{PARALLEL_STATE}.init_model_parallel_group")
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


def verify_config_seam():
    """vLLM's ``EngineArgs`` class, whose ``create_engine_config`` builds the ``VllmConfig`` with
    ``additional_config`` and ``parallel_config``; raises ``MoonEPSeamError`` otherwise."""
    seam = f"{ARG_UTILS}.EngineArgs.create_engine_config"
    cls = getattr(_module(ARG_UTILS), "EngineArgs", None)
    fn = getattr(cls, "create_engine_config", None)
    if not callable(fn):
        raise _fail(seam, "is missing")
    _need_names(_unwrapped(fn), ["VllmConfig(", "additional_config=", "parallel_config="], seam)
    return cls


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "__vllm_moonep__", False) else fn


def _flat(src: str) -> str:
    return " ".join(src.split())


#: vLLM 0.33's switch to eager for moonep, inside VllmConfig.__post_init__ (whitespace collapsed)
MOONEP_EAGER_SWITCH = (
    'if self.parallel_config.all2all_backend == "moonep":',
    "self.parallel_config.use_all2all and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE",
    "self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE",
)


def verify_graph_seams() -> tuple[type, type]:
    """vLLM's ``VllmConfig`` and ``CompilationConfig`` when ``VllmConfig.__post_init__`` calls
    ``self._set_compile_ranges()`` once, then switches moonep to eager (``MOONEP_EAGER_SWITCH``),
    then calls ``self.compilation_config.set_splitting_ops_for_v1(``, with no other write of
    ``cudagraph_mode`` in between; raises ``MoonEPSeamError`` otherwise."""
    vcfg, comp = _module(VLLM_CONFIG), _module(COMPILATION)
    seam = f"{VLLM_CONFIG}.VllmConfig._set_compile_ranges"
    cls, ccls = getattr(vcfg, "VllmConfig", None), getattr(comp, "CompilationConfig", None)
    for owner, (mod, path) in ((cls, GRAPH_SEAMS[0]), (ccls, GRAPH_SEAMS[1])):
        if not callable(getattr(owner, path.split(".")[1], None)):
            raise _fail(f"{mod}.{path}", "is missing")
    assert isinstance(cls, type) and isinstance(ccls, type)  # callable members found above
    if getattr(getattr(comp, "CUDAGraphMode", None), "NONE", None) is None:
        raise _fail(f"{COMPILATION}.CUDAGraphMode.NONE", "is missing")
    src = _flat(_source(_unwrapped(getattr(cls, "__post_init__")), seam))
    first, last = "self._set_compile_ranges()", "self.compilation_config.set_splitting_ops_for_v1("
    if src.count(first) != 1 or src.count(last) != 1:
        raise _fail(seam, f"is not called the way 0.33 calls it (VllmConfig.__post_init__ calls {first} "
                          f"{src.count(first)} time(s) and {last}...) {src.count(last)} time(s), once each expected)")
    a, b = src.index(first), src.index(last)
    window = src[a:b]
    at = [window.find(part) for part in MOONEP_EAGER_SWITCH]
    if a > b or -1 in at or at != sorted(at):
        raise _fail(seam, "no longer frames vLLM's moonep switch to eager the way 0.33 does (VllmConfig.__post_init__ "
                          f"does not read {MOONEP_EAGER_SWITCH} between {first} and {last}...))")
    writes = re.findall(r"cudagraph_mode\s*=(?!=)", window)
    if len(writes) != 1:
        raise _fail(seam, f"is followed by {len(writes)} writes of cudagraph_mode before {last}...) (0.33 has one: "
                          "its moonep switch to eager)")
    return cls, ccls


# ------------------------------------------------------------------------------------ apply / undo
def _rebind(module: str, path: str, value) -> None:
    """Set ``module.path`` (``path``: an attribute, or ``Class.attribute``) to ``value``, keeping vLLM's
    original for ``undo_seams``."""
    owner = importlib.import_module(module)
    *outer, attr = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    if (module, path) not in _originals:
        _originals[(module, path)] = owner.__dict__.get(attr) if outer else getattr(owner, attr, None)
    setattr(owner, attr, value)


def _restore(keys) -> None:
    for module, path in keys:
        if (module, path) not in _originals:
            continue
        value = _originals.pop((module, path))
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        if value is None:
            if attr in vars(owner):
                delattr(owner, attr)
        else:
            setattr(owner, attr, value)


def _apply_moonep_seams() -> None:
    mods = verify_seams()
    # verified: vLLM's base classes exist, so the modules that subclass them import
    from vllm_moonep.vllm_plugin import manager, modular
    from vllm_moonep.vllm_plugin.weights import build_weight_layout

    pf = mods[PF_MOONEP]
    new = {
        (A2A, "MoonEPAll2AllManager"): manager.MoonEPAll2AllManager,
        (PARALLEL_STATE, "init_model_parallel_group"):
            manager.wrap_init_model_parallel_group(mods[PARALLEL_STATE].init_model_parallel_group),
        (A2A_UTILS, "get_ep_all2all_manager"):
            manager.wrap_get_ep_all2all_manager(mods[A2A_UTILS].get_ep_all2all_manager),
        (A2A_UTILS, "MoonEPPrepareAndFinalize"): modular.MoonEPPrepareAndFinalize,
        (A2A_UTILS, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS"): getattr(pf, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", 4),
        (A2A_UTILS, "MOONEP_DEFAULT_TOKEN_PADDING"): getattr(pf, "MOONEP_DEFAULT_TOKEN_PADDING", 128),
        (A2A_UTILS, "MOONEP_DEFAULT_NUM_SMS"): getattr(pf, "MOONEP_DEFAULT_NUM_SMS", 32),
        (EXPERTS, "MoonEPExperts"): modular.MoonEPExperts,
        (PF_MOONEP, "gather_moonep_weight_layout"): build_weight_layout,
    }
    assert set(new) == set(SEAMS)
    for (m, a), value in new.items():
        _rebind(m, a, value)


def _apply_config_seam() -> None:
    cls = verify_config_seam()
    if not getattr(cls.__dict__.get("create_engine_config"), "__vllm_moonep__", False):
        _rebind(*CONFIG_SEAM, hook_create_engine_config(cls.__dict__["create_engine_config"]))


def _apply_graph_seams() -> None:
    from vllm_moonep.vllm_plugin.cudagraphs import hook_set_compile_ranges, hook_set_splitting_ops

    cls, ccls = verify_graph_seams()
    for (m, path), owner, hook in zip(GRAPH_SEAMS, (cls, ccls), (hook_set_compile_ranges, hook_set_splitting_ops)):
        fn = owner.__dict__[path.split(".")[1]]
        if not getattr(fn, "__vllm_moonep__", False):
            _rebind(m, path, hook(fn))


def apply_step_seam() -> bool:
    """In the worker: rebind ``Worker.execute_model`` and ``Worker.execute_dummy_batch`` to run the step check
    first (``step_check.py``). Idempotent, never raises (a WARNING says what is then not checked); returns whether
    they are hooked."""
    from vllm_moonep.vllm_plugin.step_check import hook_step

    with _lock:
        if not LOAD.step_hooked:
            try:
                cls = getattr(_module(WORKER), "Worker", None)
                fns = {p: cls.__dict__.get(p.split(".")[1]) if isinstance(cls, type) else None for _, p in STEP_SEAMS}
                for path, fn in fns.items():
                    if not callable(fn):
                        raise _fail(f"{WORKER}.{path}", "is missing")
                for path, fn in fns.items():
                    if not getattr(fn, "__vllm_moonep__", False):
                        _rebind(WORKER, path, hook_step(fn))
                LOAD.step_hooked = True
            except Exception as exc:
                _restore(STEP_SEAMS)
                if LOAD.step_seam_error is None:
                    LOAD.step_seam_error = _as_seam_error(exc, STEP_SEAMS[0][1])
                    log.warning("%s A device-side MoonEP failure is then raised at the next eager MoonEP call only, "
                                "not before the next step under CUDA graphs.", LOAD.step_seam_error)
        return LOAD.step_hooked


def _as_seam_error(exc: Exception, seam: str) -> MoonEPSeamError:
    return exc if isinstance(exc, MoonEPSeamError) else _fail(seam, f"could not be hooked ({exc!r})")


def apply_seams() -> list[str]:
    """Verify then rebind every seam (idempotent, never raises: see the module doc). Returns the
    ``module.attribute`` names hooked."""
    with _lock:
        if LOAD.applied or LOAD.seam_error is not None:
            return hooked_names()
        version = vllm_version()
        if not version.startswith(TESTED_VLLM + "."):
            log.warning(
                "vllm-moonep %s is tested with vLLM %s.x; this is vLLM %s. Its seams are verified before anything "
                "is hooked, but behaviour may differ; for the tested pair: pip install 'vllm>=%s,<0.%d'",
                our_version(), TESTED_VLLM, version, TESTED_VLLM, int(TESTED_VLLM.split(".")[1]) + 1,
            )
        try:
            _apply_config_seam()
            LOAD.config_hooked = True
        except Exception as exc:
            LOAD.config_seam_error = _as_seam_error(exc, CONFIG_SEAM[1])
            log.warning("%s The moonep options are then checked on the workers only, not when the config is made.",
                        LOAD.config_seam_error)
        try:
            _apply_moonep_seams()
            LOAD.applied = True
            LOAD.worker_seams = apply_step_seam
        except Exception as exc:
            _restore([s for s in _originals if s in SEAMS])
            LOAD.seam_error = _as_seam_error(exc, "(applying)")
            log.warning(
                "%s vLLM runs unchanged; a run with --all2all-backend moonep fails with this error when its config "
                "is made.", LOAD.seam_error)
            return hooked_names()
        try:
            _apply_graph_seams()
            LOAD.graphs_hooked = True
        except Exception as exc:
            _restore(GRAPH_SEAMS)
            LOAD.graph_seam_error = _as_seam_error(exc, GRAPH_SEAMS[0][1])
            log.warning("%s vLLM's switch to eager for --all2all-backend moonep then stands (no CUDA graphs).",
                        LOAD.graph_seam_error)
        names = [a for _, a in hooked_names_pairs() if not a.startswith("MOONEP_DEFAULT_")]
        names.insert(names.index("MoonEPExperts"), "MOONEP_DEFAULT_*")
        LOAD.load_line = (
            f"vllm-moonep {our_version()} hooked vLLM {version} ({len(hooked_names())} seams: {', '.join(names)}); "
            "--all2all-backend moonep builds vllm-moonep's classes"
        )
        emit_load_line()
        return hooked_names()


def hooked_names_pairs() -> list[tuple[str, str]]:
    """``(module, attribute path)`` of every seam hooked now."""
    out = list(SEAMS) if LOAD.applied else []
    if LOAD.config_hooked:
        out.append(CONFIG_SEAM)
    if LOAD.graphs_hooked:
        out.extend(GRAPH_SEAMS)
    if LOAD.step_hooked:
        out.extend(STEP_SEAMS)
    return out


def hooked_names() -> list[str]:
    """``module.attribute`` of every seam hooked now."""
    return [f"{m}.{a}" for m, a in hooked_names_pairs()]


def undo_seams() -> None:
    """Restore vLLM's originals and forget what was found at load (tests only)."""
    with _lock:
        _restore(list(_originals))
        LOAD.reset()
