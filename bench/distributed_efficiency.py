#!/usr/bin/env python3
"""Context parallelism's efficiency on one machine: W processes × T threads each (gloo over loopback) against one
process × W·T threads on the whole sequence, the same total cores. Forward + backward of causal attention at
(B, S, H, E) with attnforge.distributed's zigzag ring, its plain (contiguous) ring and Ulysses, and the whole-sequence
attnforge.flash_attn_func as the baseline.

    efficiency = time(one process, W·T threads) / time(W processes × T threads)      (1.00 = perfect scaling)

For the rings it also reports the exposed communication (seconds the slowest rank waited for its transfers, the
ring's counters in attnforge.distributed._comm.stats; it includes waiting for a neighbour with more work, which is
all of the plain ring's), its share of the call's time, the same transfers alone (ranks exchanging the same K/V and
dK/dV bytes with no compute), the share of those hidden under compute (1 - exposed / alone, floored at 0), and the
bytes each rank sends per transfer (the forward's K/V and the backward's K/V and float32 dK/dV posts, averaged),
from which a slower network's effect follows (docs/DISTRIBUTED.md).

    python bench/distributed_efficiency.py                         # S 8192, H 8, E 128, W 2 x 1 thread, f32 + bf16
    python bench/distributed_efficiency.py --seq 16384 --world 2 --threads 1 --rounds 3 --dtypes bfloat16

Medians over rounds; the machine must be quiet (check `uptime`): the rounds of the W processes and the baseline
alternate so that other load hits both alike.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

METHODS = ("zigzag", "ring", "ulysses")


def _setup_threads(threads):
    import attnforge
    torch.set_num_threads(threads)
    attnforge.set_num_threads(threads)


def _tensors(shape, dtype, seed=0):
    b, s, h, e = shape
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(b, s, h, e, generator=g).to(dtype).requires_grad_()   # noqa: E731
    return make(), make(), make(), torch.randn(b, s, h, e, generator=g).to(dtype)


def _single(shape, dtype_name, threads, rounds, queue):
    """The baseline: the whole sequence in this process, fwd + bwd, `rounds` timings."""
    import attnforge
    _setup_threads(threads)
    q, k, v, dout = _tensors(shape, getattr(torch, dtype_name))
    times = []
    for _ in range(rounds + 1):   # the first is a warm-up
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        out, _ = attnforge.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        times.append(time.perf_counter() - start)
    queue.put(times[1:])


def _rank(rank, world, init_file, shape, dtype_name, threads, method, rounds, queue):
    import torch.distributed as dist
    import attnforge.distributed as ad
    from attnforge.distributed import _comm
    _setup_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dtype = getattr(torch, dtype_name)
    q, k, v, dout = _tensors(shape, dtype)
    layout = "ring" if method == "ulysses" else method
    lq, lk, lv = (ad.shard(t.detach(), layout, rank, world).requires_grad_() for t in (q, k, v))
    ldout = ad.shard(dout, layout, rank, world)
    call = {"zigzag": ad.zigzag_ring_flash_attn_func, "ring": ad.ring_flash_attn_func,
            "ulysses": ad.ulysses_attention}[method]
    rows = []
    for _ in range(rounds + 1):
        lq.grad = lk.grad = lv.grad = None
        dist.barrier()
        _comm.stats.reset()
        start = time.perf_counter()
        out = call(lq, lk, lv, causal=True)
        out.backward(ldout)
        elapsed = time.perf_counter() - start
        rows.append((elapsed, _comm.stats.wait_seconds, _comm.stats.bytes_sent, _comm.stats.steps))
    # the same transfers alone: every step's K/V (forward and backward) and dK/dV exchange, no compute
    alone = None
    if method != "ulysses" and world > 1:
        ring = _comm.Ring(dist.group.WORLD, world, rank, "bench")
        kv = (lk.detach().contiguous(), lv.detach().contiguous())
        dkv = tuple(torch.zeros(t.shape, dtype=torch.float32) for t in kv)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2 * (world - 1)):   # forward and backward K/V hops
            ring.post(kv, tuple(torch.empty_like(t) for t in kv))
            ring.wait()
        for _ in range(world):             # dK/dV hops
            ring.post(dkv, tuple(torch.empty_like(t) for t in dkv))
            ring.wait()
        alone = time.perf_counter() - start
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, rows[1:], alone))


def _distributed(shape, dtype_name, world, threads, method, rounds):
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [context.Process(target=_rank, args=(r, world, init, shape, dtype_name, threads, method, rounds,
                                                     queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    return results


def _run_single(shape, dtype_name, threads, rounds):
    context = mp.get_context("spawn")
    queue = context.Queue()
    p = context.Process(target=_single, args=(shape, dtype_name, threads, rounds, queue))
    p.start()
    times = queue.get(timeout=3600)
    p.join()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    w, t = args.world, args.threads
    print(f"shape (B, S, H, E) = {shape}, causal, forward + backward; {w} processes x {t} threads vs 1 process x "
          f"{w * t} threads; {os.cpu_count()} CPUs; torch {torch.__version__}", flush=True)
    table = []
    for dtype_name in args.dtypes:
        base = _run_single(shape, dtype_name, w * t, args.rounds)
        print(f"{dtype_name}: one process, {w * t} threads: median {statistics.median(base):.3f} s "
              f"({', '.join(f'{x:.3f}' for x in base)})", flush=True)
        for method in args.methods:
            ranks = _distributed(shape, dtype_name, w, t, method, args.rounds)
            per_round = [max(r[1][i][0] for r in ranks) for i in range(args.rounds)]   # the slowest rank's time
            median = statistics.median(per_round)
            wait = statistics.median(max(r[1][i][1] for r in ranks) for i in range(args.rounds))
            bytes_step = ranks[0][1][0][2] / max(1, ranks[0][1][0][3])
            alone = max((r[2] for r in ranks if r[2] is not None), default=None)
            hidden = None if not alone else max(0.0, 1.0 - wait / alone)
            row = {"dtype": dtype_name, "method": method, "single_s": statistics.median(base),
                   "distributed_s": median, "efficiency": statistics.median(base) / median,
                   "exposed_comm_s": wait, "exposed_share": wait / median, "comm_alone_s": alone,
                   "hidden_share": hidden,
                   "bytes_per_step": bytes_step, "per_rank_s": [statistics.median(x[0] for x in r[1]) for r in ranks]}
            table.append(row)
            extra = "" if method == "ulysses" else (
                f", exposed comm {wait:.3f} s ({100 * wait / median:.1f}% of the call; the transfers alone "
                f"{alone:.3f} s, hidden {100 * hidden:.0f}%), {bytes_step / 2**20:.1f} MiB per transfer")
            print(f"  {method:8s}: {median:.3f} s, efficiency {row['efficiency']:.2f}, per rank "
                  f"{', '.join(f'{x:.3f}' for x in row['per_rank_s'])} s{extra}", flush=True)
    print("\n| dtype | method | 1 process x %d threads (s) | %d x %d (s) | efficiency | exposed comm | "
          "transfers alone | hidden |" % (w * t, w, t))
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        hid = "-" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.0f}%"
        exposed = "-" if r["method"] == "ulysses" else f"{r['exposed_comm_s']:.3f} s ({100 * r['exposed_share']:.1f}%)"
        alone = "-" if r["comm_alone_s"] is None else f"{r['comm_alone_s']:.3f} s"
        print(f"| {r['dtype']} | {r['method']} | {r['single_s']:.3f} | {r['distributed_s']:.3f} | "
              f"{r['efficiency']:.2f} | {exposed} | {alone} | {hid} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "world": w, "threads": t, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
