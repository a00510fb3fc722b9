#!/usr/bin/env bash
# The type check (docs/TESTING.md, "Type checking"); scripts/test.sh runs it after setup, before
# pytest. mypy with pyproject.toml's [tool.mypy]: the five source roots of the vllm_moonep
# namespace, strict on the engine's and the layouts' public API, the basic level elsewhere. Any
# error fails it. Extra arguments go to mypy (e.g. a path to check one file);
# TYPECHECK_PYTHON picks the interpreter (default: .venv/bin/python, which has mypy from the
# dev extra).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${TYPECHECK_PYTHON:-.venv/bin/python}
start=$(date +%s)
"$PY" -m mypy "$@"
echo "typecheck: mypy $("$PY" -m mypy --version | awk '{print $2}') passed in $(( $(date +%s) - start ))s"
