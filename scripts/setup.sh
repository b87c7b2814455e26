#!/usr/bin/env bash
# Create the virtual environment and install pa_tile with its notebook and test tools
# (`pip install -e .[notebooks,test]`). On a machine without ROCm this also installs a CPU-only
# torch and the CPU toolchain FlyDSL compiles with (a linker and the AMD device bitcode; see
# pa_tile/toolchain.py).
#
#   PYTHON               the interpreter to create the venv with (default python3)
#   PA_TILE_TORCH_SPEC   the torch to install instead of the CPU build (e.g. a ROCm build)
#   PA_TILE_TORCH_INDEX  an extra package index to find it in (e.g. PyTorch's CPU or ROCm index)
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0

have_rocm() { [ -x "${ROCM_PATH:-/opt/rocm}/llvm/bin/ld.lld" ]; }

if ! have_rocm; then
  # Debian/Ubuntu as root: lld and rocm-device-libs are ordinary packages.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    if ! { ls /usr/lib/llvm-*/bin/ld.lld >/dev/null 2>&1 && ls /usr/lib/*/amdgcn/bitcode/ockl.bc >/dev/null 2>&1; }; then
      echo "[setup] installing the CPU toolchain: lld-19 rocm-device-libs"
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lld-19 rocm-device-libs gcc >/dev/null
    fi
  else
    NEED_PIP_TOOLCHAIN=1  # no apt: ziglang's ld.lld and triton's bitcode, from PyPI below
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
INDEX=()
if [ -n "${PA_TILE_TORCH_INDEX:-}" ]; then INDEX=(--extra-index-url "$PA_TILE_TORCH_INDEX"); fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${PA_TILE_TORCH_SPEC:-}" ]; then
    echo "[setup] installing ${PA_TILE_TORCH_SPEC}"
    $PIP install -q ${INDEX[@]+"${INDEX[@]}"} "$PA_TILE_TORCH_SPEC"
  # A CPU build, deliberately: the "+cpu" wheel is found where pip's configuration or
  # PA_TILE_TORCH_INDEX offers PyTorch's CPU wheels. PyPI alone has none for Linux x86_64:
  # there its torch wheel is a CUDA build (~3 GB with the nvidia packages), which also runs
  # on a CPU, so it is the fallback, with a warning.
  elif $PIP install -q ${INDEX[@]+"${INDEX[@]}"} "torch==${TORCH_VERSION}+cpu" 2>/dev/null; then
    echo "[setup] installed torch ${TORCH_VERSION}+cpu (CPU only)"
  else
    echo "[setup] torch ${TORCH_VERSION}+cpu is not on the configured indexes; installing PyPI's torch==${TORCH_VERSION}" \
         "(on Linux x86_64 a CUDA build of ~3 GB; set PA_TILE_TORCH_INDEX to PyTorch's CPU index to avoid it)"
    $PIP install -q "torch==${TORCH_VERSION}"
  fi
fi
EXTRAS="notebooks,test"
if [ "${NEED_PIP_TOOLCHAIN:-0}" = 1 ]; then EXTRAS="$EXTRAS,cpu-toolchain"; fi
echo "[setup] installing pa_tile with its extras: $EXTRAS"
$PIP install -q -e ".[$EXTRAS]"
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
"$VENV/bin/python" -c "from pa_tile.toolchain import describe_toolchain as d; print('[setup] toolchain:', d())"
