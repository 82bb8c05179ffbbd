#!/usr/bin/env bash
# The CUDA backend's compile checks: src/cuda/backend.cu compiled by nvcc for sm_80 and sm_90a with ptxas -v; fails
# when a tensor-core kernel for head dims 64 or 128 (the fast paths) has spill stores/loads or a stack frame, or when
# the SASS of those kernels (of BUILD_DIR/libattnforge_cuda.so when it is built, else of the cubins compiled here)
# holds no HMMA (tensor-core) instruction for sm_80 and sm_90, or when a 32-rows-a-warp kernel issues fewer than 3
# HMMA per LDSM (ldmatrix) in its SASS, or when a Hopper kernel (af_wgmma_*) has spills or a stack frame for sm_90a or
# holds no HGMMA (wgmma) or UTMALDG (TMA) there, or when ptxas split a Hopper kernel's S = Q·Kᵀ chain (a
# WARPGROUP.ARRIVE inside it, a dummy HGMMA.64x8x16 closing a group, or warning C7519 "warpgroup.arrive is injected").
# Prints a table: kernel x registers/stack/spills/smem/HMMA/LDSM.
# Usage: scripts/cuda-compile-check.sh BUILD_DIR
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc); CUOBJDUMP (default: on PATH, in the
# toolkit, or pip's nvidia-cuda-cuobjdump; --dump-sass also needs nvdisasm: pip's nvidia-cuda-nvdisasm);
# AF_REQUIRE_SASS_CHECK=1 fails when cuobjdump is missing (default: the SASS check is skipped with a message);
# AF_FAST_KERNEL_REGEX: which kernels are the fast paths (Python regex; default: af_mma_ (forward) and af_bwd_
# (backward) with a 64 or 128 in the name);
# AF_REUSE_KERNEL_REGEX: which must reach AF_MIN_HMMA_PER_LDSM (default 3) HMMA per LDSM (default: the 16-bit
# head-dim 64/128 kernels with 32 rows a warp, af_mma_{f16,bf16}_hd{64,128}).
# Exit status: 0 passed, 1 failed, 77 skipped (no nvcc).
set -u
if [ $# -ne 1 ]; then
    echo "usage: $0 BUILD_DIR" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
build=$1
out=$build/cuda-compile-check
fast_regex=${AF_FAST_KERNEL_REGEX:-'^af_(mma|bwd)_.*(^|[^0-9])(64|128)([^0-9]|$)'}
hopper_regex=${AF_HOPPER_KERNEL_REGEX:-'^af_wgmma_'}
reuse_regex=${AF_REUSE_KERNEL_REGEX:-'^af_mma_(f16|bf16)_hd(64|128)$'}
min_ratio=${AF_MIN_HMMA_PER_LDSM:-3}

nvcc=${NVCC:-$(command -v nvcc || true)}
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
    echo "cuda-compile-check: skipped: nvcc not found (set NVCC or install the CUDA toolkit)"
    exit 77
fi

find_cuobjdump() {
    if [ -n "${CUOBJDUMP:-}" ]; then echo "$CUOBJDUMP"; return; fi
    command -v cuobjdump && return
    [ -x "$(dirname "$nvcc")/cuobjdump" ] && { echo "$(dirname "$nvcc")/cuobjdump"; return; }
    python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
# scripts/install-deps.sh puts PyPI's nvidia-cuda-cuobjdump/nvdisasm into /opt/attnforge-cuda-tools
for base in site.getsitepackages() + [site.getusersitepackages()] + \
        glob.glob("/opt/attnforge-cuda-tools/lib/python3*/site-packages"):
    for path in sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "bin", "cuobjdump"))):
        print(path); sys.exit(0)
PY
}
cuobjdump=$(find_cuobjdump | head -1)

mkdir -p "$out"
echo "cuda-compile-check: $("$nvcc" --version | tail -1)"
failures=0

