"""The first hour of a vLLM user, through vLLM 0.33's own code (CLI parser, ``create_engine_config``,
``load_general_plugins``, ``init_model_parallel_group``), on its CPU platform.

- our ``VLLM_MOONEP_*`` variables pass vLLM's environment validation (``--fail-on-environ-validation``);
- the ``moonep`` block is checked in the front end when the engine config is made: bad values,
  bounds, model-dependent limits are errors; settings that cannot take effect and look-alike
  top-level keys are warnings;
- what only a worker knows (heap, kernel) is checked when its EP group is built, before weights;
- the plugin says at INFO what it hooked, warns for an untested vLLM, and a seam mismatch is a
  warning at load and an error only when moonep is asked for.

The front-end cases run on rank 0 of the 2-rank vLLM CPU pool the other vLLM tests use (building
vLLM's parser needs a platform: ``VLLM_TARGET_DEVICE=cpu`` there; vLLM's own, CUDA, with
``VLLM_MOONEP_TEST_DEVICE=cuda``: ``workers.PLATFORM``); rank 1 returns ``None``. The
model is a local ``config.json`` (no weights are needed to make an engine config).
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from tests.conftest import ranks
from tests.vllm import workers as W
from vllm_moonep.testing.launch import call_with_env

pytestmark = pytest.mark.vllm

#: a tiny Qwen3-MoE: E=32 experts, top-4, H=256
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 32, "num_experts_per_tok": 4,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}

MOONEP_ARGS = ["--enable-expert-parallel", "--data-parallel-size", "2", "--all2all-backend", "moonep"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-moe")
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


# ---------------------------------------------------------------------------- rank side
class _Capture(logging.Handler):
    """Records of the plugin's logger ('vllm.vllm_moonep', which vLLM's logging config leaves alone)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))

    def __enter__(self):
        lg = logging.getLogger("vllm.vllm_moonep")
        self._level = lg.level
        lg.addHandler(self)
        lg.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc):
        lg = logging.getLogger("vllm.vllm_moonep")
        lg.removeHandler(self)
        lg.setLevel(self._level)

    def ours(self, level: str) -> list[str]:
        return [m for lv, m in self.records if lv == level and "vllm-moonep" in m]


def _configure_vllm_logging() -> None:
    """vLLM's default logging, as create_engine_config applies it (its dictConfig resets the handlers
    of the 'vllm' tree; applied once here, later calls leave _Capture attached)."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())


def _engine_config(model_dir: str, argv: list[str], env: dict[str, str]):
    """``vllm serve``'s path to a VllmConfig: vLLM's parser, EngineArgs.from_cli_args, create_engine_config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_moonep.vllm_plugin import checks

    checks._warned.clear()  # each case sees its own warnings

    def build():
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", model_dir, "--skip-tokenizer-init", "--dtype", "bfloat16", *argv])
        return EngineArgs.from_cli_args(args).create_engine_config()

    return call_with_env(env, build)


def rk_frontend(model_dir: str, cases: list[tuple[list[str], dict]]):
    """Each case: (argv, env) -> ("ok", warnings, infos, options) or ("error", type, message, warnings)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    from vllm.plugins import load_general_plugins

    _configure_vllm_logging()
    load_general_plugins()
    out = []
    for argv, env in cases:
        with _Capture() as cap:
            try:
                cfg = _engine_config(model_dir, argv, env)
                out.append(("ok", cap.ours("WARNING"), cap.ours("INFO"), cfg.additional_config))
            except Exception as exc:
                out.append(("error", type(exc).__name__, str(exc), cap.ours("WARNING")))
    return out


def rk_env_registration():
    """Our names in vllm.envs before the VLLM_MOONEP_PLUGIN=0 early return; typos still caught."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    import vllm.envs as envs
    from vllm.platforms import current_platform

    from vllm_moonep.vllm_plugin import envs as our_envs
    from vllm_moonep.vllm_plugin import register, seams, state

    res = {}
    ours = {"VLLM_MOONEP_WEIGHT_LAYOUT": "symmetric", "VLLM_MOONEP_TRANSPORT": "collective",
            "VLLM_MOONEP_PLUGIN": "0", "VLLM_MOONEP_HEAP": "host", "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S": "60"}
    saved_env = dict(os.environ)
    saved_table = {k: envs.environment_variables.pop(k) for k in our_envs.KNOWN_ENV_VARS
                   if k in envs.environment_variables}
    seams.undo_seams()
    try:
        os.environ.update(ours)
        register()  # VLLM_MOONEP_PLUGIN=0: registers the names, hooks nothing
        res["registered"] = sorted(k for k in ours if k in envs.environment_variables)
        res["patched_when_disabled"] = state.patched()
        res["getter"] = envs.environment_variables["VLLM_MOONEP_WEIGHT_LAYOUT"]()
        current_platform.validate_environ(True)  # what --fail-on-environ-validation runs
        res["strict_validation"] = "passed"
        os.environ["VLLM_MOONEP_WEIGHT_LAYOT"] = "symmetric"
        with _Capture() as cap:
            our_envs.register_env_vars()
        res["typo_warning"] = cap.ours("WARNING")
        try:
            current_platform.validate_environ(True)
            res["typo_validation"] = "passed"
        except ValueError as exc:
            res["typo_validation"] = str(exc)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        envs.environment_variables.update(saved_table)
        seams.undo_seams()
        seams.apply_seams()
    return res


