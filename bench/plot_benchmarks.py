#!/usr/bin/env python3
"""Plots for docs/BENCHMARKS.md from the JSON lines of `attnforge bench --json` and `bench/torch_compare.py --json`.

    build/attnforge bench --quick --json > docs/plots/data/bench-quick.jsonl
    python bench/torch_compare.py --quick --json > docs/plots/data/torch-quick.jsonl
    python bench/plot_benchmarks.py --bench docs/plots/data/bench-quick.jsonl \\
        --torch docs/plots/data/torch-quick.jsonl --out docs/plots

Writes, under --out:
  prefill-<dtype>.png   GFLOP/s against sequence length (L = S), one line per (E, causal) for attnforge
                        (`bench` rows, solid) and, where --torch is given, attnforge and PyTorch's SDPA from
                        torch_compare (dashed / dotted), with the FMA peak sampled in the run as a grey band.
  decode.png            GB/s of K+V per decode row (`bench` rows with L = 1) beside the read pass sampled
                        before each call (the measured read limit, `peak_gbps`).
Each input line is one JSON object; lines that are not rows (the machine line, the spot check) are skipped.
matplotlib is installed into the running interpreter with pip when it is missing.
"""
import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict


def need_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_benchmarks: matplotlib is missing; installing it with "
              f"`{sys.executable} -m pip install matplotlib`", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_rows(path):
    rows = []
    if not path:
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def machine(rows):
    for r in rows:
        if r.get("machine"):
            return r
    return {}


def short(dtype):
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3",
            "float8_e5m2": "e5m2"}.get(dtype, dtype)


def label(E, causal):
    return f"E {E}{' causal' if causal else ''}"


def plot_prefill(plt, bench, torch_rows, out, title_tail):
    made = []
    prefill = [r for r in bench if r.get("case") == "prefill" and not r.get("scaling") and r.get("ok", True) and r.get("L") == r.get("S")]
    tprefill = [r for r in torch_rows if r.get("kind") == "prefill"]
    dtypes = sorted({r["dtype"] for r in prefill} | {r["dtype"] for r in tprefill})
    for dtype in dtypes:
        fig, ax = plt.subplots(figsize=(8.4, 4.0), dpi=80)
        series = defaultdict(list)
        peaks = []
        for r in prefill:
            if r["dtype"] == dtype:
                series[("attnforge bench", r["E"], r["causal"])].append((r["L"], r["gflops"]))
                if r.get("peak_gflops"):
                    peaks.append(r["peak_gflops"])
        for r in tprefill:
            if r["dtype"] == dtype:
                series[("attnforge (torch_compare)", r["E"], r["causal"])].append((r["L"], r["attnforge_gflops"]))
                series[("PyTorch SDPA", r["E"], r["causal"])].append((r["L"], r["pytorch_gflops"]))
        style = {"attnforge bench": "-o", "attnforge (torch_compare)": "--s", "PyTorch SDPA": ":^"}
        for (who, E, causal), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style[who], label=f"{who}, {label(E, causal)}")
        if peaks:
            peaks.sort()
            # bf16 rows on AVX512-BF16 products are paired with a vdpbf16ps loop, twice an FMA's FLOPs (BENCHMARKS.md)
            fma = [r.get("peak_gflops") for r in prefill if r["dtype"] == "float32" and r.get("peak_gflops")]
            dot = dtype == "bfloat16" and fma and peaks[len(peaks) // 2] > 1.5 * sorted(fma)[len(fma) // 2]
            ax.axhline(peaks[len(peaks) // 2], color="0.5", linewidth=2,
                       label=f"{'vdpbf16ps' if dot else 'FMA'} peak (median of the samples before each call)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L = S")
        ax.set_ylabel("GFLOP/s (FA4's count)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"prefill, {dtype}{title_tail}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.path.join(out, f"prefill-{dtype}.png")
        fig.savefig(path)
        plt.close(fig)
        made.append(path)
    return made


def plot_decode(plt, bench, out, title_tail):
    decode = [r for r in bench if not r.get("scaling") and r.get("L") == 1 and r.get("gbps") is not None and r.get("ok", True)]
    if not decode:
        return []
    fig, ax = plt.subplots(figsize=(9.0, 3.8), dpi=80)
    names = [f"{r['case']}\n{short(r.get('kv_dtype', r['dtype']))}\nS {r['S'] // 1024}k {r.get('threads', '?')}t"
             for r in decode]
    xs = range(len(decode))
    ax.bar([x - 0.2 for x in xs], [r["peak_gbps"] for r in decode], width=0.4, color="0.75",
           label="read pass sampled before the call (limit)")
    ax.bar([x + 0.2 for x in xs], [r["gbps"] for r in decode], width=0.4, label="attnforge decode, K+V read (% = median paired share)")
    for x, r in zip(xs, decode):
        ax.text(x + 0.2, r["gbps"], f"{100 * r['bandwidth_ratio']:.0f}%" if "bandwidth_ratio" in r else "", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(f"decode bandwidth{title_tail}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "decode.png")
    fig.savefig(path)
    plt.close(fig)
    return [path]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", help="JSON lines of `attnforge bench --json`")
    parser.add_argument("--torch", help="JSON lines of `python bench/torch_compare.py --json`")
    parser.add_argument("--out", default="docs/plots", help="folder for the PNGs (default docs/plots)")
    parser.add_argument("--title", default="", help="text appended to each title (machine, date)")
    args = parser.parse_args(argv)
    if not args.bench and not args.torch:
        parser.error("give --bench and/or --torch")
    bench, torch_rows = read_rows(args.bench), read_rows(args.torch)
    m = machine(bench)
    tail = args.title or (f" ({m.get('isa')}, {m.get('threads')} threads)" if m else "")
    if tail and not tail.startswith(" "):
        tail = " (" + tail + ")"
    plt = need_matplotlib()
    os.makedirs(args.out, exist_ok=True)
    made = plot_prefill(plt, bench, torch_rows, args.out, tail) + plot_decode(plt, bench, args.out, tail)
    for path in made:
        print(f"{path}: {os.path.getsize(path) // 1024} KiB")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
