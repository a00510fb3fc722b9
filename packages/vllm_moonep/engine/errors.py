"""Errors raised by the engine and the layers above it."""

from __future__ import annotations

from collections.abc import Iterable


class MoonEPError(RuntimeError):
    """Base class of this project's errors."""


class MoonEPInputError(MoonEPError, ValueError):
    """A caller passed something the contract does not allow. Nothing was modified."""


class MoonEPStateError(MoonEPError):
    """An object was used out of order (destroyed, plan from another buffer, a process group
    that failed earlier, ...)."""


class MoonEPUnavailableError(MoonEPError):
    """A requested engine or heap cannot run here; the message says why."""


class MoonEPCollectiveTimeout(MoonEPError, TimeoutError):
    """A collective did not complete within its timeout (a peer died or stopped calling).

    The message names the operation, the step and the peer(s) that did not answer (see
    ``engine/faults/bounded_collectives.py`` and ``error_board.py``). Structured copies of those facts:

    - ``op``: the operation (e.g. ``"dispatch: all_gather(tokens_per_expert)"``)
    - ``step``: the buffer's step (its dispatch count), ``None`` at construction / load time
    - ``rank``, ``world_size``: this rank in the EP group
    - ``missing``: group ranks that did not answer (empty when every peer had entered the
      collective and the transport failed inside it)
    - ``timed_out``: ``True`` when the bound ran out, ``False`` when the transport failed first
      (e.g. gloo's "Connection closed by peer" when a peer process exited)
    - ``elapsed_s``, ``timeout_s``, ``seq`` (the group's collective sequence number)

    After this error the process group is unusable (the collective may still be pending in the
    backend): every MoonEP object on the group refuses further collectives with
    ``MoonEPStateError``; destroy them, then the process group.
    """

    def __init__(self, message: str = "", *, op: str = "", step: int | None = None, rank: int = -1,
                 world_size: int = 0, missing: Iterable[int] = (), timed_out: bool = True, elapsed_s: float = 0.0,
                 timeout_s: float = 0.0, seq: int = 0) -> None:
        super().__init__(message)
        self.op = op
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.missing = list(missing)
        self.timed_out = timed_out
        self.elapsed_s = elapsed_s
        self.timeout_s = timeout_s
        self.seq = seq

    def summary(self) -> str:
        """One line for the group's failure record (``BoundedCollectives.mark_broken``): the operation, how it
        ended, the step and the peers it names."""
        how = "timed out" if self.timed_out else "failed"
        where = "" if self.step is None else f" at step {self.step}"
        return f"{self.op!r} {how}{where}" + (f", peers {self.missing}" if self.missing else "")
