"""Errors raised by the engine and the layers above it."""

from __future__ import annotations


class MoonEPError(RuntimeError):
    """Base class of this project's errors."""


class MoonEPInputError(MoonEPError, ValueError):
    """A caller passed something the contract does not allow. Nothing was modified."""


class MoonEPStateError(MoonEPError):
    """An object was used out of order (destroyed, plan from another buffer, ...)."""


class MoonEPUnavailableError(MoonEPError):
    """A requested engine or heap cannot run here; the message says why."""


class MoonEPCollectiveTimeout(MoonEPError, TimeoutError):
    """A collective did not complete within its timeout (a peer died or stopped calling)."""
