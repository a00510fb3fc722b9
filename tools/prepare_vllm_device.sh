#!/bin/bash
# Builds .device/vllm/ (git-ignored): everything vLLM 0.33 needs on a lent GPU machine that has
# torch but no vLLM and no network, packed into parts that each travel in one device call.
# Run here, where PyPI is reachable and `bash scripts/setup.sh` installed vLLM into .venv.
#
# The bundle (one tar, xz -9e) holds:
#   src/       the installed vllm package's Python (.py, .json, .jinja, py.typed; no tests) and its
#              dist-info (version and entry points: platform detection and plugin loading read them),
#              plus its compiled extensions that the CUDA path loads: _C_stable_libtorch (92 MB) and
#              _moe_C_stable_libtorch (45 MB), both built on PyTorch's stable C ABI so they load on
#              the device's torch 2.11 although vLLM pins 2.14, and the small cumem_allocator,
#              fs_io_C and spinloop (no PyTorch symbols). Not FlashAttention (_vllm_fa2_C 308 MB,
#              _vllm_fa3_C 172 MB): the runs use vLLM's Triton attention backend.
#   wheels/    cp312 manylinux x86_64 wheels of what vLLM's import closure, its engine core and its
#              OpenAI server need and the device image lacks (versions as in .venv; WHEELS below)
# then split into parts of PART_MIB (default: tools/device_parts.sh's) MiB, one folder each:
# .device/vllm/part-<k>/ holds bundle.<k> and MANIFEST (the bundle's and every part's sha256, the part
# count). A call carries one folder (run's carry=[".device/vllm/part-<k>"]); `bash tools/gpu_vllm.sh stage` there keeps the
# part in the machine's /tmp, and once every part is there joins, checks and unpacks them, so the
# parts travel in consecutive calls while the machine stays warm (30 s idle). A part plus the
# working tree must stay under one call's 64 MiB: the script says if it does not.
#
# Usage (repo root): bash tools/prepare_vllm_device.sh        (about 3 minutes on 2 cores)
#   PART_MIB     part size in MiB (default: DEFAULT_PART_MIB in tools/device_parts.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DEST=.device/vllm
# name as pip knows it; the import that needs each is in docs/TESTING.md ("vLLM on the GPU machine")
WHEELS="pyzmq pydantic pydantic_core annotated-types typing-inspection typing_extensions cbor2 oss-harmony openai
        httpx2 sniffio msgspec pybase64 cachetools xgrammar apache-tvm-ffi fastapi starlette partial-json-parser
        llguidance compressed-tensors loguru uvicorn prometheus-fastapi-instrumentator annotated-doc orjson
        blake3 lm-format-enforcer outlines_core python-json-logger setproctitle watchfiles
        model-hosting-container-standards jmespath supervisor"
# the compiled extensions the CUDA path needs (the rest of vllm/*.so is for other kernels)
SOS="_C_stable_libtorch.abi3.so _moe_C_stable_libtorch.abi3.so cumem_allocator.abi3.so fs_io_C.abi3.so spinloop.abi3.so"

SITE=$($PY -c "import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
VER=$($PY -c "import vllm; print(vllm.__version__)")
WORK=$(mktemp -d /tmp/prepare_vllm.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/src" "$WORK/wheels"
echo "prepare: vLLM $VER from $SITE"
(cd "$SITE" && find vllm -type f \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name 'py.typed' \) \
   -not -path '*/__pycache__/*' | sort >"$WORK/files")
(cd "$SITE" && tar cf - -T "$WORK/files" "vllm-$VER.dist-info" $(printf 'vllm/%s ' $SOS)) | tar xf - -C "$WORK/src"
for p in $WHEELS; do
  v=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null) \
    || { echo "prepare: $p is not installed in .venv (vLLM $VER no longer needs it? drop it from WHEELS)" >&2; exit 1; }
  if ! $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_35_x86_64 -d "$WORK/wheels" "$p==$v" >"$WORK/pip.log" 2>&1; then
    grep -v "^WARNING: Location" "$WORK/pip.log" >&2
    echo "prepare: no cp312 manylinux x86_64 wheel of $p==$v" >&2; exit 1
  fi
done
echo "prepare: $(find "$WORK/src/vllm" -name '*.py' | wc -l) .py files, $(ls "$WORK/wheels" | wc -l) wheels," \
     "extensions $(cd "$WORK/src/vllm" && du -ch $SOS | tail -1 | cut -f1)"
echo "prepare: compressing (xz -9e)..."
source tools/device_parts.sh
pack_parts "$WORK" "$DEST" "vllm $VER"
N=$(manifest_field parts "$DEST/part-1/MANIFEST")
for k in $(seq 1 "$N"); do echo "  call $k: run(carry=[\"$DEST/part-$k\"], command=\"bash tools/gpu_vllm.sh stage ...\")"; done
