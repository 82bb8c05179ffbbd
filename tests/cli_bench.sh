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
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
    kv = r["B"] * r["Hkv"] * r["S"] * (r["E"] + r["Ev"]) * sizes[r.get("kv_dtype", r["dtype"])]
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
# a float8 K/V cache under an f16 q (af_flash_attn): bytes counted at one per K/V element
if "$cli" bench --shape 1,8,2,1,600,32,32 --dtype float16 --kv-dtype float8_e4m3fn --reps 2 --json >"$tmp/f8" \
    2>"$tmp/err"; then
    check_rows "$tmp/f8" 1 || fail "float8 decode rows: $(cat "$tmp/f8")"
    grep -q '"kv_dtype":"float8_e4m3fn"' "$tmp/f8" || fail "--kv-dtype not reported: $(cat "$tmp/f8")"
else
    fail "bench --kv-dtype exited non-zero: $(cat "$tmp/err")"
fi
if "$cli" bench --shape 1,4,4,48,48,32,32 --layout nhd --reps 2 --json >"$tmp/nhd" 2>"$tmp/err"; then
    check_rows "$tmp/nhd" 0 || fail "nhd rows: $(cat "$tmp/nhd")"
    grep -q '"layout":"nhd"' "$tmp/nhd" || fail "--layout nhd not reported"
    grep -q '"failures":0' "$tmp/nhd" || fail "nhd spot check failed: $(cat "$tmp/nhd")"
else
    fail "bench --layout nhd exited non-zero: $(cat "$tmp/err")"
fi
# --features at tiny sizes: each pair's two rows and its comparison, with the keys docs/BENCHMARKS.md reads
if "$cli" bench --features --features-len 256 --window 32 --dtype bfloat16 --reps 2 --json >"$tmp/features" \
    2>"$tmp/err"; then
    python3 - "$tmp/features" <<'PY' || fail "features rows: $(cat "$tmp/features")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
calls = {r["case"]: r for r in rows if "case" in r}
pairs = {r["pair"]: r for r in rows if "pair" in r}
assert sorted(calls) == ["bf16kv", "contig", "f8kv", "full", "padded", "paged", "varlen", "window"], calls
assert sorted(pairs) == ["fp8_vs_f16", "paged_vs_contiguous", "varlen_vs_padded", "window_vs_full"], pairs
for r in calls.values():
    assert r["ok"] and r["dtype"] == "bfloat16" and r["seconds"] > 0 and r["gflops"] > 0 and r["peak_ratio"] > 0, r
assert calls["window"]["window_left"] == 32 and calls["window"]["window_right"] == 0, calls["window"]
assert calls["full"]["L"] == calls["full"]["S"] == 256 and calls["paged"]["S"] == 256, calls
assert calls["paged"]["page_size"] == 16 and calls["paged"]["bandwidth_ratio"] > 0, calls["paged"]
# FLOPs of the keys each row sees: full 2·H·L·S·2E; window (32, 0): min(i + 1, 33) keys in row i
full, window = calls["full"], calls["window"]
flops = lambda r: r["gflops"] * r["seconds"] * 1e9
assert abs(flops(full) - 2 * 4 * 256 * 256 * 256) <= 1e-6 * flops(full), full
seen = sum(min(i + 1, 33) for i in range(256))
assert abs(flops(window) - 2 * 4 * seen * 256) <= 1e-6 * flops(window), window
w = pairs["window_vs_full"]
assert abs(w["work_ratio"] - seen / 256 ** 2) < 1e-3 and w["target"] == 0.1 and w["time_ratio"] > 0, w
for name in ("varlen_vs_padded", "paged_vs_contiguous"):
    p = pairs[name]
    assert p["time_ratio"] > 0 and p["cpu_time_ratio"] > 0 and 0 <= p["agreement"] <= 1, p
