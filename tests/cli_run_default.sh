#!/usr/bin/env bash
# `attnforge run` and `attnforge` with no arguments: the built-in default samples go end to end
# (samples -> prepare -> plan -> JSON -> from_json -> infer) and every case is within tolerance.
set -u
cli=$1
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
"$cli" run --reps 1 >"$out" 2>"$err" || { echo "FAIL: attnforge run exited $?"; cat "$out" "$err"; exit 1; }
cat "$out"
grep -q '^6 of 6 cases within tolerance$' "$out" || { echo "FAIL: not every default case passed"; exit 1; }
grep -q '^plan for prefill-gqa: {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "keyword_qkv", "flash_kwargs": {"causal": true, "pack_gqa": false}, "copy_free_layout": true' "$err" ||
    { echo "FAIL: the default plans are not shown on stderr"; cat "$err"; exit 1; }
grep -q 'FlashAttention-4 must copy query, key, and value tensors' "$err" || { echo "FAIL: no copy-path warning for prefill-f16"; exit 1; }
grep -q '^running mha-1024' "$err" || { echo "FAIL: no progress"; exit 1; }
echo "ok"
