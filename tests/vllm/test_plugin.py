"""The vLLM plugin through vLLM's own code, as deep as it runs without a GPU.

- the ``vllm.general_plugins`` entry point is found and loaded by ``load_general_plugins()``;
- options from vLLM's CLI parser (``EngineArgs`` / ``FlexibleArgumentParser --additional-config``)
  down to the config object the plugin reads, env fallbacks, bad values;
- on 2 gloo CPU ranks with vLLM's distributed state (``init_distributed_environment`` /
  ``initialize_model_parallel``, DP=EP=2, ``--all2all-backend moonep``) and vLLM's CPU platform
  (``VLLM_TARGET_DEVICE=cpu``): a real vLLM fused-MoE layer (``FusedMoEFactory`` -> ``MoERunner`` +
  ``RoutedExperts``), weights loaded through its ``weight_loader``, ``process_weights_after_loading``
  (the unquantized oracle, ``maybe_make_prepare_finalize``, the weight conversion), forward under a
  DP forward context, with each layout, against the dense reference;
- seam verification names the vLLM version and the seam on an unexpected vLLM (what happens then:
  ``test_plugin_options.py``).

Not exercised here (no GPU): ``CudaCommunicator`` constructing our manager (on CPU the wrapped
``get_ep_all2all_manager`` attaches it instead), NCCL groups, the torch/NVSHMEM heaps, CUDA graphs
(whether vLLM keeps them is checked on config builds: ``test_plugin_cudagraphs.py``), ``vllm serve``
end to end (vLLM's engine cannot start without a GPU under the CUDA build the set-up installs:
docs/SERVING.md, "Without a GPU"; ``test_vllm_cli_without_gpu.py`` checks its ``--help``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ranks
from tests.vllm import workers as W

pytestmark = pytest.mark.vllm

CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu"}  # vLLM's CPU platform in the rank processes


# ---------------------------------------------------------------------------- rank side
_DIST = {"ready": False}


def _vllm_config(additional: dict):
    import torch.distributed as dist
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    rank, R = dist.get_rank(), dist.get_world_size()
    pc = ParallelConfig(data_parallel_size=R, data_parallel_rank=rank, enable_expert_parallel=True,
                        all2all_backend="moonep")
    # scheduler default: max_num_batched_tokens=2048 -> the pool's largest capacity
    return VllmConfig(parallel_config=pc, device_config=DeviceConfig(device="cpu"), additional_config=additional)


def _ensure_vllm_dist(cfg) -> None:
    """vLLM's world/DP/EP groups over the pool's existing gloo world (once per process)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if _DIST["ready"]:
        return
    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:1",
                                 backend="gloo")
    initialize_model_parallel(1, 1, backend="gloo")
    _DIST["ready"] = True


