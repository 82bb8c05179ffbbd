"""attnforge.create_block_mask against PyTorch's create_block_mask (uncompiled: it builds the dense (B, H, L, S) mask
first), on packed documents with a causal mask (issue 47's shape: 16 documents, L = S = 32768), in one run: times,
peak memory growth of each (ru_maxrss, so PyTorch's runs last), and the two masks' tensors compared for equality.

    python bench/flex_block_mask.py [--len 32768] [--docs 16] [--block 128]
"""
import argparse
import resource
import time

import torch

import attnforge


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask
    N = args.len
    lengths = torch.full((args.docs,), N // args.docs)
    lengths[0] += N - int(lengths.sum()) + 77   # documents that do not start on block boundaries
    lengths[-1] -= 77
    docs = torch.repeat_interleave(torch.arange(args.docs), lengths)

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    t0 = time.perf_counter()
    attnforge.create_block_mask(document_causal, 1, 1, N, N, BLOCK_SIZE=args.block)
    first = time.perf_counter() - t0
    before = rss_mib()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ours = attnforge.create_block_mask(document_causal, 1, 1, N, N, BLOCK_SIZE=args.block)
        times.append(time.perf_counter() - t0)
    ours_t = sorted(times)[2]
    ours_mem = rss_mib() - before
    before = rss_mib()
    t0 = time.perf_counter()
    theirs = create_block_mask(document_causal, 1, 1, N, N, device="cpu", BLOCK_SIZE=args.block)
    theirs_t = time.perf_counter() - t0
    theirs_mem = rss_mib() - before
    same = all(torch.equal(getattr(ours, n), getattr(theirs, n))
               for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
    print(f"{args.docs} causal documents, L = S = {N}, blocks of {args.block}, {attnforge.get_num_threads()} threads")
    print(f"attnforge.create_block_mask   {ours_t * 1e3:9.1f} ms (median of 5; first call {first * 1e3:.1f} ms, "
          f"tracing the mask)   peak memory +{ours_mem:.0f} MiB")
    print(f"PyTorch create_block_mask     {theirs_t * 1e3:9.1f} ms                                     "
          f"peak memory +{theirs_mem:.0f} MiB")
    print(f"ratio {theirs_t / ours_t:.0f}x; the same block tensors: {same}")


if __name__ == "__main__":
    main()