def rk_load_lines(model_dir: str):
    """The INFO line at load, the untested-version warning, and a seam mismatch end to end."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    import vllm
    import vllm.model_executor.layers.fused_moe.prepare_finalize.moonep as pfm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_moonep.vllm_plugin import seams, state

    _configure_vllm_logging()  # so the INFO line is logged at load, not deferred to the first config
    res = {}
    try:
        seams.undo_seams()
        with _Capture() as cap:
            res["hooked"] = seams.apply_seams()
        res["load_info"] = cap.ours("INFO")
        res["load_warnings"] = cap.ours("WARNING")

        seams.undo_seams()
        real_version = vllm.__version__
        vllm.__version__ = "0.34.0"  # an untested vLLM whose seams still verify
        try:
            with _Capture() as cap:
                seams.apply_seams()
        finally:
            vllm.__version__ = real_version
        res["version_warnings"] = cap.ours("WARNING")
        res["patched_on_untested"] = state.patched()

        seams.undo_seams()
        saved = pfm.gather_moonep_weight_layout
        del pfm.gather_moonep_weight_layout  # a vLLM that differs in one seam
        try:
            with _Capture() as cap:
                seams.apply_seams()  # must not raise: every vLLM command goes through here
            res["seam_warnings"] = cap.ours("WARNING")
            res["patched_with_bad_seam"] = state.patched()
            EngineArgs.add_cli_args(FlexibleArgumentParser())  # what `vllm serve --help` builds
            res["help_parser"] = "built"
            _engine_config(model_dir, [], {})
            res["without_moonep"] = "ok"
            try:
                _engine_config(model_dir, MOONEP_ARGS, {})
                res["with_moonep"] = "no error"
            except Exception as exc:
                res["with_moonep"] = f"{type(exc).__name__}: {exc}"
        finally:
            pfm.gather_moonep_weight_layout = saved
    finally:
        seams.undo_seams()
        seams.apply_seams()
    return res


def rk_worker_checks(additional: dict):
    """vLLM's init_model_parallel_group for the moonep EP group (both ranks): our manager is attached
    and checks the worker right there, before any layer or weight exists."""
    import torch.distributed as dist
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    from tests.vllm.test_plugin import _ensure_vllm_dist

    load_general_plugins()
    R = dist.get_world_size()

    def config(extra):
        pc = ParallelConfig(data_parallel_size=R, data_parallel_rank=dist.get_rank(), enable_expert_parallel=True,
                            all2all_backend="moonep")
        return VllmConfig(parallel_config=pc, device_config=DeviceConfig(device="cpu"), additional_config=extra)

    with set_current_vllm_config(config({})):
        _ensure_vllm_dist(None)  # vLLM's world, DP and EP groups, as a worker has before it builds anything
    cfg = config(additional)
    with set_current_vllm_config(cfg), _Capture() as cap:
        try:
            group = parallel_state.init_model_parallel_group([list(range(R))], dist.get_rank(), "gloo",
                                                             group_name="ep", use_all2all=True)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        mgr = group.device_communicator.all2all_manager
        out = {"manager": type(mgr).__name__, "ours": getattr(mgr, "is_vllm_moonep", False),
               "engine": getattr(mgr, "engine", None), "infos": cap.ours("INFO")}
        group.destroy()
    return out


def rk_parse_once(model_dir: str, extra: dict):
    """One engine config build through vLLM's parser and ``create_engine_config`` (on a platform that
    captures graphs, so the graph rule reads the options too), then a worker's start on that config:
    its EP group and our manager, a MoE layer built, loaded and run once (the start-up line). Counts
    every call of ``options.parse_options``, however a plugin module reaches it."""
    import sys

    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    from tests.vllm import workers as W
    from tests.vllm.test_plugin import _ensure_vllm_dist, rk_vllm_layer
    from vllm_moonep.vllm_plugin import options

    load_general_plugins()
    rank, R = dist.get_rank(), dist.get_world_size()
    parse = options.parse_options
    calls: list[str] = []

    def counted(*args, **kwargs):
        calls.append("parse")
        return parse(*args, **kwargs)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("vllm_moonep.") and getattr(m, "parse_options", None) is parse]
    for m in holders:
        m.parse_options = counted
    try:
        with W.graph_capable_platform():
            cfg = _engine_config(model_dir, MOONEP_ARGS + ["--additional-config", json.dumps(extra)], {})
        res = {"front_end": len(calls), "cudagraph_mode": cfg.compilation_config.cudagraph_mode.name}
        cfg.parallel_config.data_parallel_rank = rank  # what vLLM sets in each DP engine core
        with set_current_vllm_config(cfg):
            _ensure_vllm_dist(cfg)  # vLLM's world, DP and EP groups (once per process)
            group = parallel_state.init_model_parallel_group([list(range(R))], rank, "gloo", group_name="ep",
                                                             use_all2all=True)
            res["manager"] = type(group.device_communicator.all2all_manager).__name__
            group.destroy()
        layer = rk_vllm_layer({}, [37, 150], 7, cfg=cfg)
        res["summary"] = layer["summary"]
        res["total"] = len(calls)
    finally:
        for m in holders:
            m.parse_options = parse
    return res


# ---------------------------------------------------------------------------- tests
def test_env_vars_registered_with_vllm_validation():
    """VLLM_MOONEP_* made vLLM warn 'Unknown vLLM environment variable' and fail --fail-on-environ-validation."""
    res = ranks(2, rk_env_registration, **W.PLATFORM)[0]
    assert res["registered"] == sorted(["VLLM_MOONEP_WEIGHT_LAYOUT", "VLLM_MOONEP_TRANSPORT", "VLLM_MOONEP_PLUGIN",
                                        "VLLM_MOONEP_HEAP", "VLLM_MOONEP_COLLECTIVE_TIMEOUT_S"]), res
    assert res["patched_when_disabled"] is False and res["getter"] == "symmetric"
    assert res["strict_validation"] == "passed"
    assert "Unknown vLLM environment variable detected: VLLM_MOONEP_WEIGHT_LAYOT" in res["typo_validation"]
    assert any("VLLM_MOONEP_WEIGHT_LAYOT" in w and "did you mean VLLM_MOONEP_WEIGHT_LAYOUT" in w
               for w in res["typo_warning"]), res["typo_warning"]


def test_frontend_accepts_env_options_under_strict_validation(model_dir):
    """SERVING.md's VLLM_MOONEP_WEIGHT_LAYOUT=symmetric stopped `--fail-on-environ-validation` runs."""
    env = {"VLLM_MOONEP_WEIGHT_LAYOUT": "symmetric", "VLLM_MOONEP_TRANSPORT": "collective", "VLLM_MOONEP_PLUGIN": "1"}
    (status, warnings, infos, _), = ranks(2, rk_frontend, model_dir, [(MOONEP_ARGS + ["--fail-on-environ-validation"],
                                                                       env)], **W.PLATFORM)[0]
    assert status == "ok" and warnings == [], warnings
    line = [m for m in infos if "--all2all-backend moonep for" in m]
    assert line, infos
    assert "weight_layout='symmetric' (VLLM_MOONEP_WEIGHT_LAYOUT)" in line[0]
    assert "transport='collective' (VLLM_MOONEP_TRANSPORT)" in line[0] and "E=32 experts" in line[0]


