"""Triton launches that skip Triton's per-call Python once a kernel is compiled.

    first call for a key ─► kernel[grid](*args, **consts, num_warps=)  (binds, specializes,
                            compiles or finds the cache) ─► CompiledKernel kept for the key
    later calls, same key ─► its C launcher: run(grid, stream, function, metadata, *parameters)

Why: the engine's kernels take 5-40 us on the device, while Triton's Python dispatch (binding
~20 arguments, computing specialization keys, the cache lookup) costs 20-60 us of host time per
launch, and even the compiled kernel's own runner (``kernel[grid](...)``: device and stream
lookups, launch metadata and hook reads on every call) measured 17-42 us per launch on the H200
hosts (docs/PERFORMANCE.md); eleven launches per dispatch and combine then cost more than the
data movement, and the peer waits for them. The key is what Triton specializes a call on: each
tensor's dtype and 16-byte alignment, each integer's "is 1", "divisible by 16" and "fits in 32
bits", the grid, the warps and the constexprs. A call whose key was seen goes straight to the C
launcher on torch's current raw stream.

Safety: a launcher that refuses the call's arguments (another Triton's calling convention:
TypeError or IndexError) raises before any kernel starts; the launcher then says so once,
launches the ordinary way and stays there. Any other error (a CUDA error) is raised: the kernel
may have run, and the engine's signalling kernels must not run twice. The key includes the
current device (a compiled kernel is loaded on one GPU). Triton's launch hooks (its profiler,
proton) do not see these launches; ``VLLM_MOONEP_FAST_LAUNCH=0`` keeps every launch ordinary
(``FAST_LAUNCH``, the one default). Under the Triton interpreter there is no compiled kernel, so
every call is ordinary.
"""

from __future__ import annotations

import inspect
import os
import time

import torch

from vllm_moonep.engine.defaults import say_once

__all__ = ["FAST_LAUNCH", "Launcher", "capability", "interpreting", "sm_count"]

#: the runner path on by default; ``VLLM_MOONEP_FAST_LAUNCH=0`` keeps every launch ordinary
FAST_LAUNCH = os.environ.get("VLLM_MOONEP_FAST_LAUNCH", "1") != "0"


_PROPS: dict[int, object] = {}


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _props(device: torch.device):
    """``torch.cuda.get_device_properties`` of ``device``, read once per GPU (launch paths ask per call)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PROPS:
        _PROPS[idx] = torch.cuda.get_device_properties(idx)
    return _PROPS[idx]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``, what persistent grids are sized by; 2 off CUDA (the
    interpreter runs any grid)."""
    return _props(device).multi_processor_count if device.type == "cuda" else 2


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA ``device``."""
    p = _props(device)
    return p.major, p.minor


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
    #: ``{kernel name: [calls, host seconds]}`` while a profile runs (``bench_dispatch
    #: --profile``); ``None``, the default, costs one attribute read per launch
    timings: dict[str, list] | None = None

    def __init__(self, fn, fast: bool | None = None):
        self.fn = fn
        self.fast = FAST_LAUNCH if fast is None else bool(fast)
        # the interpreter (and a machine without CUDA) has no compiled kernel to keep
        self.fast = self.fast and not interpreting() and torch.cuda.is_available()
        self.names = tuple(getattr(fn, "arg_names", ()))
        self.runners: dict = {}
        self.hits = 0  # calls that went through a compiled runner (tests read it)

    def _off(self, why: str) -> None:
        self.fast = False
        self.runners.clear()
        name = getattr(self.fn, "__name__", "a kernel")
        say_once(f"MoonEP: fast launch off for {name} ({why}); Triton's ordinary launch is used")

    def __call__(self, grid: tuple, *args, num_warps: int = 4, **consts) -> None:
        if Launcher.timings is not None:
            t0 = time.perf_counter()
            self._launch(grid, args, num_warps, consts)
            rec = Launcher.timings.setdefault(getattr(self.fn, "__name__", "?"), [0, 0.0])
            rec[0] += 1
            rec[1] += time.perf_counter() - t0
            return
        self._launch(grid, args, num_warps, consts)

    def _launch(self, grid: tuple, args: tuple, num_warps: int, consts: dict) -> None:
        # the C launcher reads grid[0..2]; Triton's ordinary launch pads a shorter grid with ones
        grid = tuple(grid)
        if len(grid) != 3:
            grid += (1,) * (3 - len(grid))
        key = None
        if self.fast:
            # a compiled kernel is loaded on one GPU: the device is part of the key
            dev = torch.cuda.current_device()
            key = (dev, grid, num_warps, tuple(consts.items()), tuple(map(_arg_key, args)))
            hit = self.runners.get(key)
            if hit is not None:
                launch, fixed, tail = hit
                try:
                    launch(grid[0], grid[1], grid[2], _raw_stream(dev), *fixed, *args, *tail)
                except (TypeError, IndexError) as exc:  # the arguments were refused: nothing launched
                    self._off(f"the compiled kernel's launcher refused the call: {type(exc).__name__}: {exc}")
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
            tail_names = self.names[len(args):]
            if set(tail_names) != set(consts):
                self._off("its parameters are not leading arguments then constexprs by name")
                return
            from triton.compiler import CompiledKernel

            if isinstance(k, CompiledKernel) and hasattr(k, "_init_handles"):
                k._init_handles()  # loads the module on this GPU and sets k.run / k.function
                if all(hasattr(k, a) for a in ("run", "function", "packed_metadata")):
                    self.runners[key] = (*_c_launch(k), tuple(consts[n] for n in tail_names))
                else:
                    self._off("this Triton's compiled kernel has no run/function/packed_metadata")


def _c_launch(k) -> tuple:
    """``(launch, fixed)``: ``launch(gx, gy, gz, stream, *fixed, *parameters)`` starts compiled
    kernel ``k`` with no launch metadata and no hooks.

    Triton 3.6's ``CudaLauncher.__call__(gx, gy, gz, stream, function, *rest)`` only allocates
    scratch and calls its C ``launch`` with the cooperative/PDL flags and the two scratch buffers
    spliced in; for a kernel with no scratch the C function is called directly (the Python wrapper
    measured several microseconds per launch). Any other launcher gets the calling convention of
    ``CompiledKernel.__getitem__``'s runner (Triton 3.2 to 3.8): ``run(gx, gy, gz, stream,
    function, packed_metadata, launch_metadata, enter_hook, exit_hook, *parameters)``.
    """
    run = k.run
    call = getattr(type(run), "__call__", None)
    try:
        params = list(inspect.signature(call).parameters.values()) if call is not None else []
    except (TypeError, ValueError):
        params = []
    shape_36 = ([p.name for p in params[:6]] == ["self", "gridX", "gridY", "gridZ", "stream", "function"]
                and len(params) == 7 and params[6].kind is inspect.Parameter.VAR_POSITIONAL)
    if (shape_36 and callable(getattr(run, "launch", None)) and getattr(run, "global_scratch_size", None) == 0
            and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        return run.launch, (k.function, run.launch_cooperative_grid, run.launch_pdl, None, None, k.packed_metadata,
                            None, None, None)
    return run, (k.function, k.packed_metadata, None, None, None)


def _stream_getter():
    """``index -> raw CUDA stream handle`` of torch's current stream (what Triton's own launch
    passes); the public API where torch lacks the raw accessor."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_raw_stream = _stream_getter()