def rk_vllm_layer(additional: dict, counts: list[int], seed: int, H: int = 256, I: int = 256, steps: int = 1,
                  cfg=None):
    """A vLLM MoE layer built, loaded and run under ``cfg`` (default: a config with ``additional``)."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.forward_context import set_forward_context
    from vllm.plugins import load_general_plugins

    from vllm_moonep.testing.reference import dense_moe
    from vllm_moonep.vllm_plugin import state

    W.set_threads()
    load_general_plugins()  # our entry point, as every vLLM process does
    assert state.patched(), "the moonep entry point was not loaded by load_general_plugins()"
    E, K = 32, 4
    rank, R = dist.get_rank(), dist.get_world_size()
    cfg = _vllm_config(additional) if cfg is None else cfg
    res = {}
    with set_current_vllm_config(cfg):
        _ensure_vllm_dist(cfg)
        from vllm.model_executor.layers.fused_moe import FusedMoEFactory

        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                     params_dtype=torch.bfloat16, renormalize=False,
                                     prefix=f"model.layers.{seed}.mlp.experts")
        finally:
            torch.set_default_dtype(prev)
        layer = runner.routed_experts
        epn = E // R
        assert tuple(layer.w13_weight.shape) == (epn, 2 * I, H)
        w13, w2 = W.global_weights(E, H, I, seed)
        for e in range(E):  # every rank sees the whole checkpoint; the loader keeps its own experts
            layer.weight_loader(layer.w13_weight, w13[e, :I], f"experts.{e}.gate_proj.weight", "w1", e)
            layer.weight_loader(layer.w13_weight, w13[e, I:], f"experts.{e}.up_proj.weight", "w3", e)
            layer.weight_loader(layer.w2_weight, w2[e], f"experts.{e}.down_proj.weight", "w2", e)
        assert bool((layer.w13_weight.data == W.local_rows(w13, rank, R)).all())
        w13_param_before = layer.w13_weight
        # what vLLM's model loader calls for every module with a quant_method
        layer.quant_method.process_weights_after_loading(layer)
        kernel = layer.quant_method.moe_kernel
        pf, ex, lay = kernel.prepare_finalize, kernel.fused_experts, layer._moonep_weight_layout
        res["classes"] = [f"{type(o).__module__}.{type(o).__name__}" for o in (pf, ex, lay)]
        res["bases"] = [f"{c.__module__}.{c.__name__}" for o in (pf, ex) for c in type(o).__mro__[1:2]]
        res["manager"] = type(get_ep_group().device_communicator.all2all_manager).__name__
        from vllm.v1.worker.gpu_worker import Worker

        res["step_hooked"] = [getattr(Worker.__dict__[m], "__vllm_moonep__", False)
                              for m in ("execute_model", "execute_dummy_batch")]
        res["backend"] = layer.quant_method.unquantized_backend.name
        res["w13_shape"] = tuple(layer.w13_weight.shape)
        res["same_param"] = layer.w13_weight is w13_param_before
        if lay.kind == "symmetric":
            res["adopted"] = layer.w13_weight.data_ptr() == lay.home_w13.data_ptr()
        res["report"] = lay.memory_report().as_dict()
        res["B"] = lay.num_slots
        res["batch_invariant"] = ex.batch_invariant

        # a DP step: each rank its own token count; capacity from vLLM's DP metadata
        n = counts[rank]
        g = torch.Generator().manual_seed(5 + 17 * seed + rank)
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        bias = torch.linspace(3, -3, E)  # hot experts all on rank 0: the planner must use slots
        logits = (torch.randn(n, E, generator=g) + bias).to(torch.bfloat16)
        seen = {}
        orig = pf.prepare

        def spy(a1, tw, ti, *a, **k):  # the router's actual output, for an exact reference
            seen["ids"], seen["w"] = ti.clone(), tw.clone()
            return orig(a1, tw, ti, *a, **k)

        pf.prepare = spy
        import vllm_moonep.common.vllm_modular as vm

        ffn, flags = vm.expert_ffn, []

        def ffn_spy(*a, **k):  # what the experts' apply asks of the expert compute
            flags.append(k.get("batch_invariant"))
            return ffn(*a, **k)

        vm.expert_ffn = ffn_spy
        try:
            for _ in range(steps):
                with set_forward_context(None, cfg, num_tokens=n,
                                         num_tokens_across_dp=torch.tensor(counts, dtype=torch.int32)):
                    y = runner.forward(x, logits)
        finally:
            del pf.prepare
            vm.expert_ffn = ffn
        res["ffn_batch_invariant"] = sorted(set(flags))
        probs = torch.softmax(logits.float(), -1)
        _, ids_torch = torch.topk(probs, K, -1)
        assert bool((seen["ids"].long().sort(-1).values == ids_torch.sort(-1).values).all()), "router ids differ"
        ref = dense_moe(x, seen["ids"], seen["w"], w13, w2)
        res["err"] = W.close(y, ref, f"vLLM layer rank={rank} layout={lay.kind}")
        res["cap"] = pf.last.capacity
        res["slots"] = int((pf.last.experts_to_copy >= 0).sum())
        res["summary"] = state.STATE.last_summary
        res["made"], res["capacities"] = sorted(pf.buffer_pool.buffers), pf.buffer_pool.capacities
        res["buffer_kwargs"] = {k: v for k, v in pf.buffer_pool.buffer_kwargs.items() if k != "group"}
        res["step_stats"] = state.STATE.stats.last
    # tear down this layer's MoonEP objects (collective), keep vLLM's groups for the next call
    get_ep_group().device_communicator.all2all_manager.destroy()
    state.STATE.reset()
    return res


def rk_seam_check():
    """verify_seams on the real vLLM passes; a missing seam fails naming version and seam."""
    import vllm.model_executor.layers.fused_moe.prepare_finalize.moonep as pfm

    from vllm_moonep.vllm_plugin import seams
    from vllm_moonep.vllm_plugin.state import MoonEPSeamError

    seams.verify_seams()
    saved = pfm.gather_moonep_weight_layout
    del pfm.gather_moonep_weight_layout
    try:
        seams.verify_seams()
        return "no error"
    except MoonEPSeamError as e:
        return str(e)
    finally:
        pfm.gather_moonep_weight_layout = saved


def rk_library_impl_under_invariance(impl: str) -> str:
    """MoonEPExperts built with a library kernel under VLLM_BATCH_INVARIANT=1: the error it raises."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from vllm_moonep.common.vllm_modular import MoonEPExperts
    from vllm_moonep.engine import MoonEPInputError

    try:
        MoonEPExperts(W.moe_config(32, 4, 256, 256, 2, 0, 512), FUSED_MOE_UNQUANTIZED_CONFIG, impl=impl)
    except MoonEPInputError as e:
        return str(e)
    return "no error"


