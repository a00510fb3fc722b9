"""Run a function on R ranks: spawned CPU/GPU processes with a gloo group, or under torchrun.

``RankPool(R)`` starts R processes once, each with an initialised process group, and runs
picklable module-level functions on all of them (``pool.run(fn, *args)`` calls ``fn(*args)`` on
every rank and returns the per-rank results in rank order). Tests and tools reuse pools across
calls, which keeps a multi-rank test suite fast on a 2-core machine.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment, one node or
several) ``run_on_ranks`` runs the function in the launched process on the launched group
instead, so the same tests run unchanged there.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["RankError", "RankFailure", "RankPool", "get_pool", "launched_world_size", "run_on_ranks", "shutdown_pools"]

#: how long a worker waits in one collective before gloo gives up (seconds); a pool's ``env`` may
#: set VLLM_MOONEP_TEST_GROUP_TIMEOUT_S for its own ranks (read when the group is made)
GROUP_TIMEOUT_S = float(os.environ.get("VLLM_MOONEP_TEST_GROUP_TIMEOUT_S", "120"))


def _group_timeout_s() -> float:
    return float(os.environ.get("VLLM_MOONEP_TEST_GROUP_TIMEOUT_S", GROUP_TIMEOUT_S))


class RankError(RuntimeError):
    """One or more ranks raised; the message carries each rank's traceback."""


class RankFailure:
    """What ``run(..., allow_failures=True)`` returns for a rank that did not return a result.

    ``status``: ``"error"`` (the function raised; ``detail`` is the traceback), ``"died"`` (the
    process exited; ``exitcode``), or ``"timeout"`` (no answer within the run's deadline).
    """

    def __init__(self, rank: int, status: str, detail: str, exitcode: int | None = None):
        self.rank, self.status, self.detail, self.exitcode = rank, status, detail, exitcode

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, status={self.status!r}, exitcode={self.exitcode})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_world_size() -> int | None:
    """World size of a torchrun launch this process belongs to, else ``None``."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return int(os.environ.get("WORLD_SIZE", "1"))
    return None


def _bind_gpu(rank: int, backend: str) -> None:
    """NCCL needs one GPU per rank: rank ``r`` uses GPU ``LOCAL_RANK`` (torchrun) or ``r``."""
    if backend == "nccl":
        import torch

        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))


def _init_group(rank: int, world_size: int, init_method: str, backend: str) -> None:
    import torch.distributed as dist

    _bind_gpu(rank, backend)

    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=_group_timeout_s()),
    )


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, conn, env: dict) -> None:
    os.environ.update(env)
    os.environ["VLLM_MOONEP_RANK"] = str(rank)
    import torch

    torch.set_num_threads(max(1, int(env.get("VLLM_MOONEP_THREADS_PER_RANK", "1"))))
    try:
        _init_group(rank, world_size, init_method, backend)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    import torch.distributed as dist

    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    """R long-lived rank processes with a process group (gloo by default)."""

    def __init__(self, world_size: int, *, backend: str = "gloo", env: dict | None = None, start_timeout_s: float = 120.0):
        self.world_size = world_size
        self.backend = backend
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(env or {})
        self.procs, self.conns = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(r, world_size, init_method, backend, child, env), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.broken = False
        for r, c in enumerate(self.conns):
            status, payload = self._recv(r, c, start_timeout_s)
            if status != "ready":
                self.close()
                raise RankError(f"rank {r} failed to start:\n{payload}")

    def _recv(self, rank: int, conn, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                try:
                    return conn.recv()
                except EOFError:
                    self.procs[rank].join(timeout=1)
                    return "died", f"rank {rank} exited (exit code {self.procs[rank].exitcode})"
            if not self.procs[rank].is_alive() and not conn.poll(0):
                return "died", f"rank {rank} died (exit code {self.procs[rank].exitcode})"
        return "timeout", f"rank {rank} did not answer within {timeout_s:.0f}s"

    def run(self, fn: Callable, *args, timeout_s: float = 600.0, allow_failures: bool = False, **kwargs) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; results in rank order, or ``RankError``.

        With ``allow_failures`` a rank that raised, died or did not answer yields a
        ``RankFailure`` in its place instead of an exception (fault-injection tests kill ranks
        on purpose). Either way a failure leaves the pool broken and closed: a dead rank, or a
        process group that failed mid-collective, cannot be reused.
        """
        if self.broken:
            raise RankError("this rank pool is broken (an earlier call failed); make a new one")
        for r, c in enumerate(self.conns):
            try:
                c.send((fn, args, kwargs))
            except (BrokenPipeError, OSError):
                pass  # a dead rank: reported by _recv below
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        for r, c in enumerate(self.conns):
            # once a rank failed, peers stuck in a collective get a short grace period
            left = max(deadline - time.monotonic(), 0.1) if not errors else min(_group_timeout_s() + 15, max(deadline - time.monotonic(), 0.1))
            status, payload = self._recv(r, c, left)
            if status == "ok":
                results[r] = payload
            else:
                errors.append(f"--- rank {r} ({status}) ---\n{payload}")
                results[r] = RankFailure(r, status, payload, self.procs[r].exitcode)
        if errors:
            self.broken = True
            self.close()
            if allow_failures:
                return results
            raise RankError(f"{fn.__module__}.{fn.__qualname__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave (it destroys its process group), wait ``grace_s`` in all, then
        kill the stragglers (a rank whose group has a pending failed collective may block in
        ``destroy_process_group`` until the group's own timeout). Idempotent."""
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.01))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            try:
                c.close()
            except Exception:
                pass
        self.conns, self.procs = [], []
        self.broken = True


_POOLS: dict[tuple, RankPool] = {}


def get_pool(world_size: int, *, backend: str = "gloo", env: dict | None = None) -> RankPool:
    """A cached pool for ``(world_size, backend, env)``; a broken one is replaced."""
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        pool = RankPool(world_size, backend=backend, env=env)
        _POOLS[key] = pool
    return pool


def shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_on_ranks(world_size: int, fn: Callable, *args, env: dict | None = None, fresh: bool = False,
                 backend: str = "gloo", **kwargs) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return the per-rank results.

    Under torchrun the launched processes are the ranks: ``world_size`` must equal the launched
    world size (callers skip otherwise) and each process returns ``[its own result]`` gathered
    from every rank. Otherwise a (cached, or with ``fresh=True`` new) spawned pool runs it.
    ``timeout_s=`` and ``allow_failures=`` go to ``RankPool.run`` (spawned pools only; use
    ``fresh=True`` when ranks are killed on purpose).
    """
    launched = launched_world_size()
    if launched is not None:
        import torch.distributed as dist

        kwargs.pop("timeout_s", None)
        if kwargs.pop("allow_failures", False):
            raise RankError("allow_failures (fault injection) needs spawned ranks, not a torchrun launch")

        if launched != world_size:
            raise RankError(f"launched with WORLD_SIZE={launched}, the call needs {world_size}")
        if not dist.is_initialized():
            backend = os.environ.get("VLLM_MOONEP_BACKEND", "gloo")
            _bind_gpu(int(os.environ.get("RANK", "0")), backend)
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=_group_timeout_s()))
        if env:
            os.environ.update(env)
        mine = fn(*args, **kwargs)
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, mine)
        return out
    if fresh:
        pool = RankPool(world_size, env=env, backend=backend)
        try:
            return pool.run(fn, *args, **kwargs)
        finally:
            pool.close()
    return get_pool(world_size, env=env, backend=backend).run(fn, *args, **kwargs)
