"""Run a test file's Triton cases under the CPU interpreter in a child process.

``TRITON_INTERPRET`` must be set before Triton is imported, and the pytest process may already
have imported it; so a test module runs itself as a script in a child with the variable set,
prints ``REPORT <json>`` and each test asserts one entry. Where a GPU exists the kernels run
natively in the ``gpu`` tests instead (and Triton 3.6's interpreter breaks on that machine's numpy).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def interpreter_report(script: str, timeout_s: float = 600) -> dict:
    """The child's report for ``script`` (a test module's path); skips where it cannot apply."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the kernels run natively in the gpu tests")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the script imports tests.*
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, os.path.abspath(script)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (
        f"interpreter child failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("REPORT "):])


def print_report(cases, run_case) -> None:
    """The child's side: ``{"err": run_case(name)}`` for every case (``None`` = as expected, else
    what differed; an exception is reported there rather than hidden), printed as the
    ``REPORT <json>`` line the parent reads."""
    report = {}
    for name in cases:
        try:
            report[name] = {"err": run_case(name)}
        except Exception as e:  # report, don't hide
            report[name] = {"err": f"{type(e).__name__}: {e}"}
    print("REPORT " + json.dumps(report))
