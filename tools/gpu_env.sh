# Sourced by the GPU scripts: multicast off, the package importable on a machine that has torch
# but cannot install anything (an editable install without deps, else the source roots on PYTHONPATH), and
# nvshmem4py from a carried wheel when there is one (.whl/*.whl at the repository root, e.g.
# nvshmem4py-cu13==0.4.1's cp312 wheel; installed with --no-index --no-deps --target /tmp/site,
# which goes on PYTHONPATH since .pth files there are not read). Logs: $OUT/setup.log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# a script run by another that sourced this already (gpu_deepgemm.sh run bash tools/gpu_suite.sh) inherits
# what it exported: install nothing twice
if [ -n "${MOONEP_GPU_ENV:-}" ]; then
  echo "gpu_env: set up by the calling script (nvshmem4py: ${NVSHMEM_STATUS:-unknown})"
  return 0
fi
if ! python3 -m pip install --no-deps --no-build-isolation --no-index -e . -q >"$OUT/setup.log" 2>&1; then
  # each top-level folder is a source root of the vllm_moonep namespace (pyproject.toml)
  export PYTHONPATH=$PWD/packages:$PWD/common:$PWD/replicated:$PWD/symmetric:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl -q >>"$OUT/setup.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "wheels: installed $(cd .whl && ls *.whl | tr '\n' ' ')into /tmp/site (on PYTHONPATH)"
  else
    echo "wheels: installing .whl/*.whl FAILED (see setup.log); the NVSHMEM tests will skip"
  fi
else
  echo "wheels: no .whl/ folder: nvshmem4py is not installed here and the NVSHMEM tests will skip" \
       "(carry nvshmem4py-cu13==0.4.1's cp312 wheel in .whl/ to run them)"
fi
NVSHMEM_STATUS=$(python3 -c "from vllm_moonep.engine.heaps.nvshmem_heap import nvshmem_status as s; c, why = s(); print('imports' if c else why)" 2>&1 | tail -1)
echo "nvshmem4py: $NVSHMEM_STATUS"
export NVSHMEM_STATUS
export MOONEP_GPU_ENV=1
