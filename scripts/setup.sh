#!/usr/bin/env bash
# Create the virtual environment and install pa_tile with everything it needs.
# On a machine without ROCm this also installs the CPU toolchain FlyDSL compiles with
# (a linker and the AMD device bitcode; see pa_tile/toolchain.py).
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"

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
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # On a ROCm machine install a ROCm build of torch first (see README); this pin is the CPU default.
  echo "[setup] installing torch ${PA_TILE_TORCH_SPEC:-torch==2.13.0}"
  $PIP install -q "${PA_TILE_TORCH_SPEC:-torch==2.13.0}"
fi
echo "[setup] installing pa_tile and its dependencies"
$PIP install -q -e . 
if [ "${NEED_PIP_TOOLCHAIN:-0}" = 1 ]; then
  $PIP install -q ziglang triton
fi
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
"$VENV/bin/python" -c "from pa_tile.toolchain import describe_toolchain as d; print('[setup] toolchain:', d())"