# ---- ptxas -v for each target: from the build's own log when it has one (scripts/capture-ptxas.sh), else compiled
build_log=$build/cuda-ptxas.log
if [ -s "$build_log" ] && [ -f "$build/libattnforge_cuda.so" ] && [ "$build_log" -nt "$root/src/cuda/backend.cu" ]; then
    echo "ptxas report: $build_log (the build of $build/libattnforge_cuda.so)"
    # one nvcc run reports every target in turn: each line belongs to the target of the last entry function named
    awk -v out="$out" '
        match($0, /for .sm_[0-9]+a?./) { arch = substr($0, RSTART + 8, RLENGTH - 9) }
        arch != "" { print > (out "/ptxas_sm" arch ".log") }' "$build_log"
    for arch in 80 90a; do
        if [ ! -s "$out/ptxas_sm$arch.log" ]; then
            echo "FAIL: the build's ptxas report has no sm_$arch section"
            failures=$((failures + 1))
        fi
    done
else
    for arch in 80 90a; do   # both targets at once: two processes
        "$nvcc" -cubin -std=c++17 -O3 -I"$root/include" -I"$root/src" "-gencode=arch=compute_$arch,code=sm_$arch" \
            --ptxas-options=-v -o "$out/backend_sm$arch.cubin" "$root/src/cuda/backend.cu" >"$out/ptxas_sm$arch.log" 2>&1 &
    done
    for arch in 80 90a; do
        if ! wait -n; then failures=$((failures + 1)); fi
    done
    for arch in 80 90a; do
        if [ ! -s "$out/backend_sm$arch.cubin" ]; then
            echo "FAIL: nvcc for sm_$arch:"
            tail -30 "$out/ptxas_sm$arch.log"
        fi
    done
fi
if [ "$failures" -gt 0 ]; then
    echo "cuda-compile-check: $failures target(s) did not compile"
    exit 1
fi

# ---- the SASS: the build's library when there is one (what ships), else the cubins above
sass_inputs=()
sass_source="(not checked)"
if [ -n "$cuobjdump" ] && PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" --version >/dev/null 2>&1; then
    if [ -f "$build/libattnforge_cuda.so" ]; then
        sass_inputs=("$build/libattnforge_cuda.so")
    else
        sass_inputs=("$out/backend_sm80.cubin" "$out/backend_sm90a.cubin")
    fi
    sass_source="${sass_inputs[*]}"
    : >"$out/sass.txt"
    for input in "${sass_inputs[@]}"; do
        # a bare cubin's dump does not name its target: the file name does
        case $input in
            *_sm80.cubin) echo "arch = sm_80" >>"$out/sass.txt" ;;
            *_sm90a.cubin) echo "arch = sm_90a" >>"$out/sass.txt" ;;
        esac
        # cuobjdump finds nvdisasm beside itself only through PATH
        if ! PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" --dump-sass "$input" >>"$out/sass.txt" 2>"$out/sass.err"; then
            echo "FAIL: cuobjdump --dump-sass $input: $(cat "$out/sass.err")"
            failures=$((failures + 1))
        fi
    done
elif [ "${AF_REQUIRE_SASS_CHECK:-0}" = 1 ]; then
    echo "FAIL: cuobjdump not found (AF_REQUIRE_SASS_CHECK=1): pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    failures=$((failures + 1))
fi

