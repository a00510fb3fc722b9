"""``vllm serve`` on loopback for the tools that drive vLLM (``vllm_model_check``, ``serve_ab``): one
server in its own process group, its output in a log file, ``/health`` polled, then stopped the way
vLLM shuts down (SIGTERM to the API server, which stops its engine cores; then the whole group).

    cmd = serve_command(SERVE_CMD, engine_argv, port)
    srv = ServerProcess(cmd, env, log, header)     -> start()
    srv.wait_healthy(timeout_s)                    -> ("ok" | "timeout" | "failed", error)
    ... requests to srv.base ...
    srv.stop()                                     -> how it stopped, and the log's size at the stop

Every child of a run lives in the group the server leads (``start_new_session``), so ``kill_group``
leaves no engine core holding a GPU for the next run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

__all__ = ["SERVED_NAME", "SERVE_CMD", "ServerProcess", "free_port", "kill_group", "serve_command"]

#: the model name the servers answer to
SERVED_NAME = "moonep-check"
#: python arguments that start the server: what the ``vllm`` console script runs for ``vllm serve``
SERVE_CMD = "-m vllm.entrypoints.cli.main serve"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies left to an init that does not reap do not count)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            return True
    return False


def kill_group(proc: subprocess.Popen, grace: float = 15.0, sig: int = signal.SIGTERM) -> str:
    """Stop ``proc``'s process group (started with ``start_new_session``): ``sig``, then SIGKILL after
    ``grace`` seconds; waits (bounded) until none of its processes is left. Returns what it did."""
    pgid = proc.pid
    did = "exited"
    for s, wait in ((sig, grace), (signal.SIGKILL, 20.0)):
        if not _group_alive(pgid) and proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, s)
        did = signal.Signals(s).name
        end = time.monotonic() + wait
        while time.monotonic() < end:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
            if proc.poll() is not None and not _group_alive(pgid):
                return did
    return did if not _group_alive(pgid) else did + " (processes left)"


def serve_command(serve_cmd: str, engine_argv: list[str], port: int, served_name: str = SERVED_NAME) -> list[str]:
    """The server's command line: this interpreter, ``serve_cmd`` (shell-split), the engine
    arguments, then loopback host and port, the served name, no per-request access log."""
    return [sys.executable, *shlex.split(serve_cmd), *engine_argv, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_name, "--disable-uvicorn-access-log"]


def _port_of(cmd: list[str]) -> int:
    try:
        return int(cmd[cmd.index("--port") + 1])
    except (ValueError, IndexError):
        raise ValueError("the server command names no --port") from None


class ServerProcess:
    """One server process group and its log (see the module doc)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, header: str = ""):
        self.cmd, self.env, self.log, self.header = list(cmd), dict(env), Path(log), header
        self.port = _port_of(self.cmd)
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._lf: IO[str] | None = None
        self.stopped: dict[str, Any] | None = None

    def start(self) -> "ServerProcess":
        self._lf = open(self.log, "w")
        if self.header:
            self._lf.write(self.header if self.header.endswith("\n") else self.header + "\n")
            self._lf.flush()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._lf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def exited(self) -> int | None:
        """The server's exit status, None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> tuple[str, str | None]:
        """Poll ``/health`` until it answers 200, the server exits, or ``timeout_s`` passes:
        ``("ok", None)``, ``("failed", why)`` or ``("timeout", why)``."""
        assert self.proc is not None, "start() first"
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return "ok", None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        if self.proc.poll() is None:
            return "timeout", f"no /health 200 within {timeout_s:.0f}s"
        return "failed", f"no /health 200 (server exited with {self.proc.returncode})"

    def stop(self, api_grace: float = 20.0, group_grace: float = 10.0) -> dict[str, Any]:
        """SIGTERM to the API server alone (it shuts its engine cores down), then the whole group.
        Returns ``stop`` (what it took), ``stop_s`` and ``log_bytes_at_stop`` (where the log stood
        when the stop began: what follows is shutdown noise). Idempotent."""
        if self.stopped is not None:
            return self.stopped
        t = time.monotonic()
        if self._lf is not None:
            self._lf.flush()
        at_stop = self.log.stat().st_size if self.log.exists() else 0
        did = "never started"
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=api_grace)
            did = kill_group(self.proc, grace=group_grace)
        if self._lf is not None:
            self._lf.close()
        self.stopped = {"stop": did, "stop_s": round(time.monotonic() - t, 1), "log_bytes_at_stop": at_stop}
        return self.stopped

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
