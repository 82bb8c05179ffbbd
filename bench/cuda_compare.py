#!/usr/bin/env python3
"""attnforge's CUDA kernels beside PyTorch's SDPA backends (flash, cuDNN, efficient, each forced with
torch.nn.attention.sdpa_kernel) on the same CUDA tensors: TFLOP/s by FA4's formula for prefill, GB/s of K+V read for
decode against a torch device-to-device copy measured in the same run, and decode from a float8 K/V cache against
attnforge's own f16 decode on the same values (torch's SDPA takes no float8). Timing: CUDA events around back-to-back
calls (each sample ~SAMPLE_MS), median of --samples samples. Prints markdown tables; rows are measured in order of
importance and the run stops measuring when --budget seconds are spent (the rows left are listed).

    python bench/cuda_compare.py                       # the whole table (a few minutes on an H200)
    python bench/cuda_compare.py --quick --budget 60
    python bench/cuda_compare.py --attnforge-cli build/attnforge   # when the Python binding cannot run on CUDA

attnforge runs through attnforge.scaled_dot_product_attention on torch CUDA tensors (PyTorch's current stream);
when that is unavailable, through `attnforge bench --device cuda --json` (its own tensors of the same shape).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SAMPLE_MS = 20.0
BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
COLUMNS = ("attnforge",) + tuple(b.split("_")[0].lower() for b in BACKENDS)   # attnforge, flash, cudnn, efficient


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def fa4_flops(B, Hq, L, S, E, Ev, causal):
    """2·B·Hq·L·S'·(E+Ev), S' = keys seen per row on average (top-left causal: row i sees min(i+1, S))."""
    if causal:
        seen = (min(L, S) * (min(L, S) + 1) / 2 + max(0, L - S) * S) / L
    else:
        seen = S
    return 2.0 * B * Hq * L * seen * (E + Ev)


def prefill_rows(quick, long_shapes):
    """(dtype, E, L, causal) in order of importance: bf16 E=128 first, the issue's target L=8k first."""
    lengths = [8192, 2048] if quick else [8192, 4096, 2048, 1024] + ([16384] if long_shapes else [])
    rows = []
    for dtype in ("bfloat16", "float16"):
        for E in (128, 64):
            if quick and E == 64:
                continue
            for L in lengths:
                for causal in (False, True):
                    rows.append((dtype, E, L, causal))
    return rows


def decode_rows(quick):
    return [(dtype, S) for dtype in ("bfloat16", "float16") for S in ([32768] if quick else [32768, 8192])]


def time_cuda(fn, samples, deadline=None):
    """Median seconds per call: CUDA events around `calls` back-to-back calls, calls chosen from a first call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()   # warm-up (and compilation / autotuning, where a backend does it)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    first_ms = max(start.elapsed_time(end), 1e-3)
    calls = max(1, min(1000, math.ceil(SAMPLE_MS / first_ms)))
    times = []
    for _ in range(samples):
        if deadline and time.monotonic() > deadline and times:
            break
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(samples, nbytes=1 << 30):
    """A torch device-to-device copy: (bytes read + bytes written) per second, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), samples)
    del src, dst
    return 2 * nbytes / seconds * 1e-9


class Attnforge:
    """attnforge on the same tensors through the binding, or the CLI's own bench on the same shape."""

    def __init__(self, cli):
        self.cli, self.binding, self.why = cli, None, ""
        try:
            import attnforge
            q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
            out = attnforge.scaled_dot_product_attention(q, q, q)
            ref = F.scaled_dot_product_attention(q, q, q)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            if not err < 2e-2:
                raise RuntimeError(f"binding's output differs from torch's by {err}")
            self.binding = attnforge
        except Exception as e:   # noqa: BLE001 -- any failure means: use the CLI
            self.why = f"{type(e).__name__}: {e}"

    @property
    def how(self):
        if self.binding:
            return "attnforge.scaled_dot_product_attention (Python binding, same tensors)"
        if self.cli:
            return f"`{self.cli} bench --device cuda` (its own tensors of the same shape; binding: {self.why})"
        return f"not run (binding: {self.why}; no --attnforge-cli)"

    def seconds(self, q, k, v, causal, gqa, samples, deadline):
        if self.binding:
            af = self.binding
            return time_cuda(lambda: af.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                             samples, deadline)
        if not self.cli:
            raise RuntimeError("unavailable")
        B, Hq, L, E = q.shape
        _, Hkv, S, Ev = v.shape
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[q.dtype]
        cmd = [self.cli, "bench", "--device", f"cuda:{q.device.index or 0}", "--json", "--reps", str(samples),
               "--shape", f"{B},{Hq},{Hkv},{L},{S},{E},{Ev}", "--dtype", dtype] + (["--causal"] if causal else [])
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        shape_rows = [r for r in rows if "case" in r]
        if not shape_rows or not shape_rows[0].get("ok"):
            raise RuntimeError((shape_rows[0].get("error") if shape_rows else run.stderr.strip()[-200:]) or "failed")
        return shape_rows[0]["seconds"]


