#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (written for an H200 with nvcc 13 and PyTorch, no network; fits
# 11.5 minutes, --quick 7.5): builds with the CUDA backend, runs ctest, `attnforge verify --device cuda` (the default
# cases and random samples against the double reference, and the occupancy each tensor-core variant got), the CUDA
# backward against the double reference (tests/cuda_emu/test_cuda_backward on the real backend, twice bit for bit),
# compute-sanitizer memcheck/racecheck on small cases and memcheck on a paged decode with a bad page index, the
# compile checks, `python -m attnforge` and the Python GPU tests (python/tests/test_cuda_gpu.py, where pytest and
# torch import: CUDA graphs, two streams at once, PyTorch's caching allocator), then bench/cuda_compare.py
# (attnforge beside torch's SDPA backends), and, where the CPU has AVX-512/AMX,
# the ctest suites, `attnforge bench --isa avx512|amx --quick` and decode's compute floor
# (bench/standalone/decode_compute.c). Each phase has a time budget (the time an early phase leaves goes to the
# later ones); a phase's failure is reported and the later phases still run.
# Usage: scripts/gpu-check.sh [--quick]   (BUILD_DIR, default build-gpu; OUT: also writes $OUT/gpu-check.log;
#        --quick: 450 s in all, no CPU phase, a shorter comparison)
#        GPU_CHECK_DRY=1 scripts/gpu-check.sh   runs only the phases that need no GPU (for trying it without one)
#        GPU_CHECK_PHASES="verify compare" scripts/gpu-check.sh   a subset of: info build verify backward ctest sanitizer
#        compile pytest compare cpu_isa (the later ones need the build); GPU_CHECK_BUDGET: seconds in all
#        (default 690, --quick 450)
#        --before-after: the Hopper kernel before and after (issue 37): the backend of a baseline commit
#        (AF_BASELINE_COMMIT, default 19c44b2) built for this GPU's architecture alone (sm_90a on an H200) beside the
#        current build, then bench/cuda_compare.py --before-after (the same shapes on both backends, torch's flash and
#        cuDNN; CSV/JSON/markdown in $OUT), then the correctness phases; 570 s in all (one device call: 600 s at
#        most). Where this checkout has no git history (the device machine gets a copy of the working tree without
#        .git), run `scripts/gpu-check.sh --prepare-baseline` first on a machine that has it (no GPU needed: it
#        exports the baseline's src/ and include/ to build-baseline/) and carry build-baseline.
#        AF_BASELINE_LIB=PATH: take that backend as the baseline instead of building one. A baseline that cannot be
#        built is reported and the comparison runs with the current build alone.
# Exit status: the number of failed phases (0: all passed or skipped).
# shellcheck disable=SC2317  # the phase_* functions are called indirectly, by run_phase
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
build=${BUILD_DIR:-$root/build-gpu}
dry=${GPU_CHECK_DRY:-0}
quick=0
before_after=0
prepare_only=0
for arg in "$@"; do
    case $arg in
        --quick) quick=1 ;;
        --before-after) before_after=1 ;;
        --prepare-baseline) prepare_only=1 ;;
        *) echo "gpu-check: unknown argument $arg (--quick, --before-after, --prepare-baseline)" >&2; exit 2 ;;
    esac
done
# the baseline of --before-after: its sources (exported from git, here or by --prepare-baseline) and its backend
baseline_commit=${AF_BASELINE_COMMIT:-19c44b2}
baseline_dir=${AF_BASELINE_DIR:-$root/build-baseline}   # build*/ is ignored by git: name it in the device's carry
baseline_src=$baseline_dir/src
baseline_lib=""          # set by baseline_start: the backend that phase baseline waits for
baseline_pid=""
baseline_why=""          # why there is no baseline backend, when there is none
if [ "$quick" = 1 ]; then
    total_budget=${GPU_CHECK_BUDGET:-450}   # seconds: 7.5 minutes
else
    total_budget=${GPU_CHECK_BUDGET:-690}   # 11.5 minutes: 15 minutes of device time less the machine's start
fi
# --before-after: one call of the device tool, whose commands stop at 600 s: 570 s, the table written as it goes
[ "$before_after" = 1 ] && [ "$quick" = 0 ] && total_budget=${GPU_CHECK_BUDGET:-570}
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu-check.log") 2>&1
fi
start=$(date +%s)
deadline=$((start + total_budget))
cli=$build/attnforge
cuda_lib=$build/libattnforge_cuda.so
jobs=$(nproc 2>/dev/null || echo 2)
failed=()
passed=()
skipped=()