assert 0.25 < pairs["varlen_vs_padded"]["work_ratio"] < 0.35 and pairs["paged_vs_contiguous"]["target"] == 1.1, pairs
# the float8 pair: decode over 4·256 keys, half the bytes, the same values in both caches: outputs within the bound
# (bit for bit when both take the same tiles; a multi-head direct item's keys per tile follow its bytes per key)
f8, f16 = calls["f8kv"], calls["bf16kv"]
assert f8["S"] == f16["S"] == 1024 and f8["B"] == 1 and f8["Hq"] == 32 and f8["Hkv"] == 8, (f8, f16)
bytes_f8, bytes_f16 = f8["kv_gbps"] * f8["seconds"], f16["kv_gbps"] * f16["seconds"]
assert abs(2 * bytes_f8 - bytes_f16) <= 1e-4 * bytes_f16, (f8, f16)
p = pairs["fp8_vs_f16"]
assert p["work_ratio"] == 0.5 and abs(p["target"] - 1 / 1.8) < 0.01, p
assert 0 <= p["agreement"] <= 1 and p["time_ratio"] > 0, p
PY
else
    fail "bench --features exited non-zero: $(cat "$tmp/err")"
fi
# --backward on one tiny causal GQA shape: the forward and backward halves, FLOPs by FA4's count (backward 2.5x)
if "$cli" bench --backward --shape 1,4,2,48,40,32,24 --dtype bfloat16 --causal --reps 2 --json >"$tmp/backward" \
    2>"$tmp/err"; then
    python3 - "$tmp/backward" <<'PY' || fail "backward rows: $(cat "$tmp/backward")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
machine = [r for r in rows if r.get("machine")]
check = [r for r in rows if r.get("spot_check")]
shapes = [r for r in rows if "case" in r]
assert len(machine) == 1 and machine[0]["backward"] and machine[0]["peak_gflops"] > 0, machine
assert len(check) == 1 and check[0]["failures"] == 0 and check[0]["cases"] > 0, check
assert len(shapes) == 1, shapes
r = shapes[0]
assert r["ok"] and r["dtype"] == "bfloat16" and r["causal"] and (r["Hq"], r["Hkv"], r["L"], r["S"]) == (4, 2, 48, 40), r
seen = sum(min(i + 1, 40) for i in range(48))   # top-left causal: row i sees min(i + 1, S) keys
assert r["forward_flops"] == 2 * 4 * seen * (32 + 24) and r["backward_flops"] == 2.5 * r["forward_flops"], r
for half in ("forward", "backward"):
    assert r[half + "_seconds"] > 0 and r[half + "_peak_ratio"] > 0, r
    gflops = r[half + "_flops"] / r[half + "_seconds"] * 1e-9
    assert abs(r[half + "_gflops"] - gflops) <= 1e-6 * gflops, (half, r)
assert abs(r["seconds"] - r["forward_seconds"] - r["backward_seconds"]) <= 1e-9 and r["peak_gflops"] > 0, r
PY
else
    fail "bench --backward exited non-zero: $(cat "$tmp/err")"
fi
"$cli" bench --shape 1,2,1,16,16,8,8 --reps 2 --isa portable >"$tmp/table" 2>&1 || fail "bench --isa portable: $(cat "$tmp/table")"
grep -q 'isa portable' "$tmp/table" || fail "table does not name the portable isa: $(head -3 "$tmp/table")"

for bad in "--shape 1,3,2,8,8,8,8" "--shape 1,2,1,8,8" "--dtype float64" "--threads -1" "--threads x" "--reps 0" "--isa sse9" "--layout bhsd" "--frobnicate" \
    "--features --causal" "--features --shape 1,2,1,8,8,8,8" "--features-len 64" "--features --window 0" \
    "--kv-dtype float8" "--features --pair fp8" "--pair fp8_vs_f16" "--backward --features" \
    "--backward --kv-dtype float8_e4m3fn" "--backward --device cuda"; do
    # shellcheck disable=SC2086
    "$cli" bench $bad --reps 1 >"$tmp/out" 2>&1
    code=$?
    [ "$code" -eq 2 ] || fail "bench $bad -> exit $code (want 2): $(head -3 "$tmp/out")"
done

[ "$failures" -eq 0 ] && echo "cli_bench: all checks passed" || echo "cli_bench: $failures failure(s)"
exit $((failures > 0))
