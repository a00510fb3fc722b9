"""Bounded collectives: every all-gather, all-to-all and barrier MoonEP issues over a process group,
each bounded in time and, when it fails, naming the peer that did not arrive.

Works wherever ``torch.distributed`` works: gloo on CPU (and CUDA tensors staged through the
host), NCCL on GPUs, across nodes. A world of one rank needs no process group at all. The
buffer's configuration check and host plan, the collective and hybrid transports' all-to-alls
(``engine/transports/``), the heaps' agreement and frees and the layouts' loading all go through
one ``BoundedCollectives``.

Fault handling
--------------
Every collective the engine and the layouts issue goes through ``BoundedCollectives._run``:
the collective is issued asynchronously and waited on with a bound (``timeout_s``; default
``VLLM_MOONEP_COLLECTIVE_TIMEOUT_S``, else 300 s). When a peer dies or stops calling, the
survivors raise ``MoonEPCollectiveTimeout`` naming the operation, the step and the peer(s) that
did not answer, instead of hanging; nothing half-received is returned. Verified behaviour of
gloo (``tests/distributed/test_faults.py``): ``work.wait(timeout)`` raises ``RuntimeError
("Operation timed out!")`` after the bound while the operation stays pending in the backend (a
second ``wait`` can still complete it); a peer process that exits makes the wait fail at once
with "Connection closed by peer".

Naming the peer that did not answer: the ``ArrivalBoard`` (``arrival_board.py``). Each rank
counts the MoonEP collectives it enters on a process group (the count is the same on every rank,
since every rank issues the same collectives in the same order) and a daemon thread publishes the latest
``(count, heartbeat, step, op)`` to the group's rendezvous store every ``heartbeat_s`` (one
overwritten key per rank, so the store never grows). The hot path only stores a tuple in
memory: no store round trip per collective. On a failure the survivor reads every peer's key
twice, ``probe_s`` apart: a peer whose count is behind never entered this collective (its last
operation is reported), a peer whose heartbeat did not advance is dead or frozen. The probe is
taken inside the bound (the wait is split into ``timeout_s - probe_s`` and ``probe_s``), so a
timeout is reported after ``timeout_s``; a transport error (dead peer) is reported after the
error plus ``probe_s``. A store that does not answer (its host frozen) costs at most the board's
``read_bound_s`` more, and the error says so. ``VLLM_MOONEP_ARRIVAL_BOARD=0`` turns the board off (the error then
names no peer); ``VLLM_MOONEP_HEARTBEAT_S`` overrides the publish interval
(default ``clamp(timeout_s / 20, 0.02, 1.0)``).

After a failure the group is unusable (the failed collective may still be pending in the
backend, and a late peer would be matched against it): every ``BoundedCollectives`` on that
group then refuses further collectives with ``MoonEPStateError``. Destroy the buffers, pools and
layouts (their heap frees turn local once the group failed, so it works after a failure), then the
process group, then build a fresh set. Note that ``dist.destroy_process_group()`` waits for a
pending gloo operation until it fails (when the peers tear their group down, or after the
group's own timeout).

On NCCL, ``work.wait(timeout)`` blocks the host until the collective completes or the bound
expires (it is a host synchronization, which the built-in engine's dispatch needs anyway for its
split sizes); also set the process group's timeout so NCCL's watchdog aborts the communicator.
"""

from __future__ import annotations

import datetime
import pickle
import time
import weakref

import torch
import torch.distributed as dist

from vllm_moonep.engine.defaults import current_cuda_device, group_rank_world
from vllm_moonep.engine.errors import MoonEPCollectiveTimeout, MoonEPInputError, MoonEPStateError
from vllm_moonep.engine.faults.arrival_board import ARRIVAL_ENV, ArrivalBoard, heartbeat_s
from vllm_moonep.engine.faults.timeouts import collective_timeout_s

__all__ = ["BoundedCollectives"]


