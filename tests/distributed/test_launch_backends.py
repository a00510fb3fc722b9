"""How the tools' ranks run: the backend each device and GPU count gets (and the sentence when a
run cannot), where tools stage host data for a collective, and moonep-ab, moonep-balance and the
soak under a real torchrun launch (CPU, gloo). Their NCCL counterparts, spawned and under
torchrun, are in test_multi_gpu.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from vllm_moonep.testing.launch import RankPool, comm_device, launched_world_size, resolve_launch

pytestmark = pytest.mark.skipif(launched_world_size() is not None, reason="these tests launch their own ranks")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "VLLM_MOONEP_BACKEND")


@pytest.fixture
def clean_env(monkeypatch):
    for k in TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_cpu_ranks_run_over_gloo_and_refuse_nccl(clean_env):
    """`--device cpu --backend nccl` started ranks that failed on their first CPU tensor."""
    assert resolve_launch("cpu", 4).backend == "gloo"
    with pytest.raises(ValueError, match="--backend nccl moves CUDA tensors only"):
        resolve_launch("cpu", 2, "nccl")
    with pytest.raises(ValueError, match="--share-gpus applies to --device cuda only"):
        resolve_launch("cpu", 2, share_gpus=True)


def test_cuda_defaults_to_nccl_with_one_gpu_per_rank(clean_env):
    """`moonep-ab --device cuda --ranks 2` spawned gloo ranks and timed host staging, not the product."""
    for gpus, ranks in ((2, 2), (8, 4), (2, 1)):
        lau = resolve_launch("cuda", ranks, gpus=gpus)
        assert (lau.backend, lau.device, lau.ranks_per_gpu, lau.launched) == ("nccl", "cuda", 1, False)
        assert "NCCL" in lau.note
    assert resolve_launch("cuda", 2, "nccl", gpus=2).backend == "nccl"


def test_fewer_gpus_than_ranks_is_refused_unless_sharing_is_asked(clean_env):
    """With fewer GPUs than ranks the tools silently shared GPUs over gloo (or NCCL died in ncclInvalidUsage)."""
    with pytest.raises(ValueError) as e:
        resolve_launch("cuda", 4, gpus=2)
    msg = str(e.value)
    for needle in ("with 4 ranks needs 4 GPUs", "2 are visible here", "use --ranks 2 or fewer", "--share-gpus",
                   "timings are not the product's"):
        assert needle in msg, msg
    assert "1 is visible" in str(pytest.raises(ValueError, resolve_launch, "cuda", 2, "nccl", gpus=1).value)
    with pytest.raises(ValueError, match="--share-gpus needs gloo"):
        resolve_launch("cuda", 4, "nccl", True, gpus=2)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_launch("cuda", 2, gpus=0)
    shared = resolve_launch("cuda", 4, share_gpus=True, gpus=2)
    assert (shared.backend, shared.ranks_per_gpu) == ("gloo", 2)
    assert shared.env == {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    assert "share 2 GPUs" in shared.note and "not the product's" in shared.note
    # asking to share where every rank has a GPU still gives NCCL
    assert resolve_launch("cuda", 2, share_gpus=True, gpus=2).backend == "nccl"


def test_explicit_gloo_on_cuda_says_its_timings_are_not_the_products(clean_env):
    """A gloo run on GPUs printed latencies with nothing saying they include host staging."""
    lau = resolve_launch("cuda", 2, "gloo", gpus=2)
    assert lau.backend == "gloo" and "staged through host memory" in lau.note and "--backend nccl" in lau.note


def test_torchrun_world_backend_variable_and_gpus_per_node(clean_env):
    """Under torchrun --ranks could disagree with WORLD_SIZE, and the GPU check counted every node's ranks."""
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    lau = resolve_launch("cuda", None, gpus=2)  # 2 nodes x 2 GPUs
    assert (lau.ranks, lau.backend, lau.launched) == (4, "nccl", True)
    with pytest.raises(ValueError, match="WORLD_SIZE=4 processes, but --ranks 2"):
        resolve_launch("cuda", 2, gpus=2)
    with pytest.raises(ValueError, match=r"--nproc-per-node 1"):
        resolve_launch("cuda", None, gpus=1)
    clean_env.setenv("VLLM_MOONEP_BACKEND", "gloo")
    assert resolve_launch("cuda", None, gpus=2).backend == "gloo"
    assert resolve_launch("cuda", None, "nccl", gpus=2).backend == "nccl"  # the flag wins
    clean_env.setenv("VLLM_MOONEP_BACKEND", "mpi")
    with pytest.raises(ValueError, match="VLLM_MOONEP_BACKEND='mpi'"):
        resolve_launch("cpu", None)


