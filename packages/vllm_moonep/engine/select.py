"""Choosing the engine: the real ``moonep`` when installed and usable, else the built-in one.

``engine="auto"`` takes the real package only when it imports, a CUDA device is present and the
user opted into multicast (upstream's kernels need NVSwitch multicast, which this project keeps
off by default); otherwise the built-in engine. ``engine="moonep"`` where that is not the case
raises ``MoonEPUnavailableError`` with the reason.
The built-in engine's transport is chosen in ``transports.py``.

``make_buffer`` says which engine it uses, and why, once per process at INFO (again only when
the engine or the reason changes).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from vllm_moonep.engine.buffer import Buffer as BuiltinBuffer
from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPInputError, MoonEPUnavailableError
from vllm_moonep.engine.multicast import OPT_IN_VAR, multicast_opted_in
from vllm_moonep.engine.protocol import MoonEPBuffer

ENGINES = ("auto", "builtin", "moonep")


def real_moonep_status() -> tuple[ModuleType | None, str]:
    """``(module, "")`` when the real ``moonep`` can run here, else ``(None, reason)``."""
    try:
        mod = importlib.import_module("moonep")
    except Exception as exc:  # ImportError, or a broken extension
        return None, f"the 'moonep' package does not import ({type(exc).__name__}: {exc})"
    if not hasattr(mod, "Buffer"):
        return None, "the installed 'moonep' package has no Buffer (an incompatible version)"
    if not torch.cuda.is_available():
        return None, "the real moonep needs a CUDA device and none is available"
    if not multicast_opted_in():
        return None, (
            "the real moonep's kernels need NVLink multicast, which vllm-moonep keeps off; "
            f"set {OPT_IN_VAR}=1 (and enable NVLS) to use it"
        )
    check = getattr(mod, "check_system", None) or getattr(mod, "system_check", None)
    if callable(check):
        try:
            res = check()
        except Exception as exc:
            return None, f"moonep's system check failed: {type(exc).__name__}: {exc}"
        if res is False:
            return None, "moonep's system check reported this system unusable"
    return mod, ""


def resolve_engine(engine: str = "auto") -> tuple[str, str]:
    """``(name, reason)`` of the engine ``engine`` selects: name is ``builtin`` or ``moonep``."""
    if engine not in ENGINES:
        raise MoonEPInputError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "builtin":
        return "builtin", "requested"
    mod, why = real_moonep_status()
    if engine == "moonep":
        if mod is None:
            raise MoonEPUnavailableError(f"engine='moonep' was requested but {why}")
        return "moonep", "requested"
    if mod is None:
        return "builtin", why
    return "moonep", "the real moonep is installed and usable"


def make_buffer(*args: Any, engine: str = "auto", **kwargs: Any) -> MoonEPBuffer:
    """Build a MoonEP buffer with the contract's arguments on the selected engine.

    The engine used and the reason (for ``engine="auto"``, why the real ``moonep`` was or was
    not taken) are logged once per process at INFO.
    """
    name, why = resolve_engine(engine)
    say_once(f"MoonEP engine: {name} (engine={engine!r}: {why})")
    if name == "moonep":
        mod, why = real_moonep_status()
        if mod is None:  # usable a moment ago (resolve_engine): its system check changed its mind
            raise MoonEPUnavailableError(f"engine 'moonep' was selected but {why}")
        for k in ("device", "dtype", "check_inputs", "timeout_s", "transport", "heap"):
            kwargs.pop(k, None)
        real: MoonEPBuffer = mod.Buffer(*args, **kwargs)
        return real
    return BuiltinBuffer(*args, **kwargs)