# ---------------------------------------------------------------------------- tests
def test_entry_point_declared():
    """The vllm.general_plugins entry point missing or pointing elsewhere, so vLLM never loads the plugin."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("moonep") == "vllm_moonep.vllm_plugin:register", eps


def rk_cli_options(extra: dict, bad_cases: list):
    """vLLM's CLI parser -> EngineArgs -> VllmConfig.additional_config -> the plugin's options.

    Runs in a rank process: building vLLM's parser instantiates a default ``VllmConfig``, which
    needs a platform (vLLM's CPU platform there; none is detected in a plain CPU-only process)."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_moonep.vllm_plugin.options import MoonEPOptionsError, options_from_vllm_config

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "dummy", "--all2all-backend", "moonep", "--enable-expert-parallel",
                              "--data-parallel-size", "2", "--additional-config", json.dumps(extra)])
    ea = EngineArgs.from_cli_args(args)
    assert ea.all2all_backend == "moonep" and ea.enable_expert_parallel and ea.data_parallel_size == 2
    cfg = VllmConfig(parallel_config=ParallelConfig(all2all_backend=ea.all2all_backend,
                                                    enable_expert_parallel=ea.enable_expert_parallel),
                     device_config=DeviceConfig(device="cpu"), additional_config=ea.additional_config)
    good = options_from_vllm_config(cfg).as_dict()
    errors = []
    for case in bad_cases:
        a = parser.parse_args(["--model", "dummy", "--additional-config", json.dumps(case)])
        c = VllmConfig(device_config=DeviceConfig(device="cpu"),
                       additional_config=EngineArgs.from_cli_args(a).additional_config)
        try:
            options_from_vllm_config(c)
            errors.append(None)
        except MoonEPOptionsError as e:
            errors.append(str(e))
    return good, errors


