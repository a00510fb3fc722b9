#!/bin/bash
# quack-kernels (the optional extra behind impl="quack") on a lent GPU machine that has torch but no
# network: quack's wheel and the CuTe DSL's (nvidia-cutlass-dsl, whose CUDA 13 libraries alone are a
# 92 MB wheel), packed here into two parts that travel in consecutive calls (tools/device_parts.sh).
#
#   here:  bash tools/gpu_quack.sh pack      -> .device/quack/part-{1,2} (the WHEELS below, cp312
#                                               manylinux x86_64, from PyPI; about 100 MB, not recompressed)
#   there: call 1, carry=[".device/quack/part-1"]:  bash tools/gpu_quack.sh stage
#          call 2, carry=[".device/quack/part-2"], the machine still warm (30 s idle):
#                  bash tools/gpu_quack.sh run CMD ...
#          run stages what is carried (kept in /tmp/moonep-qk, which survives between calls on a warm
#          machine), refuses while a part is missing, then runs CMD with quack importable; later calls
#          on the same machine need no carry. It composes with DeepGEMM's staging:
#                  bash tools/gpu_quack.sh run bash tools/gpu_deepgemm.sh run python3 -m vllm_moonep.tools.bench_experts ...
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=.device/quack
ROOT=${QK_STAGE_ROOT:-/tmp/moonep-qk}
# the versions that ran on the lent H100 and H200 (docs/TESTING.md, "What ran on GPUs"); the CuTe DSL's
# libraries for CUDA 13 (the device's torch is cu130)
WHEELS="quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
        torch-c-dlpack-ext==0.1.5 einops==0.8.2 protobuf==7.36.2"
source tools/device_parts.sh

case "${1:-}" in
  pack)
    set -e
    WORK=$(mktemp -d /tmp/prepare_quack.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
    mkdir -p "$WORK/wheels"
    # shellcheck disable=SC2086
    if ! .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WORK/wheels" $WHEELS >"$WORK/pip.log" 2>&1; then
      grep -v "^WARNING: Location" "$WORK/pip.log" >&2
      echo "gpu_quack: a wheel of WHEELS could not be downloaded" >&2; exit 1
    fi
    pack_parts "$WORK" "$DEST" "quack $(echo $WHEELS | tr ' ' ',')" 0
    N=$(manifest_field parts "$DEST/part-1/MANIFEST")
    for k in $(seq 1 "$N"); do
      echo "  call $k: run(carry=[\"$DEST/part-$k\"], command=\"bash tools/gpu_quack.sh $([ "$k" = "$N" ] && echo 'run CMD ...' || echo stage)\")"
    done
    ;;
  stage)
    stage_parts "$DEST" "$ROOT"; r=$?
    (( r == 3 )) && r=0  # parts still to come is not a failure
    exit $r
    ;;
  run)
    shift
    stage_parts "$DEST" "$ROOT" || { echo "gpu_quack: quack is not staged here (see above); CMD not run" >&2; exit 2; }
    source tools/gpu_env.sh
    # a --target install writes no .pth that Python reads: the CuTe DSL's packages go on the path by hand
    export PYTHONPATH=$ROOT/site:$ROOT/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    echo "quack: $(python3 -c 'import importlib.metadata as m, quack; print(m.version("quack-kernels"), quack.__file__)' 2>&1 | tail -1)"
    "$@"
    ;;
  *)
    echo "usage: bash tools/gpu_quack.sh pack | stage | run CMD ..." >&2; exit 2 ;;
esac
