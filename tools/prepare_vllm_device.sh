#!/bin/bash
# Builds .device/vllm/ (git-ignored) for tools/gpu_vllm.sh, on this machine (PyPI reachable, vLLM
# 0.33 installed in .venv): vllm-py.tar.gz = the installed vllm package's Python (.py, .json,
# .jinja, py.typed; no compiled extensions) with its dist-info, and wheels/ = cp312 manylinux
# x86_64 wheels of what the imports of vLLM's config, engine args, fused-MoE layer and modular
# kernel need and the GPU image lacks (versions as in .venv; the list and the import that needs
# each: .device/vllm/README.txt after a run, and docs/TESTING.md). About 29 MB; carry it with
# run(carry=[".device/vllm", ".whl"]).
# Usage (repo root): bash tools/prepare_vllm_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device/vllm
SITE=$(.venv/bin/python -c "import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
VER=$(.venv/bin/python -c "import vllm; print(vllm.__version__)")
mkdir -p "$DEST/wheels"
tar czf "$DEST/vllm-py.tar.gz" -C "$SITE" --exclude='__pycache__' --exclude='*.so' --exclude='*.cu' --exclude='*.cuh' \
  --exclude='*.cpp' --exclude='*.h' --exclude='vllm-rs' \
  $(cd "$SITE" && find vllm -type f \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name 'py.typed' \) | sort) \
  "vllm-$VER.dist-info"
# name==version as installed in .venv (one version of each)
PKGS="pyzmq pydantic pydantic_core annotated-types typing-inspection typing_extensions cbor2 oss-harmony openai
      httpx2 sniffio msgspec pybase64 cachetools xgrammar apache-tvm-ffi fastapi starlette partial-json-parser llguidance"
for p in $PKGS; do
  v=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null) || { echo "prepare: $p is not installed in .venv" >&2; exit 1; }
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d "$DEST/wheels" "$p==$v"
done
du -sh "$DEST"
