#!/bin/bash
# vLLM 0.33 on a lent GPU machine (torch, no vLLM, no network): stage what
# tools/prepare_vllm_device.sh packed here, then run named steps under vLLM's own CUDA platform
# with its real compiled extensions (_C and _moe_C).
#
#   call k (k = 1..N, machine warm between calls):  carry=[".device/vllm/part-<k>"]
#       bash tools/gpu_vllm.sh stage [STEP ...]
#   the part is kept in /tmp/moonep-vllm/parts (which survives between calls on a warm machine;
#   carried folders do not); once every part named in MANIFEST is there, they are joined, checked
#   (sha256) and unpacked into /tmp/moonep-vllm/{src,site} once (a stamp holds the bundle's hash),
#   so a later call on the same machine runs steps with no carry at all: bash tools/gpu_vllm.sh STEP ...
#
# Steps (run in the order given, each bounded; a step that needs vLLM refuses while parts are missing):
#   imports   the import closure under vLLM's own platform choice, the platform it chose, the plugin
#             hooked through its entry point, the compiled ops present -> vllm-imports.txt
#   tests     tests/vllm with VLLM_MOONEP_TEST_DEVICE=cuda under vLLM's CUDA platform: tokens, buffer
#             pool, layouts and vLLM's FusedMoEConfig on the rank's GPU, one GPU per rank over NCCL
#             (a case with more ranks than GPUs skips, and is listed) -> vllm-tests.xml
#   experts   our layer against vLLM's own fused_experts on the same weights and routing
#             (tests/gpu/test_vs_vllm_fused_experts.py), then bench_experts with vLLM's
#             fused_experts time beside ours (EXPERTS_BENCH_ARGS) -> experts.json, bench_experts.json
#   model     a bf16 Qwen3-30B-A3B-architecture model (dummy weights) generating through vllm.LLM,
#             eager and with CUDA graphs, with and without the plugin, and through the OpenAI
#             server on loopback (vllm_moonep.tools.vllm_model_check; MODEL_ARGS adds options, e.g.
#             "--dp 2 --plugin on --compare-backend allgather_reducescatter" on two GPUs)
#             -> model.json, summary.txt, model-logs.tar.gz
#   serve_ab  (two GPUs: nvidia-h200-x2) the serving A/B inside vLLM, DP=2 EP=2: moonep replicated /
#             symmetric / symmetric with a shared slot pool against allgather_reducescatter and naive,
#             eager and with CUDA graphs, one `vllm serve` per configuration
#             (vllm_moonep.tools.serve_ab; docs/SERVING.md, "Serving A/B"). Rows are kept in
#             $STAGE_ROOT/serve-ab on the warm machine: each call runs the configurations not yet
#             there that fit its budget, so the same step again continues (SERVE_AB_ARGS adds
#             options, e.g. "--configs moonep-symmetric allgather_reducescatter"; "--rerun")
#             -> serve-ab-summary.md, serve-ab.tar.gz (every <config>.json so far and the servers' logs)
#
# Device-side workarounds (never in the product; docs/TESTING.md lists them):
#   - vllm/vllm_flash_attn/__init__.py raises ImportError at import unless _vllm_fa2_C or _vllm_fa3_C
#     exists, whichever attention backend is chosen; the runs use TRITON_ATTN, so an empty
#     vllm_flash_attn/_vllm_fa3_C.py stands in for the 172 MB extension that is not carried.
#   - VLLM_USE_FLASHINFER_SAMPLER=0: the model runner's sampler imports vLLM's FlashInfer attention
#     backend to ask whether FlashInfer's sampler applies (vllm/v1/sample/ops/topk_topp_sampler.py,
#     flashinfer_sampler_supported), and flashinfer is not carried; 0 answers no before that import.
#   - the image's torch is 2.11 (vLLM pins 2.14): nothing else is patched; where vLLM's Python trips
#     on it, the step's log shows it.
#
# Env: OUT (default /tmp/out; 8 files at most come back), BUDGET (seconds for all steps, default
#   540), STAGE_ROOT (default /tmp/moonep-vllm), PYTHON (default python3), TESTS (the tests step's
#   paths, default tests/vllm), TEST_TIMEOUT per test (default 240).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
ROOT=${STAGE_ROOT:-/tmp/moonep-vllm}
BUDGET=${BUDGET:-540}
T0=$(date +%s)
LOG="$OUT/vllm.log"

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# bounded SECONDS CMD...: at most SECONDS and what is left of BUDGET (SIG: the signal, default TERM;
# pytest gets INT so that it still writes its junit report)
bounded() {
  local want=$1 l; shift
  l=$(left)
  (( l < want )) && want=$l
  if (( want < 5 )); then echo "gpu_vllm: time budget spent, skipped: $*"; return 124; fi
  timeout -s "${SIG:-TERM}" -k 15 "$want" "$@"
}

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
        print(f"  {s:7s} {tc.get('classname', '').split('.')[-1]}::{tc.get('name')}: {(msg[0] if msg else '')[:240]}")
