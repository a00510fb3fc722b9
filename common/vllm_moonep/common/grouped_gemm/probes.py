"""What this process can run, found once: whether a module imports, and a tensor's GPU generation.
A leaf the dispatcher and the implementations share (each asks through this module's names, so a
test stands in for a GPU or a missing package in one place)."""

from __future__ import annotations

import importlib

import torch

#: modules whose import was probed: name -> ``None`` (imports) or the error text; an import is
#: probed once per process (a missing package would otherwise be looked for on every call)
_IMPORTS: dict[str, str | None] = {}


def import_error(module: str) -> str | None:
    """Why ``module`` does not import (``"ModuleNotFoundError: No module named 'quack'"``), or
    ``None`` when it does; probed once per process."""
    if module not in _IMPORTS:
        try:
            importlib.import_module(module)
            _IMPORTS[module] = None
        except Exception as exc:
            _IMPORTS[module] = f"{type(exc).__name__}: {exc}"
    return _IMPORTS[module]


def cuda_capability(x: torch.Tensor) -> tuple[int, int] | None:
    """``x``'s GPU's compute capability, ``None`` off CUDA."""
    if x.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(x.device)


def device_name(x: torch.Tensor) -> str | None:
    """``x``'s GPU's name as CUDA reports it (``"NVIDIA H200"``), ``None`` off CUDA."""
    if x.device.type != "cuda":
        return None
    return torch.cuda.get_device_name(x.device)