python3 - "$out" "$fast_regex" "${#sass_inputs[@]}" "$sass_source" "$reuse_regex" "$min_ratio" "$hopper_regex" <<'PY' || failures=$((failures + 1))
import os, re, sys
out, fast_regex, sass_count, sass_source = sys.argv[1], re.compile(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
reuse_regex, min_ratio, hopper_regex = re.compile(sys.argv[5]), float(sys.argv[6]), re.compile(sys.argv[7])

def ptxas_report(path):
    """{kernel: {regs, stack, spill_st, spill_ld, smem}} from ptxas -v, entry functions only."""
    kernels, current, pending = {}, None, None
    for line in open(path, errors="replace"):
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            kernels[current] = {"regs": 0, "stack": 0, "spill_st": 0, "spill_ld": 0, "smem": 0}
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            pending = m.group(1) if m.group(1) in kernels else None
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and pending:
            k = kernels[pending]
            k["stack"], k["spill_st"], k["spill_ld"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            kernels[current]["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            kernels[current]["smem"] = int(s.group(1)) if s else 0
    return kernels

def s_chain_splits(path):
    """{(arch, kernel): WARPGROUP.ARRIVE placed right before an SS HGMMA (A by descriptor: S = Q·Kᵀ) that accumulates
    (its C operand is not RZ: a chain's later k-step), i.e. ptxas split the chain} from cuobjdump --dump-sass."""
    splits, arrived = {}, False
    for key, line in sass_lines(path):
        splits.setdefault(key, 0)
        if line is None or re.search(r"\bWARPGROUP\.ARRIVE\b", line):
            arrived = line is not None   # a kernel's start clears it
        elif re.search(r"\bHGMMA\.", line):
            ss = re.search(r"HGMMA\.\S+ R\d+, gdesc\[", line)
            if arrived and ss and not re.search(r", RZ\b", line.split("gdesc", 2)[-1]):
                splits[key] += 1
            arrived = False
    return splits

def c7519(path):
    """{kernel: ptxas C7519 notes (warpgroup.arrive injected)} from a ptxas -v log."""
    found = {}
    for line in open(path, errors="replace"):
        m = re.search(r"\(C7519\).*in function '([^']+)'", line)
        if m:
            found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found

def sass_lines(path):
    """(arch, kernel), line for every line of a kernel in cuobjdump --dump-sass (line None at the kernel's start)."""
    arch, kernel = None, None
    for line in open(path, errors="replace"):
        m = re.match(r"\s*arch = (sm_\w+)", line)
        if m:
            arch, kernel = m.group(1), None
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            kernel = m.group(1)
            yield (arch, kernel), None
        elif kernel:
            yield (arch, kernel), line

def sass_counts(path, opcode, pattern=None):
    """{(arch, kernel): number of `opcode` instructions (or lines matching `pattern`)} from cuobjdump --dump-sass."""
    pattern = re.compile(pattern or (r"\b" + opcode + r"\."))
    counts = {}
    for key, line in sass_lines(path):
        counts[key] = counts.get(key, 0) + (line is not None and bool(pattern.search(line)))
    return counts

failures = []
hmma = sass_counts(os.path.join(out, "sass.txt"), "HMMA") if sass_count else {}
ldsm = sass_counts(os.path.join(out, "sass.txt"), "LDSM") if sass_count else {}
hgmma = sass_counts(os.path.join(out, "sass.txt"), "HGMMA") if sass_count else {}
utmaldg = sass_counts(os.path.join(out, "sass.txt"), "UTMALDG") if sass_count else {}
bar_arv = sass_counts(os.path.join(out, "sass.txt"), "", r"\bBAR\.ARV\b") if sass_count else {}
depbar = sass_counts(os.path.join(out, "sass.txt"), "", r"\bWARPGROUP\.DEPBAR\b") if sass_count else {}
arrive = sass_counts(os.path.join(out, "sass.txt"), "", r"\bWARPGROUP\.ARRIVE\b") if sass_count else {}
splits = s_chain_splits(os.path.join(out, "sass.txt")) if sass_count else {}
dummies = sass_counts(os.path.join(out, "sass.txt"), "", r"\bHGMMA\.64x8x16\b") if sass_count else {}
injected = c7519(os.path.join(out, "ptxas_sm90a.log"))
print(f"\nfast paths: kernels matching /{fast_regex.pattern}/ (*); static smem only (dynamic smem is set at launch)")
print(f"SASS from: {sass_source}")
print(f"HMMA/LDSM >= {min_ratio:g} for kernels matching /{reuse_regex.pattern}/ (+)")
print("| target | kernel | regs | stack | spill st | spill ld | smem | HMMA | LDSM | HMMA/LDSM |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for arch in ("80", "90a"):
    kernels = ptxas_report(os.path.join(out, f"ptxas_sm{arch}.log"))
    if not kernels:
        failures.append(f"sm_{arch}: ptxas reported no entry function")
    fast = [name for name in kernels if fast_regex.search(name)]
    if not fast:
        failures.append(f"sm_{arch}: no kernel matches the fast-path pattern (the tensor-core kernels for head dims "
                        f"64 and 128): {sorted(kernels)}")
    for name in sorted(kernels):
        k = kernels[name]
        is_fast = name in fast
        count = hmma.get((f"sm_{arch}", name))
        loads = ldsm.get((f"sm_{arch}", name))
        shown = "-" if count is None else str(count)
        ratio = count / loads if count is not None and loads else None
        is_reuse = bool(reuse_regex.search(name))
        print(f"| sm_{arch} | {name}{' *' if is_fast else ''}{' +' if is_reuse else ''} | {k['regs']} | {k['stack']} | "
              f"{k['spill_st']} | {k['spill_ld']} | {k['smem']} | {shown} | {'-' if loads is None else loads} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} |")
        if hopper_regex.search(name) and arch == "90a":
            wg, tma = hgmma.get((f"sm_{arch}", name)), utmaldg.get((f"sm_{arch}", name))
            arv, dep = bar_arv.get((f"sm_{arch}", name)), depbar.get((f"sm_{arch}", name))
            print(f"|   | (sm_90a Hopper kernel: {wg} HGMMA, {tma} UTMALDG, {dep} WARPGROUP.DEPBAR, "
                  f"{arrive.get((f'sm_{arch}', name))} WARPGROUP.ARRIVE, {arv} BAR.ARV) | | | | | | | | |")
            if injected.get(name):
                failures.append(f"sm_90a {name}: ptxas injected warpgroup.arrive {injected[name]} times (C7519): a "
                                f"wgmma chain is split by a branch or a register access between its k-steps")
            key = (f"sm_{arch}", name)
            if sass_count and (splits.get(key) or dummies.get(key)):
                failures.append(f"sm_90a {name}: {splits.get(key)} WARPGROUP.ARRIVE inside an S = Q·Kᵀ chain and "
                                f"{dummies.get(key)} dummy HGMMA.64x8x16 in its SASS (want one ARRIVE before each "
                                f"chain, none inside)")
            if k["stack"] or k["spill_st"] or k["spill_ld"]:
                failures.append(f"sm_90a {name}: {k['stack']} bytes stack frame, {k['spill_st']} bytes spill stores, "
                                f"{k['spill_ld']} bytes spill loads (the Hopper kernels must have none)")
            if sass_count and (not wg or not tma):
                failures.append(f"sm_90a {name}: {wg} HGMMA and {tma} UTMALDG in its SASS (want both: wgmma and TMA)")
            if sass_count and re.search(r"_hd(64|128)$", name) and not arv:
                failures.append(f"sm_90a {name}: no BAR.ARV in its SASS (the consumers' ping-pong hands turns over "
                                f"with named barriers)")
        if is_reuse and sass_count and count and (ratio is None or ratio < min_ratio):
            failures.append(f"sm_{arch} {name}: {count} HMMA for {loads} LDSM in its SASS (want >= {min_ratio:g} "
                            f"HMMA per LDSM: each K/V fragment read from shared memory must feed the warp's 32 rows)")
        if is_fast and (k["stack"] or k["spill_st"] or k["spill_ld"]):
            failures.append(f"sm_{arch} {name}: {k['stack']} bytes stack frame, {k['spill_st']} bytes spill stores, "
                            f"{k['spill_ld']} bytes spill loads (the fast paths must have none)")
        if is_fast and sass_count and not count:
            failures.append(f"sm_{arch} {name}: no HMMA in its SASS" if count == 0 else
                            f"sm_{arch} {name}: not found in the SASS of {sass_source}")
if not any(hopper_regex.search(name) for name in ptxas_report(os.path.join(out, "ptxas_sm90a.log"))):
    failures.append(f"sm_90a: no kernel matches /{hopper_regex.pattern}/ (the Hopper kernels)")
if sass_count and not any(reuse_regex.search(name) for arch in ("80", "90a")
                          for name in ptxas_report(os.path.join(out, f"ptxas_sm{arch}.log"))):
    failures.append(f"no kernel matches /{reuse_regex.pattern}/ (the 32-rows-a-warp kernels)")
if not sass_count:
    print("SASS check skipped: cuobjdump (with nvdisasm) not found: pip install nvidia-cuda-cuobjdump "
          "nvidia-cuda-nvdisasm, or set CUOBJDUMP")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
PY

[ "$failures" -eq 0 ] && echo "cuda-compile-check: passed" || echo "cuda-compile-check: $failures failure(s)"
exit $((failures > 0))
