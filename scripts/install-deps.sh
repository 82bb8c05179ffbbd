#!/usr/bin/env bash
# Installs what attnforge needs to build and test, from Debian's packages; quick when all are present.
# The CUDA toolkit (nvcc) is optional and not installed here: where CMake finds it (on PATH, CUDACXX, or
# /usr/local/cuda/bin/nvcc) it also builds libattnforge_cuda.so; the CUDA tests run on the CPU emulation either way.
set -euo pipefail
packages=(build-essential cmake pkg-config libjansson-dev libcmocka-dev clang libclang-rt-14-dev valgrind)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# With nvcc present, the compile checks read the SASS of libattnforge_cuda.so (tensor-core instructions): the toolkit
# here lacks cuobjdump/nvdisasm, so they come from PyPI's NVIDIA wheels into their own venv.
tools=/opt/attnforge-cuda-tools
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && ! command -v cuobjdump >/dev/null &&
   [ ! -x /usr/local/cuda/bin/cuobjdump ] && ! ls "$tools"/lib/python3*/site-packages/nvidia/cu*/bin/nvdisasm >/dev/null 2>&1; then
  echo "install-deps: cuobjdump and nvdisasm from PyPI into $tools"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO python3 -m venv "$tools" && $SUDO "$tools/bin/pip" install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    echo "install-deps: no cuobjdump (the compile check will skip its SASS part)"
fi
