"""The plugin's options: ``--additional-config '{"moonep": {...}}'``, then env vars, then defaults.

| key                 | env var                          | values                                  | default      |
|---------------------|----------------------------------|-----------------------------------------|--------------|
| weight_layout       | VLLM_MOONEP_WEIGHT_LAYOUT        | replicated, symmetric                   | replicated   |
| engine              | VLLM_MOONEP_ENGINE               | ``vllm_moonep.engine.ENGINES``          | auto         |
| transport           | VLLM_MOONEP_TRANSPORT            | ``vllm_moonep.engine.TRANSPORTS``       | auto         |
| num_prefetch_slots  | VLLM_MOONEP_NUM_PREFETCH_SLOTS   | int in [1, 4096]                        | 4            |
| shared_slot_pool    | VLLM_MOONEP_SHARED_SLOT_POOL     | true/false (symmetric only)             | false        |
| heap                | VLLM_MOONEP_HEAP                 | ``vllm_moonep.engine.heaps.HEAP_KINDS`` | auto         |
| token_padding       | VLLM_MOONEP_TOKEN_PADDING        | int in [1, 4096]                        | 128          |
| impl                | VLLM_MOONEP_IMPL                 | ``vllm_moonep.common.grouped_gemm.IMPLS``| auto        |
| step_log_interval   | VLLM_MOONEP_STEP_LOG_INTERVAL    | int in [0, 1000000] (0: off)            | 0            |

The choice lists are imported from the modules that own them; the defaults are the dataclass's.
Unknown keys and bad values raise ``MoonEPOptionsError`` naming the valid ones. No vLLM import
(``checks.py`` and ``envs.py`` are the vLLM-facing parts).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from vllm_moonep.common.grouped_gemm import IMPLS
from vllm_moonep.engine import ENGINES, TRANSPORTS, MoonEPInputError
from vllm_moonep.engine.heaps import HEAP_KINDS

__all__ = [
    "BOUNDS",
    "CHOICES",
    "CONFIG_KEY",
    "ENV_VARS",
    "PLUGIN_ENV",
    "WEIGHT_LAYOUTS",
    "MoonEPOptions",
    "MoonEPOptionsError",
    "option_sources",
    "options_from_vllm_config",
    "parse_options",
    "plugin_enabled",
]

CONFIG_KEY = "moonep"

#: the plugin owns this list (the layouts are chosen only here)
WEIGHT_LAYOUTS = ("replicated", "symmetric")

CHOICES = {
    "weight_layout": WEIGHT_LAYOUTS,
    "engine": ENGINES,
    "transport": TRANSPORTS,
    "heap": HEAP_KINDS,
    "impl": IMPLS,
}

#: inclusive bounds of the integer options
BOUNDS = {
    "num_prefetch_slots": (1, 4096),
    "token_padding": (1, 4096),
    "step_log_interval": (0, 1_000_000),
}

ENV_VARS = {
    "weight_layout": "VLLM_MOONEP_WEIGHT_LAYOUT",
    "engine": "VLLM_MOONEP_ENGINE",
    "transport": "VLLM_MOONEP_TRANSPORT",
    "num_prefetch_slots": "VLLM_MOONEP_NUM_PREFETCH_SLOTS",
    "shared_slot_pool": "VLLM_MOONEP_SHARED_SLOT_POOL",
    "heap": "VLLM_MOONEP_HEAP",
    "token_padding": "VLLM_MOONEP_TOKEN_PADDING",
    "impl": "VLLM_MOONEP_IMPL",
    "step_log_interval": "VLLM_MOONEP_STEP_LOG_INTERVAL",
}

#: ``VLLM_MOONEP_PLUGIN=0`` leaves vLLM untouched (the env vars are still registered)
PLUGIN_ENV = "VLLM_MOONEP_PLUGIN"

_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def plugin_enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(PLUGIN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class MoonEPOptionsError(MoonEPInputError):
    """A bad ``moonep`` option (from --additional-config or the environment)."""


@dataclass(frozen=True)
class MoonEPOptions:
    weight_layout: str = "replicated"
    engine: str = "auto"
    transport: str = "auto"
    num_prefetch_slots: int = 4
    shared_slot_pool: bool = False
    heap: str = "auto"
    token_padding: int = 128
    impl: str = "auto"
    step_log_interval: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


OPTION_NAMES = tuple(f.name for f in fields(MoonEPOptions))
assert set(OPTION_NAMES) == set(ENV_VARS), "every option has exactly one env var"


def _coerce(key: str, value: Any, source: str) -> Any:
    if key in CHOICES:
        if not isinstance(value, str) or value.strip().lower() not in CHOICES[key]:
            raise MoonEPOptionsError(
                f"moonep option {key}={value!r} ({source}) is not valid; valid values: {', '.join(CHOICES[key])}"
            )
        return value.strip().lower()
    if key in BOUNDS:
        lo, hi = BOUNDS[key]
        v = value
        if isinstance(v, str):
            try:
                v = int(v.strip())
            except ValueError:
                v = None
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise MoonEPOptionsError(f"moonep option {key}={value!r} ({source}) must be {what} (at most {hi})")
        if v > hi:
            raise MoonEPOptionsError(f"moonep option {key}={value!r} ({source}) is out of range: at most {hi}")
        return v
    if key == "shared_slot_pool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL:
            return _BOOL[value.strip().lower()]
        raise MoonEPOptionsError(f"moonep option shared_slot_pool={value!r} ({source}) must be true or false")
    raise AssertionError(key)


def _section(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not config or not isinstance(config, Mapping):
        return {}
    section = config.get(CONFIG_KEY, {})
    if isinstance(section, str):
        try:
            section = json.loads(section)
        except json.JSONDecodeError as exc:
            raise MoonEPOptionsError(f"--additional-config '{CONFIG_KEY}' is not valid JSON: {exc}") from None
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise MoonEPOptionsError(
            f"--additional-config '{CONFIG_KEY}' must be an object of options ({', '.join(OPTION_NAMES)}), "
            f"got {type(section).__name__}"
        )
    unknown = sorted(set(section) - set(OPTION_NAMES))
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), OPTION_NAMES, n=1)
            if close:
                hints.append(f"{k!r}: did you mean {close[0]!r}?")
        raise MoonEPOptionsError(
            f"unknown moonep option(s) {unknown} in --additional-config"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f"; valid options: {', '.join(OPTION_NAMES)}"
        )
    return section


def option_sources(config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where each option's value comes from: ``--additional-config``, its env var's name, or ``default``."""
    env = os.environ if env is None else env
    section = _section(config)
    out = {}
    for key in OPTION_NAMES:
        if key in section:
            out[key] = "--additional-config"
        elif env.get(ENV_VARS[key], "").strip() != "":
            out[key] = ENV_VARS[key]
        else:
            out[key] = "default"
    return out


def parse_options(config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> MoonEPOptions:
    """Options from the ``moonep`` section of ``additional_config`` (``config``), then ``env``."""
    env = os.environ if env is None else env
    section = _section(config)
    values = {}
    for key in OPTION_NAMES:
        if key in section:
            values[key] = _coerce(key, section[key], "--additional-config")
        elif env.get(ENV_VARS[key], "").strip() != "":
            values[key] = _coerce(key, env[ENV_VARS[key]], ENV_VARS[key])
    opts = MoonEPOptions(**values)
    if opts.shared_slot_pool and opts.weight_layout != "symmetric":
        raise MoonEPOptionsError("moonep option shared_slot_pool=true needs weight_layout='symmetric'")
    if opts.shared_slot_pool and opts.impl == "grouped_mm":
        raise MoonEPOptionsError(
            "moonep option impl='grouped_mm' cannot read a shared slot pool (it needs one dense weight tensor); "
            "use impl='auto', 'triton' or 'reference'"
        )
    return opts


def options_from_vllm_config(vllm_config=None) -> MoonEPOptions:
    """Options of the current (or given) ``VllmConfig``'s ``additional_config``; env/defaults without one."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    extra = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    return parse_options(extra if isinstance(extra, Mapping) else None)
