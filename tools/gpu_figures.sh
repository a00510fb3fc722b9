#!/bin/bash
# The GPU figures of docs/PERFORMANCE.md in one run, each next to the anchor measured in the same
# run (bench_dispatch: NCCL all_to_all_single and one-sided copies of the same payload; moonep-ab:
# matmul, copy and all_to_all of the step's payload). Needs 1 or 2+ CUDA GPUs and torch; nothing is
# downloaded.
#
# Usage (repo root): bash tools/gpu_figures.sh
#   FIGS="dispatch planner ab"   which parts (default: all three; "abgraphs": moonep-ab --graphs, each
#                                  step one CUDA-graph replay of every layer, as vLLM runs a captured step;
#                                  "profile": bench_dispatch --profile, kernel and host-launch tables)
#   AB_PRESETS, AB_TOKENS          moonep-ab presets (default qwen3-30b-a3b kimi-k2) and tokens/rank
#                                  (default 1 128 4096)
# Files in $OUT: figures.log (every table), bench_dispatch_graphs<0|1>_fast<0|1>.json, ab.tgz (each moonep-ab run's JSON
# and plots, ab-<preset>-r<ranks>/).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tools/gpu_env.sh >/tmp/gpu_env.out 2>&1
cat /tmp/gpu_env.out
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
RANKS=1; [ "$NGPU" -ge 2 ] && RANKS=2
LOG="$OUT/figures.log"; : >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }
run() { say "\$ $*"; local t0=$(date +%s); "$@" 2>&1 | grep -v "it/s\|point/s" | tee -a "$LOG"; say "(${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
for part in ${FIGS:-dispatch planner ab}; do
  case $part in
    dispatch)
      # the engine's transport against NCCL and one-sided copies; eager calls through private graphs
      # (engine/transports/eager_graphs.py), then launching each kernel on both launch paths (engine/launch.py)
      for mode in "1 1" "0 1" "0 0"; do
        set -- $mode
        say "=== bench_dispatch, VLLM_MOONEP_EAGER_GRAPHS=$1 VLLM_MOONEP_FAST_LAUNCH=$2 ==="
        VLLM_MOONEP_EAGER_GRAPHS=$1 VLLM_MOONEP_FAST_LAUNCH=$2 run timeout 240 python3 -m vllm_moonep.tools.bench_dispatch \
          --device cuda --ranks "$RANKS" --preset kimi-k2 --tokens 1 128 1024 4096 --maxvio 0 2 --iters 30 --warmup 5 \
          --json "$OUT/bench_dispatch_graphs$1_fast$2.json"
      done;;
    profile)
      # where eager dispatch + combine spend host and device time (kernel table, host us per launch)
      for g in 0 1; do
        say "=== bench_dispatch --profile, VLLM_MOONEP_EAGER_GRAPHS=$g ==="
        VLLM_MOONEP_EAGER_GRAPHS=$g run timeout 150 python3 -m vllm_moonep.tools.bench_dispatch --device cuda \
          --ranks "$RANKS" --preset kimi-k2 --tokens 1 128 1024 --maxvio 0 --iters 10 --warmup 3 --profile
      done;;
    planner)
      for fast in 1 0; do
        say "=== bench_planner, VLLM_MOONEP_FAST_LAUNCH=$fast ==="
        VLLM_MOONEP_FAST_LAUNCH=$fast run timeout 120 python3 -m vllm_moonep.tools.bench_planner --device cuda \
          --ranks 8 --experts 384 --tokens 1 128 1024 8192 --maxvio 0 2 --iters 100
      done
      # rule 4 both ways where the planner sorts (E/R = 192, Kimi-K2 on 2 ranks) and where it compares pairwise (E/R = 48)
      for r in 2 8; do
        for way in sort pairwise; do
          say "=== bench_planner, R=$r, E=384, --rule4 $way ==="
          run timeout 60 python3 -m vllm_moonep.tools.bench_planner --device cuda --ranks "$r" --experts 384 \
            --tokens 1 128 --maxvio 0 2 --iters 100 --rule4 "$way"
        done
      done;;
    ab)
      for preset in ${AB_PRESETS:-qwen3-30b-a3b kimi-k2}; do
        for r in $(seq "$RANKS" -1 1); do
          say "=== moonep-ab $preset, $r rank(s), one GPU each ==="
          run timeout 300 python3 -m vllm_moonep.tools.ab --device cuda --ranks "$r" --preset "$preset" \
            --tokens ${AB_TOKENS:-1 128 4096} --maxvio 0 2 --steps 8 --warmup 2 \
            --configs replicated symmetric symmetric-shared --out "/tmp/ab/ab-$preset-r$r"
          tar czf "$OUT/ab.tgz" -C /tmp ab 2>/dev/null  # after each run: a later time-out keeps these
        done
      done;;
    abgraphs)
      for preset in ${AB_PRESETS:-qwen3-30b-a3b kimi-k2}; do
        for r in $(seq "$RANKS" -1 1); do
          say "=== moonep-ab --graphs $preset, $r rank(s), one GPU each ==="
          run timeout 300 python3 -m vllm_moonep.tools.ab --device cuda --ranks "$r" --preset "$preset" --graphs \
            --tokens ${AB_TOKENS:-1 128 4096} --maxvio 0 2 --steps 8 --warmup 2 \
            --configs replicated symmetric --out "/tmp/ab/abg-$preset-r$r"
          tar czf "$OUT/ab.tgz" -C /tmp ab 2>/dev/null
        done
      done;;
    *) say "gpu_figures: unknown part $part (dispatch, profile, planner, ab, abgraphs)";;
  esac
done
