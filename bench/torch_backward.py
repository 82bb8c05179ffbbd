#!/usr/bin/env python3
"""attnforge vs PyTorch's CPU flash attention, forward + backward (a training step's attention), on issue 36's
shapes. Each side runs its forward with the log-sum-exp, then its backward from it:

    PyTorch:   aten::_scaled_dot_product_flash_attention_for_cpu, then ..._for_cpu_backward
    attnforge: attnforge.scaled_dot_product_attention(..., return_lse=True), then attnforge._backward.sdpa_backward

Runs are interleaved (PyTorch, attnforge, attnforge, PyTorch, ...) so that load from other processes hits both
alike; the table gives medians, the ratio of the medians of fwd+bwd, and the geometric mean over the rows. q, k, v
and dout are HND views of NHD-contiguous memory (what a transformer's x.view(B, L, H, E).transpose(1, 2) gives).

The FMA peak comes from the attnforge CLI of the same build (`attnforge bench --backward --json` on a tiny shape,
whose machine row measures the f32 FMA loop of the same ISA and thread count, best of three trials), run just
before and just after each row: the row's peak is the larger of the two, so each backward's share of it compares
measurements taken seconds apart. Backward FLOPs are 2.5x FA4's forward count (causal: the keys each row sees).

    python bench/torch_backward.py --cli build/attnforge                  # the 16 rows (~10 minutes on 2 cores)
    python bench/torch_backward.py --cli build/attnforge --quick          # L=S=1024, E=64
    python bench/torch_backward.py --cli build/attnforge --repeats 7 --json > rows.jsonl
    python bench/torch_backward.py --table rows.jsonl                    # their table
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import attnforge
from attnforge import _backward
from torch_compare import fa4_flops, machine_line   # bench/ is on the path: the forward's count, the machine

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKWARD_FLOP_FACTOR = 2.5   # FA4's convention
B, H = 1, 16


def shapes(quick):
    """(L, E, causal) rows, L = S; the same set as `attnforge bench --backward`."""
    return [(L, E, causal) for L in ([1024] if quick else [2048, 4096]) for E in ([64] if quick else [64, 128])
            for causal in (False, True)]


def fma_peak(cli, threads, isa):
    """The f32 FMA peak the CLI of the same build measures now for `threads` threads of `isa`: (GFLOP/s, GFLOP per
    CPU-second)."""
    cmd = [cli, "bench", "--backward", "--shape", "1,1,1,16,16,16,16", "--reps", "1", "--json", "--threads",
           str(threads), "--isa", isa]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        row = json.loads(line)
        if row.get("machine"):
            return row["peak_gflops"], row["peak_cpu_gflops"]
    raise SystemExit(f"{' '.join(cmd)} gave no machine row (exit {done.returncode}): {done.stderr.strip()}")


def nhd(n, E, dtype, g):
    return torch.randn(B, n, H, E, generator=g).to(dtype).transpose(1, 2)


def pytorch_step(q, k, v, dout, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def pytorch_backward(state, q, k, v, dout, causal):
    out, lse = state
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def attnforge_step(q, k, v, dout, causal):
    return attnforge.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)


def attnforge_backward(state, q, k, v, dout, causal):
    out, lse = state
    return _backward.sdpa_backward(dout, q, k, v, out, lse, is_causal=causal)


SIDES = {"pytorch": (pytorch_step, pytorch_backward), "attnforge": (attnforge_step, attnforge_backward)}


def relative_difference(got, want):
    """max |got - want| / max |want| over each gradient, the worst of the three"""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(got, want))


def bench_row(L, E, causal, dtype_name, repeats, peak_fn):
    """One row; peak_fn() is called after the timing and gives the row's peak (GFLOP/s)."""
    g = torch.Generator().manual_seed(L * 1000 + E * 2 + causal)
    dtype = DTYPES[dtype_name]
    q, k, v, dout = (nhd(L, E, dtype, g) for _ in range(4))
    times = {side: {"forward": [], "backward": [], "forward_cpu": [], "backward_cpu": []} for side in SIDES}
    grads = {}
    with torch.no_grad():
        for side, (forward, backward) in SIDES.items():   # warm-up; the gradients must agree
            grads[side] = backward(forward(q, k, v, dout, causal), q, k, v, dout, causal)
        for r in range(repeats):
            for side in (("pytorch", "attnforge") if r % 2 == 0 else ("attnforge", "pytorch")):
                forward, backward = SIDES[side]
                c0, t0 = time.process_time(), time.perf_counter()
                state = forward(q, k, v, dout, causal)
                c1, t1 = time.process_time(), time.perf_counter()
                backward(state, q, k, v, dout, causal)
                c2, t2 = time.process_time(), time.perf_counter()
                times[side]["forward"].append(t1 - t0)
                times[side]["backward"].append(t2 - t1)
                times[side]["forward_cpu"].append(c1 - c0)
                times[side]["backward_cpu"].append(c2 - c1)
                del state
    flops, (peak, peak_cpu) = fa4_flops(B, H, L, L, E, causal), peak_fn()
    row = {"dtype": dtype_name, "causal": causal, "B": B, "H": H, "L": L, "S": L, "E": E, "repeats": repeats,
           "peak_gflops": peak, "peak_cpu_gflops": peak_cpu,
           "grad_rel_diff": relative_difference(grads["attnforge"], grads["pytorch"])}
    for side, t in times.items():
        total = [f + b for f, b in zip(t["forward"], t["backward"])]
        fwd, bwd, both = statistics.median(t["forward"]), statistics.median(t["backward"]), statistics.median(total)
        row[side] = {"forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3, "total_ms": both * 1e3,
                     "forward_gflops": flops / fwd * 1e-9, "backward_gflops": BACKWARD_FLOP_FACTOR * flops / bwd * 1e-9}
        for half, work in (("forward", flops), ("backward", BACKWARD_FLOP_FACTOR * flops)):
            row[side][half + "_peak_ratio"] = row[side][half + "_gflops"] / peak
            # FLOPs per CPU-second against the FMA loop's: robust to load (counts spinning threads as busy)
            row[side][half + "_cpu_peak_ratio"] = work / statistics.median(t[half + "_cpu"]) * 1e-9 / peak_cpu
    row["speedup"] = row["pytorch"]["total_ms"] / row["attnforge"]["total_ms"]
    row["backward_speedup"] = row["pytorch"]["backward_ms"] / row["attnforge"]["backward_ms"]
    return row


