"""Run a function on R ranks: processes started here (CPU or GPU; gloo, or NCCL with one GPU per
rank), or the processes of a torchrun launch.

``RankPool(R)`` starts R processes once, each with an initialised process group, and runs
picklable module-level functions on all of them (``pool.run(fn, *args)`` calls ``fn(*args)`` on
every rank and returns the per-rank results in rank order). Tests and tools reuse pools across
calls, and the processes are forked from a forkserver that imported torch once
(``FORKSERVER_PRELOAD``), which keeps a multi-rank test suite fast on a 2-core machine.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment, one node or
several) ``run_on_ranks`` runs the function in the launched process on the launched group
instead, so the same tests run unchanged there.

How the tools choose (``resolve_launch``, the ``--backend`` / ``--share-gpus`` flags of
``moonep-ab``, ``moonep-balance`` and the soak): CPU ranks use gloo; CUDA ranks use NCCL with one
GPU per rank (the default when there are enough GPUs). With fewer GPUs than ranks the tools
refuse and say so; ``--share-gpus`` runs several rank processes per GPU over gloo (CUDA tensors
staged through host memory: a correctness run whose timings are not the product's). Under
torchrun the backend is ``--backend``, else ``$VLLM_MOONEP_BACKEND``, else NCCL on CUDA and gloo
on CPU; each process uses GPU ``LOCAL_RANK``.

Collectives of host-side data that tools issue themselves must be staged on
``comm_device()``: an NCCL group moves CUDA tensors only (a CPU tensor raises "No backend type
associated with device type cpu").
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["BACKENDS", "Launch", "RankError", "RankFailure", "RankPool", "add_launch_arguments", "comm_device",
           "finish_launched_group", "get_pool", "init_launched_group", "is_driver", "launched_world_size",
           "resolve_launch", "run_on_ranks", "shutdown_pools"]

#: process-group backends the tools accept (``auto``: NCCL on CUDA with a GPU per rank, gloo on CPU)
BACKENDS = ("auto", "gloo", "nccl")
#: the launcher's variable naming the backend of a torchrun launch (``--backend auto`` reads it)
BACKEND_ENV = "VLLM_MOONEP_BACKEND"

#: how long a worker waits in one collective before gloo gives up (seconds); a pool's ``env`` may
#: set VLLM_MOONEP_TEST_GROUP_TIMEOUT_S for its own ranks (read when the group is made)
GROUP_TIMEOUT_S = float(os.environ.get("VLLM_MOONEP_TEST_GROUP_TIMEOUT_S", "120"))


def _group_timeout_s() -> float:
    return float(os.environ.get("VLLM_MOONEP_TEST_GROUP_TIMEOUT_S", GROUP_TIMEOUT_S))


#: how long ``RankPool.run`` waits for every rank's answer unless the call says (seconds); the GPU
#: suite sets VLLM_MOONEP_TEST_CALL_TIMEOUT_S lower so that one hung case cannot eat a device call
CALL_TIMEOUT_S = float(os.environ.get("VLLM_MOONEP_TEST_CALL_TIMEOUT_S", "600"))


def _stacks_of(proc, fd: int | None) -> str:
    """The Python stacks of every thread of a live rank process that did not answer: on SIGUSR1 it
    dumps them into an unlinked file (``_worker_main``) that is read here through /proc, so a hang
    names the line it waits in and leaves no file behind."""
    if fd is None:
        return ""
    path = f"/proc/{proc.pid}/fd/{fd}"
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except OSError:
        return ""
    text = ""
    for _ in range(30):  # the dump is written by the rank's signal handler: wait until it stops growing
        time.sleep(0.1)
        try:
            now = open(path).read()
        except OSError:
            return ""
        if now and now == text:
            break
        text = now
    return text.strip()


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


#: spawns of a pool whose rendezvous port was taken between picking and binding it
_START_ATTEMPTS = 3


#: what a forkserver imports once, so that each rank process it forks starts with them imported
#: (on 2 cores torch's import is 2-5 s of every spawned rank's start)
FORKSERVER_PRELOAD = ("torch", "torch.distributed")


def _process_context(env: dict):
    """How rank processes start: forked from a forkserver that imported torch once, or spawned
    (``VLLM_MOONEP_RANK_START=spawn``, and always for a pool that sets ``MALLOC_ARENA_MAX``,
    which glibc must read before anything allocates). A forked rank takes this process's
    environment as of its start (``_worker_main`` sets it), as a spawned one does."""
    how = os.environ.get("VLLM_MOONEP_RANK_START", "forkserver")
    if how not in ("forkserver", "spawn"):
        raise RankError(f"VLLM_MOONEP_RANK_START must be forkserver or spawn, got {how!r}")
    if how == "spawn" or "MALLOC_ARENA_MAX" in env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_world_size() -> int | None:
    """World size of a torchrun launch this process belongs to, else ``None``."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return int(os.environ.get("WORLD_SIZE", "1"))
    return None