def torch_seconds(backend, q, k, v, causal, gqa, samples, deadline):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kwargs = {"is_causal": causal}
    if gqa:
        kwargs["enable_gqa"] = True
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs), samples, deadline)


def measure(impl, fn):
    try:
        return fn(), ""
    except Exception as e:   # noqa: BLE001 -- a backend that refuses a shape is a table entry, not a crash
        text = str(e).strip().splitlines()
        return None, (text[0] if text else type(e).__name__)[:100]


def with_mma_sync(fn):
    """fn() with attnforge's Hopper kernel (attn_wgmma.cuh, the default on compute capability 9.0) turned off, so the
    mma.sync kernels run: ATTNFORGE_CUDA_WGMMA=0, read at every call."""
    before = os.environ.get("ATTNFORGE_CUDA_WGMMA")
    os.environ["ATTNFORGE_CUDA_WGMMA"] = "0"
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["ATTNFORGE_CUDA_WGMMA"]
        else:
            os.environ["ATTNFORGE_CUDA_WGMMA"] = before


def agreement(af, q, k, v, causal, gqa):
    """max |attnforge - torch flash-or-math| on this row's tensors (binding only): the outputs were compared."""
    if not af.binding:
        return None
    out = af.binding.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return (out.float() - ref.float()).abs().max().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="L=S in {2k, 8k}, E=128, S=32k decode")
    ap.add_argument("--long", action="store_true", help="also L=S=16k")
    ap.add_argument("--samples", type=int, default=5, help="timed samples per measurement (median)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; rows not started by then are skipped")
    ap.add_argument("--attnforge-cli", default=None, help="the attnforge command, used when the binding cannot run")
    ap.add_argument("--json", default=None, help="also write every measurement to this file")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget
    if not torch.cuda.is_available():
        print("cuda_compare: torch sees no CUDA device")
        return 2
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    af = Attnforge(args.attnforge_cli)
    print(f"\n{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    print(f"attnforge: {af.how}")
    copy_gbps = copy_bandwidth(args.samples)
    print(f"device-to-device copy (torch, 1 GiB): {copy_gbps:.0f} GB/s (bytes read + written per second)\n")
    results, skipped = [], []
    hopper = (props.major, props.minor) == (9, 0)   # attnforge runs the wgmma kernel: mma.sync gets its own column

    for dtype_name, E, L, causal in prefill_rows(args.quick, args.long):
        if time.monotonic() > deadline:
            skipped.append(f"{dtype_name} E={E} L=S={L} {'causal' if causal else 'full'}")
            continue
        dtype = getattr(torch, dtype_name)
        B, H = max(1, 16384 // L), 2048 // E   # FlashAttention's benchmark shapes: B·L = 16k, H·E = 2048
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype) for _ in range(3))
        flops = fa4_flops(B, H, L, L, E, E, causal)
        row = {"kind": "prefill", "dtype": dtype_name, "E": E, "L": L, "causal": causal, "B": B, "H": H}
        t, row["attnforge_error"] = measure("attnforge", lambda: af.seconds(q, k, v, causal, False, args.samples,
                                                                            deadline))
        row["attnforge"] = flops / t * 1e-12 if t else None
        for backend, col in zip(BACKENDS, COLUMNS[1:]):
            t, row[col + "_error"] = measure(col, lambda: torch_seconds(backend, q, k, v, causal, False, args.samples,
                                                                         deadline))
            row[col] = flops / t * 1e-12 if t else None
        diff, row["agreement_error"] = measure("agree", lambda: agreement(af, q, k, v, causal, False))
        row["max_abs_diff"] = diff
        if hopper:
            t, row["mma_sync_error"] = measure("mma.sync", lambda: with_mma_sync(
                lambda: af.seconds(q, k, v, causal, False, args.samples, deadline)))
            row["mma_sync"] = flops / t * 1e-12 if t else None
            row["mma_sync_max_abs_diff"], _ = measure("agree", lambda: with_mma_sync(
                lambda: agreement(af, q, k, v, causal, False)))
        results.append(row)
        log(f"cuda_compare: {dtype_name} E={E} L={L} causal={causal}: " +
            ", ".join(f"{c} {row[c]:.0f}" if row[c] else f"{c} -" for c in COLUMNS) + " TFLOP/s")
        del q, k, v

    for dtype_name, S in decode_rows(args.quick):
        if time.monotonic() > deadline:
            skipped.append(f"decode {dtype_name} S={S}")
            continue
        dtype = getattr(torch, dtype_name)
        B, Hq, Hkv, E = 16, 32, 8, 128
        q = torch.randn(B, Hq, 1, E, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype) for _ in range(2))
        kv_bytes = 2 * B * Hkv * S * E * q.element_size()
        row = {"kind": "decode", "dtype": dtype_name, "E": E, "L": 1, "S": S, "B": B, "Hq": Hq, "Hkv": Hkv}
        t, row["attnforge_error"] = measure("attnforge", lambda: af.seconds(q, k, v, False, True, args.samples,
                                                                            deadline))
        row["attnforge"] = kv_bytes / t * 1e-9 if t else None
        for backend, col in zip(BACKENDS, COLUMNS[1:]):
            t, row[col + "_error"] = measure(col, lambda: torch_seconds(backend, q, k, v, False, True, args.samples,
                                                                         deadline))
            row[col] = kv_bytes / t * 1e-9 if t else None
        diff, row["agreement_error"] = measure("agree", lambda: agreement(af, q, k, v, False, True))
        row["max_abs_diff"] = diff
        results.append(row)
        log(f"cuda_compare: decode {dtype_name} S={S}: " +
            ", ".join(f"{c} {row[c]:.0f}" if row[c] else f"{c} -" for c in COLUMNS) + " GB/s")
        del q, k, v

    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        if time.monotonic() > deadline or not af.binding:
            skipped.append(f"decode {fmt}" + ("" if af.binding else " (needs the Python binding)"))
            continue
        row, error = measure("float8", lambda: float8_decode_row(af.binding, fmt, 32768, args.samples, deadline))
        if not row:
            skipped.append(f"decode {fmt} ({error})")
            continue
        results.append(row)
        log(f"cuda_compare: decode {fmt}: {row['float8']:.0f} GB/s, f16 {row['f16']:.0f} GB/s")

    print_tables(results, copy_gbps)
    if skipped:
        print(f"\nnot measured (the {args.budget:.0f} s budget was spent): " + "; ".join(skipped))
    errors = sorted({f"{c}: {r[c + '_error']}" for r in results for c in COLUMNS if r.get(c + "_error")})
    if errors:
        print("\nerrors (a '-' in the tables):\n" + "\n".join(f"- {e}" for e in errors))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "copy_gbps": copy_gbps, "rows": results, "skipped": skipped}, f, indent=1)
    return 0


