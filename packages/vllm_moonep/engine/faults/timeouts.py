"""How long MoonEP waits for its peers: one bound for every collective and every device-side wait.

``timeout_s`` given to a buffer, layout or heap wins; else ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S``;
else ``DEFAULT_TIMEOUT_S`` (300 s: long enough for a slow first step that compiles kernels,
short enough that a dead peer is reported rather than hanging a server).
"""

from __future__ import annotations

import os

from vllm_moonep.engine.errors import MoonEPInputError

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "collective_timeout_s", "positive_seconds"]

#: default bound on one collective or device-side wait, seconds (override with VLLM_MOONEP_COLLECTIVE_TIMEOUT_S)
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S"


def positive_seconds(value, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MoonEPInputError(f"{what} must be a positive number of seconds, got {value!r}") from None
    if not v > 0 or v == float("inf"):
        raise MoonEPInputError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return v


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s`` if given, else ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S``, else 300 s (validated)."""
    if timeout_s is not None:
        return positive_seconds(timeout_s, "timeout_s")
    env = os.environ.get(TIMEOUT_ENV)
    if env is None or env == "":
        return DEFAULT_TIMEOUT_S
    return positive_seconds(env, TIMEOUT_ENV)