def test_options_from_vllm_cli_parser():
    """An option lost or mangled between vLLM's --additional-config and the plugin; a bad value accepted."""
    extra = {"moonep": {"weight_layout": "symmetric", "engine": "builtin", "transport": "collective",
                        "num_prefetch_slots": 8, "shared_slot_pool": True, "heap": "host", "token_padding": 64,
                        "impl": "reference", "step_log_interval": 10, "cuda_graphs": "off"}}
    cases = [
        ({"moonep": {"weight_layot": "symmetric"}}, ["weight_layot", "weight_layout", "num_prefetch_slots"]),
        ({"moonep": {"weight_layout": "sharded"}}, ["replicated", "symmetric"]),
        ({"moonep": {"engine": "deepep"}}, ["auto", "builtin", "moonep"]),
        ({"moonep": {"num_prefetch_slots": 0}}, ["positive"]),
        ({"moonep": {"heap": "shm"}}, ["host", "torch", "nvshmem"]),
        ({"moonep": {"impl": "cutlass"}}, ["reference", "grouped_mm", "triton"]),
        ({"moonep": {"shared_slot_pool": True}}, ["symmetric"]),
        ({"moonep": {"shared_slot_pool": "maybe"}}, ["true or false"]),
        ({"moonep": {"cuda_graphs": "on"}}, ["cuda_graphs", "auto, off"]),
        # valid JSON whose block is no object (it was reported as "not valid JSON")
        ({"moonep": "symmetric"}, ["must be a JSON object", 'got "symmetric"', '{"moonep": {"weight_layout": "symmetric"}}']),
    ]
    good, errors = ranks(2, rk_cli_options, extra, [c for c, _ in cases], env=CPU_ENV)[0]
    assert good == extra["moonep"]
    for (case, needles), msg in zip(cases, errors):
        assert msg is not None, f"{case} was accepted"
        for n in needles:
            assert n in msg, (case, msg)


def test_options_env_fallbacks_and_precedence():
    """A VLLM_MOONEP_* variable ignored or winning over --additional-config, or a malformed value accepted."""
    from vllm_moonep.vllm_plugin.options import MoonEPOptions, MoonEPOptionsError, parse_options

    assert parse_options(None, env={}) == MoonEPOptions()
    env = {"VLLM_MOONEP_WEIGHT_LAYOUT": "symmetric", "VLLM_MOONEP_ENGINE": "builtin",
           "VLLM_MOONEP_NUM_PREFETCH_SLOTS": "16", "VLLM_MOONEP_SHARED_SLOT_POOL": "1", "VLLM_MOONEP_HEAP": "host",
           "VLLM_MOONEP_TOKEN_PADDING": "32", "VLLM_MOONEP_IMPL": "reference", "VLLM_MOONEP_TRANSPORT": "symmetric",
           "VLLM_MOONEP_STEP_LOG_INTERVAL": "5"}
    o = parse_options({}, env=env)
    assert (o.weight_layout, o.engine, o.num_prefetch_slots, o.shared_slot_pool, o.heap, o.token_padding, o.impl,
            o.transport, o.step_log_interval) == ("symmetric", "builtin", 16, True, "host", 32, "reference",
                                                  "symmetric", 5)
    # --additional-config wins over the environment
    o = parse_options({"moonep": {"num_prefetch_slots": 2}}, env=env)
    assert o.num_prefetch_slots == 2 and o.weight_layout == "symmetric"
    with pytest.raises(MoonEPOptionsError, match="VLLM_MOONEP_NUM_PREFETCH_SLOTS"):
        parse_options({}, env={"VLLM_MOONEP_NUM_PREFETCH_SLOTS": "four"})
    with pytest.raises(MoonEPOptionsError, match="must be a JSON object"):
        parse_options({"moonep": 3}, env={})


def test_seam_verification():
    """A vLLM without a seam passed verification, or the error named neither the vLLM version nor the seam."""
    msg = ranks(2, rk_seam_check, env=CPU_ENV)[0]
    import vllm

    assert vllm.__version__ in msg and "gather_moonep_weight_layout" in msg and "0.33" in msg, msg


@pytest.mark.parametrize("layout,shared", [("replicated", False), ("symmetric", False), ("symmetric", True)],
                         ids=["replicated", "symmetric", "symmetric-shared-slots"])
