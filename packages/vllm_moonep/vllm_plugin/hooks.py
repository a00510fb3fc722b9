"""What the plugin installs on vLLM's config path, and the plugin's process state.

``seams.py`` verifies vLLM's seams and rebinds them to what this module (the front-end check),
``cudagraphs.py`` (the graph rule's two hooks) and ``runtime.py`` (the worker's classes) provide;
it records here what it found:

- ``LOAD``: which seam groups are hooked (the MoonEP seams, the config seam, the graph seams),
  the mismatch found for each group that is not, and the INFO line said once logging is set up;
- ``patched()`` / ``seam_error()``: whether the MoonEP seams are hooked, and why not;
- ``hook_create_engine_config(orig)``: vLLM's ``EngineArgs.create_engine_config`` followed by the
  front-end check of the ``moonep`` options (``checks.check_engine_config``).

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_moonep.vllm_plugin.checks import check_engine_config

if TYPE_CHECKING:
    from vllm_moonep.vllm_plugin.seams import MoonEPSeamError

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["LOAD", "LoadState", "emit_load_line", "hook_create_engine_config", "patched", "seam_error"]


@dataclass
class LoadState:
    """What ``seams.apply_seams`` found and hooked in this process."""

    applied: bool = False  # the MoonEP seams (all or none) are rebound
    config_hooked: bool = False  # EngineArgs.create_engine_config runs the front-end check
    graphs_hooked: bool = False  # the graph rule's hooks sit on VllmConfig.__post_init__'s path
    seam_error: MoonEPSeamError | None = None  # why the MoonEP seams are not hooked
    config_seam_error: MoonEPSeamError | None = None
    graph_seam_error: MoonEPSeamError | None = None
    load_line: str | None = None  # the INFO line, until vLLM's logging is configured

    def reset(self) -> None:
        vars(self).update(vars(type(self)()))


LOAD = LoadState()


def patched() -> bool:
    """Whether the MoonEP seams are hooked."""
    return LOAD.applied


def seam_error() -> MoonEPSeamError | None:
    """The seam mismatch found at load (``None``: every MoonEP seam is hooked or none was tried)."""
    return LOAD.seam_error


def _logging_ready() -> bool:
    return logging.getLogger("vllm").hasHandlers()


def emit_load_line() -> None:
    """Log the load line once vLLM's logging is configured (in the front end: when it makes the config)."""
    msg = LOAD.load_line
    if msg and _logging_ready():
        LOAD.load_line = None
        log.info(msg)


def hook_create_engine_config(orig):
    """vLLM's ``EngineArgs.create_engine_config``, then the front-end check of the ``moonep`` options."""

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        emit_load_line()  # vLLM has configured its logging by now
        check_engine_config(config, seam_error=LOAD.seam_error)
        return config

    create_engine_config.__vllm_moonep__ = True
    return create_engine_config