def markdown(results):
    lines = ["| dtype | causal | L=S | E | PyTorch fwd+bwd ms | attnforge fwd+bwd ms | **speed-up** | "
             "attnforge bwd GFLOP/s (% peak; per CPU-s) | PyTorch bwd GFLOP/s (% peak; per CPU-s) | "
             "attnforge fwd GFLOP/s | peak |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        a, p = r["attnforge"], r["pytorch"]
        lines.append(f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['L']} | {r['E']} | {p['total_ms']:.0f} | "
                     f"{a['total_ms']:.0f} | **{r['speedup']:.2f}×** | {a['backward_gflops']:.0f} "
                     f"({100 * a['backward_peak_ratio']:.0f}%; {100 * a['backward_cpu_peak_ratio']:.0f}%) | "
                     f"{p['backward_gflops']:.0f} ({100 * p['backward_peak_ratio']:.0f}%; "
                     f"{100 * p['backward_cpu_peak_ratio']:.0f}%) | {a['forward_gflops']:.0f} | "
                     f"{r['peak_gflops']:.0f} |")
    ratios = [r["speedup"] for r in results]
    bwd = [r["backward_speedup"] for r in results]
    lines.append("")
    lines.append(f"Geometric mean fwd+bwd speed-up: **{statistics.geometric_mean(ratios):.2f}×** over {len(ratios)} "
                 f"rows (min {min(ratios):.2f}×, max {max(ratios):.2f}×); backward alone "
                 f"{statistics.geometric_mean(bwd):.2f}× (min {min(bwd):.2f}×).")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cli", default=os.environ.get("ATTNFORGE_CLI", "build/attnforge"),
                        help="the attnforge CLI of the same build, for the FMA peak (default $ATTNFORGE_CLI or "
                             "build/attnforge)")
    parser.add_argument("--quick", action="store_true", help="L=S=1024, E=64 only")
    parser.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd runs per implementation and row (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both libraries")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="dtypes to run (repeatable; default float32 and bfloat16)")
    parser.add_argument("--causal", action="store_true", help="the causal rows only")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    parser.add_argument("--table", metavar="FILE", help="print the table of the rows a --json run saved, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown([json.loads(line) for line in f if line.strip()]))
        return
    torch.set_num_threads(args.threads)
    attnforge.set_num_threads(args.threads)
    isa = attnforge.get_isa()
    results = []
    peaks = [fma_peak(args.cli, args.threads, isa)]

    def row_peak():   # the larger of the measurements just before and just after the row's timing
        peaks.append(fma_peak(args.cli, args.threads, isa))
        return max(p[0] for p in peaks[-2:]), max(p[1] for p in peaks[-2:])

    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        for L, E, causal in shapes(args.quick):
            if args.causal and not causal:
                continue
            row = bench_row(L, E, causal, dtype_name, args.repeats, row_peak)
            peak = row["peak_gflops"]
            results.append(row)
            a, p = row["attnforge"], row["pytorch"]
            print(json.dumps(row) if args.json else
                  f"{dtype_name:9s} causal={causal!s:5s} L=S={L:5d} E={E:3d}: PyTorch {p['total_ms']:8.1f} ms "
                  f"(bwd {p['backward_gflops']:.0f} GF/s, {100 * p['backward_peak_ratio']:.0f}%), attnforge "
                  f"{a['total_ms']:8.1f} ms (bwd {a['backward_gflops']:.0f} GF/s, {100 * a['backward_peak_ratio']:.0f}%)"
                  f", speed-up {row['speedup']:.2f}x, peak {peak:.0f}, grads differ {row['grad_rel_diff']:.1e}",
                  file=sys.stdout if args.json else sys.stderr, flush=True)
    if not args.json:
        print(f"Machine: {machine_line(args.threads)}\n")
        print(markdown(results))


if __name__ == "__main__":
    main()
