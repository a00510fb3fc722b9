"""Kernel policy as data: which tiles the Triton kernels run and which implementation ``impl="auto"``
takes, per GPU, from ``tuning.json`` (shipped beside this module; ``bench_experts --tune`` writes it)::

    tuning.json  {"devices": {"NVIDIA H200": {"tiles": [...], "auto": [...]},
                              "NVIDIA H100 80GB HBM3": {"same_as": "NVIDIA H200", "measured": "..."}, ...},
                  "fallback": {"sm_90": "NVIDIA H200", ...}}

    the rows' GPU name --exact--------------------------> its section
                                 (or, "same_as", the section its own measurements kept: said once)
                       --else its compute capability----> the fallback device's section (said once)
                       --else--------------------------> none: generic tiles, Triton (said once)

``tiles``: the tile entries ``triton_kernels.select_config`` looks up by ``(H, I)`` and the step's
tokens per rank (else the row count ``max_rows``). ``auto``: regimes where a library kernel was
measured faster than ours on that GPU, ``{"H", "I", "impl", "from_tokens", "to_tokens"}`` (tokens per
rank, both ends included; ``to_tokens`` null: no upper end), in order of preference where two cover
the same step (the first that runs here is taken); outside every regime ``auto`` runs the Triton
kernels. A tile table measured on one GPU is a guess on another, so a device without its own
section says which section it borrowed, once, at INFO. ``same_as``: a device measured and found to
keep another's tiles and regimes (``measured`` says by what) runs that section without a copy of it,
and says so once, at INFO, with the note instead of "a guess"; with an ``auto`` list of its own it keeps
the tiles only and runs its own regimes (measured on it where they differ).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from dataclasses import dataclass
from importlib import resources

import torch

from vllm_moonep.common.grouped_gemm import probes
from vllm_moonep.engine.defaults import say_once

log = logging.getLogger(__name__)

#: keys every tile entry has (``tools/vllm_moonep/tools/bench_experts.py --tune`` writes them)
TILE_KEYS = ("H", "I", "max_rows", "gate_up", "down")
#: keys every ``auto`` regime has
REGIME_KEYS = ("H", "I", "impl", "from_tokens")


@dataclass(frozen=True)
class Regime:
    """Tokens per rank ``[from_tokens, to_tokens]`` (``None``: no upper end) at shape ``(H, I)`` where
    ``impl`` was measured faster than the Triton kernels on this GPU."""

    impl: str
    H: int
    I: int
    from_tokens: int
    to_tokens: int | None = None

    def covers(self, tokens: int) -> bool:
        return self.from_tokens <= tokens and (self.to_tokens is None or tokens <= self.to_tokens)

    def describe(self) -> str:
        upto = "" if self.to_tokens is None else f" to {self.to_tokens}"
        return f"{self.impl} from {self.from_tokens}{upto} tokens per rank"


@dataclass(frozen=True)
class DevicePolicy:
    """One GPU's policy: the section of ``tuning.json`` it uses (``section``: that section's device
    name, ``None`` where none applies), its tile entries and its ``auto`` regimes."""

    section: str | None
    tiles: tuple[dict, ...] = ()
    regimes: tuple[Regime, ...] = ()

    def regimes_for(self, H: int, I: int) -> list[Regime]:
        """The shape's regimes, by ``from_tokens``."""
        return sorted((r for r in self.regimes if (r.H, r.I) == (H, I)), key=lambda r: r.from_tokens)

    def regimes_at(self, H: int, I: int, tokens: int | None) -> list[Regime]:
        """The regimes a step of ``tokens`` per rank falls in at ``(H, I)``, in the table's order (the
        order of preference where two libraries were both measured faster; none where tokens are unknown)."""
        if tokens is None:
            return []
        return [r for r in self.regimes if (r.H, r.I) == (H, I) and r.covers(tokens)]


#: no section: generic tiles, no regimes (CPU, or a GPU nothing was measured on)
NO_POLICY = DevicePolicy(None)

#: tables read so far, by path (each file is read, and any problem reported, once)
_TABLES: dict[str, dict] = {}


def packaged_path():
    """The ``tuning.json`` shipped in this package."""
    return resources.files("vllm_moonep.common.grouped_gemm").joinpath("tuning.json")


def _valid(items, keys: tuple, what: str, where: str) -> list[dict]:
    items = items if isinstance(items, list) else []
    good = [e for e in items if isinstance(e, dict) and all(k in e for k in keys)]
    if len(good) != len(items):
        log.warning("expert kernel policy %s: %d of %d %s lack one of %s and are ignored",
                    where, len(items) - len(good), len(items), what, keys)
    return good


