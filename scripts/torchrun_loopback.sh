#!/usr/bin/env bash
# Two torchrun agents on this machine's loopback, one process each (--nnodes 2): the same
# distributed tests, now on the launched process group instead of spawned ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
tests=(tests/distributed/test_multinode.py tests/distributed/test_engine.py tests/distributed/test_moe_step.py)
pids=()
logs=()
for node in 0 1; do
  log=$(mktemp)
  logs+=("$log")
  VLLM_MOONEP_NNODES=2 .venv/bin/torchrun --nnodes=2 --nproc-per-node=1 --node-rank=$node \
    --master-addr=127.0.0.1 --master-port="$port" \
    -m pytest -q -p no:cacheprovider "${tests[@]}" >"$log" 2>&1 &
  pids+=($!)
done
rc=0
for i in 0 1; do
  if ! wait "${pids[$i]}"; then rc=1; fi
  echo "--- torchrun node $i ---"
  tail -n 5 "${logs[$i]}"
  [ $rc -eq 0 ] || { echo "--- full log of node $i ---"; cat "${logs[$i]}"; }
done
# both agents must have really run tests (not only skipped them)
for log in "${logs[@]}"; do
  grep -Eq '[0-9]+ passed' "$log" || { echo "torchrun: a node ran no test"; rc=1; }
done
rm -f "${logs[@]}"
exit $rc
