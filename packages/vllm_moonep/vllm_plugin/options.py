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
| cuda_graphs         | VLLM_MOONEP_CUDA_GRAPHS          | auto, off (``cudagraphs.py``)           | auto         |

The choice lists are imported from the modules that own them; the defaults are the dataclass's.
Unknown keys and bad values raise ``MoonEPOptionsError`` naming the valid ones.

The block and the env vars are parsed once per process and config: ``options_from_vllm_config``
keeps each ``VllmConfig``'s ``MoonEPOptions`` (or its error) for as long as the config lives, and
everyone who needs the options (the graph rule, the front-end check, the worker check, the layers,
the start-up line) asks it; ``parse_options`` itself is the one parser. No vLLM import at module
level (``checks.py`` and ``envs.py`` are the vLLM-facing parts).
"""

from __future__ import annotations

import difflib
import json
import functools
import os
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from vllm_moonep.common.grouped_gemm import IMPLS
from vllm_moonep.engine import ENGINES, TRANSPORTS, MoonEPInputError
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING
from vllm_moonep.engine.heaps import HEAP_KINDS

__all__ = [
    "BOUNDS",
    "CHOICES",
    "CONFIG_KEY",
    "CUDA_GRAPHS",
    "ENV_VARS",
    "PLUGIN_ENV",
    "WEIGHT_LAYOUTS",
    "MoonEPOptions",
    "MoonEPOptionsError",
    "options_from_vllm_config",
    "parse_options",
    "plugin_enabled",
]

CONFIG_KEY = "moonep"

#: the plugin owns this list (the layouts are chosen only here)
WEIGHT_LAYOUTS = ("replicated", "symmetric")

#: ``auto``: keep the CUDA graphs vLLM 0.33 switches off for moonep when the step is graph-safe
#: (the rule: ``cudagraphs.graph_rule``); ``off``: stay eager as vLLM's proof of concept does
CUDA_GRAPHS = ("auto", "off")

CHOICES = {
    "weight_layout": WEIGHT_LAYOUTS,
    "engine": ENGINES,
    "transport": TRANSPORTS,
    "heap": HEAP_KINDS,
    "impl": IMPLS,
    "cuda_graphs": CUDA_GRAPHS,
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
    "cuda_graphs": "VLLM_MOONEP_CUDA_GRAPHS",
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
    token_padding: int = DEFAULT_TOKEN_PADDING
    impl: str = "auto"
    step_log_interval: int = 0
    cuda_graphs: str = "auto"
    #: where each option's value came from: ``--additional-config``, its env var's name, or
    #: ``default`` (not an option: not compared, not in ``as_dict``; empty when built directly)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in OPTION_NAMES}

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")


OPTION_NAMES = tuple(f.name for f in fields(MoonEPOptions) if f.name != "sources")
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


def _not_an_object(given: Any) -> MoonEPOptionsError:
    """The error for a ``moonep`` block that is no JSON object: what was given, and what to write
    (the option whose values include a given string, else ``weight_layout``)."""
    word = given.strip().lower() if isinstance(given, str) else None
    key = next((k for k, values in CHOICES.items() if word in values), None)
    example = {CONFIG_KEY: {key: word} if key is not None else {"weight_layout": "symmetric"}}
    return MoonEPOptionsError(
        f"--additional-config '{CONFIG_KEY}' must be a JSON object of options ({', '.join(OPTION_NAMES)}), "
        f"e.g. {json.dumps(example)}; got {json.dumps(given, default=repr)}"
    )


def _section(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not config or not isinstance(config, Mapping):
        return {}
    given = section = config.get(CONFIG_KEY, {})
    if isinstance(section, str):  # the block passed as a string holding a JSON object is read as that object
        try:
            section = json.loads(section)
        except json.JSONDecodeError:
            raise _not_an_object(given) from None
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise _not_an_object(given)
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


def parse_options(config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> MoonEPOptions:
    """Options from the ``moonep`` section of ``additional_config`` (``config``), then ``env``, with
    where each value came from (``MoonEPOptions.sources``). The one parser: under vLLM, ask
    ``options_from_vllm_config``, which calls this once per config."""
    env = os.environ if env is None else env
    section = _section(config)
    values, sources = {}, {}
    for key in OPTION_NAMES:
        if key in section:
            values[key] = _coerce(key, section[key], "--additional-config")
            sources[key] = "--additional-config"
        elif env.get(ENV_VARS[key], "").strip() != "":
            values[key] = _coerce(key, env[ENV_VARS[key]], ENV_VARS[key])
            sources[key] = ENV_VARS[key]
        else:
            sources[key] = "default"
    opts = MoonEPOptions(**values, sources=sources)
    if opts.shared_slot_pool and opts.weight_layout != "symmetric":
        raise MoonEPOptionsError("moonep option shared_slot_pool=true needs weight_layout='symmetric'")
    if opts.shared_slot_pool and opts.impl == "grouped_mm":
        raise MoonEPOptionsError(
            "moonep option impl='grouped_mm' cannot read a shared slot pool (it needs one dense weight tensor); "
            "use impl='auto', 'triton' or 'reference'"
        )
    return opts


# ------------------------------------------------------------------------------------ once per config
#: id(config) -> (weak reference to the config, its options or the MoonEPOptionsError it raised);
#: ("env", values) -> the same for code that runs outside any vLLM config
_parsed: dict[Any, tuple[Any, MoonEPOptions | MoonEPOptionsError]] = {}
_parsed_lock = threading.RLock()  # re-entrant: a weak-reference callback may run during an update


def _forget(key, ref) -> None:
    with _parsed_lock:
        if _parsed.get(key, (None,))[0] is ref:
            del _parsed[key]


def options_from_vllm_config(vllm_config=None) -> MoonEPOptions:
    """The options of ``vllm_config`` (default: vLLM's current config), parsed on the first call
    for that config object and kept while it lives; a bad block raises the same
    ``MoonEPOptionsError`` on every call. Without any config: the env vars and defaults (parsed
    once per set of ``VLLM_MOONEP_*`` values)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    key: object
    if vllm_config is None:
        key, ref, extra = ("env", tuple(os.environ.get(v) for v in ENV_VARS.values())), None, None
    else:
        key = id(vllm_config)
        extra = getattr(vllm_config, "additional_config", None)
        extra = extra if isinstance(extra, Mapping) else None
    with _parsed_lock:
        hit = _parsed.get(key)
    if hit is not None and (vllm_config is None or hit[0]() is vllm_config):
        result = hit[1]
    else:
        try:
            result = parse_options(extra)
        except MoonEPOptionsError as exc:
            result = exc
        if vllm_config is not None:
            try:
                ref = weakref.ref(vllm_config, functools.partial(_forget, key))
            except TypeError:  # not weak-referenceable: nothing to key a cache entry on safely
                ref = None
        if vllm_config is None or ref is not None:
            with _parsed_lock:
                _parsed[key] = (ref, result)
    if isinstance(result, MoonEPOptionsError):
        raise result
    return result
