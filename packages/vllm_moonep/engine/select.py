"""Choosing the engine: the real ``moonep`` when installed and usable, else the built-in one.

``engine="auto"`` takes the real package only when it imports, a CUDA device is present and the
user opted into multicast (upstream's kernels need NVSwitch multicast, which this project keeps
off by default); otherwise the built-in engine. ``engine="moonep"`` where that is not the case
raises ``MoonEPUnavailableError`` with the reason.
The built-in engine's transport is chosen in ``transports/select.py``.

``make_buffer`` says which engine it uses, and why, once per process at INFO (again only when
the engine or the reason changes). The real package's buffer comes wrapped in
``RealMoonEPBuffer``, which adds what ``MoonEPBuffer`` asks and the package does not declare.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from vllm_moonep.engine.buffer import Buffer as BuiltinBuffer
from vllm_moonep.engine.defaults import say_once
from vllm_moonep.engine.errors import MoonEPInputError, MoonEPStateError, MoonEPUnavailableError
from vllm_moonep.engine.multicast import OPT_IN_VAR, multicast_opted_in
from vllm_moonep.engine.protocol import MoonEPBuffer, MoonEPPlan

__all__ = ["ENGINES", "RealMoonEPBuffer", "make_buffer", "real_moonep_status", "resolve_engine"]

ENGINES = ("auto", "builtin", "moonep")


class RealMoonEPBuffer:
    """The real ``moonep`` package's ``Buffer`` as a ``MoonEPBuffer``: every call and attribute is
    the package's own (``inner``), and the capability flags it does not declare say no (it has
    none of the built-in engine's extensions, and nothing says what its combine reads)."""

    accepts_num_tokens = False
    combine_reads_entry_rows_only = False
    #: the plan the latest ``dispatch`` returned (``check_plan``); ``None`` before one / after ``destroy``
    _latest: MoonEPPlan | None = None
    _destroyed = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # everything else (``_ctx``, ...) is the package's
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def num_dispatched_rows(self) -> int:
        return int(self.inner._ctx["NvS"])  # the only place the package keeps it

    @property
    def S(self) -> int:
        return int(self.inner.S)

    @property
    def B(self) -> int:
        return int(self.inner.B)

    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: torch.Tensor, topk_experts_sk: torch.Tensor,
                 tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MoonEPPlan]:
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, MoonEPPlan] = self.inner.dispatch(
            hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert)
        self._latest = out[3]
        return out

    def check_plan(self, plan: object, op: str) -> MoonEPPlan:
        """``plan`` if it is the plan this buffer's latest ``dispatch`` returned, else ``MoonEPStateError``
        naming ``op`` (what the adapter knows for itself: the package's own checks are its own)."""
        if self._destroyed:
            raise MoonEPStateError(f"{op}: the buffer was destroyed")
        latest = self._latest
        if latest is None or plan is not latest:
            raise MoonEPStateError(
                f"{op}: the plan is not the one this buffer's latest dispatch returned (another buffer's, a "
                "stale one: the buffer dispatched since, or none before a dispatch)")
        return latest

    def prefetch_weight(self, plan: MoonEPPlan | None = None, full_gate_weight: torch.Tensor | None = None,
                        full_up_weight: torch.Tensor | None = None,
                        full_down_weight: torch.Tensor | None = None) -> None:
        self.inner.prefetch_weight(plan=plan, full_gate_weight=full_gate_weight, full_up_weight=full_up_weight,
                                   full_down_weight=full_down_weight)

    def combine(self, plan: MoonEPPlan, hidden_nvsh: torch.Tensor,
                route_weights_nvs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        out: tuple[torch.Tensor, torch.Tensor | None, Any] = self.inner.combine(plan, hidden_nvsh, route_weights_nvs)
        return out

    def destroy(self) -> None:
        self.inner.destroy()
        self._destroyed, self._latest = True, None

    def __repr__(self) -> str:
        return f"RealMoonEPBuffer({self.inner!r})"


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
        return RealMoonEPBuffer(mod.Buffer(*args, **kwargs))
    return BuiltinBuffer(*args, **kwargs)