BAD = [
    ({"moonep": {"weight_layot": "symmetric"}}, [], "MoonEPOptionsError", ["weight_layot", "did you mean 'weight_layout'"]),
    ({"moonep": {"transport": "nvlink"}}, [], "MoonEPOptionsError", ["transport", "auto, symmetric, collective"]),
    ({"moonep": {"num_prefetch_slots": 1000000000}}, [], "MoonEPOptionsError", ["num_prefetch_slots", "at most 4096"]),
    ({"moonep": {"num_prefetch_slots": 64}}, [], "MoonEPOptionsError", ["exceeds the model's 32 experts"]),
    ({"moonep": {"step_log_interval": -1}}, [], "MoonEPOptionsError", ["step_log_interval", ">= 0"]),
    ({"moonep": {"weight_layout": "symmetric", "impl": "grouped_mm"}}, [], "MoonEPOptionsError",
     ["grouped_mm", "num_prefetch_slots=4 < E/R=16"]),
    ({"moonep": {}}, ["--data-parallel-size", "3"], "MoonEPOptionsError", ["32 routed experts", "EP size 3"]),
    ({"moonep": {}}, ["--max-num-batched-tokens", "4194304"], "MoonEPOptionsError", ["max_num_batched_tokens=4194304",
                                                                                     "2**24"]),
    # vLLM's fallback DP path calls a dispatch no moonep manager has: NotImplementedError at the first forward
    ({"moonep": {}}, ["--no-expert-parallel"], "MoonEPOptionsError",
     ["--data-parallel-size 2 needs --enable-expert-parallel", "allgather_reducescatter"]),
]


