#!/bin/bash
# The engine's dispatch and combine against other versions of its code in one device call: each variant's
# packages/vllm_moonep/engine (the working tree's, named "tree", and git revisions packed here) timed by
# bench_dispatch in interleaved rounds (round i starts at variant i, so no variant always runs first), then
# dispatch_ab's medians per point and each variant's ratio to the first. What a transport-kernel change is
# measured by: the same GPU, the same call, the plain all-to-all of each run as the anchor.
#
#   here:  bash tools/gpu_engine_ab.sh pack NAME=REV ...      -> .device/engine_ab/NAME (git archive of REV's
#                                                                engine folder; carry .device/engine_ab)
#   there: bash tools/gpu_engine_ab.sh run [BENCH_DISPATCH_ARGS ...]
#            ROUNDS=3          rounds (each variant once per round)
#            VARIANTS="..."    order of the variants, the first the anchor (default: every folder in .device/engine_ab
#                              by name, then tree: name them where older packs lie there too)
#            BENCH_TIMEOUT=300 seconds per bench_dispatch run (the first compiles and captures)
#            default args: --device cuda --ranks 1 --preset kimi-k2 --tokens 1 128 4096 --maxvio 0 --iters 50
#                              (world size 1: the kernels and signals, no traffic between GPUs; pass --ranks 2 on two)
#          files in $OUT: bd_<variant>_<round>.json, dispatch_ab.json; the working tree's engine is put back on exit
set -euo pipefail
cd "$(dirname "$0")/.."
STORE=.device/engine_ab
ENGINE=packages/vllm_moonep/engine
case "${1:-}" in
  pack)
    shift
    [ $# -gt 0 ] || { echo "gpu_engine_ab.sh pack: name at least one NAME=REV" >&2; exit 2; }
    for spec in "$@"; do
      name=${spec%%=*}; rev=${spec#*=}
      if [ -z "$name" ] || [ "$name" = "$spec" ] || [ "$name" = tree ] || [[ ! "$name" =~ ^[A-Za-z0-9_-]+$ ]]; then
        echo "gpu_engine_ab.sh pack: give NAME=REV with NAME of letters, digits, _ or - and not 'tree', got '$spec'" >&2
        exit 2
      fi
      git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || { echo "gpu_engine_ab.sh pack: no commit '$rev'" >&2; exit 2; }
      rm -rf "${STORE:?}/$name" && mkdir -p "$STORE/$name"
      git archive "$rev" "$ENGINE" | tar -x -C "$STORE/$name"
      echo "$name = $(git rev-parse --short "$rev"): $(du -sh "$STORE/$name" | cut -f1)"
    done
    ;;
  run)
    shift
    [ -d "$STORE" ] || { echo "gpu_engine_ab.sh run: $STORE not carried (pack variants here first)" >&2; exit 2; }
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    ROUNDS=${ROUNDS:-3}
    read -r -a variants <<< "${VARIANTS:-$(ls "$STORE" | tr '\n' ' ') tree}"
    [ ${#variants[@]} -ge 2 ] || { echo "gpu_engine_ab.sh run: name two variants or more (VARIANTS='${VARIANTS:-}')" >&2; exit 2; }
    for v in "${variants[@]}"; do
      [ "$v" = tree ] || [ -d "$STORE/$v/$ENGINE" ] || { echo "gpu_engine_ab.sh run: no variant '$v' in $STORE" >&2; exit 2; }
    done
    args=("$@")
    [ ${#args[@]} -gt 0 ] || args=(--device cuda --ranks 1 --preset kimi-k2 --tokens 1 128 4096 --maxvio 0 --iters 50)
    source tools/gpu_env.sh > /dev/null
    keep=$(mktemp -d); cp -r "$ENGINE" "$keep/engine"
    trap 'rm -rf "$ENGINE" && cp -r "$keep/engine" "$ENGINE" && rm -rf "$keep"' EXIT
    use() {
      local src="$keep/engine"
      [ "$1" = tree ] || src="$STORE/$1/$ENGINE"
      [ -d "$src" ] || { echo "gpu_engine_ab.sh run: no variant '$1' in $STORE" >&2; exit 2; }
      rm -rf "$ENGINE" && cp -r "$src" "$ENGINE"
    }
    specs=()
    n=${#variants[@]}
    for i in $(seq 1 "$ROUNDS"); do
      for j in $(seq 0 $((n - 1))); do
        v=${variants[$(((i - 1 + j) % n))]}
        use "$v"
        if timeout "${BENCH_TIMEOUT:-300}" python3 -m vllm_moonep.tools.bench_dispatch "${args[@]}" --json "$OUT/bd_${v}_$i.json" \
            > "$OUT/bd_${v}_$i.log" 2>&1; then
          specs+=("$v:$OUT/bd_${v}_$i.json")
          echo "== $v round $i $(date +%T)"
        else
          echo "== $v round $i failed (rc $?): tail of $OUT/bd_${v}_$i.log"; tail -5 "$OUT/bd_${v}_$i.log"
        fi
      done
    done
    anchor=${variants[0]}
    ordered=()
    for v in "${variants[@]}"; do for s in "${specs[@]}"; do [ "${s%%:*}" = "$v" ] && ordered+=("$s"); done; done
    if [ ${#ordered[@]} -eq 0 ] || [ "${ordered[0]%%:*}" != "$anchor" ]; then
      echo "gpu_engine_ab.sh run: no run of the anchor variant '$anchor' completed" >&2; exit 1
    fi
    OUT=$OUT python3 -m vllm_moonep.tools.dispatch_ab "${ordered[@]}"
    ;;
  *)
    echo "usage: bash tools/gpu_engine_ab.sh pack NAME=REV ... | run [BENCH_DISPATCH_ARGS ...]" >&2; exit 2 ;;
esac
