"""The ``vllm-poc`` configuration of ``moonep-ab``: vLLM 0.33's own in-tree MoonEP classes.

    measure.rank_build("vllm-poc") -> import_poc (vLLM imported before the memory baseline)
      -> build_poc(shape, local): per layer, all-gather the home experts into vLLM's replicated
         layout, MoonEPPrepareAndFinalize + MoonEPExperts in a FusedMoEKernel -> configs.Built

vLLM's ``MoonEPPrepareAndFinalize``, ``MoonEPBufferPool``, ``make_moonep_weight_layout`` and
``MoonEPExperts`` run unmodified inside vLLM's ``FusedMoEKernel``; the only stand-in is the
``moonep`` module they import, which here is our built-in engine (``install_engine_as_moonep``).
This is the seed's own code path, so the A/B compares our classes against it on the same engine.

Phases: vLLM's prepare does pad, dispatch and prefetch in one call, so its time is reported
under ``dispatch`` (``pad`` and ``prefetch`` read 0); ``experts`` is ``MoonEPExperts.apply``
and ``combine`` is ``finalize``.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

from vllm_moonep.common.memory import replicated_accounting
from vllm_moonep.common.moe_step import StepInfo
from vllm_moonep.common.timing import NullTimer
from vllm_moonep.engine import Buffer
from vllm_moonep.testing.vllm_harness import LayoutHolder, ensure_workspace, vllm_moe_config
from vllm_moonep.tools.ab.configs import Built

__all__ = ["PocRunner", "build_poc", "import_poc", "install_engine_as_moonep"]


def install_engine_as_moonep() -> types.ModuleType:
    """Make ``import moonep`` give our built-in engine (only where no real ``moonep`` is loaded)."""
    mod = sys.modules.get("moonep")
    if mod is None or getattr(mod, "__vllm_moonep_shim__", False):
        shim: Any = types.ModuleType("moonep")  # a module built attribute by attribute
        shim.Buffer = Buffer
        shim.__vllm_moonep_shim__ = True
        sys.modules["moonep"] = mod = shim
    return mod


def _timed(timer_ref, phase, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with timer_ref[0].phase(phase):
            return fn(*args, **kwargs)

    return wrapper


class PocRunner:
    """One layer through vLLM's ``FusedMoEKernel`` with the in-tree MoonEP classes."""

    def __init__(self, kernel, pf, layout, w13_local, w2_local, E):
        self.kernel, self.pf, self.layout = kernel, pf, layout
        self.w13, self.w2, self.E = w13_local, w2_local, E
        self._timer = [NullTimer()]
        pf.prepare = _timed(self._timer, "dispatch", pf.prepare)
        pf.finalize = _timed(self._timer, "combine", pf.finalize)
        kernel.fused_experts.apply = _timed(self._timer, "experts", kernel.fused_experts.apply)
        self.last: StepInfo | None = None

    @property
    def timer(self):
        return self._timer[0]

    @timer.setter
    def timer(self, t):
        self._timer[0] = t

    def forward(self, hidden, topk_ids, topk_weights):
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        out = self.kernel.apply(hidden, self.w13, self.w2, topk_weights, topk_ids, MoEActivation.SILU, self.E, None, False)
        buf = self.pf._buffer
        cu = self.pf._last_cu if hasattr(self.pf, "_last_cu") else None
        self.last = StepInfo(buf.S, hidden.shape[0], cu if cu is not None else torch.zeros(1, dtype=torch.int32),
                             self._last_plan.experts_to_copy, buf.S * topk_ids.shape[1])
        return out


def import_poc() -> None:
    """Import the vLLM modules the PoC configuration uses (so callers can time/measure apart),
    keeping vLLM's and torch's import-time warnings (no compiled ops on CPU, deprecations) quiet."""
    import logging
    import os

    install_engine_as_moonep()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    quiet = [logging.getLogger(n) for n in ("torch", "torch._library", "torch.utils.cpp_extension", "vllm")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import vllm.model_executor.layers.fused_moe.experts.moonep_experts  # noqa: F401
        import vllm.model_executor.layers.fused_moe.modular_kernel  # noqa: F401
        import vllm.model_executor.layers.fused_moe.prepare_finalize.moonep  # noqa: F401
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)


def build_poc(shape: dict, local, device: torch.device):
    """``moonep-ab``'s ``vllm-poc`` configuration on this rank (a ``configs.Built``)."""
    import_poc()
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts.moonep_experts import MoonEPExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as poc

    r, R = dist.get_rank(), dist.get_world_size()
    E, B, H, I, K = shape["experts"], shape["slots"], shape["hidden"], shape["intermediate"], shape["topk"]
    max_tokens = shape["max_tokens"]
    ensure_workspace(device)
    pool = poc.MoonEPBufferPool(
        # the engine's transport as the other configurations run it (our engine stands in for moonep here)
        dict(H=H, K=K, E=E, num_ep_ranks=R, B=B, token_padding=poc.MOONEP_DEFAULT_TOKEN_PADDING, device=device,
             transport=shape.get("transport", "auto")),
        max_tokens,
    )
    runners, layouts = [], []
    for w13_local, w2_local in local:
        # the PoC's load-time all-gather into global order (gather_moonep_weight_layout does the
        # same through vLLM's EP group, which this tool does not set up)
        parts13 = [torch.empty_like(w13_local) for _ in range(R)]
        parts2 = [torch.empty_like(w2_local) for _ in range(R)]
        dist.all_gather(parts13, w13_local.contiguous())
        dist.all_gather(parts2, w2_local.contiguous())
        layout = poc.make_moonep_weight_layout(torch.cat(parts13), torch.cat(parts2), B)
        del parts13, parts2
        pf = poc.MoonEPPrepareAndFinalize(buffer_pool=pool, max_tokens_per_rank=max_tokens, num_dispatchers=R,
                                          num_global_experts=E)
        experts = MoonEPExperts(vllm_moe_config(E, K, H, I, R, r, max_tokens, device), FUSED_MOE_UNQUANTIZED_CONFIG)
        kernel = mk.FusedMoEKernel(pf, experts)
        experts.process_weights_after_loading(LayoutHolder(layout))
        runner = PocRunner(kernel, pf, layout, layout.full_gate_weight, layout.full_down_weight, E)
        _record_plan(runner)
        runners.append(runner)
        layouts.append(layout)
    report = replicated_accounting(E, R, B, H, I, layers=len(local))
    # vLLM's layout objects have no methods: dropping them (and the runners) frees them
    return Built(moes=runners, pool=pool, report=report, held=layouts, heaps=[], destroy_layouts=layouts.clear)


def _record_plan(runner: PocRunner) -> None:
    """Keep the last plan (vLLM's finalize clears it) for the balance figures."""
    pf = runner.pf
    orig = pf.prepare

    @functools.wraps(orig)
    def prepare(*args, **kwargs):
        res = orig(*args, **kwargs)
        runner._last_plan = pf._plan
        pf._last_cu = pf._cu_seqlens
        return res

    pf.prepare = prepare
