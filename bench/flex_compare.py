"""attnforge.flex_attention's cost, as ratios in one run (issue 47): a mod against plain attnforge attention on the
same shape, a block-sparse window against the same window as a dense mask, and against PyTorch's FlexAttention
compiled for the CPU (--compiled: a C++ toolchain and a compile of several seconds per mod; its first call is timed
apart, as is attnforge's, which traces the mods). attnforge's calls take attnforge.create_block_mask's masks,
PyTorch's its own create_block_mask's (the same blocks). Medians of alternating loops.

    python bench/flex_compare.py [--len 4096] [--heads 16] [--dim 64] [--dtype float32] [--compiled] [--backward]

--backward times training steps instead (forward and backward, the gradients of q, k and v): plain causal attnforge
against flex with a causal block mask and with ALiBi or a relative-position table on it (PyTorch's CPU flex has no
backward to compare with).
"""
import argparse
import time
import warnings

import torch

import attnforge
from _timing import timed_loops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--compiled", action="store_true", help="also PyTorch's compiled CPU flex_attention")
    ap.add_argument("--backward", action="store_true", help="training steps (forward + backward) instead")
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dt = getattr(torch, args.dtype)
    B, H, N, E = 1, args.heads, args.len, args.dim
    q, k, v = (torch.randn(B, H, N, E).to(dt) for _ in range(3))
    slopes = torch.tensor([2.0 ** -(8 * (h + 1) / H) for h in range(H)])

    rel_table = torch.randn(H, 2 * N) * 0.1   # a learnable relative-position bias per head (T5 / Transformer-XL)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel_table[h, kv_idx - q_idx + N]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    causal_mask = attnforge.create_block_mask(causal, 1, 1, N, N)
    window_mask = attnforge.create_block_mask(window, 1, 1, N, N)
    if args.backward:
        return backward_rows(q, k, v, {"ALiBi": alibi, "relative bias": relative}, causal_mask, args)
    dense_window = torch.ones(N, N, dtype=torch.bool).tril() & ~torch.ones(N, N, dtype=torch.bool).tril(-256)
    rows = {
        "plain causal (attnforge sdpa)": lambda: attnforge.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flex: causal mask_mod": lambda: attnforge.flex_attention(q, k, v, block_mask=causal_mask),
        "flex: ALiBi + causal": lambda: attnforge.flex_attention(q, k, v, score_mod=alibi, block_mask=causal_mask),
        "flex: relative bias + causal": lambda: attnforge.flex_attention(q, k, v, score_mod=relative,
                                                                         block_mask=causal_mask),
        "flex: ALiBi, no mask": lambda: attnforge.flex_attention(q, k, v, score_mod=alibi),
        "flex: window 256": lambda: attnforge.flex_attention(q, k, v, block_mask=window_mask),
        "dense window mask (attnforge sdpa)": lambda: attnforge.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_window),
    }
    for name in [n for n in rows if n.startswith("flex")]:
        t0 = time.perf_counter()
        rows[name]()
        print(f"attnforge {name}: first call {(time.perf_counter() - t0) * 1e3:.1f} ms (tracing the mods)")
    if args.compiled:
        causal_mask = create_block_mask(causal, 1, 1, N, N, device="cpu")
        window_mask = create_block_mask(window, 1, 1, N, N, device="cpu")
        compiled = torch.compile(flex_attention)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, mod, mask in (("ALiBi + causal", alibi, causal_mask),
                                    ("relative bias + causal", relative, causal_mask),
                                    ("window 256", None, window_mask)):
                t0 = time.perf_counter()
                compiled(q, k, v, score_mod=mod, block_mask=mask)
                print(f"PyTorch compiled flex, {name}: first call {time.perf_counter() - t0:.1f} s (compile)")
                rows[f"PyTorch compiled flex: {name}"] = (lambda m=mod, b=mask: compiled(q, k, v, score_mod=m,
                                                                                          block_mask=b))
    names = list(rows)
    times = timed_loops([rows[n] for n in names], target_s=0.5, repeats=5)
    base = times[0]
    print(f"B {B}, H {H}, L = S = {N}, E {E}, {args.dtype}, {attnforge.get_num_threads()} threads, "
          f"isa {attnforge.get_isa()}")
    for name, t in zip(names, times):
        print(f"{name:42} {t * 1e3:9.2f} ms   {t / base:5.2f}x plain causal")


def backward_rows(q, k, v, mods, causal_mask, args):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def step(fn):
        return lambda: torch.autograd.backward(fn(), dout)

    rows = {
        "plain causal (attnforge sdpa)": step(lambda: attnforge.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "flex: causal mask_mod": step(lambda: attnforge.flex_attention(q, k, v, block_mask=causal_mask)),
        **{f"flex: {name} + causal": step(lambda m=mod: attnforge.flex_attention(q, k, v, score_mod=m,
                                                                               block_mask=causal_mask))
           for name, mod in mods.items()},
    }
    names = list(rows)
    times = timed_loops([rows[n] for n in names], target_s=0.5, repeats=5)
    print(f"training step (forward + backward), B 1, H {q.shape[1]}, L = S = {q.shape[2]}, E {q.shape[3]}, "
          f"{args.dtype}, {attnforge.get_num_threads()} threads, isa {attnforge.get_isa()}")
    for name, t in zip(names, times):
        print(f"{name:42} {t * 1e3:9.2f} ms   {t / times[0]:5.2f}x plain causal")


if __name__ == "__main__":
    main()
