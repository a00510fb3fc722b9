#!/usr/bin/env bash
# Sets up the project environment in .venv (idempotent): Python 3.11+, torch, vLLM 0.33,
# this package in editable mode with its test and tool extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then PY=$cand; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: need Python >= 3.11" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
start=$(date +%s)
.venv/bin/python -m pip install -q --upgrade pip
# vLLM 0.33 pins its torch; pip resolves both together.
.venv/bin/python -m pip install -q -e ".[vllm,dev]"
echo "setup: done in $(( $(date +%s) - start ))s ($(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null | tail -1))"
