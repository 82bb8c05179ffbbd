#!/usr/bin/env python3
"""attnforge vs torch.nn.functional.scaled_dot_product_attention on the CPU (PyTorch picks its own kernel,
normally its CPU flash attention), on the shapes of the speed issue. Runs are interleaved (PyTorch, attnforge,
PyTorch, ...) so that load from other processes hits both alike; the table gives medians and their ratio.

    python bench/torch_compare.py                 # the full table (a few minutes on 2 cores)
    python bench/torch_compare.py --quick         # L=S=512 and S=4096 decode only
    python bench/torch_compare.py --repeats 9 --threads 2 --json

attnforge runs through the provider (prepared on the shape, as attnforge.torch.apply runs it), on HND views of
NHD-contiguous tensors (what a transformer's `x.view(B, L, H, D).transpose(1, 2)` gives: the copy-free plan).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnforge

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def shapes(quick):
    """(name, B, Hq, Hkv, L, S, E, causal) rows: issue 4's prefill and decode shapes."""
    rows = []
    for L in ([512] if quick else [512, 2048, 4096]):
        for E in (64, 128):
            for causal in (False, True):
                rows.append(("prefill", 1, 16, 16, L, L, E, causal))
    for S in ([4096] if quick else [4096, 32768]):
        rows.append(("decode", 1, 32, 8, 1, S, 128, False))
    return rows


def make_inputs(B, Hq, Hkv, L, S, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def hnd_view(h, n):   # HND view of NHD-contiguous memory
        return torch.randn(B, n, h, E, generator=g).to(dtype).transpose(1, 2)

    return hnd_view(Hq, L), hnd_view(Hkv, S), hnd_view(Hkv, S)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fa4_flops(B, Hq, L, S, E, causal):
    """FA4's count: 2·B·Hq·L·S'·(E+Ev), S' = keys seen per row on average (top-left causal)."""
    seen = sum(min(i + 1, S) for i in range(L)) / L if causal else S
    return 2.0 * B * Hq * L * seen * (E + E)


def bench_row(row, dtype_name, repeats):
    kind, B, Hq, Hkv, L, S, E, causal = row
    dtype = DTYPES[dtype_name]
    q, k, v = make_inputs(B, Hq, Hkv, L, S, E, dtype)
    kwargs = {"is_causal": causal}
    if Hq != Hkv:
        kwargs["enable_gqa"] = True
    provider = attnforge.FlashAttention4KernelProvider()
    if not provider.prepare([((q, k, v), kwargs)]):
        raise SystemExit(f"attnforge refused {row}: {provider.reason}")
    provider.load_runtime_dependencies()

    def run_torch():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def run_attnforge():
        return provider(q, k, v, **kwargs)

    with torch.inference_mode():
        want, got = run_torch(), run_attnforge()   # warm-up, and the two must agree
        max_diff = (want.float() - got.float()).abs().max().item()
        times = {"pytorch": [], "attnforge": []}
        for r in range(repeats):
            order = ("pytorch", "attnforge") if r % 2 == 0 else ("attnforge", "pytorch")
            for name in order:
                times[name].append(timed(run_torch if name == "pytorch" else run_attnforge))
    t_torch, t_af = statistics.median(times["pytorch"]), statistics.median(times["attnforge"])
    flops = fa4_flops(B, Hq, L, S, E, causal)
    return {"kind": kind, "dtype": dtype_name, "causal": causal, "B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "S": S,
            "E": E, "Ev": E, "pytorch_ms": t_torch * 1e3, "attnforge_ms": t_af * 1e3,
            "pytorch_gflops": flops / t_torch / 1e9, "attnforge_gflops": flops / t_af / 1e9,
            "speedup": t_torch / t_af, "max_abs_diff": max_diff, "repeats": repeats}


def markdown(results):
    lines = ["| kind | dtype | causal | B,Hq,Hkv,L,S,E | PyTorch ms | attnforge ms | PyTorch GFLOP/s | "
             "attnforge GFLOP/s | speed-up (PyTorch / attnforge) | max abs diff |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['kind']} | {r['dtype']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['B']},{r['Hq']},{r['Hkv']},{r['L']},{r['S']},{r['E']} | {r['pytorch_ms']:.2f} | "
                     f"{r['attnforge_ms']:.2f} | {r['pytorch_gflops']:.1f} | {r['attnforge_gflops']:.1f} | "
                     f"**{r['speedup']:.2f}×** | {r['max_abs_diff']:.1e} |")
    ratios = [r["speedup"] for r in results]
    geo = statistics.geometric_mean(ratios)
    lines.append("")
    lines.append(f"Geometric mean speed-up: **{geo:.2f}×** over {len(ratios)} rows "
                 f"(min {min(ratios):.2f}×, max {max(ratios):.2f}×).")
    return "\n".join(lines)


def machine_line(threads):
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}; {threads} threads; PyTorch {torch.__version__} (CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}); attnforge {attnforge.__version__} (ISA {attnforge.get_isa()}); "
            f"Python {platform.python_version()}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=S=512 prefill and S=4096 decode only")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per implementation and row (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both libraries")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="dtypes to run (repeatable; default float32 and bfloat16)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    attnforge.set_num_threads(args.threads)
    dtypes = args.dtype or ["float32", "bfloat16"]
    results = []
    for row in shapes(args.quick):
        for dtype_name in dtypes:
            result = bench_row(row, dtype_name, args.repeats)
            results.append(result)
            print(json.dumps(result) if args.json else
                  f"{result['kind']:8s} {dtype_name:9s} causal={result['causal']!s:5s} L={result['L']:5d} "
                  f"S={result['S']:5d} E={result['E']:3d}: PyTorch {result['pytorch_ms']:9.2f} ms, attnforge "
                  f"{result['attnforge_ms']:9.2f} ms, speed-up {result['speedup']:.2f}x", file=sys.stdout if args.json
                  else sys.stderr, flush=True)
    if not args.json:
        print(f"Machine: {machine_line(args.threads)}\n")
        print(markdown(results))


if __name__ == "__main__":
    main()