def _staging_probe():
    out = {"comm_device": comm_device().type, "backend_config": dist.get_backend_config()}
    try:
        t = torch.ones(4)
        dist.all_gather([torch.empty_like(t) for _ in range(dist.get_world_size())], t)
        out["cpu_all_gather"] = "ok"
    except Exception as exc:
        out["cpu_all_gather"] = str(exc).splitlines()[0]
    return out


def test_host_data_is_staged_where_the_group_moves_data():
    """moonep-ab under torchrun with NCCL all-gathered a CPU tensor: 'No backend type associated with
    device type cpu'. A group without a CPU backend (NCCL; here gloo registered for CUDA only, which
    fails the same way) must get CUDA staging from comm_device(); a gloo group keeps the CPU."""
    for backend, want in (("gloo", "cpu"), ("cuda:gloo", "cuda")):
        pool = RankPool(2, backend=backend)
        try:
            res = pool.run(_staging_probe)
        finally:
            pool.close()
        for r in res:
            assert r["comm_device"] == want, (backend, r)
            if want == "cuda":  # the crash the staging avoids
                assert r["cpu_all_gather"] == "No backend type associated with device type cpu", r
            else:
                assert r["cpu_all_gather"] == "ok", r


def _torchrun(module: str, *args: str, extra_env: dict | None = None, timeout: int = 300):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_ab_under_torchrun_runs_on_the_launched_group(tmp_path):
    """`torchrun ... -m vllm_moonep.tools.ab` crashed before the first point (a CPU tensor on the
    launched group); every rank would also print the table and write the JSON."""
    p = _torchrun("vllm_moonep.tools.ab", "--layers", "1", "--tokens", "16", "--maxvio", "2", "--steps", "1",
                  "--warmup", "0", "--configs", "replicated", "symmetric", "--no-plots", "--budget-gb", "0.05",
                  "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("moonep-ab: preset tiny on 2 cpu ranks (gloo, torchrun)") == 1, p.stdout
    assert "measured: in the launched processes" in p.stdout
    data = json.loads((tmp_path / "moonep-ab.json").read_text())
    assert data["failures"] == [] and data["environment"]["launched_by_torchrun"] is True
    assert data["environment"]["ranks"] == 2 and set(data["configs"]) == {"replicated", "symmetric"}
    for cfg in data["configs"].values():
        assert [c["fresh_process"] for c in cfg["memory_check"]] == [False, False]


def test_ab_under_torchrun_refuses_another_rank_count(tmp_path):
    """`--ranks 4` on a 2-process launch failed later with 'launched with WORLD_SIZE=2' from inside the ranks."""
    p = _torchrun("vllm_moonep.tools.ab", "--ranks", "4", "--no-plots", "--out", str(tmp_path), timeout=120)
    assert p.returncode != 0
    assert "torchrun launched WORLD_SIZE=2 processes, but --ranks 4" in p.stderr, p.stderr[-3000:]


def test_balance_and_soak_under_torchrun():
    """moonep-balance and the soak had no torchrun path (the soak asked for fault injection the launch refuses)."""
    p = _torchrun("vllm_moonep.tools.balance", "--experts", "16", "--tokens", "32", "--maxvio", "0", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("MoonEP balance: 2 CPU ranks (gloo)") == 1, p.stdout
    p = _torchrun("vllm_moonep.tools.soak", "--steps", "40", "--warmup", "10", "--layers", "1", "--mem-every", "10")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("MoonEP soak: 40 steps on 2 cpu ranks (gloo)") == 1, p.stdout
    assert "errors: 0" in p.stdout


@pytest.mark.parametrize("tool,argv,needle", [
    ("ab", ["--backend", "nccl"], "--backend nccl moves CUDA tensors only"),
    ("ab", ["--share-gpus"], "--share-gpus applies to --device cuda only"),
    ("ab", ["--heap", "torch"], "--heap torch allocates GPU memory: it needs --device cuda"),
    ("balance", ["--backend", "nccl"], "--backend nccl moves CUDA tensors only"),
    ("soak", ["--backend", "nccl"], "--backend nccl moves CUDA tensors only"),
])
def test_tools_refuse_a_launch_that_cannot_run_before_spawning(capsys, monkeypatch, clean_env, tool, argv, needle):
    """A backend or heap that cannot run on the chosen device failed only inside the spawned ranks."""
    import importlib

    mod = importlib.import_module(f"vllm_moonep.tools.{tool}")
    spawns = importlib.import_module("vllm_moonep.tools.ab.driver") if tool == "ab" else mod  # ab is a package
    monkeypatch.setattr(spawns, "run_on_ranks", lambda *a, **k: pytest.fail("ranks were spawned"))
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def _rank_of_pool():
    return dist.get_rank()


def test_pool_starts_again_when_its_rendezvous_port_was_taken(monkeypatch):
    """The rendezvous port is picked free and bound a moment later; another process took it in
    between on a GPU host (EADDRINUSE) and the whole pool failed to start."""
    import socket

    from vllm_moonep.testing import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = [taken.getsockname()[1]]  # the first pick is the port another process holds
    real = launch._free_port
    monkeypatch.setattr(launch, "_free_port", lambda: ports.pop() if ports else real())
    try:
        pool = RankPool(2, start_timeout_s=60)
        try:
            assert pool.run(_rank_of_pool) == [0, 1]
        finally:
            pool.close()
    finally:
        taken.close()
    assert ports == []


def _env_and_pid(name):
    return os.environ.get(name), os.getpid()


def test_call_time_env_reaches_the_call_only_and_shares_the_pool():
    """A case's VLLM_MOONEP_TEST_TRANSPORT made a rank pool of its own (each start imports torch in every
    rank); set around the call instead, it must reach the call (or the symmetric cases silently run the
    collective transport), be gone after it, and run in the same processes as the plain cases."""
    from tests.conftest import ranks
    from vllm_moonep.testing.launch import run_on_ranks

    var = "VLLM_MOONEP_TEST_TRANSPORT"
    sym = ranks(2, _env_and_pid, var, env={var: "symmetric"})
    plain = run_on_ranks(2, _env_and_pid, var)
    assert [v for v, _ in sym] == ["symmetric"] * 2, sym
    assert [v for v, _ in plain] == [os.environ.get(var)] * 2, plain
    assert [p for _, p in sym] == [p for _, p in plain], "the call-time variable started another pool"


def _rank1_waits_in_a_named_place():
    if dist.get_rank() == 1:
        time.sleep(120)  # sentinel: the stack must name this function
    return dist.get_rank()


def test_a_silent_rank_is_reported_with_the_line_it_waits_in():
    """A hung case (seen on the GPU suite: a rank pool that never answered) cost the whole call's
    bound and said only "did not answer": the report must carry the silent rank's Python stack,
    naming the function it waits in, while the rank that answered keeps its result."""
    pool = RankPool(2, start_timeout_s=60)
    try:
        res = pool.run(_rank1_waits_in_a_named_place, timeout_s=3, allow_failures=True)
    finally:
        pool.close(grace_s=0.5)
    assert res[0] == 0, res
    failure = res[1]
    assert failure.status == "timeout", failure
    assert "its Python stacks:" in failure.detail, failure.detail
    assert "_rank1_waits_in_a_named_place" in failure.detail, failure.detail


def _env_value(name):
    return os.environ.get(name)


def test_forked_ranks_see_the_callers_environment_as_of_their_start(monkeypatch):
    """Rank processes fork from a forkserver started with an earlier environment: without the caller's
    environment handed over, a variable set after that start (a test's monkeypatch, a tool's option)
    silently missed the ranks that spawned processes used to see."""
    first = RankPool(1, start_timeout_s=60)  # the forkserver is running from here on
    first.close()
    monkeypatch.setenv("MOONEP_LAUNCH_SENTINEL", "set-after-the-forkserver-started")
    pool = RankPool(2, start_timeout_s=60)
    try:
        assert pool.run(_env_value, "MOONEP_LAUNCH_SENTINEL") == ["set-after-the-forkserver-started"] * 2
    finally:
        pool.close()


def test_unknown_rank_start_method_is_refused(monkeypatch):
    """A misspelt VLLM_MOONEP_RANK_START must not quietly pick a start method."""
    from vllm_moonep.testing.launch import RankError

    monkeypatch.setenv("VLLM_MOONEP_RANK_START", "fork")
    with pytest.raises(RankError, match="VLLM_MOONEP_RANK_START must be forkserver or spawn, got 'fork'"):
        RankPool(1, start_timeout_s=60)
