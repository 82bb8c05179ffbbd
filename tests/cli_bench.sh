#!/usr/bin/env bash
# attnforge bench end to end on tiny shapes: the --json rows carry the keys issue 4 names, with values that are
# consistent with each other (GFLOP/s by FA4's formula from the shape and the seconds; shares of a positive peak);
# bad options fail with exit code 2. Timing values are never compared with a threshold.
# Usage: cli_bench.sh PATH/TO/attnforge
set -u
cli=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# check_rows FILE DECODE(0|1): every row object has the required keys and self-consistent values
check_rows() {
    python3 - "$1" "$2" <<'PY' || return 1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
machine = [r for r in rows if r.get("machine")]
shapes = [r for r in rows if "case" in r]
assert len(machine) == 1 and machine[0]["peak_gflops"] > 0 and machine[0]["peak_gbps"] > 0, machine
assert len(shapes) == 1, shapes
r = shapes[0]
need = ["dtype", "causal", "B", "Hq", "Hkv", "L", "S", "E", "Ev", "threads", "isa", "seconds", "gflops",
        "peak_gflops", "peak_ratio"]
if sys.argv[2] == "1":
    need += ["gbps", "peak_gbps"]
missing = [k for k in need if k not in r]
assert not missing, f"missing keys {missing} in {r}"
assert r["ok"] and r["seconds"] > 0 and r["peak_gflops"] > 0 and r["peak_ratio"] > 0, r
flops = 2 * r["B"] * r["Hq"] * r["L"] * r["S"] * (r["E"] + r["Ev"])   # non-causal: every key is seen
assert abs(r["gflops"] - flops / r["seconds"] * 1e-9) <= 1e-6 * r["gflops"], r
if sys.argv[2] == "1":
    kv = r["B"] * r["Hkv"] * r["S"] * (r["E"] + r["Ev"]) * {"float32": 4, "float16": 2, "bfloat16": 2}[r["dtype"]]
    assert abs(r["gbps"] - kv / r["seconds"] * 1e-9) <= 1e-6 * r["gbps"], r
    assert r["peak_gbps"] > 0 and r["bandwidth_ratio"] > 0, r
PY
}

if "$cli" bench --shape 1,4,2,64,80,24,16 --dtype bfloat16 --reps 2 --threads 2 --json >"$tmp/prefill" 2>"$tmp/err"; then
    check_rows "$tmp/prefill" 0 || fail "prefill rows: $(cat "$tmp/prefill")"
    grep -q '"threads":2' "$tmp/prefill" || fail "--threads 2 not reported"
else
    fail "bench --shape (prefill) exited non-zero: $(cat "$tmp/err")"
fi
if "$cli" bench --shape 1,8,2,1,600,32,32 --dtype float16 --reps 2 --json >"$tmp/decode" 2>"$tmp/err"; then
    check_rows "$tmp/decode" 1 || fail "decode rows: $(cat "$tmp/decode")"
else
    fail "bench --shape (decode) exited non-zero: $(cat "$tmp/err")"
fi
if "$cli" bench --shape 1,4,4,48,48,32,32 --layout nhd --reps 2 --json >"$tmp/nhd" 2>"$tmp/err"; then
    check_rows "$tmp/nhd" 0 || fail "nhd rows: $(cat "$tmp/nhd")"
    grep -q '"layout":"nhd"' "$tmp/nhd" || fail "--layout nhd not reported"
    grep -q '"failures":0' "$tmp/nhd" || fail "nhd spot check failed: $(cat "$tmp/nhd")"
else
    fail "bench --layout nhd exited non-zero: $(cat "$tmp/err")"
fi
"$cli" bench --shape 1,2,1,16,16,8,8 --reps 2 --isa portable >"$tmp/table" 2>&1 || fail "bench --isa portable: $(cat "$tmp/table")"
grep -q 'isa portable' "$tmp/table" || fail "table does not name the portable isa: $(head -3 "$tmp/table")"

for bad in "--shape 1,3,2,8,8,8,8" "--shape 1,2,1,8,8" "--dtype float64" "--threads -1" "--threads x" "--reps 0" "--isa sse9" "--layout bhsd" "--frobnicate"; do
    # shellcheck disable=SC2086
    "$cli" bench $bad --reps 1 >"$tmp/out" 2>&1
    code=$?
    [ "$code" -eq 2 ] || fail "bench $bad -> exit $code (want 2): $(head -3 "$tmp/out")"
done

[ "$failures" -eq 0 ] && echo "cli_bench: all checks passed" || echo "cli_bench: $failures failure(s)"
exit $((failures > 0))