def float8_decode_row(af, fmt, S, samples, deadline):
    """flash_attn_func decode, K/V (B, S, Hkv, E) in float8 with descales, against the f16 K/V holding the very same
    values (every float8 value is an f16): GB/s of each cache's bytes, the time ratio, and the outputs' difference."""
    B, Hq, Hkv, E = 16, 32, 8, 128
    q = torch.randn(B, 1, Hq, E, device="cuda", dtype=torch.float16)
    k8, v8 = (torch.randn(B, S, Hkv, E, device="cuda").to(getattr(torch, fmt)) for _ in range(2))
    k16, v16 = k8.to(torch.float16), v8.to(torch.float16)
    ones = torch.ones(B, Hkv, device="cuda")
    t8 = time_cuda(lambda: af.flash_attn_func(q, k8, v8, k_descale=ones, v_descale=ones), samples, deadline)
    t16 = time_cuda(lambda: af.flash_attn_func(q, k16, v16), samples, deadline)
    o8 = af.flash_attn_func(q, k8, v8, k_descale=ones, v_descale=ones)[0]
    o16 = af.flash_attn_func(q, k16, v16)[0]
    diff = (o8.float() - o16.float()).abs().max().item()
    return {"kind": "float8", "dtype": fmt, "S": S, "float8": k8.numel() * 2 / t8 * 1e-9,
            "f16": k16.numel() * 2 * 2 / t16 * 1e-9, "speedup": t16 / t8, "max_abs_diff": diff}


