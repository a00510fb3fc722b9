#!/bin/bash
# vLLM 0.33's Python on a GPU machine that cannot install vLLM (no network; vLLM's wheel is too
# large to carry, its compiled extensions above all): unpack the carried .py files of the installed
# vllm package with its dist-info (version, entry points: platform detection and plugin loading
# read them) and install the wheels of what the imports of its config, engine args, fused-MoE layer
# and modular kernel need and the image lacks (pydantic, pyzmq, msgspec, ...: .device/vllm/
# README.txt lists them); probe the import closure twice, under vLLM's own platform choice (CUDA
# where GPUs are visible) and under its CPU platform, printing the first failure verbatim (where
# vLLM's Python stops); run tests/vllm on CPU ranks, then its core cases on CUDA tensors over NCCL;
# then show how far vLLM's CUDA platform gets in a test.
#
# What tests/vllm run on (read before reading the results): by default every case builds its
# tensors, buffer pool, layouts and vLLM FusedMoEConfig on device "cpu" (tests/vllm/workers.py) and
# runs them on spawned gloo ranks of world size 1 to 4 (tests/conftest.py ranks() -> run_on_ranks).
# VLLM_MOONEP_TEST_DEVICE=cuda in the pytest process switches both: ranks() then spawns one NCCL
# rank per GPU (cases with more ranks than GPUs skip) and workers.py puts those objects on the
# rank's GPU (symmetric layouts on the torch heap; the dense reference stays on the CPU). vLLM's
# platform is a separate choice: test_plugin*.py pin its CPU platform in their ranks
# (VLLM_TARGET_DEVICE=cpu); test_modular.py and test_contract.py take vLLM's own choice, which on a
# GPU machine is CUDA, whose module (vllm/platforms/cuda.py:23) imports the compiled
# vllm._C_stable_libtorch at its top (reached from `import vllm.config` through
# vllm/utils/torch_utils.py's PIN_MEMORY). So:
#   main pass   every tests/vllm case with VLLM_TARGET_DEVICE=cpu exported: vLLM's Python on CPU
#               gloo ranks beside visible GPUs -> vllm.xml
#   cuda pass   CUDA_TESTS (default: every case of test_contract.py and test_modular.py: both
#               layouts, capacity switches, bad inputs, top-1; cases with more ranks than GPUs
#               skip) with VLLM_MOONEP_TEST_DEVICE=cuda and still VLLM_TARGET_DEVICE=cpu: our classes
#               and vLLM's MoonEP classes on CUDA tensors, one GPU per rank over NCCL -> vllm-cuda.xml
#   cudaplat    when the own-choice probe stopped: vllm/_C_stable_libtorch.py written as an empty
#               stand-in (registers no ops; STUB_C=0: none), the probe again, and test_contract.py
#               + test_modular.py with -x under vLLM's CUDA platform (CPU tensors): the next place
#               that needs a compiled op or a GPU-only path -> vllm-cudaplat.xml
#
# Usage (repo root; carry .device/vllm, and .whl for nvshmem4py): bash tools/gpu_vllm.sh [pytest args]
#   (extra pytest args go to the main and cuda passes)
#   PYTHON          interpreter (default python3); a path puts its folder first on PATH, so that
#                   tools/gpu_env.sh's python3 is the same one (local checks: PYTHON=/tmp/venv/bin/python)
#   VLLM_DIR        folder of vllm-py.tar.gz and wheels/ (default .device/vllm); VLLM_WHEELS overrides
#                   the wheel folder (cp312 manylinux x86_64 wheels there; another Python needs its own)
#   VLLM_SRC, VLLM_SITE   where the sources unpack / the wheels install (default /tmp/vllm-src, /tmp/vsite)
#   STEPS           which steps (default "imports suite cuda cudaplat"); "imports" alone: setup and probes
#   SUITE_TARGET    VLLM_TARGET_DEVICE of the main pass (default cpu; "auto": vLLM's own choice)
#   SUITE_TIMEOUT   seconds for the main pass (default 300), CUDA_TIMEOUT for the cuda pass (default
#                   200), CUDAPLAT_TIMEOUT for the cudaplat pass (default 150), TEST_TIMEOUT per test
#                   (default 240); BUDGET caps the whole script (default 440 s: under 8 minutes with
#                   the 15 s kill grace); every step is bounded and a later one gets only what is left
#   CUDA_TESTS      the cuda pass's paths / node ids; CUDAPLAT_TESTS the cudaplat pass's; STUB_C=0
#                   leaves vllm._C_stable_libtorch absent there
#   VLLM_MOONEP_THREADS_PER_RANK  torch threads per rank process (default 4 with >= 16 cores, else 1)
# Files in $OUT (8 at most come back from the device tool): setup.log (editable install, nvshmem4py
# and the vLLM wheels' pip output), vllm-imports.txt (environment and import probes), vllm.log
# (everything this script printed, the main and cuda passes included), vllm.xml and vllm-cuda.xml
# (their junit reports), vllm-cudaplat.log and vllm-cudaplat.xml (the cudaplat pass).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if [[ "$PYTHON" == */* ]]; then export PATH="$(cd "$(dirname "$PYTHON")" && pwd):$PATH"; fi
VLLM_DIR=${VLLM_DIR:-.device/vllm}
VLLM_WHEELS=${VLLM_WHEELS:-$VLLM_DIR/wheels}
VLLM_SRC=${VLLM_SRC:-/tmp/vllm-src}
VLLM_SITE=${VLLM_SITE:-/tmp/vsite}
STEPS=${STEPS:-imports suite cuda cudaplat}
BUDGET=${BUDGET:-440}
T0=$(date +%s)

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# bounded SECONDS CMD...: timeout of SECONDS or what is left of BUDGET, whichever is less (signal
# $SIG, default TERM; the pytest passes use INT so that pytest still writes its junit report)
bounded() {
  local want=$1 l; shift
  l=$(left)
  (( l < want )) && want=$l
  if (( want < 5 )); then echo "gpu_vllm: time budget spent, skipped: $*"; return 124; fi
  timeout -s "${SIG:-TERM}" -k 15 "$want" "$@"
}
has_step() { [[ " $STEPS " == *" $1 "* ]]; }