def test_frontend_rejects_bad_options_when_config_is_made(model_dir):
    """Bad moonep values (or ones the model cannot take) surfaced only on each worker, after weight loading."""
    cases = []
    for extra, argv, _, _ in BAD:
        a = list(MOONEP_ARGS)
        if "--data-parallel-size" in argv:
            a[a.index("--data-parallel-size") + 1] = argv[1]
            argv = []
        if "--no-expert-parallel" in argv:
            a.remove("--enable-expert-parallel")
            argv = []
        cases.append((a + argv + ["--additional-config", json.dumps(extra)], {}))
    res = ranks(2, rk_frontend, model_dir, cases, **W.PLATFORM)[0]
    for (extra, _, etype, needles), r in zip(BAD, res):
        assert r[0] == "error" and r[1] == etype, (extra, r)
        for n in needles:
            assert n in r[2], (extra, r[2])


def test_frontend_warns_for_settings_without_effect(model_dir):
    """Look-alike keys, a moonep block with DP=1 or another backend, and ineffective settings were silent."""
    cases = [
        (MOONEP_ARGS + ["--additional-config", json.dumps({"weight_layout": "symmetric"})], {}),
        (MOONEP_ARGS + ["--additional-config", json.dumps({"MoonEP": {"weight_layout": "symmetric"}})], {}),
        (["--enable-expert-parallel", "--all2all-backend", "moonep", "--additional-config",
          json.dumps({"moonep": {"weight_layout": "symmetric"}})], {}),
        (["--additional-config", json.dumps({"moonep": {"weight_layout": "symmetric"}})], {}),
        (MOONEP_ARGS + ["--additional-config", json.dumps({"moonep": {"heap": "nvshmem"}})], {}),
        (MOONEP_ARGS + ["--additional-config", json.dumps({"moonep": {"weight_layout": "symmetric"}})], {}),
    ]
    res = ranks(2, rk_frontend, model_dir, cases, **W.PLATFORM)[0]
    assert all(r[0] == "ok" for r in res), res
    w = [r[1] for r in res]
    assert any("key 'weight_layout' has no effect" in m and '{"moonep": {"weight_layout"' in m for m in w[0]), w[0]
    assert any("key 'MoonEP' has no effect" in m and "'moonep' (lower case)" in m for m in w[1]), w[1]
    assert any("MoonEP will not run: --data-parallel-size is 1" in m for m in w[2]), w[2]
    assert any("--all2all-backend is 'allgather_reducescatter'" in m and "no effect" in m for m in w[3]), w[3]
    assert any("heap='nvshmem' has no effect with weight_layout='replicated'" in m for m in w[4]), w[4]
    assert w[5] == [], w[5]


def _nvshmem_why() -> str | None:
    from vllm_moonep.engine.heaps.nvshmem_heap import nvshmem_status

    return nvshmem_status()[1] or None


#: (options, what the worker says) on a CPU worker (vLLM's CPU platform) and on a CUDA one (its own
#: platform with ``VLLM_MOONEP_TEST_DEVICE=cuda``): ``None`` = the options are valid there
WORKER_CASES = {
    "nvshmem-heap": ({"weight_layout": "symmetric", "heap": "nvshmem"},
                     ["heap='nvshmem'", "needs CUDA devices", "this worker runs on cpu"],
                     lambda: ["heap='nvshmem'", "nvshmem4py does not import"] if _nvshmem_why() else None),
    "torch-heap": ({"weight_layout": "symmetric", "heap": "torch"}, ["heap='torch'", "needs CUDA devices"],
                   lambda: None),
    "triton": ({"impl": "triton"}, ["impl='triton' cannot run on this worker (cpu)", "available here: reference",
                                    "use impl='auto'"], lambda: None),
}


