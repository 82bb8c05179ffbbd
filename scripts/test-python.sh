#!/usr/bin/env bash
# The Python tests (run by `make test`): a virtual environment that reuses what the machine already has
# (torch among it), torch/numpy/pytest/scikit-build-core/transformers from PyPI where missing, `pip install ./` (the
# extension built from the same C sources by CMake), then pytest python/tests.
# Usage: scripts/test-python.sh [PATH/TO/attnforge-command]   (for the plan round trips with the C command)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=${PYTHON:-python3}
venv=${AF_PYTHON_VENV:-build-python/venv}
cli=${1:-${ATTNFORGE_CLI:-}}

# Debian's python3 needs python3-dev (Python.h for the extension) and python3-venv (ensurepip).
if ! "$python" - <<'PY' 2>/dev/null
import ensurepip, os, sysconfig
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PY
then
  echo "test-python: installing python3-dev python3-venv"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-dev python3-venv python3-pip
fi

# --system-site-packages: a torch already installed on the machine is used as it is (it is large).
py="$venv/bin/python"
made_here="$venv/.made-by-attnforge-test-python"   # only a venv this script made is ever removed
venv_with_basics() {
  [ -x "$py" ] || { "$python" -m venv --system-site-packages "$venv" && touch "$made_here"; }
  "$py" -m pip install -q --disable-pip-version-check numpy pytest "scikit-build-core>=0.10"
}
venv_with_basics