def is_driver() -> bool:
    """Whether this process prints and writes files: always when spawning ranks, rank 0 under torchrun."""
    return launched_world_size() is None or int(os.environ.get("RANK", "0")) == 0


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


@dataclass(frozen=True)
class Launch:
    """How a tool's ranks run (``resolve_launch``)."""

    backend: str  # gloo | nccl
    device: str  # cpu | cuda
    ranks: int
    launched: bool  # the processes of a torchrun launch (else spawned here)
    ranks_per_gpu: int = 1  # > 1: rank processes share GPUs (--share-gpus)
    env: dict = field(default_factory=dict)  # extra environment of the rank processes
    note: str = ""  # one line for the tool's output


def resolve_launch(device: str, ranks: int | None, backend: str = "auto", share_gpus: bool = False, *,
                   gpus: int | None = None) -> Launch:
    """How ``ranks`` ranks on ``device`` run here; ``ValueError`` with a sentence when they cannot.

    ``gpus``: GPUs visible to this process (default: ``torch.cuda.device_count()``). Under
    torchrun, ``ranks`` (``None``: the launched ``WORLD_SIZE``) must be the launched world size
    and the ranks of this node (``LOCAL_WORLD_SIZE``) need a GPU each.
    """
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    launched_ws = launched_world_size()
    launched = launched_ws is not None
    if launched:
        if ranks is not None and ranks != launched_ws:
            raise ValueError(f"torchrun launched WORLD_SIZE={launched_ws} processes, but --ranks {ranks}: under "
                             f"torchrun the launched processes are the ranks (leave --ranks out or make it {launched_ws})")
        ranks = launched_ws
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be a positive integer, got {ranks!r}")
    if backend == "auto":
        from_env = os.environ.get(BACKEND_ENV, "").strip().lower()
        if from_env:
            if from_env not in BACKENDS:
                raise ValueError(f"${BACKEND_ENV}={from_env!r}: must be one of {', '.join(BACKENDS)}")
            backend = from_env
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("--backend nccl moves CUDA tensors only; CPU ranks run over gloo "
                             "(use --device cuda for NCCL, or --backend gloo / auto)")
        if share_gpus:
            raise ValueError("--share-gpus applies to --device cuda only")
        return Launch("gloo", "cpu", ranks, launched, note="CPU ranks over gloo")
    n = _visible_gpus() if gpus is None else gpus
    if n < 1:
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks)) if launched else ranks
    where = " on this node" if launched else ""
    if backend == "nccl" and share_gpus:
        raise ValueError("--share-gpus needs gloo: NCCL refuses two ranks on one GPU (ncclInvalidUsage); "
                         "use --backend gloo --share-gpus, or one GPU per rank with --backend nccl")
    if per_node > n and not share_gpus:
        fewer = f"launch {n} processes per node (--nproc-per-node {n})" if launched else f"use --ranks {n} or fewer"
        raise ValueError(
            f"--device cuda with {per_node} ranks{where} needs {per_node} GPUs (one GPU per rank, NCCL), but "
            f"{n} {'is' if n == 1 else 'are'} visible here: {fewer}, or pass --share-gpus to run {per_node} rank "
            f"processes on {n} GPU{'s' if n != 1 else ''} over gloo (CUDA tensors staged through host memory: a "
            "correctness run, its timings are not the product's)")
    if per_node > n:  # share_gpus, gloo (explicit or auto)
        k = -(-per_node // n)
        return Launch("gloo", "cuda", ranks, launched, ranks_per_gpu=k,
                      env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"},
                      note=f"{per_node} rank processes share {n} GPU{'s' if n != 1 else ''}{where} over gloo "
                           f"(--share-gpus; up to {k} per GPU): CUDA tensors are staged through host memory, so "
                           "timings are not the product's")
    if backend == "gloo":
        return Launch("gloo", "cuda", ranks, launched,
                      note="one GPU per rank over gloo (--backend gloo): every collective is staged through host "
                           "memory, so timings are not the product's (--backend nccl is)")
    note = "one GPU per rank over NCCL"
    if share_gpus:
        note += " (--share-gpus not needed: there is a GPU for every rank)"
    return Launch("nccl", "cuda", ranks, launched, note=note)


def add_launch_arguments(parser) -> None:
    """The tools' ``--backend`` and ``--share-gpus`` flags (see ``resolve_launch``)."""
    parser.add_argument("--backend", default="auto", choices=list(BACKENDS),
                        help="process group of the ranks: auto = NCCL with one GPU per rank on --device cuda (gloo "
                             f"with --share-gpus), gloo on cpu; under torchrun ${BACKEND_ENV} may name it "
                             "(default: %(default)s)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="--device cuda with fewer GPUs than ranks: run several rank processes per GPU over gloo "
                             "(a correctness run; without this flag such a run is refused)")


def comm_device(group=None):
    """Where host-side data is staged for a collective on ``group``: the current CUDA device when
    the group has no CPU backend (NCCL), else the CPU."""
    import torch
    import torch.distributed as dist

    from vllm_moonep.engine.defaults import current_cuda_device

    try:
        config = dist.get_backend_config(group)
    except Exception:
        config = str(dist.get_backend(group))
    if "cpu:" in config or config == "gloo":
        return torch.device("cpu")
    return current_cuda_device() if torch.cuda.is_available() else torch.device("cuda")


def _bind_gpu(local_rank: int, backend: str, device: str | None = None):
    """Give this rank GPU ``local_rank % count`` (the spawned rank, or ``LOCAL_RANK`` under
    torchrun): always for NCCL (one GPU per rank), and for gloo ranks on ``device="cuda"``."""
    if backend != "nccl" and device != "cuda":
        return None
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        if backend == "nccl":
            raise RankError("the NCCL backend needs a CUDA device and none is visible")
        return None
    torch.cuda.set_device(local_rank % n)
    return torch.device("cuda", local_rank % n)


def _init_group(rank: int, world_size: int, init_method: str, backend: str, device: str | None = None) -> None:
    import torch.distributed as dist

    _bind_gpu(rank, backend, device)

    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=_group_timeout_s()),
    )


