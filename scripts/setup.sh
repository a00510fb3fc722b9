#!/usr/bin/env bash
# Sets up the project environment in .venv (idempotent): Python 3.11+, torch, vLLM 0.33,
# this package in editable mode with its test and tool extras (installed by uv, or pip:
# SETUP_INSTALLER). Safe to re-run.
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
# A fresh .venv takes about 10 GiB (vLLM's pinned CUDA build of torch and its libraries). Where the
# disk has less, pip stops half-way with "No space left on device": say so up front, and again after
# pip's own error so that it is the last thing a log's tail shows.
low_space() {  # under 11 GiB free where .venv lives
  [ "$(df -Pk .venv | awk 'NR==2 {print $4}')" -lt $((11 * 1024 * 1024)) ] 2>/dev/null
}
space_note() {
  local free_gib; free_gib=$(df -Pk .venv | awk 'NR==2 {printf "%.1f", $4 / 1048576}')
  echo "setup: $free_gib GiB free on $(df -P .venv | awk 'NR==2 {print $6}') where .venv lives; a fresh" \
       ".venv (torch + vLLM 0.33) takes about 10 GiB: free some space (old clones, pip caches) first" >&2
}
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' \
    && low_space; then
  space_note
fi
# No package cache (uv's or pip's): a fresh clone installs once, and a cached copy of torch would
# cost GBs more.
export PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1
# The installer: uv (installed into .venv by pip, then it installs the rest) downloads and unpacks
# in parallel: about 75 s where pip takes 270 s for the same set on 2 cores. SETUP_INSTALLER=pip
# installs with pip alone; uv reads no pip configuration, so an index that pip is configured with
# (a mirror) takes SETUP_INSTALLER=pip or uv's own UV_DEFAULT_INDEX. Either resolves vLLM 0.33
# with the torch it pins.
installer=${SETUP_INSTALLER:-uv}
case "$installer" in uv|pip) ;; *) echo "setup: SETUP_INSTALLER must be uv or pip, got '$installer'" >&2; exit 2;; esac
if [ "$installer" = uv ] && ! { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q "uv>=0.5,<1"; }; then
  echo "setup: could not install uv into .venv; installing with pip instead" >&2
  installer=pip
fi
echo "setup: installing with $installer (SETUP_INSTALLER=uv|pip)"
# cuda-python>=13: without it uv takes cuda-python 12.6.2.post1 (pip takes 13.4.4), whose files
# overwrite cuda-bindings 13's, and quack-kernels' CUTLASS DSL then fails to import
# ("cuda.bindings.runtime has no attribute cudaLibrary_t"); with it uv resolves what pip does.
# --compile-bytecode: pip writes every module's .pyc at install, uv only when asked. Without them,
# and with PYTHONDONTWRITEBYTECODE set (the 2-core development machine sets it), every process compiles what it imports
# from source: torch's import 4.7 s instead of 2.2, vLLM's 24 s instead of 11, in each of the test
# suite's hundreds of rank and tool processes.
extra=()
if [ "$installer" = uv ]; then
  install=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
  extra=("cuda-python>=13")
else
  .venv/bin/python -m pip install -q --upgrade pip
  install=(.venv/bin/python -m pip install -q)
fi
"${install[@]}" -e ".[vllm,dev]" "${extra[@]}" || { rc=$?; if low_space; then space_note; fi; exit "$rc"; }
# the project's own modules and tests too (the editable install compiles nothing; a .pyc stays valid
# until its source changes)
.venv/bin/python -m compileall -q -j 0 packages common replicated symmetric tools tests || true
# versions from the installed metadata (importing torch and vLLM to print them takes 10-15 s)
versions=$(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "vllm", v("vllm"))' 2>/dev/null || true)
echo "setup: done in $(( $(date +%s) - start ))s with $installer ($versions)"