class BoundedCollectives:
    """All-gather and all-to-all over a process group (``None``: the default group), each
    bounded by ``timeout_s`` (``None``: ``$VLLM_MOONEP_COLLECTIVE_TIMEOUT_S`` or 300 s).

    ``world_size == 1`` without an initialised default group runs locally. ``step`` is set by the
    owner (the buffer's dispatch count) and appears in error messages; ``None`` means set-up
    (construction, weight loading). ``store`` overrides the rendezvous store the arrival board
    publishes to. ``close()`` (idempotent) releases the board.
    """

    def __init__(self, group=None, world_size: int | None = None, timeout_s: float | None = None, *, store=None):
        self.group = group
        if (dist.is_available() and dist.is_initialized()) or (group is None and world_size in (None, 1)):
            self.rank, self.world_size = group_rank_world(group)
        else:
            raise MoonEPInputError(
                "torch.distributed is not initialised: a MoonEP buffer with "
                f"num_ep_ranks={world_size} needs a process group"
            )
        if self.rank < 0:
            raise MoonEPInputError("this process is not a member of the given process group")
        self.timeout_s = collective_timeout_s(timeout_s)
        self.step: int | None = None
        self.last_op = ""
        self._seq = 0
        self.board: ArrivalBoard | None = None
        if not self.local:
            self.board = ArrivalBoard.for_group(group, heartbeat_s(self.timeout_s), store)
            if self.board is not None:
                # the board outlives an object that is garbage collected without close()
                self._finalizer = weakref.finalize(self, ArrivalBoard.release, self.board)
        self._closed = False

    @property
    def local(self) -> bool:
        return self.world_size == 1

    @property
    def broken(self) -> str | None:
        """Why the group is unusable (a collective on it failed earlier), else ``None``."""
        return self.board.broken if self.board is not None else getattr(self, "_broken", None)

    def mark_broken(self, summary: str) -> None:
        """Record that the group failed outside a collective (a device-side wait of the symmetric
        transport): every MoonEP object on the group then refuses further steps."""
        if self.board is not None:
            self.board.broken = self.board.broken or summary
        else:
            self._broken = getattr(self, "_broken", None) or summary

    def close(self) -> None:
        """Release the arrival board (idempotent, local: safe after a failure)."""
        if self._closed:
            return
        self._closed = True
        if self.board is not None:
            self._finalizer()  # calls ArrivalBoard.release once

    # ------------------------------------------------------------------ bounded collectives
    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise MoonEPStateError(f"MoonEP collective {op!r}: the transport was closed (its owner was destroyed)")
        why = self.broken
        if why is not None:
            raise MoonEPStateError(
                f"MoonEP collective {op!r} refused: the process group is unusable after an earlier failure ({why}); "
                "destroy the MoonEP buffers, pools and layouts, then the process group, and build a fresh set"
            )

    def _run(self, op: str, issue) -> None:
        """Issue one collective (``issue()`` returns its async work) and wait for it, bounded."""
        self._check_usable(op)
        if self.board is not None:
            seq = self.board.mark(op, self.step)
        else:
            self._seq += 1
            seq = self._seq
        t0 = time.monotonic()
        # no local reference to the work here: on failure _wait drops its own before raising, so
        # a traceback kept by the caller does not keep the failed group's backend alive (which
        # would stop the peers' pending operations from failing when this rank tears down)
        self._wait(issue(), op, seq=seq, t0=t0)

    def _wait(self, work, op: str, *, seq: int | None = None, t0: float | None = None) -> None:
        self.last_op = op
        if work is None:
            return
        t0 = time.monotonic() if t0 is None else t0
        board = self.board
        probe = min(board.probe_s, 0.5 * self.timeout_s) if board is not None else 0.0
        first_wait = self.timeout_s - probe
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=first_wait))
            if ok is not False:
                return
            exc = RuntimeError("wait returned False")
        except RuntimeError as e:  # gloo/NCCL report timeouts and dead peers as RuntimeError
            exc = e
        # The slow path: something is wrong (or merely slow). Probe the board inside the bound.
        timed_out = "timed out" in str(exc).lower() or (time.monotonic() - t0) >= 0.99 * first_wait
        first = second = None
        store_exc = None
        if board is not None:
            try:
                first = board.snapshot()
            except Exception as e:
                store_exc = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if timed_out:
            left = self.timeout_s - (time.monotonic() - t0)
            if left > 0:
                try:
                    ok = work.wait(timeout=datetime.timedelta(seconds=left))
                    if ok is not False:
                        return  # slow, but it completed within the bound
                except RuntimeError as e:
                    if "timed out" not in str(e).lower():
                        exc, timed_out = e, False
        elif probe > 0:
            time.sleep(probe)
        if board is not None and store_exc is None:
            try:
                second = board.snapshot()
            except Exception as e:
                store_exc = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        del work  # see _run
        elapsed = time.monotonic() - t0
        if board is not None:
            missing, diag = board.diagnose(seq or 0, first, second, store_exc)
        else:
            missing, diag = [], f"no arrival board ({ARRIVAL_ENV}=0 or no store), so the missing peer is unknown"
        what = "timed out" if timed_out else "failed"
        step = "set-up (construction/loading)" if self.step is None else f"step {self.step}"
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        msg = (
            f"MoonEP collective {op!r} {what} after {elapsed:.1f}s (limit {self.timeout_s:g}s) at {step}, "
            f"on rank {self.rank} of {self.world_size} (collective #{seq}); {diag}. Transport: {cause}. "
            "The process group is unusable now: destroy the MoonEP buffers, pools and layouts, then the process group."
        )
        summary = f"{op!r} {what} at {step}" + (f", peers {missing} did not answer" if missing else "")
        if board is not None:
            board.broken = board.broken or summary
        else:
            self._broken = summary
        raise MoonEPCollectiveTimeout(
            msg, op=op, step=self.step, rank=self.rank, world_size=self.world_size, missing=missing,
            timed_out=timed_out, elapsed_s=elapsed, timeout_s=self.timeout_s, seq=seq or 0,
        ) from exc

    # ------------------------------------------------------------------ the operations
    def all_gather(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``[world, *t.shape]``: every rank's ``t``."""
        if self.local:
            self._check_usable(op)
            return t.unsqueeze(0).clone()
        out = t.new_empty((self.world_size,) + tuple(t.shape))
        parts = list(out.unbind(0))
        src = t.contiguous()
        self._run(op, lambda: dist.all_gather(parts, src, group=self.group, async_op=True))
        return out

    def all_gather_object(self, obj, op: str) -> list:
        """Every rank's picklable ``obj`` (two bounded all-gathers: sizes, then padded bytes)."""
        if self.local:
            self._check_usable(op)
            return [obj]
        dev = self.comm_device
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=dev), op + " (sizes)").cpu()
        n = int(sizes.max())
        padded = torch.zeros(n, dtype=torch.uint8, device=dev)
        padded[: data.numel()] = data.to(dev)
        every = self.all_gather(padded, op).cpu()
        return [pickle.loads(every[r, : int(sizes[r, 0])].numpy().tobytes()) for r in range(self.world_size)]

    @property
    def comm_device(self) -> torch.device:
        """Where host-side objects are staged for a collective: CUDA for NCCL groups, else CPU."""
        if not self.local and dist.get_backend(self.group) == "nccl":
            return current_cuda_device()
        return torch.device("cpu")

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], op: str) -> torch.Tensor:
        """Rows ``send[sum(send_splits[:d]) : ...]`` go to rank ``d``; returns received rows in rank order."""
        if self.local:
            self._check_usable(op)
            return send.clone()
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        src = send.contiguous()
        self._run(op, lambda: dist.all_to_all_single(recv, src, recv_splits, send_splits, group=self.group, async_op=True))
        return recv

    def barrier(self, op: str = "barrier") -> None:
        if self.local:
            self._check_usable(op)
            return
        self._run(op, lambda: dist.barrier(group=self.group, async_op=True))
