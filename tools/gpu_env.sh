# Sourced by the GPU scripts: multicast off, and the package importable on a machine that has
# torch but cannot install anything (an editable install without deps, else a link tree).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -m pip install --no-deps --no-build-isolation --no-index -e . -q >"$OUT/pip.log" 2>&1; then
  mkdir -p /tmp/pp/vllm_moonep && cp -r packages/vllm_moonep/. /tmp/pp/vllm_moonep/
  for p in engine:packages/engine common:common replicated:replicated symmetric:symmetric tools:tools vllm_plugin:packages/vllm_plugin; do
    ln -sfn "$PWD/${p#*:}" "/tmp/pp/vllm_moonep/${p%%:*}"
  done
  export PYTHONPATH=/tmp/pp
fi
