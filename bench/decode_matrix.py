#!/usr/bin/env python3
"""Decode against the read bandwidth over issue 13's whole matrix, as a Markdown table.

Runs `attnforge bench --shape 1,8G,8,1,S,128,128 --json` for every K/V dtype, GQA group G, K/V layout and thread
count asked, --runs times each (the runs of a row interleaved with all other rows, so drift spreads evenly), and
prints per row the median GB/s of K+V and the median share of the read pass sampled before each call (%bw), with
the range over the runs. Hkv is 8 and E = Ev = 128 throughout; L = 1.

    python3 bench/decode_matrix.py                       # f16/bf16/f32, G 1/2/4/8, hnd/nhd, 1 and 2 threads
    python3 bench/decode_matrix.py --dtypes float16 --groups 4 --runs 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_row(cli, dtype, group, layout, threads, seq, reps):
    shape = f"1,{8 * group},8,1,{seq},128,128"
    cmd = [cli, "bench", "--shape", shape, "--dtype", dtype, "--layout", layout, "--threads", str(threads),
           "--reps", str(reps), "--portable-max-gflop", "0", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{")) if "case" in r]
    if len(rows) != 1 or "bandwidth_ratio" not in rows[0] or not rows[0].get("ok"):
        sys.exit(f"decode_matrix: unexpected output from {' '.join(cmd)}:\n{out}")
    return rows[0]["gbps"], rows[0]["bandwidth_ratio"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "build", "attnforge"), help="the attnforge command")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--groups", default="1,2,4,8", help="GQA groups G (Hq = 8G, Hkv = 8)")
    ap.add_argument("--layouts", default="hnd,nhd", help="hnd: K/V (B,H,S,E); nhd: (B,S,H,E) views")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seq", type=int, default=32768, help="keys S")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per run (bench --reps)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each row")
    a = ap.parse_args()
    if not os.access(a.cli, os.X_OK):
        sys.exit(f"decode_matrix: {a.cli} is not an executable attnforge command (--cli)")

    rows = [(d, int(g), lay, int(t)) for d in a.dtypes.split(",") for lay in a.layouts.split(",")
            for g in a.groups.split(",") for t in a.threads.split(",")]
    results = {r: [] for r in rows}
    for run in range(a.runs):
        for i, r in enumerate(rows):
            print(f"decode_matrix: run {run + 1}/{a.runs}, row {i + 1}/{len(rows)}: {r}", file=sys.stderr, flush=True)
            results[r].append(run_row(a.cli, *r, a.seq, a.reps))

    print(f"| K/V | layout | G (Hq/Hkv) | threads | GB/s of K+V | %bw, median (range over {a.runs} runs) |")
    print("|---|---|---|---|---|---|")
    for (d, g, lay, t), res in results.items():
        gbps = statistics.median(x[0] for x in res)
        bw = [100 * x[1] for x in res]
        layout = "(B,H,S,E)" if lay == "hnd" else "(B,S,H,E)"
        print(f"| {d} | {layout} | {g} ({8 * g}/8) | {t} | {gbps:.1f} | {statistics.median(bw):.0f}% "
              f"({min(bw):.0f}–{max(bw):.0f}) |")


if __name__ == "__main__":
    main()