summary() {  # junit summary: counts, then every failed / errored / skipped case with its message
  "$PYTHON" - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
from collections import Counter
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"  no junit report ({e})"); sys.exit(0)
cases = list(root.iter("testcase"))
def status(tc):
    for k in ("failure", "error", "skipped"):
        if tc.find(k) is not None:
            return k
    return "passed"
print("  summary:", dict(Counter(status(tc) for tc in cases)))
for tc in cases:
    s = status(tc)
    if s != "passed":
        msg = (tc.find(s).get("message") or "").splitlines()
        print(f"  {s:7s} {tc.get('classname', '').split('.')[-1]}::{tc.get('name')}: {(msg[0] if msg else '')[:220]}")
PY
}

# the import probe (python "$PROBE" LABEL): the import closure in one process, the first failure's
# traceback verbatim, later ones in a line each
PROBE=/tmp/gpu_vllm_probe.py
cat >"$PROBE" <<'PY'
import importlib, os, sys, traceback
label = sys.argv[1]
print(f"--- import probes, {label} (VLLM_TARGET_DEVICE={os.environ.get('VLLM_TARGET_DEVICE', '<unset>')}) ---")
MODULES = [
    "vllm", "vllm.envs", "vllm.config", "vllm.engine.arg_utils", "vllm.distributed", "vllm.forward_context",
    "vllm.v1.worker.workspace", "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.modular_kernel", "vllm.model_executor.layers.fused_moe.config",
    "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce",
    "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep",
    "vllm.model_executor.layers.fused_moe.experts.moonep_experts",
    "vllm_moonep.vllm_plugin", "vllm_moonep.common.vllm_modular",
]
def platform():
    from vllm.platforms import current_platform
    return f"{type(current_platform).__name__} (device_type={current_platform.device_type!r})"
def plugins():
    from vllm.plugins import load_general_plugins, load_plugins_by_group
    found = load_plugins_by_group("vllm.general_plugins")
    assert "moonep" in found, f"no moonep entry point among {sorted(found)}"
    load_general_plugins()
    for name in ("vllm_moonep.vllm_plugin.hooks",):  # where patched() lives
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "patched"):
            assert mod.patched(), f"{name}.patched() is False after load_general_plugins()"
            return f"moonep entry point loaded, {name}.patched() is True"
    return "moonep entry point loaded"
def compiled_ops():
    import torch
    import vllm._custom_ops  # noqa: F401  (warns when vllm._C is absent)
    out = []
    for ns, op in (("_C", "silu_and_mul"), ("_moe_C", "moe_sum"), ("_moe_C", "topk_softmax")):
        try:
            getattr(getattr(torch.ops, ns), op)
            out.append(f"torch.ops.{ns}.{op} present")
        except Exception as e:
            out.append(f"torch.ops.{ns}.{op} ABSENT ({type(e).__name__})")
    return "; ".join(out)
STEPS = [(f"import {m}", (lambda m=m: (importlib.import_module(m), "ok")[1])) for m in MODULES]
STEPS += [("vllm.platforms.current_platform", platform), ("load_general_plugins()", plugins),
          ("vLLM compiled ops", compiled_ops)]
