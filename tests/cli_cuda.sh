#!/usr/bin/env bash
# attnforge verify/bench --device cuda end to end, on the CUDA backend compiled against the CPU emulation of CUDA
# (libattnforge_cuda_emulated.so, built in tests/cuda_emu/ of the command's build tree; ATTNFORGE_CUDA_EMULATED names
# another backend, e.g. the real one on a GPU machine): every output is checked against the double reference
# by the command itself; the unavailable backend gives exit 3 and the loader's message; bad --device values exit 2.
# Tiny shapes only: the emulation runs each GPU thread on the CPU.
# Usage: cli_cuda.sh PATH/TO/attnforge   (exit 77 = skipped: the emulated backend is not built)
set -u
cli=$1
emulated=${ATTNFORGE_CUDA_EMULATED:-$(dirname "$cli")/tests/cuda_emu/libattnforge_cuda_emulated.so}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

source "$(dirname "$0")/support/expect.sh"

# ---- bad --device values: exit 2, naming the option
for bad in gpu cuda: cuda:-1 cuda:x cuda0 CUDA ""; do
    expect 2 "--device takes cpu, cuda or cuda:N" "$cli" verify --device "$bad"
    expect 2 "--device takes cpu, cuda or cuda:N" "$cli" bench --device "$bad" --shape 1,1,1,1,1,8,8
done
expect 2 "--device needs a value" "$cli" verify --device
expect 2 "--isa chooses a CPU kernel" "$cli" bench --device cuda --isa portable
expect 0 "--device cpu|cuda|cuda:N" "$cli" verify --help
expect 0 "--device cuda[:N]" "$cli" bench --help

# ---- no backend: exit 3 and the loader's message (which library, how to fix it); the CPU is unaffected
missing="ATTNFORGE_CUDA_LIBRARY=/nonexistent could not be opened"
expect 3 "$missing" env ATTNFORGE_CUDA_LIBRARY=/nonexistent "$cli" verify --device cuda
expect 3 "$missing" env ATTNFORGE_CUDA_LIBRARY=/nonexistent "$cli" bench --device cuda:0 --quick
expect 0 "" env ATTNFORGE_CUDA_LIBRARY=/nonexistent "$cli" bench --device cpu --shape 1,2,1,16,16,8,8 --reps 1 \
    --portable-max-gflop 0

if [ ! -f "$emulated" ]; then
    echo "cli_cuda: $emulated is not built: the emulated part is skipped ($failures failure(s) before it)"
    [ "$failures" -eq 0 ] && exit 77
    exit 1
fi
export ATTNFORGE_CUDA_LIBRARY=$emulated

# ---- verify on the emulated device: a CPU plan's cases run af_sdpa on device tensors (GQA, causal, L != S, Ev != E,
# f32 on the CUDA-core path, decode); a cuda plan's run through the plan (NHD views, non-causal, explicit scale)
cat >"$tmp/cpu.samples.json" <<'JSON'
{"samples": [
  {"args": [{"shape": [1,4,37,64], "dtype": "float16"}, {"shape": [1,2,45,64], "dtype": "float16"},
            {"shape": [1,2,45,64], "dtype": "float16"}], "kwargs": {"is_causal": true, "enable_gqa": true}},
  {"args": [{"shape": [2,2,19,128], "dtype": "bfloat16"}, {"shape": [2,1,33,128], "dtype": "bfloat16"},
            {"shape": [2,1,33,80], "dtype": "bfloat16"}], "kwargs": {"is_causal": true, "enable_gqa": true}},
  {"args": [{"shape": [1,2,21,40], "dtype": "float32"}, {"shape": [1,1,30,40], "dtype": "float32"},
            {"shape": [1,1,30,40], "dtype": "float32"}], "kwargs": {"is_causal": true, "enable_gqa": true}}
]}
JSON
cat >"$tmp/cuda.samples.json" <<'JSON'
{"samples": [
  {"args": [{"shape": [1,2,24,64], "dtype": "bfloat16", "strides": [3072,64,128,1], "device": "cuda:0"},
            {"shape": [1,2,40,64], "dtype": "bfloat16", "strides": [5120,64,128,1], "device": "cuda:0"},
            {"shape": [1,2,40,64], "dtype": "bfloat16", "strides": [5120,64,128,1], "device": "cuda:0"}],
   "kwargs": {"scale": 0.2}},
  {"args": [{"shape": [1,2,1,128], "dtype": "float16", "strides": [256,128,256,1], "device": "cuda:0"},
            {"shape": [1,2,400,128], "dtype": "float16", "strides": [102400,128,256,1], "device": "cuda:0"},
            {"shape": [1,2,400,128], "dtype": "float16", "strides": [102400,128,256,1], "device": "cuda:0"}],
   "kwargs": {"scale": 0.2}}
]}
JSON
expect 0 "3 of 3 checks within tolerance (device cuda:0)" "$cli" verify --device cuda --samples "$tmp/cpu.samples.json"
grep -qE '^samples\[2\] +1,2,1,21,30,40,40 +float32 +yes' "$tmp/out" || fail "no f32 row"
expect 0 "2 of 2 checks within tolerance (device cuda:0)" \
    "$cli" verify --device cuda:0 --samples "$tmp/cuda.samples.json"
