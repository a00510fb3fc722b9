"""What the plugin installs on vLLM's config path (the front end): the load line and the check.

``seams.py`` verifies vLLM's config seam and rebinds ``EngineArgs.create_engine_config`` to
``hook_create_engine_config(orig)``: vLLM's own, then the load line (``emit_load_line``, held in
``state.LOAD`` until vLLM has configured its logging) and the front-end check of the ``moonep``
options (``checks.check_engine_config``), which fails a moonep run with the seam mismatch found
at load, if any.

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import logging

from vllm_moonep.vllm_plugin.checks import check_engine_config
from vllm_moonep.vllm_plugin.state import LOAD

log = logging.getLogger("vllm.vllm_moonep")

__all__ = ["emit_load_line", "hook_create_engine_config"]


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
