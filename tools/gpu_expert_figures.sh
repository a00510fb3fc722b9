#!/bin/bash
# The expert-compute tables of docs/PERFORMANCE.md in one device call (about 5 minutes on a warm H100,
# inside one call's 600 s): DeepGEMM's halves against the Triton kernels in Williams-ordered rounds
# (bench_levers --lever deepgemm_half, what decides a GPU's `auto` regimes at 1024-4096 tokens), then the whole
# table (bench_experts, every column against its floor) RUNS times and their medians (bench_median, with the
# pooled ratios). Each tool measures its own anchors in the same run.
#
# Here:  bash tools/gpu_deepgemm.sh pack                      (-> .device/deepgemm, to carry)
# There: bash tools/gpu_expert_figures.sh                     (carry: .device/deepgemm)
#   RUNS=2           bench_experts runs (0: none)
#   LEVER_ROUNDS=8   rounds of the lever call (0: no lever call)
# Files in $OUT: lever.log and lever/bench_levers.json; be<i>.log and be<i>/bench_experts.json; bench_median.json.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=${RUNS:-2}
LEVER_ROUNDS=${LEVER_ROUNDS:-8}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "$LEVER_ROUNDS" -gt 0 ]; then
  mkdir -p "$OUT/lever"
  OUT=$OUT/lever timeout 200 bash tools/gpu_deepgemm.sh run python3 -m vllm_moonep.tools.bench_levers \
    --lever deepgemm_half --shapes kimi-k2,qwen3-30b-a3b --tokens 1024,4096 --rep 20 --rounds "$LEVER_ROUNDS" \
    >"$OUT/lever.log" 2>&1
  echo "bench_levers rc=$? $(date +%T)"
  grep "^| \|^# Ceilings" "$OUT/lever.log" | tail -8
fi
runs=()
for i in $(seq 1 "$RUNS"); do
  mkdir -p "$OUT/be$i"
  OUT=$OUT/be$i timeout 220 bash tools/gpu_deepgemm.sh run python3 -m vllm_moonep.tools.bench_experts --rep 30 \
    --no-vllm >"$OUT/be$i.log" 2>&1
  echo "bench_experts run $i rc=$? $(date +%T)"
  [ -f "$OUT/be$i/bench_experts.json" ] && runs+=("$OUT/be$i/bench_experts.json")
done
if [ "${#runs[@]}" -gt 0 ]; then
  source tools/gpu_env.sh >/dev/null
  python3 -m vllm_moonep.tools.bench_median "${runs[@]}"
fi
