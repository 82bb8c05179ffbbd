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
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check numpy pytest "scikit-build-core>=0.10"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "test-python: installing torch from PyPI (measured 2m12s on a 2-core machine)"
  start=$(date +%s)
  if "$py" -m pip install -q --disable-pip-version-check torch; then
    echo "test-python: torch installed in $(( $(date +%s) - start ))s"
  elif [ "${ATTNFORGE_REQUIRE_TORCH:-0}" = 1 ]; then
    echo "test-python: torch could not be installed and ATTNFORGE_REQUIRE_TORCH=1" >&2; exit 1
  else
    echo "test-python: WARNING: torch could not be installed; only the NumPy tier runs (torch tests skip)" >&2
  fi
fi
# Hugging Face Transformers for attnforge.transformers (tests/test_transformers_backend.py): pinned, the version
# those tests were written and run against with the torch above.
transformers_pin="transformers==5.24.0"
if ! "$py" -c "import transformers, sys; sys.exit(transformers.__version__ != '${transformers_pin#*==}')" 2>/dev/null \
   && ! "$py" -m pip install -q --disable-pip-version-check "$transformers_pin"; then
  echo "test-python: WARNING: $transformers_pin could not be installed; the Transformers tests skip" >&2
fi
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation ./

[ -n "$cli" ] && export ATTNFORGE_CLI="$(cd "$(dirname "$cli")" && pwd)/$(basename "$cli")"
status=0
"$py" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests" || status=$?
if [ "$status" -eq 5 ]; then   # pytest: no tests collected — a broken test tree must not pass
  echo "test-python: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
