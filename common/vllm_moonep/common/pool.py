"""``MoonEPBufferPool``: MoonEP buffers at power-of-two token capacities, made on first use.

A ``Buffer`` fixes its capacity ``S`` at construction, so one full-size buffer would pad every
decode step to the prefill size. The pool serves the smallest power of two (at least 128, at
most the configured maximum) that fits the step. The choice must be the same on every rank,
since dispatch and construction are collective: callers pass the max token count across DP
ranks. At most ``log2(max / 128) + 2`` buffers ever exist. With ``make_all_at_first_use`` the first
``get`` makes every capacity (smallest first, the same order on every rank), so that memory is taken
at one known step (vLLM's profiling run, before it sizes the KV cache) rather than at the first step
of each size.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist

from vllm_moonep.engine import MoonEPInputError, MoonEPStateError, check_buffer_settings, make_buffer, resolve_device
from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING, say_once
from vllm_moonep.engine.faults.teardown import each

MIN_CAPACITY = 128


def as_int(value: object) -> int | None:
    """``value`` as an int where it is one (an int, numpy's, a one-element int tensor), else ``None``
    (a bool, a float, a str: ``int()`` would take some of them silently)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def capacity_for(num_tokens: int, max_tokens_per_rank: int, min_capacity: int = MIN_CAPACITY) -> int:
    """Smallest power of two >= ``num_tokens`` (and >= ``min_capacity``), capped at the maximum."""
    n = as_int(num_tokens)
    if n is None:
        raise MoonEPInputError(f"token count must be an int, got {type(num_tokens).__name__} {num_tokens!r}")
    num_tokens = n
    if num_tokens < 0:
        raise MoonEPInputError(f"token count must be >= 0, got {num_tokens}")
    if num_tokens > max_tokens_per_rank:
        raise MoonEPInputError(
            f"MoonEP capacity exceeded: {num_tokens} tokens > max_tokens_per_rank={max_tokens_per_rank}"
        )
    cap = 1 << max(num_tokens - 1, 0).bit_length()
    return min(max(cap, min_capacity), max_tokens_per_rank)


class MoonEPBufferPool:
    """Lazily made buffers keyed by capacity.

    Args:
        buffer_kwargs: the ``Buffer`` arguments except ``S`` (``H, K, E, num_ep_ranks, B,
            token_padding, group, num_sms, device, ...``).
        max_tokens_per_rank: the largest capacity.
        engine: ``auto`` | ``builtin`` | ``moonep`` (``vllm_moonep.engine.make_buffer``).
        make_all_at_first_use: the first ``get`` makes every capacity (``capacities``), not only its own.
    """

    def __init__(self, buffer_kwargs: dict[str, Any], max_tokens_per_rank: int, engine: str = "auto",
                 min_capacity: int = MIN_CAPACITY, *, make_all_at_first_use: bool = False):
        top = as_int(max_tokens_per_rank)
        if top is None or top <= 0:
            raise MoonEPInputError(f"max_tokens_per_rank must be an int > 0, got {type(max_tokens_per_rank).__name__} "
                                   f"{max_tokens_per_rank!r}")
        self._kwargs = {k: v for k, v in buffer_kwargs.items() if k != "S"}
        try:  # at construction, not at the first get() mid-serving: a misspelt or bad setting
            check_buffer_settings(top, self._kwargs)
        except MoonEPInputError as exc:
            raise MoonEPInputError(f"MoonEPBufferPool: buffer_kwargs at max_tokens_per_rank={top}: {exc}") from None
        # The step's ids and counts come from padding.tokens_per_expert (ids range-checked there,
        # counts derived from the ids), so the engine's per-call re-validation would only add host
        # synchronizations on a GPU; keep it on CPU, where it is free, unless the caller says.
        if "check_inputs" not in self._kwargs:
            self._kwargs["check_inputs"] = resolve_device(self._kwargs.get("device")).type != "cuda"
        self.max_tokens_per_rank = top
        self.min_capacity = int(min_capacity)
        self.engine = engine
        self.make_all_at_first_use = bool(make_all_at_first_use)
        self._made_all = False
        self.buffers: dict[int, Any] = {}
        self._destroyed = False
        self._pad_expert: int | None = None
        self._staging: tuple[torch.Tensor, ...] | None = None
        self._staging_views: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def buffer_kwargs(self) -> dict[str, Any]:
        """The ``Buffer`` arguments (except ``S``) every buffer of this pool is made with."""
        return dict(self._kwargs)

    @property
    def token_padding(self) -> int:
        """The multiple each group's segment of dispatched rows is padded to (and starts at), in every buffer of
        this pool: the expert compute's DeepGEMM paths need it."""
        return int(self._kwargs.get("token_padding", DEFAULT_TOKEN_PADDING))

    @property
    def pad_expert(self) -> int:
        """The expert that padding rows of this rank route to: its first home expert (``rank * E/R``),
        so padding never leaves the rank (``padding.pad_to_capacity``)."""
        if self._pad_expert is None:
            E, R = int(self._kwargs.get("E") or 0), int(self._kwargs.get("num_ep_ranks") or 1)
            rank = dist.get_rank(self._kwargs.get("group")) if dist.is_available() and dist.is_initialized() else 0
            self._pad_expert = max(rank, 0) * (E // R) if E and R > 0 else 0
        return self._pad_expert

    def staging(self, capacity: int, hidden: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Where a CUDA step of ``capacity`` tokens is padded to (``padding.pad_and_count``):
        ``(x [cap, H] bf16, ids [cap, K] int32, w [cap, K] f32, tpe [E] int32)``, views of one set
        sized for the largest capacity (Kimi-K2 at 8192 tokens: 117 MB), made at the first CUDA
        step. Fixed addresses: each capacity's dispatch graph reads them in place. ``None`` for
        hidden states off this pool's CUDA device (torch ops pad those)."""
        if not hidden.is_cuda:
            return None
        if self._staging is None:
            dev = resolve_device(self._kwargs.get("device"))
            if dev.type != "cuda":
                return None
            H, K, E = (int(self._kwargs[k]) for k in ("H", "K", "E"))
            top = self.capacity_for(self.max_tokens_per_rank)
            self._staging = (torch.empty(top, H, dtype=torch.bfloat16, device=dev),
                             torch.empty(top, K, dtype=torch.int32, device=dev),
                             torch.empty(top, K, dtype=torch.float32, device=dev),
                             torch.empty(E, dtype=torch.int32, device=dev))
            self._staging_views = {}
            mib = sum(t.numel() * t.element_size() for t in self._staging) / 2**20
            say_once(f"MoonEP: CUDA steps are padded and counted by one kernel into staging tensors of the buffer pool "
                     f"({mib:.0f} MiB for {top} tokens per rank; common/pad_kernel.py)", __name__)
        views = self._staging_views.get(capacity)
        if views is None:
            x, ids, w, tpe = self._staging
            views = self._staging_views[capacity] = (x[:capacity], ids[:capacity], w[:capacity], tpe)
        return views if views[0].device == hidden.device else None

    def capacity_for(self, num_tokens: int) -> int:
        return capacity_for(num_tokens, self.max_tokens_per_rank, self.min_capacity)

    def get(self, num_tokens: int) -> tuple[int, Any]:
        """``(capacity, buffer)`` for a step of ``num_tokens`` (the max across DP ranks)."""
        if self._destroyed:
            raise MoonEPStateError("MoonEPBufferPool.get: the pool was destroyed")
        cap = self.capacity_for(num_tokens)
        if self.make_all_at_first_use and not self._made_all:
            for c in self.capacities:  # collective, in one order on every rank (its first get is every rank's);
                if c not in self.buffers:  # after a failed first get, the next one makes what is missing
                    self.buffers[c] = make_buffer(S=c, engine=self.engine, **self._kwargs)
            self._made_all = True
        buf = self.buffers.get(cap)
        if buf is None:
            buf = make_buffer(S=cap, engine=self.engine, **self._kwargs)
            self.buffers[cap] = buf
        return cap, buf

    @property
    def capacities(self) -> list[int]:
        """Every capacity a step can get, smallest first."""
        return sorted({min(c, self.max_tokens_per_rank) for c in self._powers()})

    def _powers(self) -> list[int]:
        out, c = [self.min_capacity], self.min_capacity
        while c < self.max_tokens_per_rank:
            c *= 2
            out.append(c)
        return out

    @property
    def max_buffers(self) -> int:
        """Upper bound on how many buffers this pool can hold."""
        return len(self._powers())

    def destroy(self) -> None:
        """Destroy every buffer, newest first; idempotent. With the built-in engine this issues no
        collective on the collective transport, and on the symmetric one frees heap memory
        collectively, locally after a failed step: it works after a failure either way. Call
        before the process group is destroyed. Every buffer is destroyed even if one raises (the
        first error is re-raised)."""
        self._destroyed = True
        self._staging = None
        self._staging_views = {}
        newest_first = [self.buffers.popitem()[1] for _ in range(len(self.buffers))]
        each(lambda buf: buf.destroy(), newest_first, Exception)  # as it always did: every buffer is tried