PY
}

source tools/device_parts.sh

stage() {
  local r
  stage_parts .device/vllm "$ROOT"; r=$?
  (( r == 0 )) || return $r
  # the device-side stand-in (see the header): the import check only, the Triton backend runs
  printf '# tools/gpu_vllm.sh: stands in for the FlashAttention extension that is not carried (TRITON_ATTN runs)\n' \
    >"$ROOT/src/vllm/vllm_flash_attn/_vllm_fa3_C.py"
  echo "stage: vLLM $(manifest_field vllm "$ROOT/parts/MANIFEST") in $ROOT/src ($(find "$ROOT/src/vllm" -name '*.py' | wc -l)" \
       ".py files; extensions $(cd "$ROOT/src/vllm" && ls *.so | tr '\n' ' '))"
}

vllm_env() {  # the environment every vLLM step runs in
  if [ "$(cat "$ROOT/ready" 2>/dev/null)" = "" ]; then
    echo "gpu_vllm: vLLM is not staged on this machine (run the stage step with every part first)"; return 2
  fi
  source tools/gpu_env.sh >"$OUT/setup.log" 2>&1 || true
  export PYTHONPATH=$ROOT/src:$ROOT/site${PYTHONPATH:+:$PYTHONPATH}
  # vLLM finds plugins through entry points: without the editable install's metadata, write ours
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'moonep' for e in m.entry_points(group='vllm.general_plugins')) else 1)"; then
    local ver d
    ver=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    d="$ROOT/site/vllm_moonep-${ver:-0}.dist-info"; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm-moonep\nVersion: %s\n' "${ver:-0}" >"$d/METADATA"
    printf '[vllm.general_plugins]\nmoonep = vllm_moonep.vllm_plugin:register\n' >"$d/entry_points.txt"
    echo "gpu_vllm: the editable install left no entry point; wrote $d"
  fi
  # no network: no usage reporting; rank processes of the tests share the GPU's host
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried (see the header)
  export VLLM_MOONEP_THREADS_PER_RANK=${VLLM_MOONEP_THREADS_PER_RANK:-4}
  unset VLLM_TARGET_DEVICE
}

step_imports() {
  bounded 150 "$PYTHON" - <<'PY' 2>&1 | tee "$OUT/vllm-imports.txt"
import importlib, platform, sys, time, traceback
import torch
t0 = time.time()
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda devices {torch.cuda.device_count()}")
steps = [f"import {m}" for m in (
    "vllm", "vllm.config", "vllm.engine.arg_utils", "vllm.distributed", "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.modular_kernel", "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep",
    "vllm.model_executor.layers.fused_moe.experts.moonep_experts", "vllm.entrypoints.openai.api_server",
    "vllm_moonep.vllm_plugin", "vllm_moonep.common.vllm_modular")]
failed = 0
for s in steps:
    try:
        importlib.import_module(s.split()[1]); print(f"OK    {s}")
    except BaseException:
        failed += 1; print(f"FAIL  {s}:"); print(traceback.format_exc().rstrip())
from vllm.platforms import current_platform
print(f"platform: {type(current_platform).__name__} (device_type={current_platform.device_type!r})")
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_moonep.vllm_plugin import state
print(f"plugin hooked through its entry point: {state.patched()}")
for ns, op in (("_C", "silu_and_mul"), ("_C", "rms_norm"), ("_moe_C", "topk_softmax"), ("_moe_C", "moe_align_block_size")):
    ok = hasattr(getattr(torch.ops, ns), op)
    failed += not ok
    print(f"{'OK   ' if ok else 'FAIL '} torch.ops.{ns}.{op}")
print(f"imports: {'all ok' if not failed else f'{failed} failed'} in {time.time() - t0:.0f}s")
sys.exit(1 if failed else 0)
PY
  return "${PIPESTATUS[0]}"
}

