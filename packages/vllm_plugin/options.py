"""The plugin's options: ``--additional-config '{"moonep": {...}}'``, then env vars, then defaults.

| key                 | env var                          | values                                  | default      |
|---------------------|----------------------------------|-----------------------------------------|--------------|
| weight_layout       | VLLM_MOONEP_WEIGHT_LAYOUT        | replicated, symmetric                   | replicated   |
| engine              | VLLM_MOONEP_ENGINE               | auto, builtin, moonep                   | auto         |
| num_prefetch_slots  | VLLM_MOONEP_NUM_PREFETCH_SLOTS   | int > 0                                 | 4            |
| shared_slot_pool    | VLLM_MOONEP_SHARED_SLOT_POOL     | true/false (symmetric only)             | false        |
| heap                | VLLM_MOONEP_HEAP                 | auto, host, torch, nvshmem              | auto         |
| token_padding       | VLLM_MOONEP_TOKEN_PADDING        | int > 0                                 | 128          |
| impl                | VLLM_MOONEP_IMPL                 | auto, reference, grouped_mm, triton     | auto         |

Unknown keys and bad values raise ``MoonEPOptionsError`` naming the valid ones. No vLLM import.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from vllm_moonep.engine import MoonEPInputError

__all__ = ["ENV_VARS", "MoonEPOptions", "MoonEPOptionsError", "CONFIG_KEY", "parse_options", "options_from_vllm_config"]

CONFIG_KEY = "moonep"

CHOICES = {
    "weight_layout": ("replicated", "symmetric"),
    "engine": ("auto", "builtin", "moonep"),
    "heap": ("auto", "host", "torch", "nvshmem"),
    "impl": ("auto", "reference", "grouped_mm", "triton"),
}

ENV_VARS = {
    "weight_layout": "VLLM_MOONEP_WEIGHT_LAYOUT",
    "engine": "VLLM_MOONEP_ENGINE",
    "num_prefetch_slots": "VLLM_MOONEP_NUM_PREFETCH_SLOTS",
    "shared_slot_pool": "VLLM_MOONEP_SHARED_SLOT_POOL",
    "heap": "VLLM_MOONEP_HEAP",
    "token_padding": "VLLM_MOONEP_TOKEN_PADDING",
    "impl": "VLLM_MOONEP_IMPL",
}


class MoonEPOptionsError(MoonEPInputError):
    """A bad ``moonep`` option (from --additional-config or the environment)."""


@dataclass(frozen=True)
class MoonEPOptions:
    weight_layout: str = "replicated"
    engine: str = "auto"
    num_prefetch_slots: int = 4
    shared_slot_pool: bool = False
    heap: str = "auto"
    token_padding: int = 128
    impl: str = "auto"

    def as_dict(self) -> dict:
        return asdict(self)


_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _coerce(key: str, value: Any, source: str) -> Any:
    if key in CHOICES:
        if not isinstance(value, str) or value.strip().lower() not in CHOICES[key]:
            raise MoonEPOptionsError(
                f"moonep option {key}={value!r} ({source}) is not valid; valid values: {', '.join(CHOICES[key])}"
            )
        return value.strip().lower()
    if key in ("num_prefetch_slots", "token_padding"):
        v = value
        if isinstance(v, str):
            try:
                v = int(v.strip())
            except ValueError:
                v = None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise MoonEPOptionsError(f"moonep option {key}={value!r} ({source}) must be a positive integer")
        return v
    if key == "shared_slot_pool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL:
            return _BOOL[value.strip().lower()]
        raise MoonEPOptionsError(f"moonep option shared_slot_pool={value!r} ({source}) must be true or false")
    raise AssertionError(key)


def parse_options(config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> MoonEPOptions:
    """Options from the ``moonep`` section of ``additional_config`` (``config``), then ``env``."""
    env = os.environ if env is None else env
    valid = [f.name for f in fields(MoonEPOptions)]
    section = {}
    if config:
        section = config.get(CONFIG_KEY, {}) if isinstance(config, Mapping) else {}
        if isinstance(section, str):
            try:
                section = json.loads(section)
            except json.JSONDecodeError as exc:
                raise MoonEPOptionsError(f"--additional-config '{CONFIG_KEY}' is not valid JSON: {exc}") from None
        if not isinstance(section, Mapping):
            raise MoonEPOptionsError(
                f"--additional-config '{CONFIG_KEY}' must be an object of options ({', '.join(valid)}), "
                f"got {type(section).__name__}"
            )
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise MoonEPOptionsError(
            f"unknown moonep option(s) {unknown} in --additional-config; valid options: {', '.join(valid)}"
        )
    values = {}
    for key in valid:
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
