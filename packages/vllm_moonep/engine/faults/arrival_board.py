"""The arrival board: which MoonEP collective each rank last entered, and whether it is alive.

Each rank counts the MoonEP collectives it enters on a process group (the count is the same on
every rank, since every rank issues the same collectives in the same order) and a daemon thread
publishes the latest ``(count, heartbeat, step, op)`` to the group's rendezvous store every
``heartbeat_s`` (one overwritten key per rank, so the store never grows). The hot path only
stores a tuple in memory: no store round trip per collective. On a failure the survivor reads
every peer's key twice, ``probe_s`` apart: a peer whose count is behind never entered this
collective (its last operation is reported), a peer whose heartbeat did not advance is dead or
frozen. Each read of the board, and the tidy delete of this rank's key on release, is bounded
(``read_bound_s``): the store lives in global rank 0's process, and a frozen or half-torn-down host
holds a store call for the store's own timeout (minutes by default), which would carry a failure past
the collective's bound, or a teardown past any bound; an unanswered read is reported as such.
``VLLM_MOONEP_ARRIVAL_BOARD=0`` turns the board off (errors then name no peer);
``VLLM_MOONEP_HEARTBEAT_S`` overrides the publish interval (default
``clamp(timeout_s / 20, 0.02, 1.0)``). The transports (``collective``, ``symmetric``) consult it.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch.distributed as dist

from vllm_moonep.engine.errors import MoonEPStateError
from vllm_moonep.engine.faults.timeouts import positive_seconds

__all__ = ["ARRIVAL_ENV", "HEARTBEAT_ENV", "ArrivalBoard", "heartbeat_s"]

ARRIVAL_ENV = "VLLM_MOONEP_ARRIVAL_BOARD"
HEARTBEAT_ENV = "VLLM_MOONEP_HEARTBEAT_S"
#: the least time a diagnosis gives one read of the board (more where the probe interval is longer): a healthy
#: store answers in milliseconds, also on a loaded 2-core machine
STORE_READ_BOUND_S = 0.5


def _board_enabled() -> bool:
    return os.environ.get(ARRIVAL_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def heartbeat_s(timeout_s: float) -> float:
    env = os.environ.get(HEARTBEAT_ENV)
    if env:
        return positive_seconds(env, HEARTBEAT_ENV)
    return min(1.0, max(0.02, timeout_s / 20.0))


class ArrivalBoard:
    """Which MoonEP collective each rank of one process group last entered, and whether it is
    alive, published through the group's store (see the module doc).

    One board per process group per process (``ArrivalBoard.for_group``), shared by every
    transport on that group and reference-counted: the publisher thread runs while at least one
    transport holds it. The collective count lives as long as the process group (the board
    tracks the group weakly, so it never keeps a destroyed group's backend alive), so it stays
    comparable across ranks however their objects come and go. ``broken`` records the first
    failure on the group.
    """

    _registry: dict[int, "ArrivalBoard"] = {}
    _registry_lock = threading.Lock()

    def __init__(self, pg, group_ranks: list[int], rank: int, label: str, interval_s: float):
        self._pg_ref = weakref.ref(pg)
        self.store: dist.Store | None = None
        self.group_ranks = list(group_ranks)  # global rank of each group rank
        self.rank = rank  # this process's rank in the group
        self.world_size = len(group_ranks)
        self.label = label
        self.interval_s = float(interval_s)
        self.probe_s = 2.5 * self.interval_s
        self.read_bound_s = max(STORE_READ_BOUND_S, self.probe_s)
        self.seq = 0
        self._last = (0, None, "")  # (seq, step, op) of the last collective entered
        self._beat = 0
        self.broken: str | None = None
        self.refs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store_error: str | None = None

    # -- registry ------------------------------------------------------------------------------
    @classmethod
    def for_group(cls, group, interval_s: float, store=None) -> "ArrivalBoard | None":
        """Acquire the board of ``group`` (``None``: the default group), made on first use;
        ``None`` when the board is disabled or the group's store is not reachable from here."""
        pg = group if group is not None else dist.group.WORLD
        if pg is None or not _board_enabled():
            return None
        with cls._registry_lock:
            for k in [k for k, b in cls._registry.items() if b._pg_ref() is None]:
                del cls._registry[k]  # boards of groups that no longer exist
            board = cls._registry.get(id(pg))
            if board is None or board._pg_ref() is not pg:
                try:
                    ranks = dist.get_process_group_ranks(pg)
                    rank = dist.get_rank(pg)
                    label = getattr(pg, "group_name", "") or str(id(pg))
                except Exception:
                    return None
                board = cls(pg, ranks, rank, label, interval_s)
                cls._registry[id(pg)] = board
            board.refs += 1
            if board.refs > 1:
                return board
            try:
                board.store = store if store is not None else dist.distributed_c10d._get_default_store()
            except Exception:
                board.refs -= 1
                return None
            board.store_error = None
            board._stop = threading.Event()
        try:  # the key exists from the start (bounded: this is the caller's thread)
            board._bounded(board._publish, "publish")
        except TimeoutError:
            pass  # the publisher thread keeps trying
        board._thread = threading.Thread(target=board._loop, args=(board._stop,), name=f"moonep-arrival-{board.label}",
                                         daemon=True)
        board._thread.start()
        return board

    def release(self) -> None:
        with self._registry_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            self._stop.set()
            t, self._thread = self._thread, None
            store, self.store = self.store, None
        stuck = False
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(2 * self.interval_s, 0.5))
            stuck = t.is_alive()  # held in a publish: the store is not answering, so a delete would wait too
        if self.broken is None and self.store_error is None and store is not None and not stuck:
            key = self._key(self.rank)
            try:  # tidy, best effort, bounded like a read: a half-torn-down store host holds it for minutes
                self._bounded(lambda: store.delete_key(key), "delete")
            except Exception:
                pass

    @classmethod
    def live_boards(cls) -> int:
        """Boards with a running publisher (held by at least one transport)."""
        with cls._registry_lock:
            return sum(1 for b in cls._registry.values() if b.refs > 0)

    # -- hot path ------------------------------------------------------------------------------
    def mark(self, op: str, step) -> int:
        """Record entry into the next collective (memory only); returns its sequence number."""
        self.seq += 1
        self._last = (self.seq, step, op)
        return self.seq

    # -- publisher -----------------------------------------------------------------------------
    def _key(self, group_rank: int) -> str:
        return f"moonep/arrival/{self.label}/{self.group_ranks[group_rank]}"

    def _publish(self) -> None:
        store = self.store
        if self.store_error is not None or store is None:
            return
        seq, step, op = self._last
        self._beat += 1
        value = f"{seq}|{self._beat}|{'' if step is None else step}|{op}"
        try:
            store.set(self._key(self.rank), value)
        except Exception as exc:  # the store's host died: stop publishing (and stop the noise)
            self.store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            self._publish()
            if self.store_error is not None:
                return

    # -- diagnosis -----------------------------------------------------------------------------
    def snapshot(self) -> dict[int, tuple | None]:
        """``{group rank: (seq, beat, step, op) or None}`` for every peer; raises if the store is gone, and
        ``TimeoutError`` if it does not answer within ``read_bound_s`` (the read goes on in a daemon thread
        until the store's own timeout ends it)."""
        return self._bounded(self._read, "read")

    def _bounded(self, call, what: str):
        """``call()`` on a daemon thread, waited for at most ``read_bound_s``; ``TimeoutError`` past it (the
        call goes on until the store's own timeout ends it). Every store round trip outside the publisher thread
        goes through here, so no set-up, diagnosis or teardown waits on the store's host for longer."""
        got: dict = {}

        def run():
            try:
                got["value"] = call()
            except BaseException as exc:  # handed to the caller
                got["error"] = exc

        worker = threading.Thread(target=run, name=f"moonep-arrival-{what}-{self.label}", daemon=True)
        worker.start()
        worker.join(self.read_bound_s)
        if worker.is_alive():
            raise TimeoutError(f"the rendezvous store did not answer within {self.read_bound_s:g}s")
        if "error" in got:
            raise got["error"]
        return got["value"]

    def _read(self) -> dict[int, tuple | None]:
        store = self.store
        if store is None:
            raise MoonEPStateError("the arrival board was released")
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = [self._key(r) for r in peers]
        present = store.check(keys) if keys else True
        out: dict[int, tuple | None] = {r: None for r in peers}
        if not present:  # at least one key missing: read the ones that exist one by one
            for r, k in zip(peers, keys):
                if store.check([k]):
                    out[r] = _parse(store.get(k))
            return out
        for r, v in zip(peers, store.multi_get(keys)):
            out[r] = _parse(v)
        return out

    def diagnose(self, seq: int, first: dict | None, second: dict | None, store_exc: str | None) -> tuple[list[int], str]:
        """``(missing group ranks, text)`` for a failure of collective ``seq`` on this rank."""
        if second is None:
            why = store_exc or self.store_error or "no snapshot"
            return [], (
                f"could not read the arrival board from the rendezvous store ({why}); the store is hosted by "
                f"global rank 0 / MASTER_ADDR: if that rank died, it is the one that did not answer"
            )
        missing, notes = [], []
        for r, now in sorted(second.items()):
            name = f"rank {r}" + (f" (global {self.group_ranks[r]})" if self.group_ranks[r] != r else "")
            if now is None:
                missing.append(r)
                notes.append(f"{name} (never published an arrival)")
                continue
            pseq, beat, step, op = now
            before = first.get(r) if first else None
            stalled = before is not None and before[1] == beat
            life = (f"no heartbeat for {self.probe_s:.1f}s: the process is dead or frozen" if stalled
                    else "alive" if before is not None else "liveness unknown")
            if pseq < seq:
                missing.append(r)
                last = (f"last entered {op!r} at step {'-' if step is None else step}, collective #{pseq}" if pseq
                        else "published no arrival since the board started")
                notes.append(f"{name} ({last}; {life})")
            elif stalled:
                missing.append(r)
                notes.append(f"{name} (entered this collective, then stopped: {life})")
        if not missing:
            return [], "every peer entered this collective; the transport failed inside it"
        return missing, "peer(s) that did not answer: " + "; ".join(notes)


def _parse(raw) -> tuple | None:
    try:
        s = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        seq, beat, step, op = s.split("|", 3)
        return int(seq), int(beat), (int(step) if step else None), op
    except Exception:
        return None
