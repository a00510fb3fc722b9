"""The symmetric transport: rows move by one-sided writes into peers' receive buffers on a
symmetric heap, with signals instead of collectives. The fast path between GPUs of one node.

One ``SymmetricTransport`` per ``Buffer`` (its capacity ``S`` fixes every size), allocated once
on the heap at construction (collective), never per step; on the buffer's heap, or on one it
makes over the EP group and closes with itself::

    every rank:  counts [R, E] i32     row src = src's tokens_per_expert
                 recv_x [NvS, H]       the dispatched shard (returned as hidden_nvsh)
                 recv_w [NvS] f32      route weight of each row
                 recv_src [NvS] i32    src_rank * S*K + flat entry of each row, -1 for padding
                 comb_x [S*K, H]       expert outputs of this rank's entries, landed by their computing rank
                 comb_w [S*K] f32      their route weights
                 sig [5, R] i64        signal counters per phase and source, which sources gave up on
                                       the group (see engine/signals.py), the last call each refused

    dispatch:  put counts to every peer, wait(counts), plan [R,E] (one device-planner launch)
               -> place own entries, write each entry's row into recv_* of its destination,
                  signal, list own real rows, wait(rows) (one launch; a histogram and a place
                  launch before it above DIRECT_MAX_SUBBLOCKS sub-blocks of entries)
    combine:   each real row's output -> comb_* of its source, the row back to padding
               (hidden 0, weight 0, source -1), signal, wait(outputs)
               -> out[t] = bf16(sum_k fp32 comb_x[t*K+k])

Ordering between steps needs no extra barrier: a rank writes into a peer's ``recv_*`` for step
``t+1`` only after its own wait for step ``t+1``'s counts, which the peer sends after its combine
of step ``t``, which runs after the peer's expert compute of step ``t`` on its stream; likewise
``comb_*`` and ``counts``. So one step in flight per buffer, as the contract says.

Two executors of the same protocol:

- GPU (``TorchSymmHeap`` or any heap whose peers are addressable): Triton kernels
  (``symmetric_kernels``) and the device planner; no host synchronization, no allocation per
  step, so a whole step can be captured in a CUDA graph (one graph per buffer capacity). Waits
  are bounded on the device and report through the ``ErrorBoard``; each is done in the launch
  that needs it (the plan launch waits for the counts, the last program of a row-moving launch
  for the peers' rows), so a small dispatch is two launches and a combine two. Called eagerly,
  dispatch and combine replay private graphs of their launches (``eager_graphs``; buffers up to
  ``EAGER_GRAPH_MAX_TOKENS``), so a step costs the host a graph launch instead of its kernel
  launches. Dispatch inputs whose addresses repeat (the MoE step's staging tensors) are
  read in place by their own graph; others are copied into the graph's static inputs first.
- CPU ranks (``HostHeap`` without staging, shared ``/dev/shm`` mappings): the same buffers,
  written with torch ops through peer views, host planner, host waits (polling with the same
  bound; a time-out raises at once, naming the peer). This is how CPU CI tests the protocol.
  Signals there have one writer per slot (the source rank), so plain stores suffice; ordering
  relies on the x86-64 (TSO) store order that CI machines have.

A rank whose wait timed out gives up on the group: it sets its entry of the ``gave_up`` row of
``sig`` on every rank, and from then on no rank writes into a peer (GPU launches mask their writes
and signals; the CPU executor refuses the call), so a slow peer is never handed a later step's rows.
Each rank's next wait, or its next call on CPU ranks, ends at once naming the rank that gave up. A
rank that refused its input to a dispatch (``Buffer.refuse_step``) marks the call refused in every
rank's ``refused`` row: where every rank refused it, the group stays usable; where a peer is in the
dispatch instead (or shows nothing within ``timeout_s``), the rank gives up the same way, and that
peer learns of it at once instead of after ``timeout_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the host executor needs no Triton
    triton = None

import vllm_moonep.engine.heaps as heaps
from vllm_moonep.engine.errors import (MoonEPCollectiveTimeout, MoonEPInputError, MoonEPStateError,
                                      MoonEPUnavailableError)
from vllm_moonep.engine.faults.error_board import (CODE_WAIT_COUNTS, CODE_WAIT_OUTPUTS, CODE_WAIT_ROWS,
                                                   GAVE_UP_REFUSED, GAVE_UP_TIMED_OUT, ErrorBoard)
from vllm_moonep.engine.heaps.base import SymmetricHeap
from vllm_moonep.engine.launch import Launcher, sm_count
from vllm_moonep.engine.planning.host_plan import refuse_short_counts
from vllm_moonep.engine.planning.planner import GlobalPlan, padding_rows, place_entries, plan_global
from vllm_moonep.engine.transports.base import Dispatched, Transport, sum_entries
from vllm_moonep.engine.transports.eager_graphs import EAGER_GRAPH_MAX_TOKENS, EAGER_GRAPHS, GraphCache

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DEFAULT_PROGRAMS_PER_SM", "SymmetricStep", "SymmetricTransport"]

#: programs of the row-moving kernels (persistent) per SM of the GPU; where a Buffer gives
#: ``num_sms`` (SMs for communication), PROGRAMS_PER_SM on each of those. H200, Kimi-K2 rows,
#: eager-graph replays: 2 per SM (264) moved 4096 tokens' rows at world size 1 in 309 us against
#: 415 with 128 programs (combine 553 against 637), and cost nothing at 1 token on 2 GPUs; 4 per
#: SM (528) did no better (docs/PERFORMANCE.md#engine-defaults)
DEFAULT_PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM = 4
#: rows per tile in the row-moving kernels
_ROWS = 4
#: entries compared at a time when dispatch_rows places its entries itself (small batches)
_PLACE_CHUNK = 256
#: the GPU executor's kernels (``symmetric_kernels.<name>_kernel``; clear_rows only after a dispatch
#: that had no combine)
_KERNELS = ("clear_rows", "dispatch_rows", "combine_rows", "reduce")
#: rows of ``sig`` (``signals.PH_*`` and ``signals.GAVE_UP``, in this order, then one only the host uses): a counter
#: per phase and source; nonzero where that source gave up on the group; the last call that source refused
#: (calls counted as dispatches plus refusals)
SIG_ROWS = ("counts", "dispatch", "combine", "gave_up", "refused")
_PHASE = {name: i for i, name in enumerate(SIG_ROWS[:3])}
_GAVE_UP, _REFUSED = SIG_ROWS.index("gave_up"), SIG_ROWS.index("refused")
_WAIT_CODE = {"counts": CODE_WAIT_COUNTS, "dispatch": CODE_WAIT_ROWS, "combine": CODE_WAIT_OUTPUTS}


@dataclass
class SymmetricStep:
    """What dispatch leaves for combine."""

    tokens: int  # tokens whose rows dispatch moved (GPU; combine sums these only)
    used: int | None  # rows [0, used) of the shard are this step's segments (CPU ranks; unread on GPUs)


class SymmetricTransport(Transport):
    """Buffers, address table, epochs and error board of one engine ``Buffer`` (see the module doc).

    Args: ``heap`` (a ``SymmetricHeap`` spanning the EP group; the transport allocates on it and
    frees in ``close()``), the buffer's shape (``R, rank, S, K, H, E, B, NvS, token_padding``),
    ``dtype`` of the rows, ``timeout_s`` (bound on every wait), ``num_sms`` (SMs for the row-moving
    kernels, ``PROGRAMS_PER_SM`` programs each; ``None``: every SM, ``DEFAULT_PROGRAMS_PER_SM`` each),
    ``owns_heap`` (``close()`` closes the heap too). ``on_heap`` makes the heap when given a kind.
    """

    name = "symmetric"

    @classmethod
    def on_heap(cls, heap: SymmetricHeap | str | None, group: ProcessGroup | None, device: torch.device,
                **shape: Any) -> SymmetricTransport:
        """The transport on ``heap``: a ``SymmetricHeap`` spanning the group (the caller's, left
        open by ``close()``), or a heap kind (``None``: ``auto``) made here over ``group`` on
        ``device`` and closed with the transport. ``shape``: the constructor's keywords."""
        if isinstance(heap, SymmetricHeap):
            return cls(heap, owns_heap=False, **shape)
        # the host heap's staging mode hides owner writes until a barrier; the transport's
        # peers write into each other's buffers, so it maps the shared pages directly
        extra = {"staging": False} if device.type == "cpu" else {}
        made = heaps.make_heap(heap or "auto", group=group, device=device, **extra)
        try:
            return cls(made, owns_heap=True, **shape)
        except BaseException:
            made.close(force=True)
            raise

    def __init__(self, heap, *, R: int, rank: int, S: int, K: int, H: int, E: int, B: int, NvS: int,
                 token_padding: int, dtype: torch.dtype, timeout_s: float, num_sms: int | None = None,
                 owns_heap: bool = False):
        self._handles: list = []
        self.owns_heap = owns_heap
        try:
            self._setup(heap, R, rank, S, K, H, E, B, NvS, token_padding, dtype, timeout_s, num_sms)
        except BaseException as exc:  # any step after the first allocation: free what was allocated (LIFO)
            try:
                heap.free_all(*self._handles[::-1])
            except Exception as cleanup:  # the set-up's error is the one to see
                exc.add_note(f"freeing what the set-up had allocated failed too: {type(cleanup).__name__}: {cleanup}")
            raise

    def _setup(self, heap, R, rank, S, K, H, E, B, NvS, token_padding, dtype, timeout_s, num_sms) -> None:
        if not heap.peers_addressable:
            raise MoonEPUnavailableError(
                f"the symmetric transport needs every peer's memory addressable, and this {type(heap).__name__} "
                "cannot map some peers (ranks on other nodes): use transport='collective'"
            )
        self.heap = heap
        self.R, self.rank, self.S, self.K, self.H, self.E, self.B, self.NvS = R, rank, S, K, H, E, B, NvS
        self.tp = token_padding
        self.dtype = dtype
        self.device = heap.device
        self.on_gpu = self.device.type == "cuda"
        self.timeout_s = float(timeout_s)
        SK = S * K
        tag = f"moonep.transport.S{S}"
        specs = [  # (name, shape, dtype) in table-row order (symmetric_kernels.T_*)
            ("counts", (R, E), torch.int32),
            ("recv_x", (NvS, H), dtype),
            ("recv_w", (NvS,), torch.float32),
            ("recv_src", (NvS,), torch.int32),
            ("comb_x", (SK, H), dtype),
            ("comb_w", (SK,), torch.float32),
            ("sig", (len(SIG_ROWS), R), torch.int64),
        ]
        for name, shape, dt in specs:
            self._handles.append(heap.allocate(shape, dt, f"{tag}.{name}"))
        self.buf = {name: h.tensor for (name, _, _), h in zip(specs, self._handles)}
        self.buf["sig"].zero_()
        self.buf["counts"].zero_()
        # padding rows must read 0: zeroed once here, and each step clears only the rows it wrote
        self.buf["recv_x"].zero_()
        self.buf["recv_w"].zero_()
        self.buf["recv_src"].fill_(-1)
        # peer views (and, on GPU, their addresses): what one-sided writes go through
        self.peer = {name: [heap.peer_view(h, d) for d in range(R)] for (name, _, _), h in zip(specs, self._handles)}
        heap.barrier()  # every rank zeroed its signals before anyone signals
        self.epoch = torch.zeros(3, dtype=torch.int64, device=self.device)  # steps of each phase so far (GPU)
        # launch-local tickets (dispatch_rows, combine_rows): which program finishes last (GPU)
        self.tickets = torch.zeros(2, dtype=torch.int32, device=self.device)
        # whether the last dispatch's rows are still real (no combine since): the next dispatch
        # then clears them first; combine leaves every row padding
        self._rows_real = False
        self._host_epoch = [0, 0, 0]
        self._calls = 0  # dispatches and refusals so far (the refused row's values)
        self.board = ErrorBoard(self.device, rank=rank, world_size=R, timeout_s=self.timeout_s,
                                what=f"MoonEP buffer S={S} (symmetric transport)")
        # the contract's num_sms (SMs for communication) becomes PROGRAMS_PER_SM light programs each
        # (a launch signals each peer once, from its last program: ranks may differ here)
        if num_sms:
            self.programs = max(1, int(num_sms) * PROGRAMS_PER_SM)
        else:
            self.programs = sm_count(self.device) * DEFAULT_PROGRAMS_PER_SM
        if self.on_gpu:
            table = [[self.peer[name][d].data_ptr() for d in range(R)] for name, _, _ in specs]
            self.table = torch.tensor(table, dtype=torch.int64, device=self.device)
            from vllm_moonep.engine.planning.device_planner import DevicePlanner

            self.planner = DevicePlanner(R, E, S, K, B, token_padding, self.device)
            # views the launches read, made once: the plan's tables are rewritten in place by every plan
            gp = self.planner.result
            self._place_tables = self.planner.tables(gp)
            self._cu_mine, self._seg_mine = gp.cu_seqlens[rank], gp.seg_len[rank]
            self._ticket_d, self._ticket_c = self.tickets[0:1], self.tickets[1:2]
            from vllm_moonep.engine.transports import symmetric_kernels as k

            # every kernel through a Launcher: after the first call, Triton's compiled runner
            self._launch = {name: Launcher(getattr(k, f"{name}_kernel")) for name in _KERNELS}
            self.cu32 = torch.empty(E + B, dtype=torch.int32, device=self.device)
            self.rows32 = torch.empty(E + B, dtype=torch.int32, device=self.device)
            self.ends32 = torch.empty(E + B, dtype=torch.int32, device=self.device)
            self._block_h = min(triton.next_power_of_2(H), 4096)
            self._SK, self._RP, self._tmo = SK, triton.next_power_of_2(R), self._timeout_ns()
            self._G = E + B
            self._G_PAD = triton.next_power_of_2(self._G)
            # the reduce: local work, enough programs to fill the GPU
            self._n_red, self._bh_red, self._K_PAD = k.reduce_grid(S, K, H)
            # rows the last step wrote (cleared at the next dispatch); rows [0, S*K) at first,
            # which the allocation zeroed
            self.real_rows = torch.arange(SK, dtype=torch.int32, device=self.device)
            eager_graphs = EAGER_GRAPHS and S <= EAGER_GRAPH_MAX_TOKENS
            self.graphs = GraphCache(self.device, f"MoonEP buffer S={S}", enabled=eager_graphs)
            # dispatch graphs that read their inputs in place, by input address (their own cache:
            # callers whose addresses never repeat cost it a few captures, never the copying graph)
            self.inplace = GraphCache(self.device, f"MoonEP buffer S={S}", enabled=eager_graphs)
        self._closed = False

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, route_w: torch.Tensor, ids: torch.Tensor, tpe: torch.Tensor,
                 plan: GlobalPlan | None, num_tokens: int | None, step: int) -> Dispatched:
        """The step planned inside the launch (``plan`` is ``None``: this transport plans on the
        device, or on CPU ranks after its own counts exchange). The owning ``Buffer`` checks the
        error board before calling (and marks the group broken). ``num_tokens``: on GPUs only the
        rows of tokens below it move (``Buffer.dispatch``)."""
        self._calls += 1
        if self.on_gpu:
            if self._rows_real:  # a dispatch with no combine since: its rows go back to padding first
                self._clear_rows()
            self._rows_real = True
            n_tok = self.S if num_tokens is None else int(num_tokens)
            # eager calls replay a private CUDA graph of the launches (transports/eager_graphs.py):
            # one that reads the inputs where they are, once their addresses repeat (a caller
            # with fixed input tensors: no copies), else one that copies them into its own. The
            # Buffer checked every input's shape, dtype and contiguity (fixed by S, H, K, E), so
            # the addresses are all a graph depends on (building fuller keys cost ~3 us a call)
            inputs = (hidden, route_w, ids, tpe)
            key = ("dispatch", n_tok, hidden.data_ptr(), route_w.data_ptr(), ids.data_ptr(), tpe.data_ptr())
            if self.inplace.ready(key):
                res, _ = self.inplace.run(key, self._dispatch_gpu, (), (*inputs, n_tok))
            else:
                self.inplace.remember(key)
                res, _ = self.graphs.run(("dispatch", n_tok), self._dispatch_gpu, inputs, (n_tok,))
            x, w, cu, gp = res
            return Dispatched(x, w, cu, gp, SymmetricStep(tokens=n_tok, used=None), rows=self.rows32,
                              live_ends=self.ends32)
        x, w, cu, gp = self._dispatch_host(hidden, route_w, ids, tpe)
        return Dispatched(x, w, cu, gp, SymmetricStep(tokens=self.S, used=int(cu[-1])))

    def combine(self, state: Any, y: torch.Tensor,
                y_w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``(hidden_sh [S,H], route_weights [S,K] or None)``."""
        if not isinstance(state, SymmetricStep):  # not reachable: the Buffer checks the plan is its own
            raise MoonEPStateError("the symmetric transport's combine needs its own dispatch's state")
        if self.on_gpu:
            # the graph reads y (and y_w) where they are: their addresses are part of the key (the
            # Buffer checked dtype, width and contiguity; the row counts may exceed NvS)
            key = ("combine", state.tokens, y.data_ptr(), y.shape[0],
                   None if y_w is None else (y_w.data_ptr(), y_w.shape[0]))
            self._rows_real = False
            (out, out_w), replayed = self.graphs.run(key, self._combine_gpu, (), (y, y_w, state.tokens))
            if replayed:  # the graph's output tensors are rewritten by its next replay: the caller gets copies
                out = out.clone()
                out_w = out_w.clone() if out_w is not None else None
            return out, out_w
        assert state.used is not None  # set by the host executor's dispatch
        return self._combine_host(y, y_w, state.used)

    # ------------------------------------------------------------------ errors
    def check_errors(self, sync: bool) -> None:
        self.board.check(sync=sync)

    def recorded_timeout(self) -> MoonEPCollectiveTimeout | None:
        """A wait that gave up (its error board recorded it), or a peer that gave up on the group (its entry in the
        ``gave_up`` row, read here too: after a bad expert id the board holds that, and teardown must still be
        local). A bad expert id alone is this rank's input error: the step completed on every rank, so it is not
        one. On GPUs the row's read synchronizes (teardown, or after a raise; skipped while capturing); a read that
        fails (a sticky CUDA error) counts as a failed group, so teardown stays local."""
        err = self.board.error() if self.board.is_set else None
        if isinstance(err, MoonEPCollectiveTimeout):
            return err
        if "sig" not in self.buf or (self.on_gpu and torch.cuda.is_current_stream_capturing()):
            return None
        try:
            gone = self.buf["sig"][_GAVE_UP].nonzero().flatten().tolist()
        except Exception as exc:  # any failure to read it: the memory is not to be trusted
            return MoonEPCollectiveTimeout(
                f"MoonEP buffer S={self.S} (symmetric transport): its signal memory could not be read on rank "
                f"{self.rank} ({type(exc).__name__}: {exc}); the group is treated as failed",
                op="symmetric transport: reading the signals", rank=self.rank, world_size=self.R, timed_out=False,
                timeout_s=self.timeout_s)
        if not gone:
            return None
        return self.board.peer_gave_up(gone[0], int(self.buf["sig"][_GAVE_UP, gone[0]]), CODE_WAIT_COUNTS)

    def refuse(self, step: int) -> None:
        """This rank refused its input to a dispatch. The transport has no frame to carry a refusal (rows move by
        one-sided writes after the counts), so the rank marks the call refused in every rank's ``refused`` row and
        waits (within ``timeout_s``) until each peer shows what it does with the same call: every peer refused it
        too (the same bad input everywhere): the group stays usable; a peer is in the dispatch instead (its counts
        arrived, the call not refused), or the bound ran out: the rank gives up on the group (``GAVE_UP_REFUSED``),
        so that peer's wait ends at once naming it, no later call of this rank can pair with it, and the buffers
        must be rebuilt. On GPUs the reads synchronize (an error path); inside a CUDA-graph capture nothing can be
        read, and the peers time out naming this rank. A single rank has no peer to tell."""
        self._calls += 1
        if self.R == 1 or (self.on_gpu and torch.cuda.is_current_stream_capturing()):
            return
        call, peers = self._calls, [d for d in range(self.R) if d != self.rank]
        for d in range(self.R):
            self.peer["sig"][d][_REFUSED, self.rank] = call
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while time.monotonic() < deadline:
            sig = self.buf["sig"].cpu()  # a peer writes its refusal mark before any later call's counts
            done = self._host_epoch[0] if not self.on_gpu else int(self.epoch[0])
            if all(int(sig[_REFUSED, d]) >= call for d in peers):
                return
            if bool(sig[_GAVE_UP].any()):  # the group is given up already: no peer is left to show anything
                break
            if any(int(sig[_PHASE["counts"], d]) > done and int(sig[_REFUSED, d]) < call for d in peers):
                break
            pause = min(1e-3, pause + 2e-5)
            time.sleep(pause)
        self._give_up(GAVE_UP_REFUSED)

    # ------------------------------------------------------------------ GPU executor
    def _timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def _clear_rows(self) -> None:
        """The last dispatch's rows back to padding (a dispatch that had no combine)."""
        b = self.buf
        self._launch["clear_rows"]((self.programs, 1, 1), self.real_rows, b["recv_x"], b["recv_w"], b["recv_src"],
                                   self._SK, self.H, self.programs, ROWS=_ROWS, BLOCK_H=self._block_h, num_warps=8)

    def _dispatch_gpu(self, hidden, route_w, ids, tpe, n_tok):
        # host time is what limits small batches: everything per call is a lookup (constants in __init__)
        R, E, rank, H, P, SK, RP, tmo = self.R, self.E, self.rank, self.H, self.programs, self._SK, self._RP, self._tmo
        b = self.buf
        board = self.board.address
        gp = self.planner.plan(b["counts"], (tpe, self.table, b["sig"], self.epoch, board, tmo, rank))
        flat = ids.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if self.planner.direct:  # dispatch_rows places the entries itself
            dest = row = flat
            ob, cum, rb = self._place_tables
        else:
            dest, row = self.planner.place(gp, rank, ids)
            ob = cum = rb = dest
        self._launch["dispatch_rows"](
            (P, 1, 1), hidden, route_w, flat, dest, row, ob, cum, rb, self.table, board, self.epoch, self._ticket_d,
            b["sig"], self._cu_mine, self._seg_mine, self.cu32, self.rows32, self.ends32,
            self.real_rows, SK, n_tok * self.K, self.K,
            H, R, E, rank, self._G, self.tp, tmo, P, PLACE=self.planner.direct, ROWS=_ROWS, BLOCK_H=self._block_h,
            R_PAD=RP, G_PAD=self._G_PAD, CHUNK=1024, PCH=_PLACE_CHUNK, num_warps=8)
        return b["recv_x"], b["recv_w"], self.cu32, gp

    def _combine_gpu(self, y, y_w, n_tok):
        R, rank, H, K, P, RP = self.R, self.rank, self.H, self.K, self.programs, self._RP
        b = self.buf
        has_w = y_w is not None
        self._launch["combine_rows"](
            (P, 1, 1), y, y_w if has_w else b["recv_w"], b["recv_x"], b["recv_w"], b["recv_src"], self.real_rows,
            self.table, self.board.address, self.epoch, self._ticket_c, b["sig"], self.S * K, H, R, rank, self._tmo,
            P, HAS_W=has_w, ROWS=_ROWS, BLOCK_H=self._block_h, R_PAD=RP, num_warps=8)
        # the result is the caller's (a layer's output must survive the next layer's combine on
        # this buffer): fresh tensors from the caching allocator, no synchronization
        out = torch.empty(self.S, H, dtype=self.dtype, device=self.device)
        out_w = torch.empty(self.S, K, dtype=torch.float32, device=self.device) if has_w else out
        n_red, bh = self._n_red, self._bh_red
        self._launch["reduce"]((n_red, 1, 1), b["comb_x"], b["comb_w"], out, out_w, n_tok, K, H, n_red, HAS_W=has_w,
                               K_PAD=self._K_PAD, BLOCK_H=bh, num_warps=4)
        return out, (out_w if has_w else None)

    @property
    def step_launchers(self) -> list[Launcher]:
        """The launchers one dispatch + combine runs, in order (GPU): the plan, the planner's
        histogram and place only for large batches, then the transport's three (clear_rows runs
        only for a dispatch that follows a dispatch with no combine)."""
        plan, *placing = self.planner.launchers
        return [plan, *([] if self.planner.direct else placing),
                *(self._launch[k] for k in ("dispatch_rows", "combine_rows", "reduce"))]

    # ------------------------------------------------------------------ CPU executor
    def _signal_host(self, phase: str, peers) -> None:
        p = _PHASE[phase]
        value = self._host_epoch[p] + 1
        for d in peers:
            self.peer["sig"][d][p, self.rank] = value

    def _give_up(self, why: int) -> None:
        """``why`` into this rank's entry of every rank's ``gave_up`` row, this one's too (host stores; on GPUs a
        copy kernel into each peer's memory, which lands when it completes)."""
        for d in range(self.R):
            self.peer["sig"][d][_GAVE_UP, self.rank] = why

    def _refuse_if_given_up(self, phase: str) -> None:
        """Raise (recorded on the board) once a rank gave up on the group: nothing more is written to a peer."""
        row = self.buf["sig"][_GAVE_UP]
        gone = row.nonzero().flatten().tolist()
        if gone:
            self.board.peer_gave_up(gone[0], int(row[gone[0]]), _WAIT_CODE[phase], self._host_epoch[_PHASE[phase]] + 1)
            self.board.check()

    def _wait_host(self, phase: str) -> None:
        p = _PHASE[phase]
        target = self._host_epoch[p] + 1
        sig = self.buf["sig"][p]
        t0 = time.monotonic()
        pause = 0.0
        while True:
            seen = sig.clone()
            late = (seen < target).nonzero().flatten().tolist()
            if not late:
                break
            elapsed = time.monotonic() - t0
            self._refuse_if_given_up(phase)
            if elapsed >= self.timeout_s:
                self.board.record(_WAIT_CODE[phase], late[0], target, int(elapsed * 1e9), int(seen[late[0]]), target)
                self._give_up(GAVE_UP_TIMED_OUT)  # every rank (this one too) stops writing and leaves its waits
                self.board.check()
            pause = min(1e-3, pause + 2e-5)
            time.sleep(pause)
        self._host_epoch[p] = target

    def _dispatch_host(self, hidden, route_w, ids, tpe):
        R, rank, S, K = self.R, self.rank, self.S, self.K
        b = self.buf
        self._refuse_if_given_up("counts")
        for d in range(R):
            self.peer["counts"][d][rank].copy_(tpe)
        self._signal_host("counts", range(R))
        self._wait_host("counts")
        tpe_all = b["counts"].to(torch.int64)
        # every rank reads the same table, so all refuse together, before any row moves (an id outside [0, E)
        # dropped from a count would otherwise be placed out of bounds). The rows phase's signal, with no rows,
        # then says each has read it: a rank that left at once could write the next step's counts into the
        # table of a peer that has not read this one yet
        try:
            refuse_short_counts(tpe_all, S, K, self.E)
        except MoonEPInputError:
            self._signal_host("dispatch", range(R))
            self._wait_host("dispatch")
            raise
        gp = plan_global(tpe_all, S, K, self.B, self.tp)
        dest, row = place_entries(gp, rank, ids)
        n = S * K
        flat = torch.arange(n)
        src_id = (rank * n + flat).to(torch.int32)
        wflat = route_w.reshape(-1)
        for d in range(R):
            sel = (dest == d).nonzero().flatten()
            if sel.numel():
                rows = row[sel]
                self.peer["recv_x"][d].index_copy_(0, rows, hidden.index_select(0, sel // K))
                self.peer["recv_w"][d].index_copy_(0, rows, wflat.index_select(0, sel))
                self.peer["recv_src"][d].index_copy_(0, rows, src_id.index_select(0, sel))
        self._signal_host("dispatch", range(R))
        # padding rows of this rank's segments: hidden 0, weight 0, no source
        cu = gp.cu_seqlens[rank]
        pad = padding_rows(gp, rank, self.tp)
        if pad.numel():
            b["recv_x"].index_fill_(0, pad, 0)
            b["recv_w"].index_fill_(0, pad, 0)
            b["recv_src"].index_fill_(0, pad, -1)
        self._wait_host("dispatch")
        return b["recv_x"], b["recv_w"], cu.to(torch.int32), gp

    def _combine_host(self, y, y_w, used: int):
        R, S, K = self.R, self.S, self.K
        b = self.buf
        self._refuse_if_given_up("combine")
        n = S * K
        # rows past cu[-1] may hold an earlier step's source ids: only [0, cu[-1]) is this step's
        src = b["recv_src"][:used].to(torch.int64)
        for d in range(R):
            rows = ((src >= d * n) & (src < (d + 1) * n)).nonzero().flatten()
            if rows.numel():
                entries = src.index_select(0, rows) - d * n
                self.peer["comb_x"][d].index_copy_(0, entries, y.index_select(0, rows))
                if y_w is not None:
                    self.peer["comb_w"][d].index_copy_(0, entries, y_w.index_select(0, rows))
        self._signal_host("combine", range(R))
        self._wait_host("combine")
        out = sum_entries(b["comb_x"], S, K, self.dtype)
        rw = b["comb_w"].view(S, K).clone() if y_w is not None else None
        return out, rw

    @property
    def nbytes(self) -> int:
        """Heap bytes of this transport's allocations, per rank (0 once closed)."""
        return sum(h.nbytes for h in self._handles)

    # ------------------------------------------------------------------ teardown
    def close(self, local: bool = False) -> None:
        """Free the heap allocations (collective, LIFO on the heap), then the heap if this
        transport made it. ``local``: the group failed, so the heap frees this rank's memory only."""
        if self._closed:
            return
        self._closed = True
        self.board.close()
        if local:
            self.heap.teardown_locally()  # peers may be gone: release local memory only
        try:
            if getattr(self, "graphs", None) is not None:
                self.graphs.clear()  # their launches address the allocations freed below
                self.inplace.clear()
            self.peer.clear()
            self.buf.clear()
            handles, self._handles = self._handles[::-1], []
            self.heap.free_all(*handles)
        finally:
            if self.owns_heap:
                self.heap.close(force=True)