@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_worker_checks_when_ep_group_is_built(case):
    """heap=nvshmem / impl=triton where they cannot run failed only at the first layer or forward; on a
    CUDA worker, a refusal of what runs there (the torch heap, the Triton kernels)."""
    extra, cpu_needles, cuda_needles = WORKER_CASES[case]
    needles = cuda_needles() if W.ON_CUDA else cpu_needles
    res = ranks(2, rk_worker_checks, {"moonep": dict(extra, engine="builtin")}, **W.PLATFORM)
    for r in res:
        if needles is None:
            assert "error" not in r and r["ours"] is True and r["engine"] == "builtin", r
            continue
        assert "error" in r and "MoonEPUnavailableError" in r["error"], r
        for n in needles:
            assert n in r["error"], r["error"]


def test_manager_attached_with_ep_group_and_fallback_explained():
    """vLLM logs 'moonep not supported on CPU, falling back' and our manager was used anyway, unexplained
    (on CUDA vLLM's communicator builds our manager itself: nothing to explain, and nothing said)."""
    res = ranks(2, rk_worker_checks, {"moonep": {"engine": "builtin"}}, **W.PLATFORM)
    for r in res:
        assert r.get("ours") is True and r["manager"] == "MoonEPAll2AllManager" and r["engine"] == "builtin", r
        explained = any("CpuCommunicator has no MoonEP all2all manager" in m and "fallback is replaced" in m
                        for m in r["infos"])
        assert explained is not W.ON_CUDA, r["infos"]


def test_plugin_load_lines_and_seam_mismatch(model_dir):
    """Silent load, no untested-version warning, and one differing seam broke every vLLM command."""
    import vllm

    res = ranks(2, rk_load_lines, model_dir, **W.PLATFORM)[0]
    assert len(res["hooked"]) == 12, res["hooked"]
    assert any(m.startswith(f"vllm-moonep 0.1.0 hooked vLLM {vllm.__version__} (12 seams:")
               and "VllmConfig._set_compile_ranges, CompilationConfig.set_splitting_ops_for_v1)" in m
               for m in res["load_info"]), res
    assert res["load_warnings"] == []
    assert any("tested with vLLM 0.33.x; this is vLLM 0.34.0" in m for m in res["version_warnings"]), res
    assert res["patched_on_untested"] is True
    assert any("seam vllm.model_executor.layers.fused_moe.prepare_finalize.moonep.gather_moonep_weight_layout" in m
               and "vLLM runs unchanged" in m for m in res["seam_warnings"]), res["seam_warnings"]
    assert res["patched_with_bad_seam"] is False
    assert res["help_parser"] == "built" and res["without_moonep"] == "ok"
    assert res["with_moonep"].startswith("MoonEPSeamError: vllm-moonep cannot hook vLLM"), res["with_moonep"]
    assert "gather_moonep_weight_layout" in res["with_moonep"]


def test_options_parsed_once_per_config(model_dir):
    """The moonep block and VLLM_MOONEP_* env were parsed again by every reader (graph rule, front-end check,
    manager, each layer's experts, P/F and layout, the start-up line): five and more parses per config."""
    if W.ON_CUDA:
        pytest.skip("runs a vLLM MoE layer on CPU tensors (test_plugin's layer harness, vLLM's CPU platform); "
                    "under the CUDA platform vLLM's moe_forward op takes CUDA tensors only")
    extra = {"moonep": {"weight_layout": "symmetric", "heap": "host", "engine": "builtin", "impl": "reference",
                        "num_prefetch_slots": 4}}
    for r in ranks(2, rk_parse_once, model_dir, extra, **W.PLATFORM):
        assert r["manager"] == "MoonEPAll2AllManager", r
        # the worker used the parsed options: not a count of 1 because nothing read them
        assert "weight_layout=symmetric" in r["summary"] and "heap=host (requested)" in r["summary"], r["summary"]
        assert r["cudagraph_mode"] == "NONE", r  # impl='reference': the graph rule read the options and kept eager
        assert r["front_end"] == 1 and r["total"] == 1, r
