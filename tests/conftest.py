"""Shared test set-up: hardware markers, rank pools, seeds.

- ``gpu``: skipped without CUDA; ``multi_gpu``: skipped with fewer than 2 CUDA devices (NCCL
  needs one GPU per rank); ``multi_node``: runs only under a torchrun launch over several nodes;
  ``vllm``: skipped only where vLLM is not importable (CI installs it, so there they run).
- Multi-rank tests call ``ranks(R, fn, *args)``: gloo rank processes by default (pools reused
  across tests), or the launched group under torchrun, where tests for another world size skip.
- ``VLLM_MOONEP_TEST_FAILURES=<file>``: each failure is appended there as it happens, so a run
  stopped by a time bound (a device call) still names what failed (tools/gpu_suite.sh sets it).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_moonep.engine.multicast import disable_multicast_by_default

disable_multicast_by_default()
# GPU tests run several gloo ranks on one GPU (test_engine, test_moe_step, ...): PyTorch's symmetric
# memory refuses their rendezvous unless told the overlap is meant. Spawned ranks inherit it, so
# `pytest tests/distributed/test_engine.py -k cuda` no longer needs tools/gpu_suite.sh's export.
os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")  # workers' reports reach the controller's hook too


def pytest_runtest_logreport(report):
    """A failure, written to ``$VLLM_MOONEP_TEST_FAILURES`` the moment it is reported."""
    path = os.environ.get("VLLM_MOONEP_TEST_FAILURES")
    if not path or not report.failed or _IS_XDIST_WORKER:
        return
    with open(path, "a") as f:
        f.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")


def pytest_collection_modifyitems(config, items):
    n_gpu = _cuda_count()
    has_vllm = importlib.util.find_spec("vllm") is not None
    nnodes = int(os.environ.get("VLLM_MOONEP_NNODES", "1"))
    for item in items:
        if "gpu" in item.keywords and n_gpu == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none here)"))
        if "multi_gpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs for NCCL (have {n_gpu})"))
        if "multi_node" in item.keywords and nnodes < 2:
            item.add_marker(pytest.mark.skip(reason="needs a torchrun launch over >= 2 nodes (VLLM_MOONEP_NNODES)"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM is not importable here"))
    # the modules whose tests read one long Triton-interpreter child (tests/interpreter_child.py; minutes
    # each on 2 cores) first: with pytest-xdist's workers (scripts/test.sh) they start at once and the
    # rest of the suite fills the other worker, instead of one of them starting last and running alone
    items.sort(key=lambda item: not _uses_interpreter_child(item))


def _uses_interpreter_child(item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and "interpreter_report" in vars(module)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from vllm_moonep.testing.launch import shutdown_pools

    shutdown_pools()


#: ``VLLM_MOONEP_TEST_DEVICE`` of the pytest process, read once: ``cuda`` makes ``ranks()`` default to one
#: GPU per rank over NCCL (the rank processes inherit it: tests/vllm/workers.py puts their objects there)
TEST_DEVICE = os.environ.get("VLLM_MOONEP_TEST_DEVICE", "cpu")
#: variables of a test's ``env`` that the rank functions read when called (not at import or process
#: start): ``ranks()`` sets them around the call, so cases differing only in them share a rank pool
CALL_TIME_ENV = ("VLLM_MOONEP_TEST_TRANSPORT",)


def ranks(world_size: int, fn, *args, **kwargs):
    """Run ``fn(*args)`` on ``world_size`` ranks; skip when launched with another world size. With
    ``VLLM_MOONEP_TEST_DEVICE=cuda``: ``backend="nccl"``, ``device="cuda"`` unless given. Spawned NCCL
    ranks skip when there are fewer GPUs than ranks. ``env`` variables in ``CALL_TIME_ENV`` are set
    for the call only (``call_env``), the rest from the processes' start."""
    from vllm_moonep.testing.launch import launched_world_size, run_on_ranks

    launched = launched_world_size()
    if launched is not None and launched != world_size:
        pytest.skip(f"launched with WORLD_SIZE={launched}; this case needs {world_size}")
    if TEST_DEVICE == "cuda":
        kwargs.setdefault("backend", "nccl")
        kwargs.setdefault("device", "cuda")
    env = kwargs.get("env")
    if env and any(k in CALL_TIME_ENV for k in env):
        kwargs["call_env"] = {**kwargs.get("call_env", {}), **{k: v for k, v in env.items() if k in CALL_TIME_ENV}}
        kwargs["env"] = {k: v for k, v in env.items() if k not in CALL_TIME_ENV} or None
    if launched is None and kwargs.get("backend") == "nccl":
        n_gpu = _cuda_count()
        if world_size > n_gpu:
            pytest.skip(f"{world_size} NCCL ranks need a GPU each (have {n_gpu})")
    return run_on_ranks(world_size, fn, *args, **kwargs)
