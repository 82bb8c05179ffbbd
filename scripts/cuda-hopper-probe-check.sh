#!/usr/bin/env bash
# The compile check of the Hopper contract (src/cuda/device_hopper.h, issue 30): tests/cuda_emu/device_hopper_probe.cu,
# which uses every primitive, compiled by nvcc with ptxas -v for sm_90a and for the backend's other targets (sm_80,
# sm_100, sm_110, sm_120: the trapping stubs must compile there). Fails when the sm_90a kernel has a stack frame or
# spills, when ptxas ignores setmaxnreg (C7508), or when its SASS lacks HGMMA (wgmma; .tnspB for the MN-major B),
# UTMALDG (the bulk tensor loads, 2D/3D/4D), SYNCS (mbarrier) or USETMAXREG (setmaxnreg). Prints the counts.
# Usage: scripts/cuda-hopper-probe-check.sh BUILD_DIR
# Environment: NVCC, CUOBJDUMP and AF_REQUIRE_SASS_CHECK as for scripts/cuda-compile-check.sh.
# Exit status: 0 passed, 1 failed, 77 skipped (no nvcc).
set -u
if [ $# -ne 1 ]; then
    echo "usage: $0 BUILD_DIR" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=$1/cuda-hopper-probe-check
mkdir -p "$out"

nvcc=${NVCC:-$(command -v nvcc || true)}
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
    echo "cuda-hopper-probe-check: skipped: nvcc not found (set NVCC or install the CUDA toolkit)"
    exit 77
fi
find_cuobjdump() {   # as scripts/cuda-compile-check.sh finds it
    if [ -n "${CUOBJDUMP:-}" ]; then echo "$CUOBJDUMP"; return; fi
    command -v cuobjdump && return
    [ -x "$(dirname "$nvcc")/cuobjdump" ] && { echo "$(dirname "$nvcc")/cuobjdump"; return; }
    ls /opt/attnforge-cuda-tools/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump 2>/dev/null | head -1
}
cuobjdump=$(find_cuobjdump | head -1)
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# sm_110 only where this nvcc knows it (CUDA 13 does)
archs="90a 80 100 120"
"$nvcc" --list-gpu-arch 2>/dev/null | grep -q compute_110 && archs="$archs 110"
gencode=""
for arch in $archs; do gencode="$gencode -gencode=arch=compute_$arch,code=sm_$arch"; done
# shellcheck disable=SC2086
if ! "$nvcc" -std=c++17 -O3 -I"$root/include" -I"$root/src" $gencode -Xptxas=-v -Xcompiler=-Wall \
        -c "$root/tests/cuda_emu/device_hopper_probe.cu" -o "$out/probe.o" >"$out/ptxas.log" 2>&1; then
    cat "$out/ptxas.log"
    fail "nvcc could not build tests/cuda_emu/device_hopper_probe.cu"
    exit 1
fi
echo "cuda-hopper-probe-check: $("$nvcc" --version | tail -1); targets: $archs"

# ptxas: the sm_90a section (the lines after its "Compiling entry function ... for 'sm_90a'")
awk '/Compiling entry function/ { on = /sm_90a/ } on' "$out/ptxas.log" >"$out/ptxas_sm90a.log"
grep -E "stack frame|Used [0-9]+ registers" "$out/ptxas_sm90a.log" | sed 's/^ */sm_90a ptxas: /'
grep -q "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" "$out/ptxas_sm90a.log" ||
    fail "the sm_90a probe has a stack frame or spills"
if grep -qE "C7508|setmaxnreg.*ignored" "$out/ptxas.log"; then
    fail "ptxas ignores setmaxnreg: $(grep -E 'C7508|setmaxnreg' "$out/ptxas.log" | head -1)"
fi
grep -E "C75[0-9][0-9]" "$out/ptxas.log" | sed 's/^/ptxas note: /'

if [ -n "$cuobjdump" ] && PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" --version >/dev/null 2>&1; then
    PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" --dump-sass -arch sm_90a "$out/probe.o" >"$out/sass_sm90a.txt" 2>&1 ||
        fail "cuobjdump --dump-sass: $(head -3 "$out/sass_sm90a.txt")"
    count() { grep -cE "$1" "$out/sass_sm90a.txt"; }
    printf 'sm_90a SASS: HGMMA %s (.tnspB %s), UTMALDG.2D %s .3D %s .4D %s, SYNCS %s, USETMAXREG %s, WARPGROUP %s\n' \
        "$(count 'HGMMA')" "$(count 'HGMMA.*tnspB')" "$(count 'UTMALDG\.2D')" "$(count 'UTMALDG\.3D')" \
        "$(count 'UTMALDG\.4D')" "$(count 'SYNCS')" "$(count 'USETMAXREG')" "$(count 'WARPGROUP')"
    [ "$(count 'HGMMA')" -ge 64 ] || fail "fewer than the probe's 64 wgmma (HGMMA) in the sm_90a SASS"
    [ "$(count 'HGMMA.*tnspB')" -ge 32 ] || fail "fewer than 32 HGMMA with .tnspB (the _btrans variants)"
    for dim in 2D 3D 4D; do
        [ "$(count "UTMALDG\\.$dim")" -ge 1 ] || fail "no UTMALDG.$dim (cp.async.bulk.tensor.${dim,,}) in the SASS"
    done
    [ "$(count 'SYNCS')" -ge 3 ] || fail "no mbarrier (SYNCS) instructions in the SASS"
    [ "$(count 'USETMAXREG')" -ge 2 ] || fail "setmaxnreg (USETMAXREG) missing from the SASS"
    [ "$(count 'BAR\.(SYNC|ARV)')" -ge 2 ] || fail "the named barriers (BAR.SYNC, BAR.ARV) missing from the SASS"
elif [ "${AF_REQUIRE_SASS_CHECK:-0}" = 1 ]; then
    fail "cuobjdump not found (AF_REQUIRE_SASS_CHECK=1): pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
else
    echo "SASS check skipped: cuobjdump (with nvdisasm) not found"
fi

if [ "$failures" -gt 0 ]; then
    echo "cuda-hopper-probe-check: $failures failure(s); logs in $out"
    exit 1
fi
echo "cuda-hopper-probe-check: passed"
