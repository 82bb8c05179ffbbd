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

Before/after (issue 37): two builds of the backend on the same shapes, each in a process of its own (libattnforge
loads its backend once per process, from ATTNFORGE_CUDA_LIBRARY), beside torch's flash and cuDNN SDPA, with both
builds' max error against a float64 reference; one markdown table, and CSV/JSON/markdown written after every row:

    python bench/cuda_compare.py --before-after --current-lib build/libattnforge_cuda.so \
        --baseline-lib build-baseline/libattnforge_cuda-19c44b2-sm_90a.so --out-dir $OUT
    python bench/cuda_compare.py --before-after --dry-run     # the shapes and a time estimate (no torch, no GPU)
    python bench/cuda_compare.py --render $OUT/before_after.json   # the table again from a run's JSON
"""
import argparse
import csv
import json
import math
import os
import select
import statistics
import subprocess
import sys
import time
import zlib

try:
    import torch
    import torch.nn.functional as F
except ImportError:   # --dry-run and --render need no torch; measuring does (main says so)
    torch = F = None

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


def time_cuda(fn, samples, deadline=None, spread=False):
    """Median seconds per call: CUDA events around `calls` back-to-back calls, calls chosen from a first call
    (spread: (median, (max − min) / median of the samples))."""
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
    median = statistics.median(times)
    return (median, (max(times) - min(times)) / median) if spread else median


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


def torch_seconds(backend, q, k, v, causal, gqa, samples, deadline, spread=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kwargs = {"is_causal": causal}
    if gqa:
        kwargs["enable_gqa"] = True
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs), samples, deadline, spread)


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="L=S in {2k, 8k}, E=128, S=32k decode "
                    "(--before-after: L=S in {8k, 2k})")
    ap.add_argument("--long", action="store_true", help="also L=S=16k")
    ap.add_argument("--samples", type=int, default=5, help="timed samples per measurement (median)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; rows not started by then are skipped")
    ap.add_argument("--attnforge-cli", default=None, help="the attnforge command, used when the binding cannot run")
    ap.add_argument("--json", default=None, help="also write every measurement to this file")
    ba = ap.add_argument_group("before/after (issue 37)")
    ba.add_argument("--before-after", action="store_true",
                    help="the FA3-paper grid (E 64/128/256, f16/bf16, causal or not, L=S 512..16k, B·L = 16k, "
                    "H·E = 2048), a GQA row and a paged decode row on two backends and torch's flash and cuDNN")
    ba.add_argument("--current-lib", default=None, help="the backend after (default: ATTNFORGE_CUDA_LIBRARY)")
    ba.add_argument("--baseline-lib", default=None, help="the backend before (a build of the baseline commit)")
    ba.add_argument("--current-name", default="current", help="what the current build is (a commit), for the table")
    ba.add_argument("--baseline-name", default="baseline", help="what the baseline is (a commit), for the table")
    ba.add_argument("--baseline-missing", default=None, help="why there is no baseline (printed with the table)")
    ba.add_argument("--page-size", type=int, default=16, help="the paged decode row's page size (default 16)")
    ba.add_argument("--out-dir", default=None,
                    help="write before_after.csv, before_after.json and before_after.md here after every row")
    ba.add_argument("--dry-run", action="store_true", help="print the shapes and the time estimate; measure nothing")
    ba.add_argument("--render", metavar="JSON", default=None,
                    help="print the table of a --before-after run's before_after.json; measure nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)   # one backend's process (below)
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.render:
        with open(args.render) as f:
            print(before_after_markdown(json.load(f)))
        return 0
    if args.worker:
        return before_after_worker(args)
    if args.before_after:
        return before_after(args)
    if torch is None:
        print("cuda_compare: torch is not importable (measuring needs it; --before-after --dry-run does not)")
        return 2
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


# ---- before/after (issue 37): two builds of the backend on the same shapes, each in its own process

BA_LENGTHS = (8192, 16384, 4096, 2048, 1024, 512)   # the target (8k) first
BA_TOKENS, BA_HIDDEN = 16384, 2048                   # FA3's grid: B·L = 16k tokens, H·E = 2048
BA_COLUMNS = ("baseline", "current", "flash", "cudnn")
BA_TORCH = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
DEVICE = "cuda"   # where ba_inputs makes the tensors (the offline test makes them on the CPU)
BA_FILES = ("before_after.csv", "before_after.json", "before_after.md")
BA_CSV_FIELDS = ("key", "kind", "B", "Hq", "Hkv", "L", "S", "E", "dtype", "causal", "page_size", "flops", "kv_bytes",
                 "baseline_tflops", "current_tflops", "flash_tflops", "cudnn_tflops", "current_over_baseline",
                 "current_over_cudnn", "baseline_max_abs_err", "current_max_abs_err", "baseline_rel_err",
                 "current_rel_err", "baseline_seconds", "current_seconds", "flash_seconds", "cudnn_seconds",
                 "baseline_spread", "current_spread", "flash_spread", "cudnn_spread", "baseline_error",
                 "current_error", "flash_error", "cudnn_error")


def before_after_shapes(quick=False, page_size=16):
    """The rows in order of importance: bf16 head dim 128 (the issue's targets), the GQA row and the paged decode
    row, then the rest of FA3's grid (bf16 head dims 64 and 256, then f16)."""
    lengths = (8192, 2048) if quick else BA_LENGTHS

    def grid(dtype, E):
        H = BA_HIDDEN // E
        return [dict(kind="prefill", dtype=dtype, B=max(1, BA_TOKENS // L), Hq=H, Hkv=H, L=L, S=L, E=E,
                     causal=causal, page_size=0) for L in lengths for causal in (False, True)]

    rows = grid("bfloat16", 128)
    rows.append(dict(kind="gqa", dtype="bfloat16", B=2, Hq=32, Hkv=8, L=8192, S=8192, E=128, causal=True,
                     page_size=0))
    rows.append(dict(kind="paged decode", dtype="bfloat16", B=16, Hq=32, Hkv=8, L=1, S=8192, E=128, causal=False,
                     page_size=page_size))
    for dtype, E in (("bfloat16", 64), ("bfloat16", 256), ("float16", 128), ("float16", 64), ("float16", 256)):
        rows += grid(dtype, E)
    return rows


def shape_key(s):
    page = f" page {s['page_size']}" if s["page_size"] else ""
    return (f"{s['kind']} {s['dtype']} B={s['B']} H={s['Hq']}/{s['Hkv']} L={s['L']} S={s['S']} E={s['E']} "
            f"{'causal' if s['causal'] else 'full'}{page}")


def shape_flops(s):
    return fa4_flops(s["B"], s["Hq"], s["L"], s["S"], s["E"], s["E"], s["causal"])


def shape_kv_bytes(s):
    return 2 * s["B"] * s["Hkv"] * s["S"] * s["E"] * (4 if s["dtype"] == "float32" else 2)


def estimate_row_seconds(s, samples):
    """A guess, from assumed rates (not measurements): 400 TFLOP/s or 3.5 TB/s for every backend's kernel, each
    timing = warm-up and first call + `samples` samples of at least SAMPLE_MS; cuDNN's plan for a new shape 0.5 s; the
    float64 reference of both builds at 25 TFLOP/s plus six passes over its scores at 3 TB/s."""
    t = max(shape_flops(s) / 400e12, shape_kv_bytes(s) / 3.5e12, 20e-6)
    per_timing = 0.05 + 3 * t + samples * max(SAMPLE_MS / 1e3, t)
    scores = s["B"] * s["Hq"] * s["L"] * s["S"]
    reference = 0.05 + 4 * scores * s["E"] / 25e12 + 6 * 8 * scores / 3e12 + 0.002 * s["B"]
    return len(BA_COLUMNS) * per_timing + 0.5 + 2 * reference


BA_START_SECONDS = 30.0   # the two backend processes' start (torch's import, the CUDA context): a guess


def before_after_dry_run(args, shapes):
    print(f"before/after: {len(shapes)} rows in this order (the budget stops the later ones); time estimate from "
          f"assumed rates, not a measurement")
    total = BA_START_SECONDS
    lines = []
    for i, s in enumerate(shapes):
        est = estimate_row_seconds(s, args.samples)
        total += est
        lines.append([i + 1, s["kind"], s["B"], f"{s['Hq']}/{s['Hkv']}", s["L"], s["S"], s["E"], s["dtype"],
                      "yes" if s["causal"] else "no", f"{shape_flops(s) / 1e12:.2f}", f"{est:.1f}", f"{total:.0f}" +
                      ("" if total <= args.budget else " (past the budget)")])
    markdown_table("", ["#", "kind", "B", "Hq/Hkv", "L", "S", "E", "dtype", "causal", "TFLOP", "est. s", "cum. s"], 3,
                   lines)
    fits = "fits" if total <= args.budget else "does NOT fit"
    print(f"\nestimate: {total:.0f} s for all rows ({BA_START_SECONDS:.0f} s to start the processes) against the "
          f"budget of {args.budget:.0f} s: {fits}")
    print(f"baseline: {args.baseline_lib or 'none: ' + (args.baseline_missing or 'no --baseline-lib')}; "
          f"current: {args.current_lib or os.environ.get('ATTNFORGE_CUDA_LIBRARY') or 'the backend of the package'}")
    print("\nthe table a run prints (the columns; no number is measured in a dry run):")
    print(before_after_markdown({"meta": dict(before_after_meta(args), dry_run=True), "rows": [], "skipped": []}))
    return 0


def ba_inputs(s):
    """The row's tensors, the same values in every process (a generator seeded from the row's key): q, k, v as
    (B, H, L|S, E); for the paged row also the pages (num_pages, page_size, Hkv, E), a shuffled page table, seqused_k
    and q as (B, 1, Hq, E), k and v being the dense copy of the pages' keys."""
    dtype = getattr(torch, s["dtype"])
    seed = zlib.crc32(shape_key(s).encode())
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    B, Hq, Hkv, L, S, E = (s[n] for n in ("B", "Hq", "Hkv", "L", "S", "E"))
    q = torch.randn(B, Hq, L, E, generator=g, device=DEVICE, dtype=dtype)
    if not s["page_size"]:
        k, v = (torch.randn(B, Hkv, S, E, generator=g, device=DEVICE, dtype=dtype) for _ in range(2))
        return {"q": q, "k": k, "v": v}
    P = s["page_size"]
    per = -(-S // P)
    kp, vp = (torch.randn(B * per, P, Hkv, E, generator=g, device=DEVICE, dtype=dtype) for _ in range(2))
    table = torch.randperm(B * per, generator=torch.Generator().manual_seed(seed)).to(torch.int32).view(B, per)
    table = table.to(DEVICE)
    dense = [p[table.long()].reshape(B, per * P, Hkv, E)[:, :S].transpose(1, 2).contiguous() for p in (kp, vp)]
    used = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    return {"q": q, "k": dense[0], "v": dense[1], "q_nhd": q.transpose(1, 2).contiguous(), "kp": kp, "vp": vp,
            "table": table, "used": used}


def ba_attnforge_seconds(af, s, t, samples, deadline):
    """(median seconds, the samples' spread) of attnforge's call on the row."""
    if s["page_size"]:
        if not af.binding:
            raise RuntimeError("the paged row needs the Python binding")
        fn = ba_attnforge_output(af, s, t, call_only=True)
        return time_cuda(fn, samples, deadline, spread=True)
    if af.binding:
        gqa = s["Hq"] != s["Hkv"]
        return time_cuda(lambda: af.binding.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=s["causal"],
                                                                         enable_gqa=gqa), samples, deadline,
                         spread=True)
    return af.seconds(t["q"], t["k"], t["v"], s["causal"], s["Hq"] != s["Hkv"], samples, deadline), None


def ba_attnforge_output(af, s, t, call_only=False):
    """attnforge's output on the row as (B, Hq, L, E) (or the call itself, for timing)."""
    b = af.binding
    if s["page_size"]:
        def call():
            return b.flash_attn_varlen_func(t["q_nhd"], t["kp"], t["vp"], page_table=t["table"],
                                            seqused_k=t["used"])[0]
        return call if call_only else call().transpose(1, 2)
    return b.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=s["causal"],
                                          enable_gqa=s["Hq"] != s["Hkv"])


def reference_errors(q, k, v, out, causal, chunk_scores=1 << 27):
    """(max |out − ref|, ‖out − ref‖ / ‖ref‖) against softmax(q·kᵀ/√E)·v in float64 (top-left causal, k/v heads
    shared by Hq/Hkv query heads), in chunks of query rows over all of one batch's heads (at most chunk_scores scores
    at a time: 1 GiB). A NaN anywhere in out gives NaN."""
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E)
    worst = torch.zeros((), dtype=torch.float64, device=q.device)
    num, den = worst.clone(), worst.clone()
    rows = max(1, chunk_scores // (Hq * S))
    for b in range(B):
        kb, vb = (x[b].double().repeat_interleave(Hq // Hkv, dim=0) for x in (k, v))
        for r0 in range(0, L, rows):
            r1 = min(L, r0 + rows)
            scores = torch.matmul(q[b, :, r0:r1].double(), kb.transpose(1, 2)) * scale
            if causal:
                i = torch.arange(r0, r1, device=q.device).unsqueeze(1)
                scores.masked_fill_(torch.arange(S, device=q.device).unsqueeze(0) > i, float("-inf"))
            ref = torch.matmul(torch.softmax(scores, dim=-1), vb)
            del scores
            d = out[b, :, r0:r1].double() - ref
            worst = torch.maximum(worst, d.abs().max())
            num += d.square().sum()
            den += ref.square().sum()
    return worst.item(), math.sqrt(num.item() / den.item()) if den.item() > 0 else float("nan")


def before_after_worker(args):
    """One backend's process (ATTNFORGE_CUDA_LIBRARY names it): a JSON line on stdout when ready, then for each
    request line (a row) one reply line: seconds, the samples' spread, max error and relative error against float64."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # whatever else writes to stdout (Python or C) goes to stderr: the protocol's lines stay whole

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    if torch is None or not torch.cuda.is_available():
        send({"ready": False, "status": "torch is not importable" if torch is None else "torch sees no CUDA device"})
        return 2
    af = Attnforge(args.attnforge_cli)
    library, status = os.environ.get("ATTNFORGE_CUDA_LIBRARY"), "?"
    try:
        from attnforge import _C
        devices, loaded, error = _C.load_cuda_backend()
        library = loaded or library
        status = f"ready, {devices} GPU(s)" if error is None else f"cannot run: {error}"
    except Exception as e:   # noqa: BLE001 -- no binding: the CLI loads ATTNFORGE_CUDA_LIBRARY itself
        status = f"no binding ({type(e).__name__}: {e})"
    send({"ready": True, "how": af.how, "library": library, "status": status})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        s, reply = request["shape"], {}
        deadline = time.monotonic() + request["budget_s"]
        t, reply["error"] = measure("inputs", lambda: ba_inputs(s))
        if t is not None:
            timed, reply["error"] = measure("attnforge", lambda: ba_attnforge_seconds(af, s, t, request["samples"],
                                                                                   deadline))
            reply["seconds"], reply["spread"] = timed if timed else (None, None)
            if af.binding:
                errs, reply["reference_error"] = measure("reference", lambda: reference_errors(
                    t["q"], t["k"], t["v"], ba_attnforge_output(af, s, t), s["causal"]))
                if errs:
                    reply["max_abs_err"], reply["rel_err"] = errs
            else:
                reply["reference_error"] = "no Python binding: the CLI times its own tensors, no output to compare"
        del t
        try:   # a CUDA error is sticky: this process cannot run another kernel
            torch.cuda.synchronize()
        except Exception as e:   # noqa: BLE001
            reply["fatal"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        send(reply)
        if "fatal" in reply:
            return 3
    return 0


class BackendProcess:
    """A worker process running one backend (ATTNFORGE_CUDA_LIBRARY=lib), asked one row at a time; a process that
    hangs past a row's timeout, dies, or reports a sticky CUDA error is ended and started again for the next row (at
    most `restarts` times)."""

    def __init__(self, label, lib, cli, restarts=2, cmd=None):
        self.label, self.lib, self.cli, self.restarts = label, lib, cli, restarts
        self.cmd = cmd or [sys.executable, os.path.abspath(__file__), "--worker"] + (["--attnforge-cli", cli] if cli
                                                                                    else [])
        self.proc, self.info, self.dead, self._buf = None, {}, None, b""

    def start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.lib:
            env["ATTNFORGE_CUDA_LIBRARY"] = self.lib
        self._buf = b""
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def wait_ready(self, timeout):
        try:
            self.info = self._read(timeout)
        except (TimeoutError, EOFError) as e:
            self.info = {"ready": False, "status": f"did not start: {e}"}
        if not self.info.get("ready"):
            self.stop()
            self.dead = self.info.get("status", "did not start")
        log(f"cuda_compare: {self.label}: {self.info}")

    def _read(self, timeout):
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"the process ended (exit {self.proc.wait()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, request, timeout):
        """The worker's reply to one row, or {"error": why} when there is none."""
        if self.dead:
            return {"error": f"no {self.label} process: {self.dead}"}
        if self.proc is None:
            self.start()
            self.wait_ready(min(180.0, max(30.0, timeout)))
            if self.dead:
                return {"error": f"no {self.label} process: {self.dead}"}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(timeout)
        except (TimeoutError, EOFError, BrokenPipeError, OSError) as e:
            reply = {"error": f"{type(e).__name__}: {e}", "fatal": str(e)}
        if "fatal" in reply:   # ended, and started again at the next row while restarts are left
            self.stop(kill=True)
            self.proc = None
            if self.restarts <= 0:
                self.dead = f"stopped after {reply['fatal']}"
            self.restarts -= 1
        return reply

    def stop(self, kill=False):
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
                self.proc.wait()
                return
            try:
                self.proc.stdin.write(b'{"quit": true}\n')
                self.proc.stdin.flush()
                self.proc.wait(5)
            except Exception:   # noqa: BLE001 -- hung or gone: killed
                self.proc.kill()
                self.proc.wait()


def before_after_meta(args):
    meta = {"current": {"name": args.current_name,
                        "library": args.current_lib or os.environ.get("ATTNFORGE_CUDA_LIBRARY")},
            "baseline": {"name": args.baseline_name, "library": args.baseline_lib, "missing": args.baseline_missing},
            "samples": args.samples, "budget_s": args.budget, "sample_ms": SAMPLE_MS}
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return meta


def write_before_after(out_dir, data):
    """before_after.json (everything), .csv (a line a row) and .md (the table), each replaced whole."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in BA_FILES]
    with open(paths[0] + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=BA_CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in data["rows"]:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in BA_CSV_FIELDS})
    with open(paths[1] + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    with open(paths[2] + ".tmp", "w") as f:
        f.write(before_after_markdown(data) + "\n")
    for p in paths:
        os.replace(p + ".tmp", p)


def ratio(a, b):
    return a / b if a and b else None


def before_after(args):
    shapes = before_after_shapes(args.quick, args.page_size)
    if args.dry_run:
        return before_after_dry_run(args, shapes)
    if torch is None or not torch.cuda.is_available():
        print("cuda_compare --before-after: " + ("torch is not importable" if torch is None else
                                                 "torch sees no CUDA device") + " (--dry-run needs neither)")
        return 2
    deadline = time.monotonic() + args.budget
    data = {"meta": before_after_meta(args), "rows": [], "skipped": [], "complete": False}
    workers = [BackendProcess("current", args.current_lib, args.attnforge_cli)]
    if args.baseline_lib:
        workers.append(BackendProcess("baseline", args.baseline_lib, args.attnforge_cli))
    for w in workers:   # both start at once (torch's import, the CUDA context)
        w.start()
    for w in workers:
        w.wait_ready(max(60.0, min(180.0, deadline - time.monotonic())))
        data["meta"][w.label].update(how=w.info.get("how"), loaded=w.info.get("library"),
                                     status=w.info.get("status"))
    write_before_after(args.out_dir, data)
    torch.manual_seed(0)
    for i, s in enumerate(shapes):
        now = time.monotonic()
        if now > deadline:
            data["skipped"].append(shape_key(s))
            continue
        est = estimate_row_seconds(s, args.samples)
        row = dict(s, key=shape_key(s), flops=shape_flops(s), kv_bytes=shape_kv_bytes(s))
        for w in workers if i % 2 == 0 else workers[::-1]:   # each build first on every other row
            timeout = min(max(60.0, 10 * est), max(20.0, deadline - time.monotonic() + 30))
            reply = w.ask({"shape": s, "samples": args.samples, "budget_s": max(1.0, deadline - time.monotonic())},
                          timeout)
            sec = reply.get("seconds")
            row[w.label + "_seconds"], row[w.label + "_spread"] = sec, reply.get("spread")
            row[w.label + "_error"] = reply.get("error") or ""
            row[w.label + "_max_abs_err"], row[w.label + "_rel_err"] = reply.get("max_abs_err"), reply.get("rel_err")
            row[w.label + "_reference_error"] = reply.get("reference_error") or ""
        if not args.baseline_lib:
            row["baseline_error"] = "no baseline: " + (args.baseline_missing or "no --baseline-lib")
        t, error = measure("inputs", lambda: ba_inputs(s))
        for col, backend in BA_TORCH.items():
            timed, row[col + "_error"] = (None, error) if t is None else measure(col, lambda: torch_seconds(
                backend, t["q"], t["k"], t["v"], s["causal"], s["Hq"] != s["Hkv"], args.samples, deadline,
                spread=True))
            row[col + "_seconds"], row[col + "_spread"] = timed if timed else (None, None)
        del t
        for col in BA_COLUMNS:
            sec = row.get(col + "_seconds")
            row[col + "_tflops"] = row["flops"] / sec * 1e-12 if sec else None
            row[col + "_kv_gbps"] = row["kv_bytes"] / sec * 1e-9 if sec else None
        row["current_over_baseline"] = ratio(row["current_tflops"], row["baseline_tflops"])
        row["current_over_cudnn"] = ratio(row["current_tflops"], row["cudnn_tflops"])
        data["rows"].append(row)
        write_before_after(args.out_dir, data)
        log(f"cuda_compare: {row['key']}: " + ", ".join(
            f"{c} {cell(row[c + '_tflops'], '{:.1f}')}" for c in BA_COLUMNS) + " TFLOP/s; err " +
            ", ".join(f"{c} {cell(row.get(c + '_max_abs_err'), '{:.1e}')}" for c in ("baseline", "current")))
    for w in workers:
        w.stop()
    data["complete"] = True
    write_before_after(args.out_dir, data)
    print(before_after_markdown(data))
    if args.out_dir:
        print("\nwritten: " + ", ".join(os.path.join(args.out_dir, n) for n in BA_FILES))
    return 0


def tflops_cell(x):
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def err_cell(x):
    if x is None:
        return "-"
    return "NaN" if x != x else f"{x:.1e}"


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def before_after_markdown(data):
    """The table (and the notes under it) of a before/after run, from its JSON."""
    import contextlib
    import io
    meta, rows = data["meta"], data["rows"]
    order = {"prefill": 0, "gqa": 1, "paged decode": 2}
    rows = sorted(rows, key=lambda r: (order.get(r["kind"], 3), r["dtype"], r["E"], r["causal"], r["L"]))
    lines = []
    for r in rows:
        lines.append([r["kind"], r["B"], f"{r['Hq']}/{r['Hkv']}" if r["Hq"] != r["Hkv"] else r["Hq"], r["L"], r["S"],
                      r["E"], r["dtype"], "yes" if r["causal"] else "no"] +
                     [tflops_cell(r.get(c + "_tflops")) for c in BA_COLUMNS] +
                     [cell(r.get("current_over_baseline"), "{:.2f}"), cell(r.get("current_over_cudnn"), "{:.2f}"),
                      err_cell(r.get("baseline_max_abs_err")), err_cell(r.get("current_max_abs_err"))])
    base, cur = meta.get("baseline", {}), meta.get("current", {})
    where = (f"{meta['device']}, torch {meta.get('torch')}, CUDA {meta.get('cuda')}, cuDNN {meta.get('cudnn')}"
             if meta.get("device") else "no device (dry run)" if meta.get("dry_run") else "device unknown")
    title = (f"\nBefore/after ({where}): baseline = {base.get('name')}, current = {cur.get('name')}; TFLOP/s by FA4's "
             f"formula (causal counts the keys seen), median of {meta.get('samples')} samples; flash and cuDNN = "
             f"torch SDPA forced to that backend (the paged row: on the dense copy of the pages); err = max |out − "
             f"float64 reference| of each attnforge build")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        markdown_table(title, ["kind", "B", "H", "L", "S", "E", "dtype", "causal", "baseline", "current",
                               "torch flash", "cuDNN", "current/baseline", "current/cuDNN", "err baseline",
                               "err current"], 8, lines)
        g_base = geomean(r.get("current_over_baseline") for r in rows)
        g_cudnn = geomean(r.get("current_over_cudnn") for r in rows)
        if g_base or g_cudnn:
            print(f"\ngeomean over the rows with both: current/baseline {cell(g_base, '{:.2f}')}, current/cuDNN "
                  f"{cell(g_cudnn, '{:.2f}')}")
        for r in rows:
            if r["kind"] == "paged decode" and any(r.get(c + "_kv_gbps") for c in BA_COLUMNS):
                print(f"{r['key']}: GB/s of K+V read: " + ", ".join(
                    f"{c} {cell(r.get(c + '_kv_gbps'))}" for c in BA_COLUMNS))
        spreads = [r.get(c + "_spread") for r in rows for c in BA_COLUMNS if r.get(c + "_spread") is not None]
        if spreads:
            print(f"timing spread ((max − min) / median of a measurement's samples): median "
                  f"{100 * statistics.median(spreads):.1f}%, largest {100 * max(spreads):.1f}%: a ratio closer to 1 "
                  f"than that is noise")
        for label, m in (("baseline", base), ("current", cur)):
            if m.get("missing"):
                print(f"{label}: none ({m['missing']})")
            elif m.get("status") or m.get("library"):
                status = f": {m['status']}" if m.get("status") else ""
                print(f"{label}: {m.get('loaded') or m.get('library')}{status}" + (f"; {m['how']}" if m.get("how") else ""))
        errors = sorted({f"{c}: {r[c + '_error']}" for r in rows for c in BA_COLUMNS if r.get(c + "_error")} |
                        {f"{c} reference: {r[c + '_reference_error']}" for r in rows for c in ("baseline", "current")
                         if r.get(c + "_reference_error")})
        if errors:
            print("errors (a '-' in the table):\n" + "\n".join(f"- {e}" for e in errors))
        if data.get("skipped"):
            print("not measured (the budget was spent): " + "; ".join(data["skipped"]))
        if rows and not data.get("complete", True):
            print("(incomplete: the run was stopped before its end; these rows were measured)")
    return buf.getvalue().rstrip("\n")


if __name__ == "__main__":
    sys.exit(main())
