#!/usr/bin/env python3
"""The pattern users run (issue 39): a projection matmul on PyTorch's OpenMP threads, then the attention. Alone and
back to back, for PyTorch's SDPA, attnforge on torch's OpenMP threads (the default once torch is imported) and
attnforge on its own thread pool (set_host_threads(False): what it did before). Then a whole Llama-shaped
Transformers model, a prefill forward and one decode step, attn_implementation "sdpa" against "attnforge".

    python bench/matmul_attention.py                  # the loop table, then the model table
    python bench/matmul_attention.py --loop           # the loop table only (about a minute on 2 cores)
    python bench/matmul_attention.py --model --hidden 2048 --lengths 512 2048 4096
    python bench/matmul_attention.py --rounds 15 --iters 5 --threads 2

Rounds are interleaved (every variant once a round, the order rotating) so that load from other processes hits all
alike; tables give medians over rounds. "loop/sum" is matmul+attention over matmul alone plus attention alone: above
1.00 is what one operator's threads cost the next. Under torch.no_grad(). The machine must be quiet: PyTorch's
OpenMP threads starved of a core by another process make every number here meaningless (check `uptime`).
"""
import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attnforge

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (name, B, Hq, Hkv, L, S, E, causal, matmul rows, hidden): q/k/v are HND views of NHD memory, as a transformer's
# x.view(B, L, H, E).transpose(1, 2) gives them; the matmul is (rows, hidden)·(hidden, hidden), the projection before.
SHAPES = [
    ("prefill", 1, 16, 16, 512, 512, 64, False, 512, 1024),
    ("prefill causal", 1, 16, 16, 512, 512, 64, True, 512, 1024),
    ("decode", 1, 16, 4, 1, 4096, 128, False, 1, 2048),
]
ATTENTIONS = ("sdpa", "attnforge", "attnforge own pool")
CACHE_ARG = "cache"   # Transformers 5's name for past_key_values


def hnd_view(B, H, n, E, dtype, g):
    return torch.randn(B, n, H, E, generator=g).to(dtype).transpose(1, 2)


def attention_fn(which, q, k, v, causal):
    kw = {"is_causal": causal, "enable_gqa": q.shape[1] != k.shape[1]}
    if which == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)
    return lambda: attnforge.scaled_dot_product_attention(q, k, v, **kw)


def use_threads_of(which):
    """attnforge on torch's OpenMP threads, or on its own pool (what it ran on before issue 39)."""
    attnforge.set_host_threads(which != "attnforge own pool")


def timed(fn, iters):
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def bench_loop(shape, dtype, rounds, iters):
    name, B, Hq, Hkv, L, S, E, causal, rows, hidden = shape
    g = torch.Generator().manual_seed(39)
    q, k, v = hnd_view(B, Hq, L, E, dtype, g), hnd_view(B, Hkv, S, E, dtype, g), hnd_view(B, Hkv, S, E, dtype, g)
    x, w = torch.randn(rows, hidden, generator=g).to(dtype), torch.randn(hidden, hidden, generator=g).to(dtype)

    def matmul():
        return x @ w

    variants = {"matmul": (None, matmul)}
    for which in ATTENTIONS:
        attend = attention_fn(which, q, k, v, causal)
        variants[which] = (which, attend)
        variants["matmul + " + which] = (which, lambda attend=attend: (matmul(), attend()))
    samples = {key: [] for key in variants}
    keys = list(variants)
    for key in keys:   # warm-up: threads made, kernels chosen, caches sized
        use_threads_of(variants[key][0] or "attnforge")
        timed(variants[key][1], 2)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            use_threads_of(variants[key][0] or "attnforge")
            samples[key].append(timed(variants[key][1], iters))
    attnforge.set_host_threads(True)
    return {key: statistics.median(times) for key, times in samples.items()}


