"""Every rebinding of vLLM 0.33's names, in one place, each checked before anything changes.

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
=====================================================================================  ==============================================

``apply_patches()`` never raises (vLLM calls it in every process, ``vllm serve --help`` included):

- it verifies the MoonEP seams (the attribute exists, and the vLLM function that uses it still
  reads it by that name). On a mismatch it patches none of them and logs a WARNING naming the vLLM
  version and the seam; vLLM runs unchanged, and a run that asks for ``--all2all-backend moonep``
  fails in the front end with that same error (``MoonEPSeamError``) when its config is made.
- the config seam is verified and hooked on its own; without it the options are checked on the
  workers only (a WARNING says so).
- it logs one INFO line: our version, vLLM's version and the seams hooked; and a WARNING when
  vLLM is not the tested 0.33.x. In the front end vLLM configures logging only when it builds
  the engine config, so the INFO line is logged then.

It is idempotent; ``undo_patches()`` restores vLLM's originals (tests).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from typing import Any

from vllm_moonep.engine import MoonEPError
from vllm_moonep.vllm_plugin.checks import check_engine_config
from vllm_moonep.vllm_plugin.runtime import STATE, summary_line  # noqa: F401  (re-exported)

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["MoonEPSeamError", "SEAMS", "CONFIG_SEAM", "TESTED_VLLM", "apply_patches", "patched", "seam_error",
           "undo_patches", "verify_config_seam", "verify_seams", "vllm_version"]

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

_lock = threading.Lock()
_state: dict[str, Any] = {"applied": False, "config_hooked": False, "seam_error": None, "config_seam_error": None,
                          "load_line": None}
_originals: dict[tuple[str, str], Any] = {}


class MoonEPSeamError(MoonEPError):
    """vLLM's internals do not look like the 0.33 seams this plugin rebinds."""


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
    if not inspect.isclass(getattr(mods[A2A], "MoonEPAll2AllManager", None)) and not _state["applied"]:
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
    orig = getattr(fn, "__wrapped__", fn) if getattr(fn, "__vllm_moonep__", False) else fn
    _need_names(orig, ["VllmConfig(", "additional_config=", "parallel_config="], seam)
    return cls


# ------------------------------------------------------------------------------------ logging
def _logging_ready() -> bool:
    return logging.getLogger("vllm").hasHandlers()


def _emit_load_line() -> None:
    msg = _state["load_line"]
    if msg and _logging_ready():
        _state["load_line"] = None
        log.info(msg)


def _hook_create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        _emit_load_line()  # vLLM has configured its logging by now
        check_engine_config(config, seam_error=_state["seam_error"])
        return config

    create_engine_config.__vllm_moonep__ = True
    return create_engine_config


