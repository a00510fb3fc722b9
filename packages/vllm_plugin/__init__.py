"""The vLLM plugin: ``--all2all-backend moonep`` builds vllm-moonep's classes.

vLLM loads ``register`` (entry point ``vllm.general_plugins: moonep``) in every process, workers
included. It verifies and rebinds vLLM 0.33's MoonEP seams (``patches.py``); the options
(``--additional-config '{"moonep": {...}}'`` or ``VLLM_MOONEP_*`` env vars, ``options.py``) are
read when the EP group, the layers' kernels and their weight layouts are built. Set
``VLLM_MOONEP_PLUGIN=0`` to leave vLLM untouched.
"""

from __future__ import annotations

import os

__all__ = ["register"]


def register() -> None:
    """vLLM general-plugin entry point (idempotent). Raises ``MoonEPSeamError`` when vLLM's
    internals are not the 0.33 seams this plugin knows, naming the version and the seam."""
    if os.environ.get("VLLM_MOONEP_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    from vllm_moonep.vllm_plugin.patches import apply_patches

    apply_patches()
