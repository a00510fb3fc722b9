"""The vLLM plugin: ``--all2all-backend moonep`` builds vllm-moonep's classes.

vLLM loads ``register`` (entry point ``vllm.general_plugins: moonep``) in every process, workers
included. It registers our ``VLLM_MOONEP_*`` variables with vLLM's environment validation
(``envs.py``), then verifies and rebinds vLLM 0.33's seams (``seams.py``; a mismatch is a
warning, and an error only for a run that asks for moonep) to what the plugin provides:

    register -> envs.register_env_vars
             -> seams.apply_seams -> hooks       the front-end check on the config path
                                  -> cudagraphs  CUDA graphs kept where the step is graph-safe
                                  -> manager     the EP group's all2all manager, its buffer pool
                                  -> modular     the prepare/finalize and experts classes
                                  -> weights     each layer's weight layout after loading

The options (``--additional-config '{"moonep": {...}}'`` or ``VLLM_MOONEP_*`` env vars,
``options.py``) are parsed once per process and config, checked in the front end when the engine
config is made and on each worker when its EP group is built (``checks.py``), and used when the
layers' kernels and weight layouts are built. What was hooked and the worker's objects live in
``state.py``, which imports no other module of the plugin; the worker's start-up line is
``startup.py``. Set ``VLLM_MOONEP_PLUGIN=0`` to leave vLLM untouched.
"""

from __future__ import annotations

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()  # first: NVLink multicast off before any library loads

__all__ = ["register"]


def register() -> None:
    """vLLM general-plugin entry point (idempotent; never raises for a vLLM that differs)."""
    from vllm_moonep.vllm_plugin.envs import register_env_vars
    from vllm_moonep.vllm_plugin.options import plugin_enabled

    register_env_vars()  # first: VLLM_MOONEP_PLUGIN=0 itself must not trip vLLM's validation
    if not plugin_enabled():
        return
    from vllm_moonep.vllm_plugin.seams import apply_seams

    apply_seams()
