#!/usr/bin/env bash
# attnforge plan / run --plan --samples / verify, end to end on the files in tests/data/provider.
# Usage: cli_provider.sh PATH/TO/attnforge   (ctest runs it from tests/)
set -u
cli=$1
data=data/provider
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

source "$(dirname "$0")/support/expect.sh"

# ---- attnforge plan
expect 0 '"flash_kwargs": {"causal": true, "softmax_scale": 0.125}, "copy_free_layout": true' "$cli" plan $data/causal_nhd.samples.json
expect 0 '"type": "FlashAttention4KernelProvider", "version": 1' "$cli" plan $data/causal_nhd.samples.json
expect 0 '"copy_free_layout": false' "$cli" plan $data/issue_example.samples.json
expect 0 'warning: FlashAttention-4 must copy query, key, and value tensors from HND to NHD layout' "$cli" plan $data/issue_example.samples.json
expect 0 '"qkv_source": "keyword_qkv", "flash_kwargs": {"causal": false, "pack_gqa": false}' "$cli" plan $data/gqa_keyword.samples.json
expect 0 '' "$cli" plan $data/causal_nhd.samples.json -o "$tmp/plan.json"
grep -qF '"softmax_scale": 0.125' "$tmp/plan.json" || { echo "FAIL: -o did not write the plan"; failures=$((failures + 1)); }
expect 3 'not supported: FlashAttention-4 provider does not support attn_mask' "$cli" plan $data/mask.samples.json
expect 3 "FlashAttention-4 provider does not support kwargs: ['softcap', 'window']" "$cli" plan $data/unknown_kwarg.samples.json
# cuda samples: a cuda plan, made without a GPU and without loading the CUDA backend
expect 0 '"copy_free_layout": false, "backend": "cuda"}' "$cli" plan $data/cuda.samples.json
expect 0 '"flash_kwargs": {"causal": true, "pack_gqa": false}, "copy_free_layout": true, "backend": "cuda"}' "$cli" plan $data/cuda_two_gpus.samples.json
expect 3 "requires query, key and value on one device (samples[0]: query is on 'cuda:0', key on 'cpu', value on 'cuda:0')" "$cli" plan $data/cuda_mixed.samples.json
expect 3 'requires consistent representative samples (samples[1] differs from samples[0]: backend cpu vs cuda)' "$cli" plan $data/cuda_and_cpu.samples.json
expect 3 "supports devices 'cpu' and 'cuda' only (samples[0]: query is on 'mps')" "$cli" plan $data/mps.samples.json
if env ATTNFORGE_LOG=debug "$cli" plan $data/cuda.samples.json 2>&1 | grep -q 'CUDA backend'; then
    echo "FAIL: plan on cuda samples touched the CUDA backend"; failures=$((failures + 1))
fi
expect 3 'requires consistent representative samples (samples[1] differs from samples[0]: is_causal true vs false)' "$cli" plan $data/inconsistent.samples.json
expect 3 'requires consistent representative samples (the list is empty)' "$cli" plan $data/empty.samples.json
expect 3 'FlashAttention-4 not supported due to: FlashAttention-4 provider does not support attn_mask' env ATTNFORGE_LOG=debug "$cli" plan $data/mask.samples.json
expect 2 'malformed JSON at line 1' "$cli" plan $data/malformed.samples.json
expect 2 'samples[0].args[0].dtype: "float17" is not a PyTorch dtype name' "$cli" plan $data/bad_dtype.samples.json
expect 2 'cannot open' "$cli" plan $data/no-such-file.json
expect 2 'missing SAMPLES.json' "$cli" plan
expect 2 'one samples file' "$cli" plan $data/mask.samples.json $data/empty.samples.json
expect 2 "unknown option '--frobnicate'" "$cli" plan --frobnicate
expect 2 'cannot write' "$cli" plan $data/causal_nhd.samples.json -o "$tmp/no-such-dir/plan.json"
expect 0 'usage: attnforge plan SAMPLES.json [-o PLAN.json]' "$cli" plan --help

# ---- attnforge run with a samples file, a plan file, both
expect 0 '2 of 2 cases within tolerance' "$cli" run --samples $data/causal_nhd.samples.json --reps 1
expect 0 'calls: 4 ran the plan, 0 the general path' "$cli" run --samples $data/causal_nhd.samples.json --reps 1
expect 0 'plan: {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv"' "$cli" run --samples $data/causal_nhd.samples.json --reps 1
# v is an NHD view already: only q and k are copied, on each of the 2 calls
expect 0 '4 HND->NHD tensor copies' "$cli" run --samples $data/issue_example.samples.json --reps 1
expect 0 'calls: 4 ran the plan' "$cli" run --plan "$tmp/plan.json" --samples $data/causal_nhd.samples.json --reps 1
expect 0 'calls: 0 ran the plan, 4 the general path' "$cli" run --plan $data/seed_form.plan.json --samples $data/gqa_keyword.samples.json --reps 1
expect 0 'FlashAttention-4 plan does not match this call (is_causal is false, the plan'"'"'s is true); running it on the general path' \
    env ATTNFORGE_LOG=debug "$cli" run --plan $data/seed_form.plan.json --samples $data/gqa_keyword.samples.json --reps 1
expect 1 'skipped: samples[0].kwargs' "$cli" run --plan "$tmp/plan.json" --samples $data/unknown_kwarg.samples.json --reps 1
expect 0 'calls: 0 ran the plan, 2 the general path' "$cli" run --plan "$tmp/plan.json" --samples $data/mask.samples.json --reps 1 --threads 1
expect 0 '' "$cli" plan $data/gqa_keyword.samples.json -o "$tmp/gqa.plan.json"
expect 0 '2 of 2 cases within tolerance' "$cli" run --plan "$tmp/gqa.plan.json" --reps 1 --isa portable   # the default GQA shapes
expect 3 'not supported: FlashAttention-4 provider does not support attn_mask' "$cli" run --samples $data/mask.samples.json
expect 2 'malformed JSON' "$cli" run --samples $data/malformed.samples.json
expect 2 'plan: version: format 2 is newer than this attnforge' "$cli" run --plan $data/newer.plan.json
expect 3 'not supported here: ' "$cli" run --plan $data/cuda.plan.json   # the loader's message (no GPU here)
expect 2 "unknown option or missing value '--plan'" "$cli" run --plan
expect 0 'usage: attnforge run [--plan PLAN.json] [--samples SAMPLES.json]' "$cli" run --help

# ---- attnforge verify
expect 0 'isa portable' "$cli" verify --samples $data/causal_nhd.samples.json
expect 0 'checks within tolerance' "$cli" verify --plan $data/seed_form.plan.json --samples $data/gqa_keyword.samples.json
expect 3 'does not support attn_mask' "$cli" verify --samples $data/mask.samples.json
expect 2 '--isa does not apply' "$cli" verify --isa portable
expect 0 'usage: attnforge verify' "$cli" verify --help

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
