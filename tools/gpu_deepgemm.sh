#!/bin/bash
# DeepGEMM (the copy vLLM 0.33 bundles, vllm/third_party/deep_gemm) on a lent GPU machine that has
# torch and the CUDA toolkit but no vLLM: carried alone (about 6 MB), importable as `deep_gemm`,
# which is the second place impl="deepgemm" looks (deepgemm_impl.DEEPGEMM_MODULES).
#
#   here:  bash tools/gpu_deepgemm.sh pack          -> .device/deepgemm/deep_gemm.tar.xz (from .venv's vLLM)
#   there: carry=[".device/deepgemm"]
#          bash tools/gpu_deepgemm.sh run CMD ...   unpack into /tmp/moonep-dg once (kept while the
#                                                   machine stays warm), then CMD with deep_gemm on
#                                                   PYTHONPATH and DeepGEMM's JIT pointed at the toolkit
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHIVE=.device/deepgemm/deep_gemm.tar.xz
ROOT=${DG_STAGE_ROOT:-/tmp/moonep-dg}
case "${1:-}" in
  pack)
    src=$(.venv/bin/python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('vllm').origin))")/third_party
    mkdir -p "$(dirname "$ARCHIVE")"
    tar -C "$src" -cJf "$ARCHIVE" --exclude=__pycache__ deep_gemm
    ls -la "$ARCHIVE"
    ;;
  run)
    shift
    if [ ! -d "$ROOT/deep_gemm" ]; then
      [ -f "$ARCHIVE" ] || { echo "gpu_deepgemm.sh: $ARCHIVE not carried and $ROOT empty" >&2; exit 2; }
      mkdir -p "$ROOT" && tar -C "$ROOT" -xJf "$ARCHIVE"
    fi
    source tools/gpu_env.sh
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    if [ -z "${CUDA_HOME:-}" ]; then
      CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
      export CUDA_HOME
    fi
    echo "deep_gemm: $(python3 -c 'import deep_gemm as d; print(d.__version__, d.__file__)' 2>&1 | tail -1); CUDA_HOME=$CUDA_HOME; nvcc $(nvcc --version 2>/dev/null | tail -1)"
    "$@"
    ;;
  *)
    echo "usage: bash tools/gpu_deepgemm.sh pack | run CMD ..." >&2; exit 2 ;;
esac