# Budgets in seconds, in run order; a phase may use what earlier phases left, minus what later ones reserve.
phases=(info build verify backward ctest sanitizer compile pytest compare cpu_isa)
declare -A budget=([info]=10 [build]=140 [verify]=45 [backward]=25 [ctest]=75 [sanitizer]=100 [compile]=0
                   [pytest]=110 [compare]=145 [cpu_isa]=40 [baseline]=0 [before_after]=0)
if [ "$before_after" = 1 ]; then
    # the table first (its rows carry both builds' errors against a float64 reference), then the correctness
    # phases that exercise the reworked kernel; the baseline compiles beside the current build (phase build starts
    # it in the background: one nvcc target on a 16-core machine), so phase baseline mostly waits
    phases=(info build baseline before_after verify sanitizer backward pytest)
    budget[build]=150
    budget[baseline]=15
    budget[before_after]=220
    budget[verify]=45
    budget[sanitizer]=50
    budget[backward]=25
    budget[pytest]=55
fi
if [ "$quick" = 1 ]; then
    budget[verify]=40
    budget[backward]=20
    budget[ctest]=60
    budget[sanitizer]=40
    budget[pytest]=80
    budget[compare]=60
    budget[cpu_isa]=0
    budget[before_after]=160   # with --before-after: no pytest (below); 435 s of the 450
fi

elapsed() { echo $(($(date +%s) - start)); }
# Seconds phase $1 may run: up to the deadline less the budgets of the phases after it, at least 10.
allowance() {
    local after=0 seen=0 p
    for p in "${phases[@]}"; do
        [ "$seen" = 1 ] && after=$((after + budget[$p]))
        [ "$p" = "$1" ] && seen=1
    done
    local left=$((deadline - $(date +%s) - after))
    [ "$left" -lt 10 ] && left=10
    echo "$left"
}
banner() { printf '\n==== [%3ss] %s\n' "$(elapsed)" "$*"; }
# run_phase NAME FUNCTION: runs it with its allowance in $allowed; records passed/failed/skipped (return 77).
run_phase() {
    local name=$1 fn=$2 t0 code
    allowed=$(allowance "$name")
    phase_end=$(($(date +%s) + allowed))
    banner "phase $name (budget ${budget[$name]} s, allowed ${allowed} s)"
    t0=$(date +%s)
    "$fn"
    code=$?
    local took=$(($(date +%s) - t0))
    if [ "$code" -eq 0 ]; then
        passed+=("$name (${took}s)")
        echo "---- $name: passed in ${took} s"
    elif [ "$code" -eq 77 ]; then
        skipped+=("$name")
        echo "---- $name: skipped"
    else
        failed+=("$name (exit $code, ${took}s)")
        echo "---- $name: FAILED (exit $code) in ${took} s"
    fi
}
# bounded SECONDS command...: the command, killed after SECONDS (exit 124)
bounded() {
    local seconds=$1
    shift
    timeout --kill-after=5 "$seconds" "$@"
}
has_gpu() { [ "$dry" != 1 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }
find_nvcc() { command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; }; }
python_bin() { command -v python3 || command -v python; }
find_sanitizer() {
    local toolkit=/usr/local/cuda/bin/compute-sanitizer
    command -v compute-sanitizer || { [ -x "$toolkit" ] && echo "$toolkit"; }
}

# ---- phases

phase_info() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git -C "$root" log -1 --format='%h %s' 2>/dev/null || echo '?')"
    echo "dry run: $dry; build dir: $build; cores: $jobs"
    grep -m1 'model name' /proc/cpuinfo || true
    local flags
    flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|amx_tile|amx_bf16)$' |
        tr '\n' ' ')
    echo "cpu flags of interest: ${flags:-none}"
    if command -v nvidia-smi >/dev/null; then
        bounded 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    else
        echo "nvidia-smi: not found"
    fi
    local nvcc
    nvcc=$(find_nvcc)
    echo "nvcc: ${nvcc:-not found} ${nvcc:+$("$nvcc" --version | tail -1)}"
    echo "compute-sanitizer: $(find_sanitizer || echo 'not found')"
    bounded 60 "$(python_bin)" - <<'PY' || echo "python: torch not importable"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
PY
    return 0
}