first = None
for name, fn in STEPS:
    try:
        print(f"OK    {name}: {fn()}")
    except BaseException as e:  # noqa: BLE001 - report everything, go on
        if first is None:
            first = name
            print(f"FAIL  {name}  <- first failure, traceback verbatim:")
            print(traceback.format_exc().rstrip())
        else:
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if "vllm" in f.filename), "?")
            print(f"FAIL  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (at {where})")
print(f"--- {label}: " + (f"stops at: {first} (later failures can be its echoes: a module whose import failed "
                          "runs again when the next probe imports it)" if first else "everything imports") + " ---")
sys.exit(1 if first else 0)
PY

main() {
  echo "gpu_vllm: $(date -u +%FT%TZ), steps: $STEPS, budget ${BUDGET}s"
  # 1. the project (editable install, else source roots on PYTHONPATH) and nvshmem4py, as gpu_suite.sh
  source tools/gpu_env.sh
  # 2. vLLM's Python sources and the wheels of what its imports need
  if [ ! -f "$VLLM_DIR/vllm-py.tar.gz" ]; then
    echo "gpu_vllm: $VLLM_DIR/vllm-py.tar.gz is missing: carry .device/vllm (run's carry list)"; return 2
  fi
  rm -rf "$VLLM_SRC" && mkdir -p "$VLLM_SRC"
  bounded 90 tar xzf "$VLLM_DIR/vllm-py.tar.gz" -C "$VLLM_SRC" || { echo "gpu_vllm: unpacking FAILED"; return 2; }
  echo "vllm sources: $(find "$VLLM_SRC/vllm" -name '*.py' | wc -l) .py files in $VLLM_SRC ($(ls -d "$VLLM_SRC"/vllm-*.dist-info | xargs -n1 basename))"
  if ! bounded 150 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$VLLM_SITE" "$VLLM_WHEELS"/*.whl >>"$OUT/setup.log" 2>&1; then
    echo "gpu_vllm: installing $VLLM_WHEELS/*.whl FAILED (tail of setup.log below)"; tail -5 "$OUT/setup.log"; return 2
  fi
  echo "vllm wheels: $(cd "$VLLM_WHEELS" && ls *.whl | sed 's/-\(cp\|py\).*//' | tr '\n' ' ')-> $VLLM_SITE"
  export PYTHONPATH=$VLLM_SRC:$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}
  # vLLM finds plugins through entry points: without the editable install's metadata, write ours
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'moonep' for e in m.entry_points(group='vllm.general_plugins')) else 1)"; then
    ver=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    d="$VLLM_SITE/vllm_moonep-${ver:-0}.dist-info"; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm-moonep\nVersion: %s\n' "${ver:-0}" >"$d/METADATA"
    printf '[vllm.general_plugins]\nmoonep = vllm_moonep.vllm_plugin:register\n' >"$d/entry_points.txt"
    echo "entry point: the editable install left none; wrote $d (vllm.general_plugins: moonep)"
  fi
  # no network there: no usage-stats reporting; the rank processes may use a few threads each.
  # (HF_HUB_OFFLINE must stay unset: with it EngineArgs resolves --model through the hub cache and
  # test_plugin's "--model dummy" fails.)
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export VLLM_MOONEP_THREADS_PER_RANK=${VLLM_MOONEP_THREADS_PER_RANK:-$(( $(nproc) >= 16 ? 4 : 1 ))}
  export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  # 3. environment and import probes
  echo 1 >/tmp/gpu_vllm_own.rc
  {
    bounded 60 "$PYTHON" - <<'PY'
import importlib.metadata as md, platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"absent ({e})"
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
nccl = ".".join(map(str, torch.cuda.nccl.version())) if n else "-"
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {tv}, cuda devices {n}, nccl {nccl}")
for d in ("vllm", "vllm-moonep", "pydantic", "pyzmq", "transformers", "huggingface_hub", "numpy", "typing_extensions"):
    try:
        print(f"  {d} {md.version(d)}")
    except Exception as e:
        print(f"  {d}: {type(e).__name__}")
print("  vllm.general_plugins:", sorted(f"{e.name}={e.value}" for e in md.entry_points(group="vllm.general_plugins")))
PY
    if has_step imports; then
      (unset VLLM_TARGET_DEVICE; bounded 150 "$PYTHON" "$PROBE" "vLLM's own platform choice"; echo $? >/tmp/gpu_vllm_own.rc) 2>&1
      (export VLLM_TARGET_DEVICE=cpu; bounded 150 "$PYTHON" "$PROBE" "vLLM's CPU platform") 2>&1
    fi
  } 2>&1 | tee "$OUT/vllm-imports.txt"
  local rc=0
  # 4. the main pass: every tests/vllm case on vLLM's CPU platform (SUITE_TARGET=auto: vLLM's own choice)
  if has_step suite; then
    local target=${SUITE_TARGET:-cpu} start
    echo "=== pytest tests/vllm, VLLM_TARGET_DEVICE=${target/auto/<unset>}, ${VLLM_MOONEP_THREADS_PER_RANK} threads per rank ==="
    start=$(date +%s)
    (if [ "$target" = auto ]; then unset VLLM_TARGET_DEVICE; else export VLLM_TARGET_DEVICE=$target; fi
     SIG=INT bounded "${SUITE_TIMEOUT:-300}" "$PYTHON" -m pytest tests/vllm -q -rfEs -p no:cacheprovider \
       --timeout="${TEST_TIMEOUT:-240}" --junitxml="$OUT/vllm.xml" "$@") 2>&1
    rc=$?
    echo "gpu_vllm: pytest exit $rc in $(( $(date +%s) - start ))s"
    summary "$OUT/vllm.xml"
  fi
  # 5. the core cases on CUDA tensors, one GPU per rank over NCCL (vLLM's platform still CPU)
  if has_step cuda; then
    local cuda_tests=${CUDA_TESTS:-tests/vllm/test_contract.py tests/vllm/test_modular.py} start r2
    echo "=== pytest $cuda_tests, VLLM_MOONEP_TEST_DEVICE=cuda (NCCL, one GPU per rank), VLLM_TARGET_DEVICE=cpu ==="
    start=$(date +%s)
    # shellcheck disable=SC2086
    (export VLLM_TARGET_DEVICE=cpu VLLM_MOONEP_TEST_DEVICE=cuda
     SIG=INT bounded "${CUDA_TIMEOUT:-200}" "$PYTHON" -m pytest $cuda_tests -q -rfEs -p no:cacheprovider \
       --timeout="${TEST_TIMEOUT:-240}" --junitxml="$OUT/vllm-cuda.xml" "$@") 2>&1
    r2=$?
    (( rc == 0 )) && rc=$r2
    echo "gpu_vllm: cuda pass pytest exit $r2 in $(( $(date +%s) - start ))s"
    summary "$OUT/vllm-cuda.xml"
  fi
  # 6. vLLM's own platform choice (CUDA on a GPU machine) past its first stop: when the probe above
  # stopped there, vllm/_C_stable_libtorch.py becomes an empty stand-in for the compiled extension
  # (it registers no ops; STUB_C=0: no stand-in), the probe runs again, then a short pytest pass (-x)
  # shows where vLLM's Python next needs a compiled op (torch.ops._C / _moe_C) or a GPU-only path.
  if has_step cudaplat; then
    if [ "$(cat /tmp/gpu_vllm_own.rc)" = 0 ]; then
      echo "=== vLLM's own platform choice imports everything here: no separate pass (SUITE_TARGET=auto runs the suite under it) ==="
    else
      local stub="$VLLM_SRC/vllm/_C_stable_libtorch.py" note="no stand-in"
      if [ "${STUB_C:-1}" != 0 ] && ! ls "$VLLM_SRC"/vllm/_C_stable_libtorch*.so >/dev/null 2>&1; then
        printf '# gpu_vllm.sh: empty stand-in for the compiled vllm._C_stable_libtorch (registers no ops)\n' >"$stub"
        note="vllm._C_stable_libtorch stubbed by an empty module (no ops)"
      fi
      (unset VLLM_TARGET_DEVICE; bounded 150 "$PYTHON" "$PROBE" "vLLM's own platform choice, $note") 2>&1 \
        | tee -a "$OUT/vllm-imports.txt"
      echo "=== pytest, vLLM's own platform choice ($note): ${CUDAPLAT_TESTS:-tests/vllm/test_contract.py tests/vllm/test_modular.py} -x ==="
      (unset VLLM_TARGET_DEVICE
       # shellcheck disable=SC2086
       SIG=INT bounded "${CUDAPLAT_TIMEOUT:-150}" "$PYTHON" -m pytest ${CUDAPLAT_TESTS:-tests/vllm/test_contract.py tests/vllm/test_modular.py} \
         -x -q -rfEs -p no:cacheprovider --timeout="${TEST_TIMEOUT:-240}" --junitxml="$OUT/vllm-cudaplat.xml") \
        >"$OUT/vllm-cudaplat.log" 2>&1
      echo "pytest exit $? (log: vllm-cudaplat.log); its first errors:"
      grep -m4 -E "^E .*(Error|error|No module named|has no attribute)" "$OUT/vllm-cudaplat.log" | cut -c1-300
      summary "$OUT/vllm-cudaplat.xml"
      rm -f "$stub"
    fi
  fi
  echo "gpu_vllm: done in $(( $(date +%s) - T0 ))s"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/vllm.log"
exit "${PIPESTATUS[0]}"
