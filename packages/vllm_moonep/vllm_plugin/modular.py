"""The MoE kernel classes vLLM builds for ``--all2all-backend moonep``: ours, with the plugin's options.

``vllm_moonep.common.vllm_modular``'s layout-agnostic classes, given what only the plugin knows:

- ``MoonEPExperts`` (vLLM's oracle builds it: ``backend_to_kernel_cls``): ``impl`` from the options;
- ``MoonEPPrepareAndFinalize`` (vLLM's ``maybe_make_prepare_finalize`` builds it, one per MoE
  layer, in layer order): the optional per-step log of slot use and row balance
  (``step_log_interval``, recorded in ``state.STATE.stats``).

They keep their bases' names, which vLLM logs (``Using MoonEPPrepareAndFinalize``, ``Using
MoonEPExperts``). Importing this module imports vLLM: ``seams.py`` imports it only after
``verify_seams`` has found vLLM 0.33's modular-kernel classes.
"""

from __future__ import annotations

from vllm_moonep.common import vllm_modular
from vllm_moonep.vllm_plugin.options import options_from_vllm_config
from vllm_moonep.vllm_plugin.state import STATE

__all__ = ["MoonEPExperts", "MoonEPPrepareAndFinalize"]


class MoonEPExperts(vllm_modular.MoonEPExperts):
    """vllm-moonep's experts as vLLM's oracle builds them: ``impl`` from the plugin options."""

    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None, **kw):
        kw.setdefault("impl", options_from_vllm_config().impl)
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers, **kw)


class MoonEPPrepareAndFinalize(vllm_modular.MoonEPPrepareAndFinalize):
    """vllm-moonep's prepare/finalize as vLLM builds it, with the optional per-step log."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._log_interval = options_from_vllm_config().step_log_interval
        self._layer_index = STATE.num_pf  # vLLM builds one per MoE layer, in layer order
        STATE.num_pf += 1

    def prepare(self, *args, **kw):
        """The base's ``prepare``, then this layer's plan recorded for the step log when it is on."""
        out = super().prepare(*args, **kw)
        if self._log_interval:
            st = self._state
            STATE.stats.record(self._layer_index, st.plan, self._log_interval, getattr(st.buffer, "rank", 0))
        return out
