"""The error board: where device-side code reports what it could not do, without a host sync.

A GPU kernel that waits for a peer's signal must never hang the GPU, and it cannot raise. So
every device-side wait is bounded (``timeout_s``, see ``timeouts.py``); when the bound runs
out, the kernel writes a record here and returns. Device-side input checks (an expert id
outside ``[0, E)``) write here too, and the offending rows are skipped instead of written out
of bounds.

::

    kernel (GPU) --st.sys--> board [pinned host memory, mapped] <--plain read-- host
                                                                 check(): raise if set

On CUDA the board lives in page-locked host memory, which kernels address directly (unified
addressing), so the host reads it with no CUDA call and no synchronization: ``check()`` is free
and runs at the start of every ``dispatch``/``combine``; ``check(sync=True)`` first waits for
the stream, for a caller that wants to know about the step just issued. Device-side waits never
read it (one read of host memory from a GPU program costs ~7 us): a wait that timed out tells the
other ranks through their signal memory instead (``signals.give_up``), and theirs record that here
(``CODE_PEER_GAVE_UP``). On CPU ranks the transport waits on the host and records failures here
itself, so both report the same way.

Every open board of the process is listed (``raise_recorded``): a caller that replays CUDA graphs, which
run no host check, asks once per step (the vLLM plugin does, before each of the worker's steps).

The first record wins (later failures leave it alone); a raised error leaves
the board set, so every later call raises too: after a peer failed to signal, the epochs of
the ranks no longer agree and the buffer must be rebuilt.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from vllm_moonep.engine.errors import MoonEPCollectiveTimeout, MoonEPInputError

__all__ = ["CODE_BAD_ID", "CODE_PEER_GAVE_UP", "CODE_WAIT_COUNTS", "CODE_WAIT_OUTPUTS", "CODE_WAIT_ROWS", "ErrorBoard",
           "GAVE_UP_REFUSED", "GAVE_UP_TIMED_OUT", "WAIT_OPS", "raise_recorded"]

#: record layout (int64 words); CLAIM makes the first failure win (later ones leave it alone)
FLAG, CODE, PEER, EPOCH, ELAPSED_NS, SEEN, TARGET, CLAIM = range(8)
WORDS = 8

#: codes of the bounded waits (the operation named in the error) and of the device-side input check
CODE_WAIT_COUNTS, CODE_WAIT_ROWS, CODE_WAIT_OUTPUTS = 1, 2, 3
WAIT_OPS = {
    CODE_WAIT_COUNTS: "dispatch: wait for every peer's token counts",
    CODE_WAIT_ROWS: "dispatch: wait for every peer's rows",
    CODE_WAIT_OUTPUTS: "combine: wait for every peer's expert outputs",
}
#: a wait ended because a peer had given up on the group (PEER: that rank; SEEN: the wait's own code; TARGET: why,
#: GAVE_UP_*; EPOCH -1: found by the host between calls)
CODE_PEER_GAVE_UP = 4
#: why a rank gave up on the group (what it writes in the symmetric transport's gave_up row): a wait of its timed
#: out; it refused its input to a dispatch (that transport has no frame to carry a refusal)
GAVE_UP_TIMED_OUT, GAVE_UP_REFUSED = 1, 2
#: an expert id outside [0, E) reached the device-side placement
CODE_BAD_ID = 16


class ErrorBoard:
    """One record of ``WORDS`` int64 words (see the module doc) on ``device``'s host side."""

    def __init__(self, device: torch.device, *, rank: int, world_size: int, timeout_s: float, what: str):
        pinned = device.type == "cuda"
        self.words = torch.zeros(WORDS, dtype=torch.int64, pin_memory=pinned)
        self.address = self.words.data_ptr()  # kernels write here (unified addressing)
        # the flag as a plain word: every dispatch and combine reads it, and indexing the tensor
        # cost ~1-2 us of host time a read
        self._flag = ctypes.c_int64.from_address(self.address + FLAG * self.words.element_size())
        self.rank, self.world_size, self.timeout_s, self.what = rank, world_size, timeout_s, what
        self.device = device
        self.raised: BaseException | None = None
        _OPEN.add(self)

    def close(self) -> None:
        """Its transport is closed: ``raise_recorded`` no longer reads it."""
        _OPEN.discard(self)

    # -- written by the host transport (CPU ranks) ------------------------------------------------
    def record(self, code: int, peer: int, epoch: int, elapsed_ns: int, seen: int = 0, target: int = 0) -> None:
        if int(self.words[CLAIM]):
            return
        self.words[CLAIM] = 1
        self.words[CODE], self.words[PEER], self.words[EPOCH] = code, peer, epoch
        self.words[ELAPSED_NS], self.words[SEEN], self.words[TARGET] = elapsed_ns, seen, target
        self.words[FLAG] = 1

    # -- read by the host -------------------------------------------------------------------------
    @property
    def is_set(self) -> bool:
        return bool(self._flag.value)

    def check(self, sync: bool = False) -> None:
        """Raise the recorded failure (``sync``: after the device finished what was issued)."""
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self._flag.value:
            return
        raise self.error()

    def error(self) -> BaseException:
        return self._error([int(v) for v in self.words.tolist()])

    def peer_gave_up(self, peer: int, why: int, code: int, epoch: int = -1) -> MoonEPCollectiveTimeout:
        """Rank ``peer`` gave up on the group (``why``: ``GAVE_UP_*``), found by the host (``code``: the wait it
        stops; ``epoch`` -1: between calls): recorded unless the board holds an earlier failure, and returned as the
        error either way."""
        self.record(CODE_PEER_GAVE_UP, peer, epoch, 0, code, why)
        w = [0] * WORDS
        w[CODE], w[PEER], w[EPOCH], w[SEEN], w[TARGET] = CODE_PEER_GAVE_UP, peer, epoch, code, why
        err = self._error(w)
        assert isinstance(err, MoonEPCollectiveTimeout)
        return err

    def _error(self, w: list[int]) -> BaseException:
        code, peer, epoch = w[CODE], w[PEER], w[EPOCH]
        if code == CODE_BAD_ID:
            return MoonEPInputError(
                f"{self.what}: an expert id outside [0, E) reached dispatch on rank {self.rank}, or an entry beyond "
                "its expert's count in tokens_per_expert (the device-side check skipped its row, so this step's "
                "output is wrong); sanitize invalid ids first and count them with their bincount. "
                "Rebuild the buffer: the ranks' step counts may no longer agree."
            )
        if code == CODE_PEER_GAVE_UP:
            if epoch >= 0:
                op = WAIT_OPS.get(w[SEEN], f"wait #{w[SEEN]}")
                what_ended = f"MoonEP {op!r} was abandoned at its call #{epoch}"
            else:
                op = "symmetric transport: the next call"
                what_ended = "This buffer will not run another step"
            why = ("it refused its input to a dispatch, and the symmetric transport carries no refusal, so the "
                   "group ends" if w[TARGET] == GAVE_UP_REFUSED else "one of its waits timed out")
            who = "this rank" if peer == self.rank else f"rank {peer}"
            return MoonEPCollectiveTimeout(
                f"{what_ended} on rank {self.rank} of {self.world_size}: {who} had given up on the group ({why}), "
                f"so no launch of this buffer writes into a peer any more. {self.what}: the output of a step in "
                "flight is wrong. Destroy the MoonEP buffers, pools and layouts, then the process group, and build "
                "a fresh set.",
                op=op, step=epoch if epoch >= 0 else None, rank=self.rank, world_size=self.world_size,
                missing=[] if peer == self.rank else [peer], timed_out=False, elapsed_s=w[ELAPSED_NS] / 1e9,
                timeout_s=self.timeout_s, seq=max(epoch, 0),
            )
        op = WAIT_OPS.get(code, f"wait #{code}")
        return MoonEPCollectiveTimeout(
            f"MoonEP {op!r} timed out after {w[ELAPSED_NS] / 1e9:.1f}s (limit {self.timeout_s:g}s) at its "
            f"call #{epoch} on rank {self.rank} of {self.world_size}: peer(s) that did not signal, first rank "
            f"{peer} (signal {w[SEEN]} of {w[TARGET]} expected); it died, stopped calling, or called another "
            f"buffer. {self.what}: the device wait gave up instead of hanging the GPU, so this step's output is "
            "wrong. Destroy the MoonEP buffers, pools and layouts, then the process group, and build a fresh set.",
            op=op, step=epoch, rank=self.rank, world_size=self.world_size, missing=[peer], timed_out=True,
            elapsed_s=w[ELAPSED_NS] / 1e9, timeout_s=self.timeout_s, seq=epoch,
        )


#: the boards of this process's open transports
_OPEN: weakref.WeakSet[ErrorBoard] = weakref.WeakSet()


def raise_recorded() -> None:
    """Raise the failure recorded on any open board of this process (plain reads of host memory, no sync): for a
    caller whose steps run as replayed CUDA graphs, where no dispatch or combine checks on entry."""
    for board in list(_OPEN):
        if board.is_set:
            raise board.error()