def cell(x, fmt="{:.0f}"):
    return fmt.format(x) if x else "-"


def markdown_table(title, header, right_aligned, lines):
    """A titled markdown table: `header` names the columns, the first len(header) - right_aligned are left-aligned."""
    print(title + "\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * (len(header) - right_aligned) + ["---:"] * right_aligned) + "|")
    for line in lines:
        print("| " + " | ".join(str(x) for x in line) + " |")


def print_tables(results, copy_gbps):
    prefill = sorted((r for r in results if r["kind"] == "prefill"),
                     key=lambda r: (r["dtype"], r["E"], r["L"], r["causal"]))
    if prefill:
        lines = []
        for r in prefill:
            best = max([r[c] for c in COLUMNS[1:] if r[c]] or [0])
            ratio = f"{r['attnforge'] / best:.2f}" if r["attnforge"] and best else "-"
            diff = f"{r['max_abs_diff']:.1e}" if r["max_abs_diff"] is not None else "-"
            lines.append([r["dtype"], r["E"], r["L"], "yes" if r["causal"] else "no", cell(r["attnforge"]),
                          cell(r["flash"]), cell(r["cudnn"]), cell(r["efficient"]), ratio, diff])
        markdown_table("\nPrefill, TFLOP/s (FA4's formula; causal counts the keys seen), B·L = 16k, H·E = 2048; "
                       "ratio = attnforge / the best torch backend; "
                       "diff = max |attnforge − torch| on the row's tensors",
                       ["dtype", "E", "L=S", "causal", "attnforge", "flash", "cudnn", "efficient", "ratio", "diff"], 6,
                       lines)
    hopper = [r for r in prefill if "mma_sync" in r]
    if hopper:
        lines = []
        for r in hopper:
            diff = f"{r['mma_sync_max_abs_diff']:.1e}" if r.get("mma_sync_max_abs_diff") is not None else "-"
            lines.append([r["dtype"], r["E"], r["L"], "yes" if r["causal"] else "no", cell(r["attnforge"]),
                          cell(r["mma_sync"]), cell(r["cudnn"]),
                          f"{r['attnforge'] / r['mma_sync']:.2f}" if r["attnforge"] and r["mma_sync"] else "-", diff])
        markdown_table("\nCompute capability 9.0: attnforge's Hopper kernel (wgmma, TMA, warp specialisation; the "
                       "default) beside its mma.sync kernels (ATTNFORGE_CUDA_WGMMA=0) and cuDNN, TFLOP/s; ratio = "
                       "wgmma / mma.sync; diff = max |mma.sync − torch|",
                       ["dtype", "E", "L=S", "causal", "wgmma", "mma.sync", "cudnn", "ratio", "diff"], 5, lines)
    decode = sorted((r for r in results if r["kind"] == "decode"), key=lambda r: (r["dtype"], r["S"]))
    if decode:
        lines = []
        for r in decode:
            share = f"{100 * r['attnforge'] / copy_gbps:.0f}%" if r["attnforge"] else "-"
            diff = f"{r['max_abs_diff']:.1e}" if r["max_abs_diff"] is not None else "-"
            lines.append([r["dtype"], r["S"], cell(r["attnforge"]), share, cell(r["flash"]), cell(r["cudnn"]),
                          cell(r["efficient"]), diff])
        markdown_table(f"\nDecode (L=1, Hq/Hkv = 32/8, E=128, B=16), GB/s of K+V read; % of the device-to-device copy "
                       f"({copy_gbps:.0f} GB/s)", ["dtype", "S", "attnforge", "% copy", "flash", "cudnn", "efficient",
                                                  "diff"], 7, lines)
    float8 = [r for r in results if r["kind"] == "float8"]
    if float8:
        markdown_table("\nDecode from a float8 K/V cache (flash_attn_func, q f16, B=16, Hq/Hkv = 32/8, E=128) against "
                       "attnforge's f16 decode on the same values: GB/s of each cache's bytes; speed-up = f16 time / "
                       "float8 time", ["K/V", "S", "float8 GB/s", "% copy", "f16 GB/s", "speed-up", "diff"], 6,
                       [[r["dtype"], r["S"], f"{r['float8']:.0f}", f"{100 * r['float8'] / copy_gbps:.0f}%",
                         f"{r['f16']:.0f}", f"{r['speedup']:.2f}", f"{r['max_abs_diff']:.1e}"] for r in float8])


if __name__ == "__main__":
    sys.exit(main())