configure() {   # configure TESTS(ON|OFF) PYTHON(ON|OFF)
    local nvcc
    nvcc=$(find_nvcc)
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DAF_BUILD_TESTS="$1" -DAF_BUILD_PYTHON="$2" \
        ${nvcc:+-DCMAKE_CUDA_COMPILER="$nvcc"} -DCMAKE_CUDA_FLAGS="--threads 0" >"$build.configure.log" 2>&1
}

phase_build() {
    mkdir -p "$build"
    # --before-after: the baseline's one-target nvcc beside this build (phase baseline waits for it)
    [[ "$only" == *" baseline "* ]] && baseline_start
    # the C tests need cmocka and the extension Python's headers: without them, build what can be built
    local tests python ok=0
    for tests in ON OFF; do
        for python in ON OFF; do
            if configure "$tests" "$python"; then
                ok=1
                break 2
            fi
            echo "configure with tests=$tests python=$python failed:" \
                "$(grep -m3 -iE 'error|not found' "$build.configure.log" | tr '\n' ' ')"
            rm -f "$build/CMakeCache.txt"
        done
    done
    [ "$ok" = 1 ] || { tail -20 "$build.configure.log"; return 1; }
    echo "configured: tests=$tests python=$python"
    grep -E "attnforge: (building|nvcc)" "$build.configure.log" || true
    if ! bounded "$allowed" cmake --build "$build" -j"$jobs" >"$build.build.log" 2>&1; then
        grep -E "error|Error" "$build.build.log" | head -20
        tail -5 "$build.build.log"
        return 1
    fi
    ls -la "$cli" "$cuda_lib" 2>&1
    # the Python package: the sources and the extension built here (ATTNFORGE_CUDA_LIBRARY names the backend)
    local ext
    ext=$(find "$build/python" -maxdepth 1 -name '_C*.so' 2>/dev/null | head -1)
    if [ -n "$ext" ]; then
        rm -rf "$build/pypkg" && mkdir -p "$build/pypkg/attnforge" &&
            cp "$root"/python/attnforge/*.py "$ext" "$build/pypkg/attnforge/"
        # the backend inside the package, where the wheel carries it and the package finds it with no variable
        if [ -f "$cuda_lib" ]; then cp "$cuda_lib" "$build/pypkg/attnforge/"; fi
        echo "python package: $build/pypkg"
    fi
    [ -f "$cuda_lib" ] || { has_gpu && echo "libattnforge_cuda.so was not built (nvcc not found?)" && return 1; }
    return 0
}

# Random samples for verify, one per file (each file is one plan, and the plan's copy-free layout depends on the
# shape): dtypes, GQA, L != S, both causal settings, head dims up to 256, NHD views; small_*.samples.json are the
# sanitizers' cases.
write_samples() {
    rm -rf "$1" && mkdir -p "$1"
    "$(python_bin)" - "$1" <<'PY'
import json, os, random, sys
out, rng = sys.argv[1], random.Random(20251130)

def tensor(b, h, n, d, dtype, nhd):
    t = {"shape": [b, h, n, d], "dtype": dtype}
    if nhd:   # x_nhd.transpose(1, 2)
        t["strides"] = [n * h * d, d, h * d, 1]
    return t

def sample(causal, gqa, small):
    while True:   # sizes within a work budget: the double reference runs on one CPU core
        dtype = rng.choice(["bfloat16", "float16", "bfloat16", "float16", "float32"])
        E = rng.choice([32, 64, 64, 128, 128, 96, 256] if not small else [64, 128])
        Ev = E if rng.random() < 0.8 else rng.choice([64, 128])
        hkv = rng.choice([1, 2, 4])
        hq = hkv * (rng.choice([2, 4, 8]) if gqa else 1)
        L = rng.choice([1, 7, 64, 130, 257, 600]) if not small else rng.choice([1, 33, 70])
        S = rng.choice([L, L + 13, 1024, 2500]) if not small else rng.choice([L, 90])
        b = rng.choice([1, 2])
        if b * hq * L * S * (E + Ev) <= 2e8:
            break
    nhd = rng.random() < 0.5
    kwargs = {"is_causal": causal}
    if gqa:
        kwargs["enable_gqa"] = True
    q, k, v = tensor(b, hq, L, E, dtype, nhd), tensor(b, hkv, S, E, dtype, nhd), tensor(b, hkv, S, Ev, dtype, nhd)
    return {"samples": [{"args": [q, k, v], "kwargs": kwargs}]}

n = 0
for causal in (False, True):
    for gqa in (False, True):
        for _ in range(6):
            with open(os.path.join(out, f"random_{n:02d}.samples.json"), "w") as f:
                json.dump(sample(causal, gqa, False), f)
            n += 1
for i in range(3):
    with open(os.path.join(out, f"small_{i}.samples.json"), "w") as f:
        json.dump(sample(True, i > 0, True), f)
print(f"{n} random and 3 small samples files in {out}")
PY
}

# verify_files LIBRARY SECONDS FILE...: verify --device cuda on each samples file; the rows and the total
verify_files() {
    local library=$1 seconds=$2 f code=0 checks=0 ok=0
    shift 2
    for f in "$@"; do
        if [ "$(date +%s)" -ge "$phase_end" ]; then
            echo "stopped at the phase's time budget before $(basename "$f")"
            break
        fi
        ATTNFORGE_LOG=debug ATTNFORGE_CUDA_LIBRARY=$library bounded "$seconds" "$cli" verify --device cuda \
            --samples "$f" >"$build.verify.out" 2>&1 || code=1
        grep -E '^samples\[|failed|error' "$build.verify.out" | sed "s|^|$(basename "$f" .samples.json): |"
        # each process asks a variant's occupancy once and logs it (debug): the variants these samples ran
        grep -oE 'cuda:[0-9]+ af_[a-z0-9_]+: [0-9]+ CTAs per multiprocessor.*' "$build.verify.out" >>"$build.occupancy"
        checks=$((checks + 1))
        grep -q '1 of 1 checks within tolerance' "$build.verify.out" && ok=$((ok + 1))
    done
    echo "samples files: $ok of $checks within tolerance"
    return "$code"
}

phase_verify() {
    [ -x "$cli" ] || return 1
    local emulated=$build/tests/cuda_emu/libattnforge_cuda_emulated.so
    : >"$build.occupancy"
    if ! has_gpu && [ "$dry" = 1 ] && [ -f "$emulated" ]; then
        echo "dry run: the small samples on the emulated backend instead of a GPU"
        write_samples "$build/samples" || return 1
        verify_files "$emulated" "$allowed" "$build"/samples/small_*.samples.json
        local code=$?
        echo "-- the occupancy of each tensor-core variant these samples ran (the emulation's model)"
        sort -u "$build.occupancy"
        return "$code"
    elif ! has_gpu; then
        echo "no GPU: verify --device cuda must refuse with exit 3"
        bounded 60 "$cli" verify --device cuda
        [ $? -eq 3 ] && return 77 || return 1
    fi
    local code=0 half=$((allowed / 2))
    export ATTNFORGE_CUDA_LIBRARY=$cuda_lib
    bounded "$half" "$cli" verify --device cuda || code=1
    write_samples "$build/samples" || return 1
    verify_files "$cuda_lib" 60 "$build"/samples/random_*.samples.json || code=1
    # on compute capability 9.0 the default above is the Hopper kernel (attn_wgmma.cuh): the mma.sync kernels too
    if nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -q '^9\.0'; then
        echo "-- the same samples on the mma.sync kernels (ATTNFORGE_CUDA_WGMMA=0)"
        ATTNFORGE_CUDA_WGMMA=0 verify_files "$cuda_lib" 60 "$build"/samples/random_*.samples.json || code=1
    fi
    echo "-- the occupancy of each tensor-core variant these samples ran (cudaOccupancyMaxActiveBlocksPerMultiprocessor)"
    sort -u "$build.occupancy"
    # the command-line checks of tests/cli_cuda.sh with the real backend in place of the emulated one
    echo "-- tests/cli_cuda.sh on the GPU"
    ATTNFORGE_CUDA_EMULATED=$cuda_lib bounded 60 bash "$root/tests/cli_cuda.sh" "$cli" >"$build.cli_cuda.log" 2>&1 ||
        code=1
    grep -vE '^ok: ' "$build.cli_cuda.log"
    return "$code"
}

# The CUDA backward (src/cuda/attn_bwd_mma.cuh) on the GPU: tests/cuda_emu/test_cuda_backward run against the real
# backend (its tensors through the backend's own cudaMalloc/cudaMemcpy): chosen cases of every meaning it takes and
# a seeded random suite (f16/bf16, head dims <= 128) against the double reference under backward_case.h's bound,
# each run twice bit for bit (determinism), nothing written outside the gradients, and the host-side refusals.
phase_backward() {
    has_gpu || return 77
    local t=$build/tests/cuda_emu/test_cuda_backward
    [ -x "$t" ] || { echo "no $t (the build has no tests)"; return 77; }
    [ -f "$cuda_lib" ] || { echo "no libattnforge_cuda.so"; return 1; }
    (cd "$root/tests" && ATTNFORGE_CUDA_LIBRARY=$cuda_lib bounded "$allowed" "$t")
}

phase_ctest() {
    [ -f "$build/CTestTestfile.cmake" ] || { echo "no tests configured"; return 77; }
    # the compile checks run in their own phase (ptxas for two targets); everything else here
    (cd "$build" && bounded "$allowed" ctest -j"$jobs" --timeout 120 --output-on-failure -E 'cuda_compile_check') \
        >"$build.ctest.log" 2>&1
    local code=$?
    grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Timeout|Not Run|Skipped" "$build.ctest.log" | head -40
    [ "$code" -eq 124 ] && echo "ctest: stopped at the phase's ${allowed} s"
    return "$code"
}

phase_sanitizer() {
    local sanitizer
    sanitizer=$(find_sanitizer)
    [ -n "$sanitizer" ] || { echo "compute-sanitizer not found"; return 77; }
    has_gpu || return 77
    export ATTNFORGE_CUDA_LIBRARY=$cuda_lib
    local code=0 tool per=$((allowed / 5))
    for tool in memcheck racecheck memcheck-wgmma; do   # small_1 has 132 packed rows: the Hopper kernel takes it
        echo "-- $tool"
        ATTNFORGE_CUDA_WGMMA=$([ "$tool" = memcheck-wgmma ] && echo 1 || echo 0) bounded "$per" "$sanitizer" \
            --tool "${tool%-wgmma}" --error-exitcode 9 \
            "$cli" verify --device cuda --samples "$build/samples/small_1.samples.json" >"$build.$tool.log" 2>&1
        local c=$?
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|checks within tolerance|Error" "$build.$tool.log" | head -10
        [ "$c" -ne 0 ] && { echo "$tool: exit $c"; code=1; }
    done
    # a page index past the pool: the kernels must not read it (memcheck), its rows are NaN and the check reports it
    local py pypath=""
    py=$(python_bin)
    if "$py" -c "import pytest, torch" 2>/dev/null; then
        echo "-- memcheck: a paged decode with a bad page index (test_cuda_gpu.py)"
        [ -d "$build/pypkg" ] && pypath=$build/pypkg
        local left=$((phase_end - $(date +%s)))
        [ "$left" -lt 20 ] && left=20
        PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" bounded "$left" "$sanitizer" \
            --tool memcheck --error-exitcode 9 --target-processes all "$py" -m pytest -q -p no:cacheprovider \
            "$root/python/tests/test_cuda_gpu.py" -k bad_page >"$build.memcheck_pages.log" 2>&1
        local c=$?
        grep -E "ERROR SUMMARY|passed|failed|skipped|Invalid" "$build.memcheck_pages.log" | head -10
        if [ "$c" -eq 124 ]; then   # torch's start under memcheck is slow: out of time is not a finding
            echo "memcheck (bad page): out of the phase's time before it finished (not a failure; rerun the phase)"
        elif [ "$c" -ne 0 ]; then
            echo "memcheck (bad page): exit $c"
            code=1
        fi
    else
        echo "pytest or torch not importable: the bad-page memcheck is skipped"
    fi
    return "$code"
}

phase_compile() {
    [ -f "$cuda_lib" ] || { echo "no libattnforge_cuda.so"; return 77; }
    AF_REQUIRE_SASS_CHECK=1 bounded "$allowed" bash "$root/scripts/cuda-compile-check.sh" "$build"
}

# python/tests/test_cuda_gpu.py: torch CUDA tensors through the binding (SDPA, the provider, flash_attn_func's
# features, varlen and paged calls) against PyTorch and against the same calls on CPU copies
phase_pytest() {
    has_gpu || return 77
    local py pypath=""
    py=$(python_bin)
    "$py" -c "import pytest, torch" 2>/dev/null || { echo "pytest or torch not importable"; return 77; }
    [ -d "$build/pypkg" ] && pypath=$build/pypkg
    # the report a bug needs, on a GPU; the package's own backend (no ATTNFORGE_CUDA_LIBRARY) must be ready
    local report
    report=$(PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" bounded 30 env -u ATTNFORGE_CUDA_LIBRARY \
        "$py" -m attnforge 2>&1)
    echo "$report"
    if ! grep -qE '^  status: +ready, ' <<<"$report"; then
        echo "python -m attnforge: the backend inside the package is not ready"
        return 1
    fi
    local code=0
    ATTNFORGE_CUDA_LIBRARY=$cuda_lib PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
        bounded "$((allowed - 45))" "$py" -m pytest -q -p no:cacheprovider "$root/python/tests/test_cuda_gpu.py" || code=1
    # what AITune's users see: its KernelSelectorBackend (real profiler) picking among its providers and attnforge's
    if "$py" -c "import aitune" 2>/dev/null; then
        ATTNFORGE_CUDA_LIBRARY=$cuda_lib PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
            bounded 40 "$py" "$root/python/tests/gpu_aitune_table.py" --dtype bfloat16 || code=1
    else
        echo "aitune is not installed here: the AITune table is skipped (pip install --no-deps aitune==0.6.0)"
    fi
    return "$code"
}

phase_compare() {
    has_gpu || return 77
    local py pypath=""
    py=$(python_bin)
    [ -d "$build/pypkg" ] && pypath=$build/pypkg
    ATTNFORGE_CUDA_LIBRARY=$cuda_lib PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
        bounded "$allowed" "$py" "$root/bench/cuda_compare.py" --budget "$((allowed - 25))" --attnforge-cli "$cli" \
        --json "$build/cuda_compare.json"
}

# ---- before/after (--before-after): the backend of a baseline commit beside the current one

# The baseline's sources in $baseline_src, exported from git at $baseline_commit; COMMIT says which commit they are,
# CURRENT which commit (and whether modified) the checkout that exported them was at.
prepare_baseline() {
    local full
    if ! full=$(git -C "$root" rev-parse --verify --quiet "$baseline_commit^{commit}" 2>/dev/null); then
        baseline_why="no git commit $baseline_commit here (this checkout has no git history?)"
        return 1
    fi
    rm -rf "$baseline_src" && mkdir -p "$baseline_src" || return 1
    if ! git -C "$root" archive "$full" src include | tar -x -C "$baseline_src"; then
        baseline_why="git archive $full failed"
        return 1
    fi
    git -C "$root" log -1 --format='%H %s' "$full" >"$baseline_dir/COMMIT"
    { git -C "$root" log -1 --format='%H %s' HEAD
      git -C "$root" status --porcelain --untracked-files=no | grep -q . && echo "(with uncommitted changes)"
    } >"$baseline_dir/CURRENT" 2>/dev/null
    echo "baseline sources: $(cut -c1-60 "$baseline_dir/COMMIT") -> $baseline_src ($(du -sh "$baseline_src" | cut -f1))"
}

# Are the sources in $baseline_src those of $baseline_commit? (the COMMIT file's hash starts with it)
baseline_sources_ready() {
    [ -f "$baseline_src/src/cuda/backend.cu" ] && [ -f "$baseline_dir/COMMIT" ] &&
        case $(cut -d' ' -f1 "$baseline_dir/COMMIT") in "$baseline_commit"*) true ;; *) false ;; esac
}

# The GPU's architecture as nvcc spells it (compute capability 9.0 -> 90a, the Hopper kernel's target); 90a without
# a GPU (GPU_CHECK_DRY)
baseline_arch() {
    local cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    case $cap in
        '' | *[!0-9]*) echo 90a ;;
        90) echo 90a ;;
        *) echo "$cap" ;;
    esac
}

# build_baseline SECONDS: the baseline backend alone, one nvcc command with the flags CMake gives attnforge_cuda in a
# Release build (CMakeLists.txt: -O3 -DNDEBUG, C++17, PIC, hidden visibility, -lineinfo, cudart static), for one
# architecture (CMake's list is fixed in CMakeLists.txt, CMAKE_CUDA_ARCHITECTURES OFF: no option restricts it, and
# the baseline's CMakeLists.txt is the old one). Each target is compiled on its own by nvcc, so the sm_90a code is
# what the full build would give. Writes $baseline_lib, its ptxas report and the seconds it took.
build_baseline() {
    local seconds=$1 nvcc arch t0 code
    nvcc=$(find_nvcc) || true
    [ -n "$nvcc" ] || { echo "baseline: nvcc not found"; return 1; }
    arch=$(baseline_arch)
    t0=$(date +%s)
    echo "baseline: $nvcc for sm_$arch alone, at most $seconds s"
    bounded "$seconds" "$nvcc" -O3 -DNDEBUG -std=c++17 -Xcompiler=-fPIC,-fvisibility=hidden -lineinfo -Xptxas=-v \
        --threads 0 "-gencode=arch=compute_$arch,code=sm_$arch" -I"$baseline_src/include" -I"$baseline_src/src" \
        -shared -cudart static -o "$baseline_lib.tmp" "$baseline_src/src/cuda/backend.cu" 2>"$baseline_dir/ptxas.log"
    code=$?
    if [ "$code" -ne 0 ]; then
        [ "$code" -eq 124 ] && echo "baseline: nvcc stopped after $seconds s"
        grep -m10 -E 'error' "$baseline_dir/ptxas.log"
        rm -f "$baseline_lib.tmp"
        return 1
    fi
    mv -f "$baseline_lib.tmp" "$baseline_lib"
    echo "$(hostname) $("$nvcc" --version | tail -1)" >"$baseline_lib.stamp"
    echo "baseline: built in $(($(date +%s) - t0)) s: $baseline_lib ($(du -h "$baseline_lib" | cut -f1))"
}

# Starts the baseline's build in the background (phase build calls it first; phase baseline waits), or finds why
# there can be none (recorded in $baseline_why; phase baseline reports it).
baseline_start() {
    [ -n "$baseline_lib$baseline_why" ] && return 0   # started already (or refused)
    if [ -n "${AF_BASELINE_LIB:-}" ]; then
        baseline_lib=$AF_BASELINE_LIB
        [ -f "$baseline_lib" ] || baseline_why="AF_BASELINE_LIB=$baseline_lib is not a file"
        return 0
    fi
    mkdir -p "$baseline_dir"
    if ! baseline_sources_ready && ! prepare_baseline; then
        baseline_why="no sources of $baseline_commit: $baseline_why; run scripts/gpu-check.sh --prepare-baseline \
where git has the commit and carry $(basename "$baseline_dir")"
        return 0
    fi
    local arch
    arch=$(baseline_arch)
    baseline_lib=$baseline_dir/libattnforge_cuda-$(cut -c1-10 "$baseline_dir/COMMIT")-sm_$arch.so
    # a backend built on this machine by this nvcc already (a second run on the same machine): kept
    if [ -f "$baseline_lib" ] && [ "$(cat "$baseline_lib.stamp" 2>/dev/null)" = \
        "$(hostname) $("$(find_nvcc)" --version 2>/dev/null | tail -1)" ]; then
        echo "baseline: $baseline_lib was built here already"
        return 0
    fi
    rm -f "$baseline_lib"
    # until the end of phase baseline: the time of build and baseline, as the allowances reckon it now
    local seconds
    seconds=$(allowance baseline)
    build_baseline "$seconds" >"$baseline_dir/build.log" 2>&1 &
    baseline_pid=$!
    echo "baseline: building $(cut -c1-60 "$baseline_dir/COMMIT") in the background (pid $baseline_pid, log" \
        "$baseline_dir/build.log)"
}

phase_baseline() {
    baseline_start
    if [ -n "$baseline_pid" ]; then
        local code
        wait "$baseline_pid"
        code=$?
        baseline_pid=""
        cat "$baseline_dir/build.log"
        if [ "$code" -ne 0 ]; then
            baseline_why="the baseline's build failed (exit $code; $baseline_dir/build.log, ptxas.log)"
        fi
    fi
    if [ -z "$baseline_why" ] && [ ! -f "$baseline_lib" ]; then
        baseline_why="$baseline_lib was not built"
    fi
    if [ -n "$baseline_why" ]; then
        echo "baseline: none: $baseline_why"
        echo "baseline: the comparison runs with the current build alone"
        baseline_lib=""
        return 1
    fi
    if command -v nm >/dev/null && ! nm -D "$baseline_lib" 2>/dev/null | grep -q ' T af_cuda_backend$'; then
        echo "baseline: $baseline_lib exports no af_cuda_backend"
    fi
    echo "baseline backend: $baseline_lib"
    echo "baseline commit: $(cat "$baseline_dir/COMMIT" 2>/dev/null || echo "? (AF_BASELINE_LIB)")"
    return 0
}

# bench/cuda_compare.py --before-after: both backends in their own processes (the library is loaded once per
# process), torch's flash and cuDNN beside them; rows in order of importance, each written to $OUT as it is measured
phase_before_after() {
    local py pypath="" outdir=${OUT:-$build}
    py=$(python_bin)
    local args=(--before-after --budget "$((allowed - 15))" --out-dir "$outdir")
    [ "$quick" = 1 ] && args+=(--quick)
    if ! has_gpu; then
        [ "$dry" = 1 ] || return 77
        args+=(--dry-run)   # the shapes and the time estimate, without torch
    else
        [ -f "$cuda_lib" ] || { echo "no $cuda_lib"; return 1; }
        [ -d "$build/pypkg" ] && pypath=$build/pypkg
        args+=(--current-lib "$cuda_lib" --attnforge-cli "$cli")
    fi
    local current_label="working tree"
    [ -f "$baseline_dir/CURRENT" ] &&
        current_label="$(head -c 120 "$baseline_dir/CURRENT" | tr '\n' ' ')(the checkout at --prepare-baseline)"
    git -C "$root" rev-parse HEAD >/dev/null 2>&1 &&
        current_label=$(git -C "$root" log -1 --format='%h %s' | cut -c1-80)
    args+=(--current-name "$current_label")
    if [ -n "$baseline_lib" ] && [ -f "$baseline_lib" ]; then
        args+=(--baseline-lib "$baseline_lib" --baseline-name "$(sed -E 's/^([0-9a-f]{7})[0-9a-f]* /\1 /' \
            "$baseline_dir/COMMIT" 2>/dev/null | cut -c1-80 || echo "$baseline_lib")")
    else
        args+=(--baseline-missing "${baseline_why:-phase baseline did not run}")
    fi
    PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
        bounded "$allowed" "$py" "$root/bench/cuda_compare.py" "${args[@]}"
}

phase_cpu_isa() {
    local flags isa code=0 ran=0
    flags=$(grep -m1 '^flags' /proc/cpuinfo)
    [ -x "$cli" ] || return 1
    for isa in avx512 amx; do
        case $isa in
            avx512) echo "$flags" | grep -qw avx512f || continue ;;
            amx) echo "$flags" | grep -qw amx_bf16 || continue ;;
        esac
        ran=1
        echo "-- $isa: the ctest suites that run every ISA this CPU has, then bench --quick"
        if [ -f "$build/CTestTestfile.cmake" ]; then
            (cd "$build" && bounded "$((allowed / 3))" ctest -j"$jobs" --timeout 60 --output-on-failure \
                -R "test_(sdpa_random|ukernel|amx|smoke|concurrency|numerics)") 2>&1 | tail -6 || code=1
        fi
        bounded "$((allowed / 3))" "$cli" bench --isa "$isa" --quick --reps 3 || code=1
        # decode's compute floor on this ISA's direct kernels, against this machine's read pass (about 2 s)
        if [ "$isa" = avx512 ] && [ -x "$build/standalone/decode_compute" ]; then
            echo "-- $isa: decode's compute floor (bench/standalone/decode_compute.c)"
            bounded 30 env ATTNFORGE_ISA="$isa" "$build/standalone/decode_compute" || code=1
        fi
    done
    [ "$ran" = 1 ] || { echo "this CPU has neither avx512f nor amx_bf16"; return 77; }
    return "$code"
}

if [ "$prepare_only" = 1 ]; then   # here, where git has the baseline commit: the sources a device run builds
    mkdir -p "$baseline_dir"
    prepare_baseline || { echo "gpu-check --prepare-baseline: $baseline_why"; exit 1; }
    echo "carry $(realpath --relative-to="$root" "$baseline_dir" 2>/dev/null || echo "$baseline_dir") with the device" \
        "run: scripts/gpu-check.sh --before-after builds it there for the GPU's architecture"
    exit 0
fi
[ "$dry" = 1 ] && echo "gpu-check: DRY RUN (GPU_CHECK_DRY=1): the phases that need a GPU are skipped"
[ "$dry" = 1 ] && budget[compare]=0
default_phases="${phases[*]}"
[ "$quick" = 1 ] && default_phases="${default_phases% cpu_isa}"
[ "$quick" = 1 ] && [ "$before_after" = 1 ] && default_phases="${default_phases% pytest}"
only=" ${GPU_CHECK_PHASES:-$default_phases} "   # GPU_CHECK_PHASES="verify compare": a subset (the build must exist)
for p in "${phases[@]}"; do
    [[ "$only" == *" $p "* ]] || budget[$p]=0
done
for p in "${phases[@]}"; do
    [[ "$only" == *" $p "* ]] && run_phase "$p" "phase_$p"
done

banner "summary (total $(elapsed) s of ${total_budget} s)"
echo "passed: ${passed[*]:-none}"
echo "skipped: ${skipped[*]:-none}"
echo "FAILED: ${failed[*]:-none}"
exit "${#failed[@]}"