# ------------------------------------------------------------------------------------ apply / undo
def _apply_moonep_seams() -> list[str]:
    mods = verify_seams()
    from vllm_moonep.common.vllm_modular import MoonEPExperts, MoonEPPrepareAndFinalize
    from vllm_moonep.vllm_plugin import runtime

    manager_cls = runtime.make_manager_class()
    pf = mods[PF_MOONEP]
    new = {
        (A2A, "MoonEPAll2AllManager"): manager_cls,
        (PARALLEL_STATE, "init_model_parallel_group"):
            runtime.wrap_init_model_parallel_group(mods[PARALLEL_STATE].init_model_parallel_group, manager_cls),
        (A2A_UTILS, "get_ep_all2all_manager"):
            runtime.wrap_get_ep_all2all_manager(mods[A2A_UTILS].get_ep_all2all_manager, manager_cls),
        (A2A_UTILS, "MoonEPPrepareAndFinalize"): runtime.plugin_pf_class(MoonEPPrepareAndFinalize),
        (A2A_UTILS, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS"): getattr(pf, "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", 4),
        (A2A_UTILS, "MOONEP_DEFAULT_TOKEN_PADDING"): getattr(pf, "MOONEP_DEFAULT_TOKEN_PADDING", 128),
        (A2A_UTILS, "MOONEP_DEFAULT_NUM_SMS"): getattr(pf, "MOONEP_DEFAULT_NUM_SMS", 32),
        (EXPERTS, "MoonEPExperts"): runtime.plugin_experts_class(MoonEPExperts),
        (PF_MOONEP, "gather_moonep_weight_layout"): runtime.build_weight_layout,
    }
    assert set(new) == set(SEAMS)
    for (m, a), value in new.items():
        mod = mods[m]
        _originals[(m, a)] = getattr(mod, a, None)
        setattr(mod, a, value)
    return [f"{m}.{a}" for m, a in SEAMS]


def _apply_config_seam() -> str:
    cls = verify_config_seam()
    fn = cls.__dict__.get("create_engine_config")
    if getattr(fn, "__vllm_moonep__", False):
        return f"{ARG_UTILS}.{CONFIG_SEAM[1]}"
    _originals[CONFIG_SEAM] = fn
    cls.create_engine_config = _hook_create_engine_config(fn)
    return f"{ARG_UTILS}.{CONFIG_SEAM[1]}"


def apply_patches() -> list[str]:
    """Verify then rebind every seam (idempotent, never raises: see the module doc). Returns the
    ``module.attribute`` names hooked."""
    with _lock:
        if _state["applied"] or _state["seam_error"] is not None:
            return _hooked_names()
        version = vllm_version()
        if not version.startswith(TESTED_VLLM + "."):
            log.warning(
                "vllm-moonep %s is tested with vLLM %s.x; this is vLLM %s. Its seams are verified before anything "
                "is hooked, but behaviour may differ; for the tested pair: pip install 'vllm>=%s,<0.%d'",
                our_version(), TESTED_VLLM, version, TESTED_VLLM, int(TESTED_VLLM.split(".")[1]) + 1,
            )
        try:
            _apply_config_seam()
            _state["config_hooked"] = True
        except Exception as exc:
            err = exc if isinstance(exc, MoonEPSeamError) else _fail(CONFIG_SEAM[1], f"could not be hooked ({exc!r})")
            _state["config_seam_error"] = err
            log.warning("%s The moonep options are then checked on the workers only, not when the config is made.",
                        err)
        try:
            _apply_moonep_seams()
            _state["applied"] = True
        except Exception as exc:
            err = exc if isinstance(exc, MoonEPSeamError) else _fail("(applying)", f"failed ({exc!r})")
            _undo_moonep_seams()
            _state["seam_error"] = err
            log.warning(
                "%s vLLM runs unchanged; a run with --all2all-backend moonep fails with this error when its config "
                "is made.", err)
            return _hooked_names()
        names = [a.split(".")[-1] for _, a in SEAMS if not a.startswith("MOONEP_DEFAULT_")]
        names.insert(names.index("MoonEPExperts"), "MOONEP_DEFAULT_*")
        if _state["config_hooked"]:
            names.append(CONFIG_SEAM[1])
        _state["load_line"] = (
            f"vllm-moonep {our_version()} hooked vLLM {version} ({len(_hooked_names())} seams: {', '.join(names)}); "
            "--all2all-backend moonep builds vllm-moonep's classes"
        )
        _emit_load_line()
        return _hooked_names()


def _hooked_names() -> list[str]:
    out = [f"{m}.{a}" for m, a in SEAMS] if _state["applied"] else []
    if _state["config_hooked"]:
        out.append(f"{ARG_UTILS}.{CONFIG_SEAM[1]}")
    return out


def patched() -> bool:
    """Whether the MoonEP seams are hooked."""
    return _state["applied"]


def seam_error() -> MoonEPSeamError | None:
    """The seam mismatch found at load (``None``: every MoonEP seam is hooked or none was tried)."""
    return _state["seam_error"]


def _undo_moonep_seams() -> None:
    for (m, a), value in list(_originals.items()):
        if (m, a) == CONFIG_SEAM:
            continue
        mod = importlib.import_module(m)
        if value is None:
            if hasattr(mod, a):
                delattr(mod, a)
        else:
            setattr(mod, a, value)
        del _originals[(m, a)]


def undo_patches() -> None:
    """Restore vLLM's originals and forget what was found at load (tests only)."""
    with _lock:
        _undo_moonep_seams()
        if CONFIG_SEAM in _originals:
            cls = importlib.import_module(ARG_UTILS).EngineArgs
            cls.create_engine_config = _originals.pop(CONFIG_SEAM)
        _state.update(applied=False, config_hooked=False, seam_error=None, config_seam_error=None, load_line=None)