def test_vllm_layer_forward(layout, shared):
    """A moonep vLLM MoE layer built vLLM's classes or another layout, kept a second copy of its experts, or
    computed outputs other than the dense reference."""
    extra = {"moonep": {"weight_layout": layout, "engine": "builtin", "num_prefetch_slots": 4,
                        "impl": "reference", "shared_slot_pool": shared}}
    if layout == "symmetric":
        extra["moonep"]["heap"] = "host"
    counts = [37, 150]
    res = ranks(2, rk_vllm_layer, extra, counts, {"replicated": 1, "symmetric": 2}[layout] + 2 * shared, env=CPU_ENV)
    if shared:
        assert all("one pool shared by all layers" in r["summary"] for r in res), res[0]["summary"]
    for r in res:
        # the start-up line says what was resolved, not the requested 'auto'
        assert "transport=collective (auto: CPU ranks" in r["summary"], r["summary"]
        assert "kernel=reference (requested)" in r["summary"], r["summary"]
        assert ("heap=host (requested)" in r["summary"]) == (layout == "symmetric"), r["summary"]
        assert r["buffer_kwargs"]["transport"] == "auto" and r["step_stats"] is None  # the step log is off by default
        # the plugin's classes (defined where grep finds them), over the layout-agnostic ones
        assert r["classes"][:2] == ["vllm_moonep.vllm_plugin.modular.MoonEPPrepareAndFinalize",
                                    "vllm_moonep.vllm_plugin.modular.MoonEPExperts"], r["classes"]
        assert r["bases"] == ["vllm_moonep.common.vllm_modular.MoonEPPrepareAndFinalize",
                              "vllm_moonep.common.vllm_modular.MoonEPExperts"], r["bases"]
        assert r["manager"] == "MoonEPAll2AllManager" and r["backend"] == "MOONEP"
        assert r["step_hooked"] == [True, True], "the manager did not hook the worker's step check"
        assert r["cap"] == 256, r  # max(37, 150) -> 256 on both ranks
        # every capacity made at the first step (vLLM's profiling run counts them before sizing the KV cache)
        assert len(r["capacities"]) > 2 and r["made"] == r["capacities"], r["made"]
        assert r["B"] == 4
        assert f"weight_layout={layout}" in r["summary"] and "engine=builtin" in r["summary"], r["summary"]
        assert "per-rank expert memory" in r["summary"]
    assert max(r["slots"] for r in res) > 0
    if layout == "replicated":
        assert all(r["classes"][2].endswith("ReplicatedWeightLayout") for r in res)
        assert all(r["w13_shape"] == (32 + 4, 256, 256) for r in res)  # vLLM rebinds to the [E+B] gate
        assert all(r["report"]["replicated_rows"] > 0 for r in res)
    else:
        assert all(r["classes"][2].endswith("SymmetricWeightLayout") for r in res)
        assert all(r["w13_shape"] == (16, 512, 256) and r["same_param"] and r["adopted"] for r in res)
        assert all(r["report"]["replicated_rows"] == 0 for r in res)


def rk_step_check():
    """The worker's step under the step seam, with a device-side failure on an open error board and after it."""
    import types

    from vllm.plugins import load_general_plugins

    from vllm_moonep.engine.faults.error_board import CODE_WAIT_ROWS, ErrorBoard
    from vllm_moonep.vllm_plugin import seams, state

    load_general_plugins()
    assert state.LOAD.worker_seams is not None, "the MoonEP seams left the manager no step seam to apply"
    res = {"hooked": state.LOAD.worker_seams()}  # what the all2all manager does in the worker
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)  # vLLM's body fails on it at once: enough to see it reached
    worker._pp_send_work = []
    sched = types.SimpleNamespace(total_num_scheduled_tokens=0)

    def step(dummy: bool = False) -> tuple[str, str]:
        try:
            Worker.execute_dummy_batch(worker) if dummy else Worker.execute_model(worker, sched)
        except Exception as exc:
            tb = exc.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            return type(exc).__name__, f"{tb.tb_frame.f_code.co_filename}: {exc}"
        return "none", ""

    res["clean"] = step()
    board = ErrorBoard(torch.device("cpu"), rank=0, world_size=2, timeout_s=3.0, what="MoonEP buffer S=8")
    board.record(CODE_WAIT_ROWS, 1, 7, 3_000_000_000, 6, 7)  # a wait for rank 1's rows gave up at call #7
    res["recorded"] = step()
    res["recorded_dummy"] = step(dummy=True)  # an idle data-parallel rank's step
    board.close()  # its transport closed: no longer read
    res["closed"] = step()
    seams.undo_seams()
    res["undone"] = not any(getattr(Worker.__dict__[m], "__vllm_moonep__", False)
                            for m in ("execute_model", "execute_dummy_batch"))
    return res