def _apply_malloc_env(env: dict) -> None:
    """glibc reads ``MALLOC_ARENA_MAX`` when the process starts, before a pool's ``env`` reaches
    it; apply it here, before torch and the process group start threads. ``MALLOC_ARENA_MAX=1``
    (what the memory-measuring tools ask for) keeps every thread's allocations in the main arena,
    whose free pages ``malloc_trim`` returns; a thread arena keeps its freed top pages resident,
    which would read as growth."""
    value = env.get("MALLOC_ARENA_MAX")
    if not value:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, int(value))  # M_ARENA_MAX
    except (OSError, AttributeError, ValueError):
        pass


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, conn, env: dict,
                 device: str | None = None, parent_env: dict | None = None) -> None:
    if parent_env is not None:  # a forked rank has the forkserver's environment, not the caller's
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ["VLLM_MOONEP_RANK"] = str(rank)
    _apply_malloc_env(env)
    # a rank that does not answer in time is asked for its stacks (RankPool.run's timeout message)
    stacks = tempfile.TemporaryFile("w+")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch

    torch.set_num_threads(max(1, int(env.get("VLLM_MOONEP_THREADS_PER_RANK", "1"))))
    try:
        _init_group(rank, world_size, init_method, backend, device)
        conn.send(("ready", stacks.fileno()))
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
    """R long-lived rank processes with a process group (gloo by default; ``backend="nccl"``: one
    GPU per rank). ``device="cuda"`` gives gloo ranks GPUs too (rank ``r`` on GPU ``r % count``)."""

    def __init__(self, world_size: int, *, backend: str = "gloo", env: dict | None = None, start_timeout_s: float = 120.0,
                 device: str | None = None):
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.broken = False
        # the rendezvous port is picked free, then bound by rank 0 a moment later: another process
        # can take it in between (seen on a GPU host: EADDRINUSE); start again on a new port
        for attempt in range(_START_ATTEMPTS):
            error = self._start(env, device, start_timeout_s)
            if error is None:
                return
            if "EADDRINUSE" not in error and "address already in use" not in error:
                break
        raise RankError(error)

    def _start(self, env: dict | None, device: str | None, start_timeout_s: float) -> str | None:
        """Spawn the ranks on a fresh port; ``None`` when every rank is ready, else why not (the
        ranks that did start are closed)."""
        env = dict(env or {})
        ctx = _process_context(env)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs, self.conns = [], []
        self.stack_fds: list[int | None] = [None] * self.world_size
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, self.world_size, init_method, self.backend, child, env, device, dict(os.environ)))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        for r, c in enumerate(self.conns):
            status, payload = self._recv(r, c, start_timeout_s)
            if status != "ready":
                self.close()
                self.broken = False
                return f"rank {r} failed to start:\n{payload}"
            self.stack_fds[r] = payload
        return None

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

    def run(self, fn: Callable, *args, timeout_s: float | None = None, allow_failures: bool = False,
            **kwargs) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; results in rank order, or ``RankError``. A rank
        silent for ``timeout_s`` (default ``CALL_TIMEOUT_S``) is reported with its Python stacks.

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
        deadline = time.monotonic() + (CALL_TIMEOUT_S if timeout_s is None else timeout_s)
        for r, c in enumerate(self.conns):
            # once a rank failed, peers stuck in a collective get a short grace period
            left = max(deadline - time.monotonic(), 0.1) if not errors else min(_group_timeout_s() + 15, max(deadline - time.monotonic(), 0.1))
            status, payload = self._recv(r, c, left)
            if status == "ok":
                results[r] = payload
            else:
                if status == "timeout" and self.procs[r].is_alive():
                    stacks = _stacks_of(self.procs[r], self.stack_fds[r])
                    payload += f"\nits Python stacks:\n{stacks}" if stacks else " (no stacks came back)"
                errors.append(f"--- rank {r} ({status}) ---\n{payload}")
                results[r] = RankFailure(r, status, payload, self.procs[r].exitcode)
        if errors:
            self.broken = True
            self.close()
            if allow_failures:
                return results
            named = args[1] if fn is call_with_env else fn
            raise RankError(f"{named.__module__}.{named.__qualname__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave (it destroys its process group), wait ``grace_s`` in all, then
        kill the stragglers (a rank whose group has a pending failed collective may block in
        ``destroy_process_group`` until the group's own timeout). Idempotent."""
        self._ask_to_leave()
        self._reap(time.monotonic() + grace_s)

    def _ask_to_leave(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass

    def _reap(self, deadline: float) -> None:
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


def get_pool(world_size: int, *, backend: str = "gloo", env: dict | None = None, device: str | None = None,
             tag: str | None = None) -> RankPool:
    """A cached pool for ``(world_size, backend, env, device, tag)``; a broken one is replaced.
    A distinct ``tag`` gets its own fresh processes (``shutdown_pools(tag)`` closes them)."""
    key = (world_size, backend, tuple(sorted((env or {}).items())), device, tag)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        pool = RankPool(world_size, backend=backend, env=env, device=device)
        _POOLS[key] = pool
    return pool


def shutdown_pools(tag: str | None = None, grace_s: float = 5.0) -> None:
    """Close the cached pools (only those made with ``tag`` when one is given): every rank of every
    pool is asked to leave first, then all get one ``grace_s`` together (one after another, the
    dozen pools of one pytest worker took half a minute)."""
    pools = [_POOLS.pop(k) for k in [k for k in _POOLS if tag is None or k[-1] == tag]]
    for pool in pools:
        pool._ask_to_leave()
    deadline = time.monotonic() + grace_s
    for pool in pools:
        pool._reap(deadline)


def _launched_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def init_launched_group(backend: str | None = None, device: str | None = None) -> None:
    """Under torchrun: bind this process's GPU (``LOCAL_RANK``) and initialise the launched group
    once (``backend``, else ``$VLLM_MOONEP_BACKEND``, else gloo). A later call asking for another
    backend than the group has raises ``RankError``."""
    import torch.distributed as dist

    if dist.is_initialized():
        have = str(dist.get_backend())
        if backend is not None and backend != have:
            raise RankError(f"the launched process group runs {have}; this call needs {backend}")
        _bind_gpu(_launched_local_rank(), have, device)
        return
    backend = backend or os.environ.get(BACKEND_ENV, "gloo")
    _bind_gpu(_launched_local_rank(), backend, device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=_group_timeout_s()))


def finish_launched_group() -> None:
    """Under torchrun: wait for every rank, then destroy the launched group (tools call this last)."""
    import torch.distributed as dist

    if launched_world_size() is None or not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def call_with_env(env: dict, fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` with ``env`` set in this process, restored afterwards."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return fn(*args, **kwargs)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_on_ranks(world_size: int, fn: Callable, *args, env: dict | None = None, fresh: bool = False,
                 backend: str | None = None, device: str | None = None, tag: str | None = None,
                 call_env: dict | None = None, **kwargs) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return the per-rank results.

    Under torchrun the launched processes are the ranks: ``world_size`` must equal the launched
    world size (callers skip otherwise) and each process returns ``[its own result]`` gathered
    from every rank; the group is made on first use (``init_launched_group``). Otherwise a
    (cached, or with ``fresh=True`` new) spawned pool runs it, over ``backend`` (default gloo).
    ``device="cuda"`` binds every rank to a GPU (NCCL always does). ``tag`` keeps a separate
    cached pool (fresh processes for that tag). ``timeout_s=`` and ``allow_failures=`` go to
    ``RankPool.run`` (spawned pools only; use ``fresh=True`` when ranks are killed on purpose).

    ``env`` is the rank processes' environment from their start (a pool per distinct ``env``);
    ``call_env`` is set around this call only and restored after, for variables the code reads
    when called: calls that differ only in those share one pool (each pool start imports torch
    in every rank, the largest fixed cost of a multi-rank test on 2 cores).
    """
    if call_env:
        fn, args = call_with_env, (dict(call_env), fn) + args
    launched = launched_world_size()
    if launched is not None:
        import torch.distributed as dist

        kwargs.pop("timeout_s", None)
        if kwargs.pop("allow_failures", False):
            raise RankError("allow_failures (fault injection) needs spawned ranks, not a torchrun launch")

        if launched != world_size:
            raise RankError(f"launched with WORLD_SIZE={launched}, the call needs {world_size}")
        init_launched_group(backend, device)
        if env:
            os.environ.update(env)
        mine = fn(*args, **kwargs)
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, mine)
        return out
    backend = backend or "gloo"
    if fresh:
        pool = RankPool(world_size, env=env, backend=backend, device=device)
        try:
            return pool.run(fn, *args, **kwargs)
        finally:
            pool.close()
    return get_pool(world_size, env=env, backend=backend, device=device, tag=tag).run(fn, *args, **kwargs)