def load_table(path=None) -> dict:
    """The policy table at ``path`` (``None``: the packaged one), read once per path, as
    ``{"devices": {name: {"tiles": [...], "auto": [...]} or {"same_as": name, "measured": str}},
    "fallback": {"sm_XY": name}}``. A file that cannot be read or parsed is reported once with a WARNING
    naming it and the error and gives no sections (every GPU then uses the generic tiles and Triton);
    entries without the keys their lookup needs, and a ``same_as`` that names no section of tiles, are
    dropped, with a WARNING."""
    if path is None:
        path = packaged_path()
    elif isinstance(path, (str, os.PathLike)):
        path = pathlib.Path(path)
    key = str(path)
    if key in _TABLES:
        return _TABLES[key]
    try:
        raw = json.loads(path.read_text())
        devices = raw.get("devices") if isinstance(raw, dict) else None
        if not isinstance(devices, dict):
            raise ValueError('expected a JSON object with a "devices" object (device name -> section)')
    except Exception as exc:
        log.warning("expert kernel policy %s could not be read (%s: %s); every shape uses the generic tiles and "
                    "the Triton kernels", key, type(exc).__name__, exc)
        raw, devices = {}, {}
    table = {"devices": {}, "fallback": dict(raw.get("fallback") or {}), "comment": raw.get("comment", "")}
    aliases: dict[str, dict] = {}
    for name, sec in devices.items():
        sec = sec if isinstance(sec, dict) else {}
        if "same_as" in sec:
            aliases[name] = {"same_as": str(sec["same_as"]), "measured": str(sec.get("measured", ""))}
            if "auto" in sec:  # its own regimes, the named section's tiles
                aliases[name]["auto"] = _valid(sec["auto"], REGIME_KEYS, "auto regimes", f"{key} [{name}]")
            continue
        table["devices"][name] = {
            "tiles": _valid(sec.get("tiles"), TILE_KEYS, "tile entries", f"{key} [{name}]"),
            "auto": _valid(sec.get("auto"), REGIME_KEYS, "auto regimes", f"{key} [{name}]"),
            **{k: v for k, v in sec.items() if k not in ("tiles", "auto")},
        }
    sections = set(table["devices"])  # of tiles: a same_as names one of these, not another same_as
    for name, alias in aliases.items():
        if alias["same_as"] in sections:
            table["devices"][name] = alias
        else:
            log.warning("expert kernel policy %s [%s]: same_as names %r, which has no section of tiles; ignored",
                        key, name, alias["same_as"])
    _TABLES[key] = table
    return table


def _policy(section: str, sec: dict) -> DevicePolicy:
    regimes = tuple(Regime(str(r["impl"]), int(r["H"]), int(r["I"]), int(r["from_tokens"]),
                           None if r.get("to_tokens") is None else int(r["to_tokens"])) for r in sec["auto"])
    return DevicePolicy(section, tuple(sec["tiles"]), regimes)


def policy_for(name: str | None, capability: tuple[int, int] | None, path=None) -> DevicePolicy:
    """The policy of a GPU called ``name`` with ``capability`` (``None`` for either: no GPU, no policy).
    A GPU without its own section borrows its capability's fallback section; either way the borrowing,
    or the lack of any section, is said once at INFO. Built once per table and GPU (every expert call
    asks)."""
    if name is None:
        return NO_POLICY
    table = load_table(path)
    key = (name, capability)
    cache = table.setdefault("_policies", {})
    if key not in cache:
        cache[key] = _resolve(table, name, capability)
    return cache[key]


def _resolve(table: dict, name: str, capability: tuple[int, int] | None) -> DevicePolicy:
    sec = table["devices"].get(name)
    if sec is not None and "same_as" in sec:
        own = "auto" in sec
        say_once(f"MoonEP expert kernels: {name} runs the tile table{'' if own else ' and auto regimes'} of "
                 f"{sec['same_as']}, which measurements on this GPU kept ({sec['measured']})"
                 + ("; its auto regimes are its own" if own else ""), "vllm_moonep.common")
        named = table["devices"][sec["same_as"]]
        return _policy(sec["same_as"], {**named, "auto": sec["auto"]} if own else named)
    if sec is not None:
        return _policy(name, sec)
    arch = None if capability is None else f"sm_{capability[0]}{capability[1]}"
    borrowed = table["fallback"].get(arch) if arch else None
    if borrowed is not None and borrowed in table["devices"]:
        say_once(f"MoonEP expert kernels: no tile table or auto regimes were measured on {name}; using those of "
                 f"{borrowed} (same {arch}), a guess until `python -m vllm_moonep.tools.bench_experts --tune` "
                 f"measures this GPU", "vllm_moonep.common")
        return _policy(borrowed, table["devices"][borrowed])
    say_once(f"MoonEP expert kernels: nothing was measured on {name} ({arch}); generic tiles, and impl=auto runs "
             f"the Triton kernels at every step size", "vllm_moonep.common")
    return NO_POLICY


def policy_of(x: torch.Tensor, path=None) -> DevicePolicy:
    """The policy of the GPU ``x`` lives on (``NO_POLICY`` off CUDA)."""
    return policy_for(probes.device_name(x), probes.cuda_capability(x), path)


def with_tiles(table: dict, device: str, tiles: list, capability: tuple[int, int] | None = None) -> dict:
    """``table`` with ``device``'s tile entries replaced by ``tiles`` (its regimes kept), as ``--tune`` writes
    it. Where ``device`` had no section, the new one keeps the regimes of the section it borrowed until now
    (its capability's fallback; none if there was none), as its tiles start from that section's (``--tune``
    measures tiles, not the libraries), and becomes its capability's fallback where that has none yet. A
    ``same_as`` device gets a section of its own the same way, from the section it named (its own regimes
    where it has them)."""
    out = {"comment": table.get("comment", ""), "fallback": dict(table.get("fallback", {})),
           "devices": {k: dict(v) for k, v in table.get("devices", {}).items()}}
    arch = None if capability is None else f"sm_{capability[0]}{capability[1]}"
    sec = out["devices"].get(device)
    if sec is None or "same_as" in sec:
        src = sec["same_as"] if sec is not None else (out["fallback"].get(arch) if arch else None)
        borrowed = out["devices"].get(src) if src is not None else None
        regimes = sec["auto"] if sec is not None and "auto" in sec else (borrowed or {}).get("auto", [])
        out["devices"][device] = {"tiles": [], "auto": [dict(r) for r in regimes]}
    out["devices"][device]["tiles"] = tiles
    if arch is not None:
        out["fallback"].setdefault(arch, device)
    return out