step_tests() {
  local start rc
  echo "=== pytest ${TESTS:-tests/vllm}: vLLM's own platform (CUDA), VLLM_MOONEP_TEST_DEVICE=cuda ==="
  start=$(date +%s)
  # shellcheck disable=SC2086
  VLLM_MOONEP_TEST_DEVICE=cuda SIG=INT bounded "${TESTS_TIMEOUT:-300}" "$PYTHON" -m pytest ${TESTS:-tests/vllm} -q -rfEs \
    -p no:cacheprovider --timeout="${TEST_TIMEOUT:-240}" --junitxml="$OUT/vllm-tests.xml" 2>&1 | tail -40
  rc=${PIPESTATUS[0]}
  echo "gpu_vllm: tests exit $rc in $(( $(date +%s) - start ))s"
  summary "$OUT/vllm-tests.xml"
  return "$rc"
}

step_experts() {
  local rc r2
  echo "=== our layer vs vLLM's fused_experts, then bench_experts with its column ==="
  VLLM_MOONEP_TEST_COMPARE_JSON="$OUT/experts.json" SIG=INT bounded "${EXPERTS_TIMEOUT:-200}" "$PYTHON" -m pytest \
    tests/gpu/test_vs_vllm_fused_experts.py -q -s -rfEs -p no:cacheprovider 2>&1 | tail -40
  rc=${PIPESTATUS[0]}
  # shellcheck disable=SC2086
  OUT=$OUT bounded "${BENCH_TIMEOUT:-200}" "$PYTHON" -m vllm_moonep.tools.bench_experts \
    ${EXPERTS_BENCH_ARGS:---shapes qwen3-30b-a3b,kimi-k2 --tokens 1,128,4096 --rep 20} 2>&1 | tail -40
  r2=${PIPESTATUS[0]}
  echo "gpu_vllm: experts test exit $rc, bench exit $r2"
  (( rc == 0 )) && rc=$r2
  return "$rc"
}

step_model() {
  echo "=== a Qwen3-30B-A3B-architecture model through vLLM (vllm_moonep.tools.vllm_model_check ${MODEL_ARGS:-}) ==="
  local rc
  # the runs' logs go to one archive: 8 files at most come back from the device
  # shellcheck disable=SC2086
  bounded "${MODEL_TIMEOUT:-520}" "$PYTHON" -m vllm_moonep.tools.vllm_model_check --out "$OUT" --json model.json \
    --logs "$ROOT/model-logs" ${MODEL_ARGS:-} 2>&1 | tail -60
  rc=${PIPESTATUS[0]}
  tar czf "$OUT/model-logs.tar.gz" -C "$ROOT" model-logs 2>/dev/null
  return "$rc"
}

step_serve_ab() {
  echo "=== serving A/B on two GPUs (vllm_moonep.tools.serve_ab ${SERVE_AB_ARGS:-}) ==="
  local rc l
  l=$(left)
  # the tool leaves a configuration that no longer fits its --budget for the next call; bounded's
  # SIGTERM (a configuration that overran) makes it stop its server before it leaves
  # shellcheck disable=SC2086
  bounded "$(( l - 20 ))" "$PYTHON" -m vllm_moonep.tools.serve_ab run --out "$ROOT/serve-ab" \
    --budget "$(( l - 45 ))" ${SERVE_AB_ARGS:-} 2>&1 | tail -150
  rc=${PIPESTATUS[0]}
  cp "$ROOT/serve-ab/summary.md" "$OUT/serve-ab-summary.md" 2>/dev/null
  tar czf "$OUT/serve-ab.tar.gz" -C "$ROOT" serve-ab 2>/dev/null
  if (( rc == 3 )); then echo "gpu_vllm: serve_ab: configurations left for the next call: run the step again"; rc=0; fi
  return "$rc"
}

main() {
  echo "gpu_vllm: $(date -u +%FT%TZ), steps: $*, budget ${BUDGET}s"
  local rc=0 r s
  for s in "$@"; do
    case "$s" in
      stage) stage; r=$?; (( r == 3 )) && r=0;;  # parts still to come is not a failure
      imports|tests|experts|model|serve_ab)
        if [ -z "${VLLM_ENV_SET:-}" ]; then vllm_env || return 2; VLLM_ENV_SET=1; fi
        "step_$s"; r=$?;;
      *) echo "gpu_vllm: unknown step '$s' (stage imports tests experts model serve_ab)"; return 2;;
    esac
    echo "gpu_vllm: step $s exit $r ($(( $(date +%s) - T0 ))s so far)"
    (( rc == 0 )) && rc=$r
  done
  return "$rc"
}

main "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
