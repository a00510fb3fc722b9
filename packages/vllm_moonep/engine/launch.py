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

Safety: a runner that refuses the call's arguments (another Triton's calling convention:
TypeError or IndexError) raises before any kernel starts; the launcher then says so once,
launches the ordinary way and stays there. Any other error (a CUDA error, a launch hook's) is
raised: the kernel may have run, and the engine's signalling kernels must not run twice. The key
includes the current device (a runner is bound to the GPU it was loaded on). Under the Triton
interpreter there is no compiled kernel, so every call is ordinary. ``FAST_LAUNCH``
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

    #: the most specializations kept per kernel (an argument that changes every call would
    #: otherwise grow the table without bound; past it, new keys launch the ordinary way)
    MAX_RUNNERS = 64

    def __init__(self, fn, fast: bool | None = None):
        self.fn = fn
        self.fast = FAST_LAUNCH if fast is None else bool(fast)
        # the interpreter (and a machine without CUDA) has no compiled kernel to keep
        self.fast = self.fast and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available()
        self.names = tuple(getattr(fn, "arg_names", ()))
        self.runners: dict = {}
        self.hits = 0  # calls that went through a compiled runner (tests read it)

    def _off(self, why: str) -> None:
        self.fast = False
        self.runners.clear()
        name = getattr(self.fn, "__name__", "a kernel")
        say_once(f"MoonEP: fast launch off for {name} ({why}); Triton's ordinary launch is used")

    def __call__(self, grid: tuple, *args, num_warps: int = 4, **consts) -> None:
        # the runner reads grid[0..2]; Triton's ordinary launch pads a shorter grid with ones
        grid = tuple(grid) + (1,) * (3 - len(grid))
        key = None
        if self.fast:
            # a runner is bound to the GPU its kernel was loaded on: the device is part of the key
            key = (torch.cuda.current_device(), grid, num_warps, tuple(consts.items()),
                   tuple(_arg_key(a) for a in args))
            run = self.runners.get(key)
            if run is not None:
                try:
                    run(*args, *[consts[n] for n in self.names[len(args):]])
                except (TypeError, IndexError) as exc:  # the arguments were refused: nothing launched
                    self._off(f"the compiled runner refused the call: {type(exc).__name__}: {exc}")
                else:
                    self.hits += 1
                    return
        k = self.fn[grid](*args, **consts, num_warps=num_warps)
        if self.fast and key is not None and key not in self.runners:
            if len(self.runners) >= self.MAX_RUNNERS:
                name = getattr(self.fn, "__name__", "a kernel")
                say_once(f"MoonEP: {name} has {self.MAX_RUNNERS} specializations kept; new ones launch the "
                         "ordinary way (an argument that changes every call?)")
                return
            if set(self.names[len(args):]) != set(consts):
                self._off("its parameters are not leading arguments then constexprs by name")
                return
            from triton.compiler import CompiledKernel

            if isinstance(k, CompiledKernel):
                self.runners[key] = k[grid]