def loop_table(args):
    print(f"\n### matmul then attention ({args.rounds} interleaved rounds of {args.iters} calls, medians)\n")
    print("| shape | dtype | attention | matmul | attention | matmul + attention | sum of the parts | loop/sum |"
          " vs matmul + sdpa |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        name, B, Hq, Hkv, L, S, E, causal, rows, hidden = shape
        label = f"{name} q ({B},{Hq},{L},{E}) kv {Hkv}×{S}, ({rows},{hidden})·({hidden},{hidden})"
        for dtype_name in args.dtypes:
            t = bench_loop(shape, DTYPES[dtype_name], args.rounds, args.iters)
            for which in ATTENTIONS:
                parts = t["matmul"] + t[which]
                loop = t["matmul + " + which]
                print(f"| {label} | {dtype_name} | {which} | {t['matmul'] * 1e3:.2f} ms | {t[which] * 1e3:.2f} ms |"
                      f" {loop * 1e3:.2f} ms | {parts * 1e3:.2f} ms | {loop / parts:.2f} |"
                      f" {t['matmul + sdpa'] / loop:.2f}× |", flush=True)


def model_table(args):
    import transformers

    import attnforge.transformers as aft

    aft.register()
    print(f"\n### Llama-shaped model, hidden {args.hidden}, {args.layers} layers ({args.rounds} interleaved rounds of a"
          f" forward, or of {args.iters} decode steps or attention calls; medians)\n")
    heads = args.hidden // 128
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75) // 64 * 64,
                                      num_hidden_layers=args.layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 4), head_dim=128, vocab_size=1024,
                                      max_position_embeddings=max(args.lengths) + 1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    print("| L | dtype | step | sdpa | attnforge | attnforge own pool | sdpa/attnforge | attention alone: sdpa |"
          " attnforge | model with attention's gain alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        model.to(DTYPES[dtype_name])
        for L in args.lengths:
            ids = torch.randint(3, config.vocab_size, (1, L), generator=torch.Generator().manual_seed(1))
            g = torch.Generator().manual_seed(2)
            q = hnd_view(1, heads, L, 128, DTYPES[dtype_name], g)
            kv = [hnd_view(1, config.num_key_value_heads, L, 128, DTYPES[dtype_name], g) for _ in range(2)]
            qd = hnd_view(1, heads, 1, 128, DTYPES[dtype_name], g)
            cache = {}

            def prefill(impl):
                model.set_attn_implementation(impl)
                out = model(ids, use_cache=True)
                cache[impl] = out.get("cache", None) or out.get("past_key_values", None)   # Transformers 5 / 4

            def decode(impl):
                model.set_attn_implementation(impl)
                model(ids[:, -1:], **{CACHE_ARG: cache[impl]}, use_cache=True)
                cache[impl].crop(-1)   # drop the step's token: the next step is timed on the same L keys + 1

            runs = {}
            for which in ATTENTIONS:
                impl = "sdpa" if which == "sdpa" else "attnforge"
                runs[("forward", which)] = (which, lambda impl=impl: prefill(impl))
                runs[("decode", which)] = (which, lambda impl=impl: decode(impl))
                runs[("attn forward", which)] = (which, attention_fn(which, q, kv[0], kv[1], True))
                runs[("attn decode", which)] = (which, attention_fn(which, qd, kv[0], kv[1], False))
            samples = {key: [] for key in runs}
            keys = list(runs)
            with torch.no_grad():
                for key in keys:
                    use_threads_of(runs[key][0])
                    runs[key][1]()
                for r in range(args.rounds):
                    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                        use_threads_of(runs[key][0])   # a forward is long enough alone; a step or a call is not
                        samples[key].append(timed(runs[key][1], 1 if key[0] == "forward" else args.iters))
            attnforge.set_host_threads(True)
            t = {key: statistics.median(times) for key, times in samples.items()}
            for step in ("forward", "decode"):
                sdpa, af = t[(step, "sdpa")], t[(step, "attnforge")]
                gain = args.layers * (t[("attn " + step, "sdpa")] - t[("attn " + step, "attnforge")])
                print(f"| {L} | {dtype_name} | {step} | {sdpa * 1e3:.1f} ms | {af * 1e3:.1f} ms |"
                      f" {t[(step, 'attnforge own pool')] * 1e3:.1f} ms | {sdpa / af:.2f}× |"
                      f" {t[('attn ' + step, 'sdpa')] * 1e3:.2f} ms | {t[('attn ' + step, 'attnforge')] * 1e3:.2f} ms |"
                      f" {(sdpa - gain) * 1e3:.1f} ms |", flush=True)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop", action="store_true", help="the matmul-then-attention table only")
    parser.add_argument("--model", action="store_true", help="the Transformers model table only")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    parser.add_argument("--iters", type=int, default=5, help="calls timed together in a loop sample (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--hidden", type=int, default=1024, help="model hidden size, a multiple of 128 (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="model prompt lengths")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    both = not args.loop and not args.model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, attnforge {attnforge.__version__}"
          f" (isa {attnforge.get_isa()}, host threads {attnforge.get_host_threads()}), {cpu_name()}")
    with torch.no_grad():
        if args.loop or both:
            loop_table(args)
    if args.model or both:
        model_table(args)


if __name__ == "__main__":
    main()
