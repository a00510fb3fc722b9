"""The built-in MoonEP engine: ``Buffer`` with the ``[E+B]`` contract (moonep-contract.md).

``dispatch`` plans (identically on every rank), moves each token slot to the rank and row the
plan gives it, and returns the expert-grouped shard; ``prefetch_weight`` fills slot rows
``[E, E+B)``; ``combine`` brings the expert outputs home and sums each token's K rows in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_moonep.engine.errors import MoonEPInputError, MoonEPStateError
from vllm_moonep.engine.planner import GlobalPlan, place_entries, plan_global
from vllm_moonep.engine.collective import CollectiveTransport

__all__ = ["Buffer", "Plan", "nvs_rows", "resolve_device", "validate_config"]

#: upstream bounds (contract, "Buffer")
MAX_RANKS = 128
MAX_TOPK = 32
MAX_NVS = 2**24


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None``: the current CUDA device if there is one, else CPU; a bare ``cuda`` gets its index
    (tensors always report one, so comparisons need it)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def nvs_rows(S: int, K: int, E: int, R: int, token_padding: int) -> int:
    """Rows of the dispatched shard: ``S*K + (tp - 1) * 2 * epn``."""
    return S * K + (token_padding - 1) * 2 * (E // R)


def validate_config(S: int, H: int, K: int, E: int, R: int, B: int, token_padding: int) -> None:
    """Raise ``MoonEPInputError`` naming the first violated bound of the contract."""
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
    ]
    for ok, msg in checks:
        if not ok:
            raise MoonEPInputError(msg)
    nvs = nvs_rows(S, K, E, R, token_padding)
    if nvs >= MAX_NVS:
        raise MoonEPInputError(f"NvS={nvs} rows must be < 2**24 (S={S}, K={K}, E={E}, R={R}, tp={token_padding})")


@dataclass
class Plan:
    """What ``dispatch`` decided, kept for ``prefetch_weight`` and ``combine``.

    ``experts_to_copy [R, B]`` int32 is the public part (the same on every rank). The rest is
    this rank's bookkeeping: which local entries went where, and which shard rows came from whom.
    """

    experts_to_copy: torch.Tensor
    global_plan: GlobalPlan = field(repr=False)
    owner: int = field(repr=False)  # id() of the Buffer that made it
    step: int = 0
    send_order: torch.Tensor = field(default=None, repr=False)  # local flat entries, by (dest, row)
    send_splits: list[int] = field(default_factory=list, repr=False)
    recv_splits: list[int] = field(default_factory=list, repr=False)
    recv_rows: torch.Tensor = field(default=None, repr=False)  # shard row of each received entry
    cu_seqlens: torch.Tensor = field(default=None, repr=False)  # this rank's [E+B] int32

    @property
    def slots_used(self) -> int:
        return int((self.experts_to_copy >= 0).sum())


class Buffer:
    """The built-in MoonEP engine for one MoE layer shape (collective, not thread-safe).

    Args follow the contract: ``S`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts,
    ``num_ep_ranks`` R, ``B`` slots per rank (``None``: ``E // R``), ``token_padding``.
    ``group`` is the EP process group (``None``: the default group). Extra keywords:
    ``device`` (default: the current CUDA device if available, else CPU), ``dtype`` of the hidden
    rows (bf16 by contract; float32 allowed for exact tests), ``check_inputs`` (validate every
    call; costs a host synchronization on GPU), ``timeout_s`` (bound on each collective; ``None``:
    ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S`` or 300 s; see ``vllm_moonep.engine.collective``).

    Faults: when a peer dies or stops calling, ``dispatch``/``combine`` (and construction) raise
    ``MoonEPCollectiveTimeout`` within ``timeout_s`` naming the operation, the step and the peer;
    no output is returned. The process group is unusable afterwards: every call except
    ``destroy()`` then raises ``MoonEPStateError``. ``destroy()`` issues no collective here, so it
    works after a failure; it must still run before the process group is destroyed.
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
        token_padding: int = 128,
        B: int | None = None,
        group=None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        check_inputs: bool = True,
        timeout_s: float | None = None,
        **_ignored,
    ):
        R = num_ep_ranks
        if B is None and isinstance(E, int) and isinstance(R, int) and R > 0:
            B = E // R
        validate_config(S, H, K, E, R, B, token_padding)
        if dtype not in (torch.bfloat16, torch.float32):
            raise MoonEPInputError(f"dtype must be torch.bfloat16 (or float32 for tests), got {dtype}")
        self.transport = CollectiveTransport(group, world_size=R, timeout_s=timeout_s)
        if self.transport.world_size != R:
            self.transport.close()
            raise MoonEPInputError(
                f"num_ep_ranks={R} does not match the process group's size {self.transport.world_size}"
            )
        self.device = resolve_device(device)
        self.S, self.H, self.K, self.E, self.R, self.B = S, H, K, E, R, B
        self.epn = E // R
        self.token_padding = token_padding
        self.num_sms = num_sms
        self.dtype = dtype
        self.check_inputs = check_inputs
        self.rank = self.transport.rank
        self.NvS = nvs_rows(S, K, E, R, token_padding)
        self._ctx = {"NvS": self.NvS, "S": S, "H": H, "K": K, "E": E, "B": B, "R": R, "tp": token_padding}
        self._destroyed = False
        self._step = 0
        # Construction is collective: every rank must agree on the shape of the buffer.
        mine = torch.tensor([S, H, K, E, R, B, token_padding], dtype=torch.int64, device=self._comm_device())
        try:
            every = self.transport.all_gather(mine, "Buffer.__init__ (config check)")
        except BaseException:
            self.destroy()
            raise
        if not bool((every == mine).all()):
            self.destroy()
            rows = every.tolist()
            raise MoonEPInputError(
                "MoonEP Buffer configuration differs across ranks ([S,H,K,E,R,B,tp] per rank): " + str(rows)
            )

    # ------------------------------------------------------------------ helpers
    def _comm_device(self) -> torch.device:
        return self.device

    def _alive(self, what: str) -> None:
        if self._destroyed:
            raise MoonEPStateError(f"Buffer.{what}: the buffer was destroyed")
        why = self.transport.broken
        if why is not None:
            raise MoonEPStateError(
                f"Buffer.{what}: the process group is unusable after an earlier failure ({why}); "
                "destroy the buffers, pools and layouts, then the process group, and build a fresh set"
            )

    def _check_dispatch_inputs(self, hidden, route_w, ids, tpe) -> None:
        S, H, K, E = self.S, self.H, self.K, self.E

        def need(cond, msg):
            if not cond:
                raise MoonEPInputError("dispatch: " + msg)

        for name, t in (("hidden_sh", hidden), ("route_weights_sk", route_w), ("topk_experts_sk", ids), ("tokens_per_expert", tpe)):
            need(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
            need(t.device == self.device, f"{name} is on {t.device}, the buffer on {self.device}")
            need(t.is_contiguous(), f"{name} must be contiguous (the contract passes raw rows), got strides {t.stride()}")
        need(hidden.dtype == self.dtype, f"hidden_sh must be {self.dtype}, got {hidden.dtype}")
        need(tuple(hidden.shape) == (S, H), f"hidden_sh must be [S={S}, H={H}], got {list(hidden.shape)} (callers pad to S)")
        need(route_w.dtype == torch.float32, f"route_weights_sk must be float32, got {route_w.dtype}")
        need(tuple(route_w.shape) == (S, K), f"route_weights_sk must be [S={S}, K={K}], got {list(route_w.shape)}")
        need(ids.dtype == torch.int32, f"topk_experts_sk must be int32, got {ids.dtype}")
        need(tuple(ids.shape) == (S, K), f"topk_experts_sk must be [S={S}, K={K}], got {list(ids.shape)}")
        need(tpe.dtype == torch.int32, f"tokens_per_expert must be int32, got {tpe.dtype}")
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
    def dispatch(self, hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert):
        """Plan and move rows. Returns ``(hidden_nvsh [NvS,H], route_weights_nvs [NvS], cu_seqlens [E+B] int32, plan)``."""
        self._alive("dispatch")
        self._check_dispatch_inputs(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert)
        tr = self.transport
        tr.step = self._step
        tpe_all = tr.all_gather(tokens_per_expert.to(torch.int64), "dispatch: all_gather(tokens_per_expert)")
        # The plan is made on the host from the small [R, E] table (the one host read of the
        # step: the transfer sizes come from it too), then its tables go to the device.
        gp_host = plan_global(tpe_all.cpu(), self.S, self.K, self.B, self.token_padding)
        gp = gp_host if self.device.type == "cpu" else gp_host.to(self.device)
        dest, row = place_entries(gp, self.rank, topk_experts_sk)
        # local entries in (destination, row) order: rows reach each peer already sorted
        send_order = torch.argsort(dest * self.NvS + row, stable=True)
        flows = gp_host.flows()  # [src, dst]
        send_splits, recv_splits = flows[self.rank].tolist(), flows[:, self.rank].tolist()
        used_rows = int(gp_host.cu_seqlens[self.rank, -1])
        tok = send_order // self.K
        send_hidden = hidden_sh.index_select(0, tok)
        meta = torch.stack(
            [row[send_order].to(torch.int32), route_weights_sk.reshape(-1)[send_order].contiguous().view(torch.int32)],
            dim=1,
        )
        recv_meta = tr.all_to_all(meta, send_splits, recv_splits, "dispatch: all_to_all(meta)")
        recv_hidden = tr.all_to_all(send_hidden, send_splits, recv_splits, "dispatch: all_to_all(hidden)")
        recv_rows = recv_meta[:, 0].to(torch.int64)
        # rows past the last segment are undefined by contract: only the used rows are zeroed
        # (padding rows must read 0), not all NvS, whose (tp-1)*2*epn slack can dwarf S*K
        hidden_nvsh = torch.empty(self.NvS, self.H, dtype=self.dtype, device=self.device)
        hidden_nvsh[:used_rows].zero_()
        hidden_nvsh.index_copy_(0, recv_rows, recv_hidden)
        route_nvs = torch.zeros(self.NvS, dtype=torch.float32, device=self.device)
        route_nvs.index_copy_(0, recv_rows, recv_meta[:, 1].contiguous().view(torch.float32))
        cu = gp.cu_seqlens[self.rank].to(torch.int32)
        plan = Plan(
            experts_to_copy=gp.experts_to_copy,
            global_plan=gp,
            owner=id(self),
            step=self._step,
            send_order=send_order,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_rows=recv_rows,
            cu_seqlens=cu,
        )
        self._step += 1
        return hidden_nvsh, route_nvs, cu, plan

    def _check_plan(self, plan, what: str) -> None:
        self._alive(what)
        if not isinstance(plan, Plan) or plan.owner != id(self):
            raise MoonEPStateError(f"Buffer.{what}: the plan was not made by this buffer's dispatch")
        if plan.step != self._step - 1:
            raise MoonEPStateError(
                f"Buffer.{what}: the plan is from dispatch #{plan.step}, but this buffer has dispatched since "
                f"(latest #{self._step - 1}); a buffer holds one step in flight: combine before the next dispatch"
            )

    def prefetch_weight(self, plan=None, full_gate_weight=None, full_up_weight=None, full_down_weight=None):
        """Slot row ``E+b`` of each ``[E+B, out, in]`` weight becomes a copy of row ``experts_to_copy[rank, b]``."""
        self._check_plan(plan, "prefetch_weight")
        weights = (("full_gate_weight", full_gate_weight), ("full_up_weight", full_up_weight), ("full_down_weight", full_down_weight))
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
        copy_slots_from_rows(plan.experts_to_copy[self.rank], self.E, [w for _, w in weights])

    def combine(self, plan, hidden_nvsh, route_weights_nvs=None):
        """Expert outputs back to their tokens; returns ``(hidden_sh [S,H], route_weights_sk or None, None)``."""
        self._check_plan(plan, "combine")
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
            or route_weights_nvs.device != self.device
        ):
            desc = (f"{route_weights_nvs.dtype} {list(route_weights_nvs.shape)} on {route_weights_nvs.device}"
                    if isinstance(route_weights_nvs, torch.Tensor) else type(route_weights_nvs).__name__)
            raise MoonEPInputError(f"combine: route_weights_nvs must be float32 [NvS={self.NvS}] on {self.device}, got {desc}")
        tr = self.transport
        tr.step = plan.step
        back = tr.all_to_all(
            hidden_nvsh.index_select(0, plan.recv_rows), plan.recv_splits, plan.send_splits, "combine: all_to_all(hidden)"
        )
        n = self.S * self.K
        acc = torch.empty(n, self.H, dtype=torch.float32, device=self.device)  # every entry comes back
        acc.index_copy_(0, plan.send_order, back.float())
        out = acc.view(self.S, self.K, self.H).sum(dim=1).to(self.dtype)
        rw = None
        if route_weights_nvs is not None:
            wb = tr.all_to_all(
                route_weights_nvs.index_select(0, plan.recv_rows), plan.recv_splits, plan.send_splits,
                "combine: all_to_all(route_weights)",
            )
            rw = torch.empty(n, dtype=torch.float32, device=self.device)
            rw.index_copy_(0, plan.send_order, wb)
            rw = rw.view(self.S, self.K)
        return out, rw, None

    def destroy(self) -> None:
        """Idempotent; call before the process group is destroyed. The built-in engine holds no
        communication resources beyond the transport's arrival-board reference, so this issues no
        collective and works after a failed step (the real moonep's destroy is collective)."""
        if self._destroyed:
            return
        self._destroyed = True
        self.transport.close()

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def __repr__(self) -> str:
        if not hasattr(self, "NvS"):
            return "Buffer(engine=builtin, not constructed)"
        return (
            f"Buffer(engine=builtin, S={self.S}, H={self.H}, K={self.K}, E={self.E}, R={self.R}, B={self.B}, "
            f"tp={self.token_padding}, NvS={self.NvS}, device={self.device})"
        )


def copy_slots_from_rows(slots: torch.Tensor, E: int, weights) -> None:
    """For every ``[E+B, ...]`` tensor: row ``E+b`` <- row ``slots[b]`` where ``slots[b] >= 0``;
    unused slots (``-1``) are not touched.

    Reads the B slot ids on the host (one small synchronization; dispatch already made one) so
    that only used slots move: copying unused ones onto themselves would move every slot's
    weights every step, GBs per layer at full size.
    """
    used = [(E + b, e) for b, e in enumerate(slots.tolist()) if e >= 0]
    if not used:
        return
    dst = torch.tensor([d for d, _ in used], dtype=torch.int64)
    src = torch.tensor([s for _, s in used], dtype=torch.int64)
    for w in weights:
        w.index_copy_(0, dst.to(w.device), w.index_select(0, src.to(w.device)))
