#!/usr/bin/env python3
"""The fixed cost of one attention call: tiny decode and prefill shapes, where the arithmetic takes a few
microseconds and everything else (argument handling, the operator dispatch, output allocation, the C call) shows.
Each path attnforge offers runs beside its PyTorch counterpart, interleaved round by round (PyTorch, attnforge, ...)
so that load from other processes hits both alike; the table gives the medians of the rounds (each round's time per
call averaged over --calls calls) and their ratio.

    python bench/tiny_calls.py                  # 7 rounds of 300 calls per path and shape, 2 threads
    python bench/tiny_calls.py --rounds 9 --calls 500 --threads 1 --json

Paths (attnforge vs the PyTorch call it stands in for):
    function     attnforge.scaled_dot_product_attention   vs F.scaled_dot_product_attention
    operator     torch.ops.attnforge.sdpa                 vs F.scaled_dot_product_attention
    apply        a module under attnforge.torch.apply()   vs the same module alone
    transformers attnforge.transformers.attention_forward vs Transformers' sdpa_attention_forward
    flash        attnforge.flash_attn_func (NHD views)    vs F.scaled_dot_product_attention
"""
import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnforge
import attnforge.torch

SHAPES = {   # name: (B, Hq, Hkv, L, S, E, is_causal); the two tiny calls
    "decode q(1,8,1,64) kv(1,2,128,64)": (1, 8, 2, 1, 128, 64, False),
    "prefill q/kv(1,8,16,64) causal": (1, 8, 8, 16, 16, 64, True),
}


class Attention(torch.nn.Module):
    """What a model's attention layer does: F.scaled_dot_product_attention, looked up at call time."""

    def __init__(self, is_causal, enable_gqa):
        super().__init__()
        self.is_causal, self.enable_gqa = is_causal, enable_gqa

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, enable_gqa=self.enable_gqa)


def inputs(B, Hq, Hkv, L, S, E, seed=0):
    """HND views of NHD-contiguous memory, as a transformer's x.view(B, L, H, D).transpose(1, 2) gives them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, Hq, E, generator=g).transpose(1, 2)
    k = torch.randn(B, S, Hkv, E, generator=g).transpose(1, 2)
    v = torch.randn(B, S, Hkv, E, generator=g).transpose(1, 2)
    return q, k, v


def transformers_pair(q, k, v, is_causal):
    """(attnforge's, Transformers' sdpa) attention functions bound to these tensors; None without Transformers."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    import attnforge.transformers as hf
    module = torch.nn.Module()
    module.is_causal = is_causal
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    scaling = q.shape[-1] ** -0.5
    return (lambda: hf.attention_forward(module, q, k, v, None, scaling=scaling, is_causal=is_causal),
            lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling, is_causal=is_causal))


def paths(shape):
    """name -> (attnforge call, PyTorch call, context manager factory or None) for one shape."""
    B, Hq, Hkv, L, S, E, causal = shape
    q, k, v = inputs(B, Hq, Hkv, L, S, E)
    gqa = Hq != Hkv
    torch_call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)   # noqa: E731
    module = Attention(causal, gqa)
    provider = attnforge.FlashAttention4KernelProvider()
    if not provider.prepare([((q, k, v), {"is_causal": causal, "enable_gqa": gqa})]):
        raise SystemExit(f"tiny_calls: the provider refused {shape}: {provider.reason}")
    qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))
    out = {
        "function": (lambda: attnforge.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                     torch_call, None),
        "operator": (lambda: torch.ops.attnforge.sdpa(q, k, v, None, 0.0, causal, None, gqa, False, False),
                     torch_call, None),
        "apply": (lambda: module(q, k, v), lambda: module(q, k, v),
                  lambda: attnforge.torch.apply(module, provider)),
        "flash": (lambda: attnforge.flash_attn_func(qn, kn, vn, causal=causal), torch_call, None),
    }
    pair = transformers_pair(q, k, v, causal)
    if pair is not None:
        out["transformers"] = (pair[0], pair[1], None)
    return out


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(ours, theirs, context, rounds, calls):
    """Medians over interleaved rounds: (attnforge µs, PyTorch µs)."""
    a, t = [], []
    for _ in range(rounds):
        t.append(per_call_us(theirs, calls))
        if context is None:
            a.append(per_call_us(ours, calls))
        else:
            with context():
                a.append(per_call_us(ours, calls))
    return statistics.median(a), statistics.median(t)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and attnforge's (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    attnforge.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for shape_name, shape in SHAPES.items():
            for path, (ours, theirs, context) in paths(shape).items():
                for fn in (ours, theirs):   # warm up: first-call work (plans, imports) is not per-call cost
                    fn()
                ours_us, torch_us = measure(ours, theirs, context, args.rounds, args.calls)
                rows.append({"shape": shape_name, "path": path, "attnforge_us": round(ours_us, 2),
                             "pytorch_us": round(torch_us, 2), "ratio": round(ours_us / torch_us, 3)})
                if not args.json:
                    print(f"{shape_name:36s} {path:13s} attnforge {ours_us:8.1f} us   PyTorch {torch_us:8.1f} us"
                          f"   attnforge/PyTorch {ours_us / torch_us:5.2f}", flush=True)
    if args.json:
        json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "attnforge": attnforge.__version__, "threads": args.threads, "rounds": args.rounds,
                   "calls": args.calls, "rows": rows}, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