# torch from PyPI is the CUDA build on Linux x86-64: torch, triton and the nvidia-* wheels take 5.3 GB installed.
# One pip call holds every wheel and its unpacked files at once: 8.1 GB at the peak, 1m46s (measured). With less
# disk free, torch's dependencies first and torch second, each pinned by pip's own resolution: 6.4 GB at the peak,
# 2m16s (the resolution is a pip call of its own). A machine with less than that runs the NumPy tier only, and a
# torch that did not install whole is removed with its venv, so that the torch tests skip instead of failing to
# import it.
torch_one_call_mb=9000
torch_disk_mb=${ATTNFORGE_TORCH_DISK_MB:-7000}
torch_missing() {
  if [ "${ATTNFORGE_REQUIRE_TORCH:-0}" = 1 ]; then
    echo "test-python: torch is required (ATTNFORGE_REQUIRE_TORCH=1) but $1" >&2; exit 1
  fi
  echo "test-python: WARNING: $1; only the NumPy tier runs (the torch tests skip)" >&2
}
install_torch() {   # $1: MB free
  local plan="$venv/torch-install-plan.json" pins pin torch_pin="" deps=()
  local pip=("$py" -m pip install -q --disable-pip-version-check --no-cache-dir)
  if [ "$1" -ge "$torch_one_call_mb" ]; then "${pip[@]}" torch && "$py" -c "import torch"; return; fi
  echo "test-python: under ${torch_one_call_mb} MB free: torch's dependencies first, then torch"
  "${pip[@]}" --dry-run --report "$plan" torch || return 1
  pins=$("$py" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$plan") || return 1
  while read -r pin; do
    if [[ $pin == torch==* ]]; then torch_pin=$pin; elif [ -n "$pin" ]; then deps+=("$pin"); fi
  done <<<"$pins"
  [ -n "$torch_pin" ] || return 1
  if [ "${#deps[@]}" -gt 0 ]; then "${pip[@]}" --no-deps "${deps[@]}" || return 1; fi
  "${pip[@]}" --no-deps "$torch_pin" && "$py" -c "import torch"
}
if ! "$py" -c "import torch" 2>/dev/null; then
  free_mb=$(df -Pm "$venv" | awk 'NR == 2 {print $4}')
  if [ "$free_mb" -lt "$torch_disk_mb" ]; then
    torch_missing "torch was not installed: ${free_mb} MB free beside $venv, and it needs ${torch_disk_mb} MB"
  else
    echo "test-python: installing torch from PyPI (measured 1m46s on a 2-core machine; ${free_mb} MB free)"
    start=$(date +%s)
    if install_torch "$free_mb"; then
      echo "test-python: torch installed in $(( $(date +%s) - start ))s"
    elif [ -e "$made_here" ]; then
      rm -rf "$venv"; venv_with_basics
      torch_missing "torch could not be installed whole (its partial install was removed with the venv)"
    else
      echo "test-python: torch could not be installed whole into $venv, which this script did not make, so it is" \
           "left as it is: remove what pip left there (pip uninstall torch), or use a fresh AF_PYTHON_VENV" >&2
      exit 1
    fi
  fi
fi
# Hugging Face Transformers for attnforge.transformers (tests/test_transformers_backend.py): pinned, the version
# those tests were written and run against with the torch above.
transformers_pin="transformers==5.24.0"
if ! "$py" -c "import transformers, sys; sys.exit(transformers.__version__ != '${transformers_pin#*==}')" 2>/dev/null \
   && ! "$py" -m pip install -q --disable-pip-version-check "$transformers_pin"; then
  echo "test-python: WARNING: $transformers_pin could not be installed; the Transformers tests skip" >&2
fi
# NVIDIA AITune for attnforge.aitune (tests/test_aitune.py): pinned, with --no-deps, since its tensorrt dependency
# downloads the real wheel from NVIDIA's own index at install time; its dependencies that install come first (those its
# kernel_forge package loads; torch brings triton). Its TensorRT, ONNX and ModelOpt backends are not installed.
aitune_pin="aitune==0.6.0"
aitune_deps=("autowrapt>=1.0" "dill>=0.3.8" nvidia-ml-py nvtx "pandas>=2.3" psutil "tabulate>=0.9.0" "wrapt~=2.0")
if ! "$py" -c "import importlib.metadata as m, sys, wrapt, dill, pandas, tabulate, psutil, nvtx, pynvml
sys.exit(m.version('aitune') != '${aitune_pin#*==}')" 2>/dev/null \
   && ! { "$py" -m pip install -q --disable-pip-version-check "${aitune_deps[@]}" \
          && "$py" -m pip install -q --disable-pip-version-check --no-deps "$aitune_pin"; }; then
  echo "test-python: WARNING: $aitune_pin could not be installed; the AITune tests skip" >&2
fi
# FlashAttention-4's own test reference (flash_attn/cute/testing.py) for tests/test_fa4_peer_suite.py: pinned, the
# version that suite was ported from, with --no-deps (the wheel is pure Python; its CUTLASS DSL and other GPU
# dependencies are never imported by testing.py, which needs only torch and einops).
fa4_pin="flash-attn-4==4.0.0b27"
if ! "$py" -c "import importlib.metadata as m, sys, einops
sys.exit(m.version('flash-attn-4') != '${fa4_pin#*==}')" 2>/dev/null \
   && ! { "$py" -m pip install -q --disable-pip-version-check einops \
          && "$py" -m pip install -q --disable-pip-version-check --no-deps "$fa4_pin"; }; then
  echo "test-python: WARNING: $fa4_pin could not be installed; the FA4 peer suite skips" >&2
fi
# `make build` compiled libattnforge_cuda.so already: the wheel takes it from there (python/CMakeLists.txt,
# AF_CUDA_BUILD_DIR) instead of compiling backend.cu a second time (2m41s measured on 2 cores)
pip_cuda=()
if [ -n "$cli" ] && grep -qx 'AF_CUDA_BACKEND:INTERNAL=ON' "$(dirname "$cli")/CMakeCache.txt" 2>/dev/null; then
  pip_cuda=(-C "cmake.define.AF_CUDA_BUILD_DIR=$(cd "$(dirname "$cli")" && pwd)")
fi
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation "${pip_cuda[@]}" ./

[ -n "$cli" ] && export ATTNFORGE_CLI="$(cd "$(dirname "$cli")" && pwd)/$(basename "$cli")"
status=0
"$py" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests" || status=$?
if [ "$status" -eq 5 ]; then   # pytest: no tests collected — a broken test tree must not pass
  echo "test-python: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
