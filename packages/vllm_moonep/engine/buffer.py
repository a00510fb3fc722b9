"""The built-in MoonEP engine: ``Buffer`` with the ``[E+B]`` contract (docs/CONTRACT.md).

``dispatch`` plans (identically on every rank), moves each token slot to the rank and row the
plan gives it, and returns the expert-grouped shard; ``prefetch_weight`` fills slot rows
``[E, E+B)``; ``combine`` brings the expert outputs home and sums each token's K rows in fp32::

    Buffer.__init__   config agreed on every rank ─► nodes ─► transport (transports/select.py)
    Buffer.dispatch   input checks ─► transport.plan ─► transport.dispatch ─► Plan(step n)
    Buffer.prefetch   plan is the latest ─► slot rows copied (row_copy.py)
    Buffer.combine    plan is the latest, rows checked ─► transport.combine(plan's state)
    Buffer.destroy    transport.close (local after a failure) ─► the bounded collectives

The ``Buffer`` holds what every transport shares (checks, the step counter, the group's failure
state, teardown order); how rows move is the transport's (``transports/base.py``).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from vllm_moonep.engine.defaults import DEFAULT_TOKEN_PADDING, default_num_slots, resolve_device, say_once
from vllm_moonep.engine.errors import MoonEPCollectiveTimeout, MoonEPError, MoonEPInputError, MoonEPStateError
from vllm_moonep.engine.faults.bounded_collectives import BoundedCollectives
from vllm_moonep.engine.nodes import (
    NodeMap,
    host_id,
    parse_ranks_per_node,
    ranks_per_node_text,
    refuse_bad_ranks_per_node,
    resolve_nodes,
)
from vllm_moonep.engine.planning.host_plan import CONFIG_WORDS, TAG_CONFIG, exchange_framed
from vllm_moonep.engine.planning.planner import GlobalPlan
from vllm_moonep.engine.protocol import MoonEPPlan
from vllm_moonep.engine.row_copy import MAX_PLANES, copy_rows
from vllm_moonep.engine.transports.base import Transport
from vllm_moonep.engine.transports.collective import CollectiveTransport
from vllm_moonep.engine.transports.select import TRANSPORTS, resolve_transport

if TYPE_CHECKING:  # the symmetric and hybrid transports are imported where a buffer makes one
    from torch.distributed import ProcessGroup

    from vllm_moonep.engine.heaps.base import SymmetricHeap
    from vllm_moonep.engine.transports.hybrid import HybridTransport
    from vllm_moonep.engine.transports.symmetric import SymmetricTransport

__all__ = ["Buffer", "Plan", "check_buffer_settings", "nvs_rows", "resolve_device", "validate_config"]


#: upstream bounds (contract, "Buffer")
MAX_RANKS = 128
MAX_TOPK = 32
MAX_NVS = 2**24


def nvs_rows(S: int, K: int, E: int, R: int, token_padding: int) -> int:
    """Rows of the dispatched shard: ``S*K + (tp - 1) * 2 * epn``."""
    return S * K + (token_padding - 1) * 2 * (E // R)


def validate_config(S: int, H: int, K: int, E: int, R: int, B: int | None, token_padding: int, *,
                    num_sms: object = None, heap: object = None) -> None:
    """Raise ``MoonEPInputError`` naming the first violated bound of the contract (``B=None``,
    an unfilled default, is refused like any other bad ``B``), or the first bad option: ``num_sms``
    ``None`` or a positive int, ``heap`` ``None``, a ``SymmetricHeap`` or one of ``HEAP_KINDS``
    (checked whatever the transport: a misspelt option must not pass where it happens to be unused)."""
    checks = [
        (isinstance(S, int) and S > 0, f"S (tokens per rank) must be a positive int, got {S!r}"),
        (isinstance(H, int) and H > 0, f"H (hidden size) must be a positive int, got {H!r}"),
        (isinstance(K, int) and 0 < K <= MAX_TOPK, f"K (top-k) must be in [1, {MAX_TOPK}], got {K!r}"),
        (isinstance(R, int) and 0 < R <= MAX_RANKS, f"num_ep_ranks must be in [1, {MAX_RANKS}], got {R!r}"),
        (isinstance(E, int) and E > 0, f"E (experts) must be a positive int, got {E!r}"),
        (isinstance(E, int) and isinstance(R, int) and R > 0 and E % R == 0,
         f"E={E} experts must be divisible by num_ep_ranks={R}"),
        (isinstance(B, int) and B > 0, f"B (prefetch slots) must be > 0, got {B!r}"),
        (isinstance(token_padding, int) and token_padding > 0, f"token_padding must be > 0, got {token_padding!r}"),
        # num_sms=-3 ran 1 program and 'many' a bare ValueError on the symmetric transport, both passed on
        # the collective one; a bool is an int to Python, not an SM count
        (num_sms is None or (isinstance(num_sms, int) and not isinstance(num_sms, bool) and num_sms > 0),
         f"num_sms (SMs of the symmetric transport's row kernels) must be None or a positive int, got {num_sms!r}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise MoonEPInputError(msg)
    _check_heap_option(heap)
    nvs = nvs_rows(S, K, E, R, token_padding)
    if nvs >= MAX_NVS:
        raise MoonEPInputError(f"NvS={nvs} rows must be < 2**24 (S={S}, K={K}, E={E}, R={R}, tp={token_padding})")


def _check_heap_option(heap: object) -> None:
    """``Buffer(heap=)``: ``None``, a ``SymmetricHeap`` or a kind of ``HEAP_KINDS``, else ``MoonEPInputError``
    (``heap='hots'`` was silently ignored wherever the transport made no heap: the collective one)."""
    if heap is None:
        return
    from vllm_moonep.engine.heaps import HEAP_KINDS, SymmetricHeap  # light (the GPU heaps load lazily)

    if isinstance(heap, str):
        if heap not in HEAP_KINDS:
            raise MoonEPInputError(f"heap must be None, a SymmetricHeap or one of {HEAP_KINDS}, got {heap!r}")
    elif not isinstance(heap, SymmetricHeap):
        raise MoonEPInputError(f"heap must be None, a SymmetricHeap or one of {HEAP_KINDS}, got {type(heap).__name__}")


def _checked_settings(S: int, H: int, K: int, E: int, R: int, num_sms: object, token_padding: int, B: int | None,
                      dtype: object, transport: object, heap: object, check_inputs: object,
                      unknown: dict[str, object]) -> int:
    """``B`` (its default filled in) once ``Buffer``'s settings pass every check made before a collective,
    else ``MoonEPInputError`` naming the first bad one."""
    if unknown:
        raise MoonEPInputError(
            f"Buffer got unknown keyword(s) {sorted(unknown)}; it takes S, H, K, E, num_ep_ranks, num_sms, "
            "token_padding, B, group, explicitly_destroy, device, dtype, check_inputs, timeout_s, transport, heap"
        )
    if transport not in TRANSPORTS:
        raise MoonEPInputError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if B is None and isinstance(E, int) and isinstance(R, int) and R > 0:
        B = default_num_slots(E, R)
    validate_config(S, H, K, E, R, B, token_padding, num_sms=num_sms, heap=heap)
    assert B is not None  # validate_config refuses None
    if dtype not in (torch.bfloat16, torch.float32):
        raise MoonEPInputError(f"dtype must be torch.bfloat16 (or float32 for tests), got {dtype}")
    if not isinstance(check_inputs, bool):  # a truthy 'no' or 0/1 from a config file reads as a choice it is not
        raise MoonEPInputError(f"check_inputs must be True or False, got {check_inputs!r}")
    return B


def check_buffer_settings(S: int, settings: dict[str, Any]) -> None:
    """What ``Buffer(S, **settings)`` would refuse before its first collective, without building it
    (``MoonEPInputError``): a pool checks the settings of the buffers it will make at its construction,
    not at its first step."""
    try:
        bound = inspect.signature(Buffer).bind(S, **settings)
    except TypeError as exc:  # a required setting missing, or one given twice
        raise MoonEPInputError(f"Buffer settings: {exc}") from None
    bound.apply_defaults()
    a = bound.arguments
    _checked_settings(S, a["H"], a["K"], a["E"], a["num_ep_ranks"], a["num_sms"], a["token_padding"], a["B"],
                      a["dtype"], a["transport"], a["heap"], a["check_inputs"], a["unknown"])


#: a fresh token per ``Buffer`` (``Plan.owner``): ``id()`` comes back once a buffer is collected, so a
#: plan of a destroyed buffer passed for the plan of a new one at the same address and step
_OWNER_TOKENS = itertools.count(1)


@dataclass
class Plan:
    """What ``dispatch`` decided, kept for ``prefetch_weight`` and ``combine``.

    ``experts_to_copy [R, B]`` int32 is the public part (the same on every rank). The rest is
    this rank's bookkeeping: the step, the whole plan, this rank's segments, and the transport's
    own record of where rows went (``transport_state``, which only its combine reads).
    """

    experts_to_copy: torch.Tensor
    global_plan: GlobalPlan = field(repr=False)
    owner: int = field(repr=False)  # the token of the Buffer that made it (never reused, unlike id())
    step: int = 0
    transport_state: Any = field(default=None, repr=False)
    cu_seqlens: torch.Tensor | None = field(default=None, repr=False)  # this rank's [E+B] int32
    # this rank's rows per segment [E+B] int32, padding included, where the transport wrote them
    # (the GPU symmetric transport's row kernel); else made from cu_seqlens when first asked
    rows: torch.Tensor | None = field(default=None, repr=False)
    # this rank's end of each segment's entries [E+B] int32 (rows from there to the segment's end are its
    # padding tail), where the transport wrote them (the GPU symmetric transport's row kernel): the
    # expert kernels then need not find them (``expert_ffn(row_ends=...)``); None elsewhere
    live_ends: torch.Tensor | None = field(default=None, repr=False)
    # set by the plan's combine: a second one is refused (the GPU symmetric transport's combine returns every
    # moved row to padding, so a second would send nothing and return the first one's sums)
    combined: bool = field(default=False, repr=False)

    @property
    def slots_used(self) -> int:
        return int((self.experts_to_copy >= 0).sum())

    @property
    def rows_per_group(self) -> torch.Tensor:
        """``cu_seqlens`` as rows per segment (``[E+B]`` int32, padding included; what vLLM's
        ``expert_num_tokens`` holds): on GPUs the dispatch kernel wrote them, so asking costs no
        launch; elsewhere they are computed once from ``cu_seqlens``."""
        if self.rows is None:
            if self.cu_seqlens is None:
                raise MoonEPStateError("this plan has no cu_seqlens to count rows from")
            cu = self.cu_seqlens
            self.rows = torch.diff(cu, prepend=cu.new_zeros(1)).to(torch.int32)
        return self.rows


class Buffer:
    """The built-in MoonEP engine for one MoE layer shape (collective, not thread-safe).

    The contract (``docs/CONTRACT.md`` in the repository), in short. Construction, ``destroy()`` and every call
    below are collective: every rank of the EP group makes the same calls in the same order.

    Per step, in this order (one step in flight per buffer):

    1. ``dispatch(hidden_sh [S,H] bf16, route_weights_sk [S,K] f32, topk_experts_sk [S,K] int32,
       tokens_per_expert [E] int32)`` -> ``(hidden_nvsh [NvS,H], route_weights_nvs [NvS] f32,
       cu_seqlens [E+B] int32, plan)``. Every rank passes exactly ``S`` rows (pad); ids in
       ``[0, E)`` (int32: convert ``torch.topk``'s int64 with ``.to(torch.int32)``);
       ``tokens_per_expert`` is the bincount of the ids. The shard is grouped by expert row:
       segment ``g < E`` for expert ``g``, ``E+b`` for slot ``b``, each padded to a multiple of
       ``token_padding`` with zero rows (weight 0); rows past ``cu_seqlens[-1]`` are undefined.
       ``plan.experts_to_copy [R,B]`` names the expert in each rank's slots (``-1``: unused).
    2. ``prefetch_weight(plan=, full_gate_weight=, full_up_weight=, full_down_weight=)``: slot row
       ``E+b`` of each ``[E+B, out, in]`` bf16 weight becomes a copy of row
       ``experts_to_copy[rank, b]`` (layouts that own their slots do this themselves).
    3. the expert compute, which applies ``route_weights_nvs`` to its output rows;
    4. ``combine(plan, hidden_nvsh [NvS,H], route_weights_nvs=None)`` -> ``(hidden_sh [S,H],
       route_weights_sk or None, None)``: each token's K rows summed in fp32, rounded once.

    Args: ``S`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``num_ep_ranks`` R,
    ``num_sms`` (SMs the symmetric transport's row-moving kernels use; ``None``: its default), ``token_padding``, ``B`` slots per rank (``None``: ``E // R``), ``group`` (the EP
    process group; ``None``: the default group), ``explicitly_destroy`` (accepted for upstream
    compatibility: this buffer is always destroyed explicitly). Keywords of this engine:

    - ``transport``: ``"auto"`` | ``"symmetric"`` | ``"collective"`` | ``"hybrid"``
      (``vllm_moonep.engine.transports``). ``symmetric``: one-sided writes into peers' buffers on a
      symmetric heap with device-side signals, no host synchronization and CUDA-graph capturable
      on GPUs (CPU ranks run the same protocol over the host heap); every peer on this node.
      ``collective``: all-gather + all-to-all (gloo/NCCL). ``hybrid``: per peer, one-sided writes
      to peers on this node and one all-to-all to peers on other nodes (host-planned). ``auto``
      on CUDA: ``symmetric`` on one node, ``hybrid`` across nodes with several ranks on a node,
      else ``collective``; on CPU ``collective``. Nodes are the hosts, or simulated ones from
      ``VLLM_MOONEP_RANKS_PER_NODE`` (``engine/nodes.py``; ``buffer.nodes``).
    - ``heap``: the symmetric heap (a ``SymmetricHeap`` spanning the group, or a kind:
      ``"auto"``/``"host"``/``"torch"``/``"nvshmem"``); ``None``: ``auto`` (the buffer owns it).
      The hybrid transport makes its own heap over this node's ranks and takes a kind only.
    - ``device`` (default: the current CUDA device if available, else CPU), ``dtype`` of the rows
      (bf16 by contract; float32 allowed for exact tests), ``check_inputs`` (validate the values of
      every call on the host: costs a host synchronization on GPU; without it the GPU path still
      checks ids on the device and reports through the error board), ``timeout_s`` (bound on each
      collective and device-side wait; ``None``: ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S`` or 300 s).

    Unknown keywords are refused, and so are a ``num_sms`` that is not ``None`` or a positive int and a
    ``heap`` kind not in ``HEAP_KINDS`` on every transport (a misspelt option must not be silently ignored).

    Faults: when a peer dies or stops calling, the collective transport raises
    ``MoonEPCollectiveTimeout`` within ``timeout_s`` naming the operation, the step and the peer;
    the symmetric transport's device-side waits give up after ``timeout_s`` and the next call (or
    ``check_errors(sync=True)``) raises the same error; the hybrid transport's waits for its node
    peers raise it at once, naming the late peer. The group is unusable afterwards: every
    call except ``destroy()`` then raises. ``destroy()`` works after a failure (teardown is local
    then); it must run before the process group is destroyed.
    """

    engine_name = "builtin"

    def __init__(
        self,
        S: int,
        H: int,
        K: int,
        E: int,
        num_ep_ranks: int,
        num_sms: int | None = None,
        token_padding: int = DEFAULT_TOKEN_PADDING,
        B: int | None = None,
        group: ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        check_inputs: bool = True,
        timeout_s: float | None = None,
        transport: str = "auto",
        heap: SymmetricHeap | str | None = None,
        explicitly_destroy: bool = True,
        **unknown: object,
    ) -> None:
        R = num_ep_ranks
        B = _checked_settings(S, H, K, E, R, num_sms, token_padding, B, dtype, transport, heap, check_inputs, unknown)
        self.collectives = BoundedCollectives(group, world_size=R, timeout_s=timeout_s)
        if self.collectives.world_size != R:
            self.collectives.close()
            raise MoonEPInputError(
                f"num_ep_ranks={R} does not match the process group's size {self.collectives.world_size}"
            )
        self.device = resolve_device(device)
        self._token = next(_OWNER_TOKENS)  # Plan.owner: this buffer's, never another's (unlike id())
        self.S, self.H, self.K, self.E, self.R, self.B = S, H, K, E, R, B
        self.epn = E // R
        self.token_padding = token_padding
        self.num_sms = num_sms
        self.dtype = dtype
        self.check_inputs = check_inputs
        self.rank = self.collectives.rank
        self.NvS = nvs_rows(S, K, E, R, token_padding)
        self._ctx: dict[str, int] = {"NvS": self.NvS, "S": S, "H": H, "K": K, "E": E, "B": B, "R": R, "tp": token_padding}
        self._destroyed = False
        self._step = 0
        self._transport: Transport | None = None
        # Construction is collective: every rank must agree on the shape of the buffer, the
        # transport and the ranks per simulated node; the host each rank runs on tells which
        # peers share its node (addressable memory).
        try:
            rpn_text = ranks_per_node_text()
            rpn_code = parse_ranks_per_node(rpn_text)  # -1: not a positive integer, refused below on every rank
            asked = TRANSPORTS.index(transport)
            mine = torch.tensor([S, H, K, E, R, B, token_padding, asked, rpn_code, host_id()], dtype=torch.int64,
                                device=self.collectives.comm_device)
            assert mine.numel() == CONFIG_WORDS
            # framed like dispatch's counts (host_plan.py): a peer dispatching meanwhile is named, not
            # read as a configuration (nor a size mismatch aborting the process in gloo)
            every = exchange_framed(self.collectives, TAG_CONFIG, S, E, mine, "Buffer.__init__ (config check)")
            if bool((every[:, 8] < 0).any()):  # every rank sees it: the values' text, then one error everywhere
                texts = self.collectives.all_gather_object(rpn_text, "Buffer.__init__ (ranks per node)")
                refuse_bad_ranks_per_node(texts, "MoonEP Buffer")
            rpn = rpn_code or None
            if not bool((every[:, :9] == mine[:9].cpu()).all()):
                rows = every[:, :9].tolist()
                raise MoonEPInputError(
                    "MoonEP Buffer configuration differs across ranks ([S,H,K,E,R,B,tp,transport,ranks per node "
                    "(VLLM_MOONEP_RANKS_PER_NODE, 0: unset)] per rank): " + str(rows)
                )
            self.nodes: NodeMap = resolve_nodes([int(h) for h in every[:, 9].tolist()], rpn)
            self.transport_name, why = resolve_transport(transport, self.device.type, nodes=self.nodes)
            say_once(f"MoonEP built-in engine: transport={self.transport_name} ({why})")
            self._transport = self._make_transport(heap, group, num_sms)
        except BaseException:
            self.destroy()
            raise

    # ------------------------------------------------------------------ helpers
    def _make_transport(self, heap: SymmetricHeap | str | None, group: ProcessGroup | None,
                        num_sms: int | None) -> Transport:
        """The transport ``transport_name`` names, on this buffer's shape (collective over the group)."""
        name = self.transport_name
        S, K, E, B, H, NvS, tp, dtype = self.S, self.K, self.E, self.B, self.H, self.NvS, self.token_padding, self.dtype
        if name == "symmetric":
            from vllm_moonep.engine.transports.symmetric import SymmetricTransport

            return SymmetricTransport.on_heap(heap, group, self.device, R=self.R, rank=self.rank, S=S, K=K, H=H, E=E,
                                              B=B, NvS=NvS, token_padding=tp, dtype=dtype,
                                              timeout_s=self.collectives.timeout_s, num_sms=num_sms)
        if name == "hybrid":
            from vllm_moonep.engine.transports.hybrid import HybridTransport, node_heap_kind

            kind = node_heap_kind(heap, self.device)  # on every rank, before any collective of the set-up
            return HybridTransport(self.collectives, self.nodes, group, heap_kind=kind, S=S, K=K, E=E, B=B, H=H,
                                   NvS=NvS, token_padding=tp, dtype=dtype, device=self.device)
        return CollectiveTransport(self.collectives, S=S, K=K, E=E, B=B, H=H, NvS=NvS, token_padding=tp, dtype=dtype,
                                   device=self.device)

    @property
    def transport(self) -> Transport:
        """The transport that moves this buffer's rows (``transport_name`` says which)."""
        t = self._transport
        if t is None:
            raise MoonEPStateError("Buffer.transport: the buffer was destroyed (or never finished construction)")
        return t

    @property
    def _sym(self) -> SymmetricTransport | None:
        """The symmetric transport, when it is this buffer's (its graphs, heap and launchers)."""
        t = self._transport
        return cast("SymmetricTransport", t) if t is not None and t.name == "symmetric" else None

    @property
    def _hyb(self) -> HybridTransport | None:
        """The hybrid transport, when it is this buffer's (its node heap and receive buffers)."""
        t = self._transport
        return cast("HybridTransport", t) if t is not None and t.name == "hybrid" else None

    def check_errors(self, sync: bool = False) -> None:
        """Raise what a device-side wait or check recorded (``sync``: after the stream finished
        the calls issued so far). ``dispatch`` and ``combine`` check on entry, without a sync."""
        t = self._transport
        if t is None:
            return
        try:
            t.check_errors(sync)
        except BaseException as exc:
            self.collectives.mark_broken(f"{t.name} transport: {_failure_summary(exc)}")
            raise

    def _mark_if_recorded(self) -> None:
        """A device-side wait that gave up (the symmetric transport's error board recorded it) makes
        the group unusable for every MoonEP object on it (the arrival board carries it): later steps
        are refused and teardown frees locally. (A bad expert id is this rank's input error: the
        step completed on every rank, so teardown stays collective.)"""
        t = self._transport
        if t is None or self.collectives.broken:
            return
        err = t.recorded_timeout()
        if err is not None:
            self.collectives.mark_broken(f"{t.name} transport: {_failure_summary(err)}")

    def _alive(self, op: str) -> None:
        if self._destroyed:
            raise MoonEPStateError(f"{op}: the buffer was destroyed")
        why = self.collectives.broken
        if why is None:
            self.check_errors()  # a failure recorded since the last call raises here once, and marks the group
            return
        # the group failed earlier (that error was raised then): every later call says so
        raise MoonEPStateError(
            f"{op}: the process group is unusable after an earlier failure ({why}); "
            "destroy the buffers, pools and layouts, then the process group, and build a fresh set"
        )

    def _check_dispatch_inputs(
        self, hidden: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor
    ) -> None:
        S, H, K, E = self.S, self.H, self.K, self.E

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise MoonEPInputError("dispatch: " + msg)

        # the common case in a few comparisons (this runs every step: host time limits small
        # batches); the messages are only formatted for a call that fails one of them
        dev = self.device
        try:
            ok = (hidden.dtype == self.dtype and hidden.shape == (S, H) and route_w.dtype == torch.float32
                  and route_w.shape == (S, K) and ids.dtype == torch.int32 and ids.shape == (S, K)
                  and tpe.dtype == torch.int32 and tpe.shape == (E,)
                  and hidden.device == dev and route_w.device == dev and ids.device == dev and tpe.device == dev
                  and hidden.is_contiguous() and route_w.is_contiguous() and ids.is_contiguous()
                  and tpe.is_contiguous())
        except AttributeError:  # not a tensor: the checks below say which
            ok = False
        if not ok:
            for name, t in (("hidden_sh", hidden), ("route_weights_sk", route_w), ("topk_experts_sk", ids), ("tokens_per_expert", tpe)):
                need(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
                need(t.device == self.device, f"{name} is on {t.device}, the buffer on {self.device}")
                need(t.is_contiguous(), f"{name} must be contiguous (the contract passes raw rows), got strides {t.stride()}")
            need(hidden.dtype == self.dtype, f"hidden_sh must be {self.dtype}, got {hidden.dtype}")
            need(tuple(hidden.shape) == (S, H), f"hidden_sh must be [S={S}, H={H}], got {list(hidden.shape)} (callers pad to S)")
            need(route_w.dtype == torch.float32, f"route_weights_sk must be float32, got {route_w.dtype}")
            need(tuple(route_w.shape) == (S, K), f"route_weights_sk must be [S={S}, K={K}], got {list(route_w.shape)}")
            need(ids.dtype == torch.int32, f"topk_experts_sk must be int32, got {ids.dtype}"
                 + (" (torch.topk returns int64: pass ids.to(torch.int32))" if ids.dtype == torch.int64 else ""))
            need(tuple(ids.shape) == (S, K), f"topk_experts_sk must be [S={S}, K={K}], got {list(ids.shape)}")
            need(tpe.dtype == torch.int32, f"tokens_per_expert must be int32, got {tpe.dtype}"
                 + (" (torch.bincount returns int64: pass counts.to(torch.int32))" if tpe.dtype == torch.int64 else ""))
            need(tuple(tpe.shape) == (E,), f"tokens_per_expert must be [E={E}], got {list(tpe.shape)}")
        if not self.check_inputs:
            return
        lo, hi = int(ids.min()), int(ids.max())
        need(lo >= 0 and hi < E, f"topk_experts_sk ids must be in [0, {E}), got min {lo}, max {hi} (sanitize invalid ids first)")
        need(bool(torch.isfinite(route_w).all()), "route_weights_sk has non-finite values")
        total = int(tpe.to(torch.int64).sum())
        need(total == S * K, f"tokens_per_expert sums to {total}, must be S*K = {S * K}")
        counts = torch.bincount(ids.reshape(-1).to(torch.int64), minlength=E)
        need(bool((counts == tpe.to(torch.int64)).all()), "tokens_per_expert is not the bincount of topk_experts_sk")

    # ------------------------------------------------------------------ contract API
    #: ``dispatch`` takes ``num_tokens`` (``MoonEPBuffer.accepts_num_tokens``)
    accepts_num_tokens = True
    #: ``combine`` reads each token's entry rows of ``hidden_nvsh`` and nothing else, on every transport
    #: (``MoonEPBuffer.combine_reads_entry_rows_only``)
    combine_reads_entry_rows_only = True

    def dispatch(
        self,
        hidden_sh: torch.Tensor,
        route_weights_sk: torch.Tensor,
        topk_experts_sk: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        *,
        num_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Plan]:
        """Plan and move rows. Returns ``(hidden_nvsh [NvS,H], route_weights_nvs [NvS], cu_seqlens [E+B] int32, plan)``.

        ``num_tokens`` (this engine's extension; ``None`` = ``S``): tokens ``[num_tokens, S)`` are the
        caller's padding. They are planned and placed like any token (the plan, ``cu_seqlens`` and
        every row position are the contract's), but the symmetric transport on GPUs does not move
        their rows: those rows read hidden 0, weight 0, as padding rows do, and combine's outputs
        for those tokens are unspecified. A decode step padded from 1 token to 128 then moves 8
        rows, not 1024. Other transports move every row (same results on the real tokens)."""
        self._alive("Buffer.dispatch")
        t = self.transport
        try:
            self._check_dispatch_inputs(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert)
            if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                           or not 0 <= num_tokens <= self.S):
                raise MoonEPInputError(f"dispatch: num_tokens must be an int in [0, S={self.S}], got {num_tokens!r}")
        except MoonEPInputError as exc:
            try:
                self.refuse_step()
            except MoonEPError as told:  # the peers could not be told (gone, or in another call): the cause
                raise exc from told
            raise
        try:
            gp_host = t.plan(tokens_per_expert, self._step)
            d = t.dispatch(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert, gp_host, num_tokens,
                           self._step)
        except BaseException:
            self._mark_if_recorded()
            raise
        plan = Plan(experts_to_copy=d.plan.experts_to_copy, global_plan=d.plan, owner=self._token, step=self._step,
                    transport_state=d.state, cu_seqlens=d.cu_seqlens, rows=d.rows, live_ends=d.live_ends)
        self._step += 1
        return d.hidden_nvsh, d.route_weights_nvs, d.cu_seqlens, plan

    def refuse_step(self) -> None:
        """This rank's caller refused the step's inputs before calling ``dispatch`` (which tells the peers of its own
        refusals itself; call this once per refused step, never after a ``dispatch`` that raised): tell the peers,
        already in this dispatch's first exchange, so that they refuse it too instead of pairing with this rank's
        next call (another layer's rows, on a buffer the layers share). The collective and hybrid transports send a
        refusal frame where the counts would go, and wait for the peers' frames (within ``timeout_s``), and the
        group stays usable; the symmetric transport has no frame: it keeps the group where every rank refused the
        call, and otherwise gives up on it, so the peers in the dispatch learn at once and every rank's buffers
        must be rebuilt (this one is marked failed now)."""
        self._alive("Buffer.refuse_step")
        self.transport.refuse(self._step)
        self._mark_if_recorded()

    def check_plan(self, plan: object, op: str) -> Plan:
        """``plan``, once it is known to be this buffer's latest dispatch's, else ``MoonEPStateError``
        naming ``op`` (the caller, e.g. ``"Buffer.combine"``): no plan, another buffer's (also one
        destroyed since), or a stale one (this buffer dispatched again). ``prefetch_weight`` and
        ``combine`` check with it, and so do layouts that fill their slots themselves
        (``SymmetricWeightLayout.prefetch``). Metadata only: no device read."""
        self._alive(op)
        if not isinstance(plan, Plan) or plan.owner != self._token:
            raise MoonEPStateError(f"{op}: the plan was not made by this buffer's dispatch")
        if plan.step != self._step - 1:
            raise MoonEPStateError(
                f"{op}: the plan is from dispatch #{plan.step}, but this buffer has dispatched since "
                f"(latest #{self._step - 1}); a buffer holds one step in flight: combine before the next dispatch"
            )
        return plan

    def prefetch_weight(
        self,
        plan: MoonEPPlan | None = None,
        full_gate_weight: torch.Tensor | None = None,
        full_up_weight: torch.Tensor | None = None,
        full_down_weight: torch.Tensor | None = None,
    ) -> None:
        """Slot row ``E+b`` of each ``[E+B, out, in]`` weight becomes a copy of row ``experts_to_copy[rank, b]``."""
        mine = self.check_plan(plan, "Buffer.prefetch_weight")
        weights = (("full_gate_weight", full_gate_weight), ("full_up_weight", full_up_weight), ("full_down_weight", full_down_weight))
        checked: list[torch.Tensor] = []
        for name, w in weights:
            if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != self.E + self.B:
                shape = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise MoonEPInputError(f"prefetch_weight: {name} must be [E+B={self.E + self.B}, out, in], got {shape}")
            if w.device != self.device:
                raise MoonEPInputError(f"prefetch_weight: {name} is on {w.device}, the buffer on {self.device}")
            if w.dtype != torch.bfloat16 or not w.is_contiguous():
                raise MoonEPInputError(
                    f"prefetch_weight: {name} must be a contiguous bf16 tensor, got {w.dtype}"
                    f"{'' if w.is_contiguous() else ' (not contiguous)'}"
                )
            checked.append(w)
        copy_slots_from_rows(mine.experts_to_copy[self.rank], self.E, checked)

    def combine(
        self, plan: MoonEPPlan, hidden_nvsh: torch.Tensor, route_weights_nvs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """Expert outputs back to their tokens; returns ``(hidden_sh [S,H], route_weights_sk or None, None)``."""
        mine = self.check_plan(plan, "Buffer.combine")
        if mine.combined:
            raise MoonEPStateError(f"Buffer.combine: the plan of dispatch #{mine.step} was combined already; a plan is "
                                   "combined once (dispatch again for another step)")
        if not isinstance(hidden_nvsh, torch.Tensor) or hidden_nvsh.dim() != 2 or hidden_nvsh.shape[1] != self.H or hidden_nvsh.shape[0] < self.NvS:
            shape = list(hidden_nvsh.shape) if isinstance(hidden_nvsh, torch.Tensor) else type(hidden_nvsh).__name__
            raise MoonEPInputError(f"combine: hidden_nvsh must be [NvS={self.NvS}, H={self.H}], got {shape}")
        if hidden_nvsh.dtype != self.dtype or hidden_nvsh.device != self.device:
            raise MoonEPInputError(
                f"combine: hidden_nvsh must be {self.dtype} on {self.device}, got {hidden_nvsh.dtype} on {hidden_nvsh.device}"
            )
        if not hidden_nvsh.is_contiguous():
            raise MoonEPInputError(f"combine: hidden_nvsh must be contiguous, got strides {hidden_nvsh.stride()}")
        if route_weights_nvs is not None and (
            not isinstance(route_weights_nvs, torch.Tensor) or route_weights_nvs.dim() != 1
            or route_weights_nvs.dtype != torch.float32 or route_weights_nvs.shape[0] < self.NvS
            or route_weights_nvs.device != self.device or not route_weights_nvs.is_contiguous()
        ):
            desc = (f"{route_weights_nvs.dtype} {list(route_weights_nvs.shape)} (strides {route_weights_nvs.stride()}) "
                    f"on {route_weights_nvs.device}"
                    if isinstance(route_weights_nvs, torch.Tensor) else type(route_weights_nvs).__name__)
            raise MoonEPInputError(
                f"combine: route_weights_nvs must be contiguous float32 [NvS={self.NvS}] on {self.device}, got {desc}")
        try:
            out, rw = self.transport.combine(mine.transport_state, hidden_nvsh, route_weights_nvs)
        except BaseException:
            self._mark_if_recorded()
            raise
        mine.combined = True
        return out, rw, None

    def destroy(self) -> None:
        """Idempotent; call before the process group is destroyed. With the collective transport
        this issues no collective; with the symmetric one it frees the heap buffers (collective,
        or local after a failed step); with the hybrid one it frees the node heap's buffers
        (collective over this node's ranks, or local after a failed step) and releases the node
        subgroups (every rank of the EP group; the last buffer using them destroys them)."""
        if self._destroyed:
            return
        self._destroyed = True
        self._mark_if_recorded()  # a failed wait not raised yet (GPU steps record; nothing re-checked)
        t, self._transport = self._transport, None
        try:
            if t is not None:
                t.close(local=self.collectives.broken is not None)
        finally:
            self.collectives.close()

    @property
    def num_dispatched_rows(self) -> int:
        """``NvS``: rows of the dispatched shard (``dispatch`` returns them, ``combine`` takes
        them). Also in ``_ctx["NvS"]``, where vLLM's in-tree code reads it."""
        return self.NvS

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def row_programs(self) -> int | None:
        """Programs each row-moving kernel of the symmetric transport launches (from ``num_sms``, or
        the default per SM); ``None`` on the collective transport."""
        t = self._transport
        return None if t is None else t.programs

    @property
    def heap_bytes(self) -> int:
        """Bytes this buffer holds on its symmetric heap, per rank (the symmetric or hybrid transport's
        receive and landing areas, sized once from ``S``; 0 for the collective transport, and for
        the hybrid one on a rank alone on its node)."""
        t = self._transport
        return 0 if t is None else t.nbytes

    def __repr__(self) -> str:
        if not hasattr(self, "NvS"):
            return "Buffer(engine=builtin, not constructed)"
        return (
            f"Buffer(engine=builtin, S={self.S}, H={self.H}, K={self.K}, E={self.E}, R={self.R}, B={self.B}, "
            f"tp={self.token_padding}, NvS={self.NvS}, device={self.device}, transport={self.transport_name})"
        )


def _failure_summary(exc: BaseException) -> str:
    """One line naming a transport's failure, for the group's failure record (every later call's error quotes it)."""
    if isinstance(exc, MoonEPCollectiveTimeout) and exc.op:
        return exc.summary()
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:200]}"


def copy_slots_from_rows(slots: torch.Tensor, E: int, weights: Iterable[torch.Tensor]) -> None:
    """For every ``[E+B, ...]`` tensor: row ``E+b`` <- row ``slots[b]`` where ``slots[b] >= 0``;
    unused slots (``-1``) are not touched (copying them onto themselves would move every slot's
    weights every step, GBs per layer at full size). On CUDA the slot ids stay on the device
    (``row_copy``: no host read); on CPU only the used slots are read and copied."""
    ws = list(weights)
    for i in range(0, len(ws), MAX_PLANES):  # one launch per MAX_PLANES tensors
        part = ws[i:i + MAX_PLANES]
        copy_rows(slots, [w[E:] for w in part], src=part, rows_per_source=part[0].shape[0])


if TYPE_CHECKING:  # the type checker verifies the class honours the protocol it is used through
    from vllm_moonep.engine.protocol import MoonEPBuffer

    _IS_A_MOONEP_BUFFER: type[MoonEPBuffer] = Buffer