grep -qF '"backend": "cuda"' "$tmp/out" || fail "the cuda samples did not give a cuda plan"
expect 3 "this machine has 1 CUDA device" "$cli" verify --device cuda:1 --samples "$tmp/cpu.samples.json"

# ---- bench on the emulated device: the spot check passes; GFLOP/s and GB/s follow from the shape and the seconds
check_row() {   # FILE DECODE(0|1)
    python3 - "$1" "$2" <<'PY' || return 1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
machine = [r for r in rows if r.get("machine")]
checks = [r for r in rows if r.get("spot_check")]
shapes = [r for r in rows if "case" in r]
assert len(machine) == 1 and machine[0]["device"] == "cuda:0", machine
assert len(checks) == 1 and checks[0]["failures"] == 0 and checks[0]["cases"] >= 4, checks
assert len(shapes) == 1 and shapes[0]["ok"], shapes
r = shapes[0]
flops = 2 * r["B"] * r["Hq"] * r["L"] * r["S"] * (r["E"] + r["Ev"])   # non-causal: every key is seen
assert r["seconds"] > 0 and abs(r["tflops"] - flops / r["seconds"] * 1e-12) <= 1e-5 * r["tflops"], r
assert abs(r["gflops"] - 1e3 * r["tflops"]) <= 1e-5 * r["gflops"], r
if sys.argv[2] == "1":
    kv = r["B"] * r["Hkv"] * r["S"] * (r["E"] + r["Ev"]) * {"float32": 4, "float16": 2, "bfloat16": 2}[r["dtype"]]
    assert abs(r["gbps"] - kv / r["seconds"] * 1e-9) <= 1e-5 * r["gbps"], r
else:
    assert "gbps" not in r, r
PY
}
# bench_row DECODE(0|1) bench-options...: bench --device cuda --json, its rows checked
bench_row() {
    local decode=$1
    shift
    if ! "$cli" bench --device cuda --reps 2 --json "$@" >"$tmp/rows" 2>"$tmp/err" || ! check_row "$tmp/rows" "$decode"
    then
        fail "bench --device cuda $*: $(cat "$tmp/rows" "$tmp/err")"
    fi
}
bench_row 0 --shape 1,4,2,48,64,64,64 --dtype bfloat16
bench_row 1 --shape 1,8,2,1,256,64,64 --dtype float16
expect 0 "spot check against the double reference (cuda:0): 4 of 4 within tolerance" \
    "$cli" bench --device cuda --shape 1,2,2,16,16,64,64 --dtype float16 --reps 1

[ "$failures" -eq 0 ] && echo "cli_cuda: all checks passed" || echo "cli_cuda: $failures failure(s)"
exit $((failures > 0))
