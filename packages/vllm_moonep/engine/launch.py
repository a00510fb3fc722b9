"""Triton launches that skip Triton's per-call dispatch once a kernel is compiled.

    first call for a key ─► kernel[grid](*args, **consts, num_warps=)  (binds, specializes,
                            compiles or finds the cache) ─► CompiledKernel ─► runner kept
    later calls, same key ─► runner(*every parameter in signature order)   (one C launch)

Why: the engine's kernels take 5-40 us on the device, while Triton's Python dispatch (binding
~20 arguments, computing specialization keys, the cache lookup) costs 20-60 us of host time per
launch; eight launches per dispatch then cost more than the data movement, and the peer waits for
them. The key is what Triton specializes a call on: each tensor's dtype and 16-byte alignment,
each integer's "is 1", "divisible by 16" and "fits in 32 bits", the grid, the warps and the
constexprs. A call whose key was seen goes straight to the compiled runner.

Safety: a runner that refuses the call (another Triton's calling convention) raises before any
kernel starts; the launcher then says so once, launches the ordinary way and stays there. Under
the Triton interpreter there is no compiled kernel, so every call is ordinary. ``FAST_LAUNCH``
(``VLLM_MOONEP_FAST_LAUNCH=0`` turns it off) is the one default.
"""

from __future__ import annotations

import os

import torch

from vllm_moonep.engine.defaults import say_once

__all__ = ["FAST_LAUNCH", "Launcher"]

#: the runner path on by default; ``VLLM_MOONEP_FAST_LAUNCH=0`` keeps every launch ordinary
FAST_LAUNCH = os.environ.get("VLLM_MOONEP_FAST_LAUNCH", "1") != "0"


def _arg_key(v) -> object:
    """What Triton specializes one runtime argument on."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, -(2**31) <= v < 2**31)
    if isinstance(v, float):
        return "f"
    return (type(v).__name__, v)


class Launcher:
    """One Triton kernel, launched through its compiled runner once the call's key was seen.

    ``launcher(grid, *args, num_warps=4, **constexprs)``: ``args`` are the kernel's leading
    runtime parameters in order, ``constexprs`` the rest by name (as an ordinary launch takes them).
    """

    def __init__(self, fn, fast: bool | None = None):
        self.fn = fn
        self.fast = FAST_LAUNCH if fast is None else bool(fast)
        self.names = tuple(getattr(fn, "arg_names", ()))
        self.runners: dict = {}

    def _off(self, why: str) -> None:
        self.fast = False
        self.runners.clear()
        name = getattr(self.fn, "__name__", "a kernel")
        say_once(f"MoonEP: fast launch off for {name} ({why}); Triton's ordinary launch is used")

    def __call__(self, grid: tuple, *args, num_warps: int = 4, **consts) -> None:
        key = None
        if self.fast:
            key = (grid, num_warps, tuple(consts.items()), tuple(_arg_key(a) for a in args))
            run = self.runners.get(key)
            if run is not None:
                try:
                    run(*args, *[consts[n] for n in self.names[len(args):]])
                    return
                except Exception as exc:  # refused before launching: nothing ran
                    self._off(f"the compiled runner refused the call: {type(exc).__name__}: {exc}")
        k = self.fn[grid](*args, **consts, num_warps=num_warps)
        if self.fast and key is not None and key not in self.runners:
            if set(self.names[len(args):]) != set(consts):
                self._off("its parameters are not leading arguments then constexprs by name")
                return
            from triton.compiler import CompiledKernel

            if isinstance(k, CompiledKernel):
                self.runners[key] = k[grid]