def test_worker_step_raises_a_device_side_failure_before_running():
    """Under CUDA graphs no MoonEP call checks its error board: a wait that timed out (or a peer that gave up) left
    the server generating from wrong rows with no error. vLLM's worker step must raise the recorded failure before
    it runs, and run as vLLM's own once no open board holds one."""
    r = ranks(1, rk_step_check, env=CPU_ENV)[0]
    assert r["hooked"] and r["undone"], r
    assert r["clean"][0] != "MoonEPCollectiveTimeout" and r["clean"][1].split(":")[0].endswith("gpu_worker.py"), r
    assert r["recorded"][0] == "MoonEPCollectiveTimeout" and r["recorded_dummy"] == r["recorded"], r
    assert "rows" in r["recorded"][1] and "call #7" in r["recorded"][1] and "first rank 1" in r["recorded"][1], r
    assert r["closed"] == r["clean"], r


def test_vllm_layer_batch_invariant():
    """VLLM_BATCH_INVARIANT=1 with the moonep backend: vLLM's oracle refusing our experts (they must say they
    support it), the flag not reaching the expert compute, the start-up line not saying so, or a wrong step."""
    extra = {"moonep": {"weight_layout": "replicated", "engine": "builtin", "num_prefetch_slots": 4}}
    res = ranks(2, rk_vllm_layer, extra, [37, 150], 7, env={**CPU_ENV, "VLLM_BATCH_INVARIANT": "1"})
    for r in res:
        assert r["backend"] == "MOONEP" and r["batch_invariant"] is True and r["ffn_batch_invariant"] == [True], r
        assert "kernel=reference, batch invariant (impl=auto)" in r["summary"], r["summary"]
    assert max(r["slots"] for r in res) > 0
    off = ranks(2, rk_vllm_layer, extra, [37, 150], 7, env=CPU_ENV)
    assert all(r["batch_invariant"] is False and r["ffn_batch_invariant"] == [False] and "batch invariant" not in
               r["summary"] for r in off)


def test_library_impl_refused_under_batch_invariance():
    """A library kernel (tiles chosen per problem size) taken under VLLM_BATCH_INVARIANT=1 without a word."""
    msg = ranks(1, rk_library_impl_under_invariance, "grouped_mm", env={**CPU_ENV, "VLLM_BATCH_INVARIANT": "1"})[0]
    assert "VLLM_BATCH_INVARIANT=1" in msg and "impl='grouped_mm'" in msg, msg


def test_vllm_layer_step_log_transport_and_resolved_kernel():
    """No per-step view of slot use and row balance; no transport option; the line printed impl=auto, not the kernel."""
    extra = {"moonep": {"weight_layout": "symmetric", "engine": "builtin", "transport": "symmetric",
                        "num_prefetch_slots": 4, "step_log_interval": 2}}
    res = ranks(2, rk_vllm_layer, extra, [37, 150], 5, steps=5, env=CPU_ENV)
    for r in res:
        assert r["buffer_kwargs"]["transport"] == "symmetric"
        assert "transport=symmetric (requested)" in r["summary"], r["summary"]  # the engine's own choice
        assert "heap=host (auto: host memory on cpu)" in r["summary"], r["summary"]
        # auto resolves to reference on every CPU (here also: B=4 < E/R=16, no dense tensor for grouped_mm)
        assert "kernel=reference (impl=auto)" in r["summary"], r["summary"]
        st = r["step_stats"]
        assert st is not None and st["steps"] == (3, 4) and st["layer_calls"] == 2, st  # steps 1-2, then 3-4 logged
        assert st["slots_used_mean"] > 0 and st["slots_per_call"] == 2 * 4
        mean_without, _ = st["without plan"]
        mean_with, worst_with = st["with plan"]
        assert mean_without > 1.2 and worst_with == pytest.approx(1.0), st  # hot experts on rank 0, evened out
