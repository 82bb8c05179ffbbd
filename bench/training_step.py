#!/usr/bin/env python3
"""One training step (forward, loss, backward) of a Llama-shaped Transformers model with GQA on the CPU, three ways:
attn_implementation="sdpa" on PyTorch's CPU flash kernels, the same model after
torch.nn.attention.activate_flash_attention_impl("attnforge") (attnforge.torch_attention: PyTorch's flash operators on
attnforge, forward and backward), and attn_implementation="attnforge" (the Transformers backend, attnforge's
operators with their autograd). And the attention alone (forward + backward of F.scaled_dot_product_attention at
the model's shape), PyTorch's kernels against attnforge's, so the step's ratio can be read against the attention's.

    python bench/training_step.py                        # hidden 1024, 2 layers, L 1024 and 2048, float32
    python bench/training_step.py --dtypes float32 bfloat16 --lengths 512 2048 --rounds 9

Rounds are interleaved (every variant once a round, the order rotating) so that load from other processes hits all
alike; the tables give medians over rounds and each variant's ratio to PyTorch's kernels (above 1.00: faster than
PyTorch). The first loss of each variant is printed beside its relative difference from PyTorch's. The machine must
be quiet (check `uptime`).
"""
import argparse
import copy
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn import attention

import attnforge
import attnforge.transformers as aft

VARIANTS = ("sdpa", "sdpa + attnforge impl", "attn_implementation=attnforge")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build(args, dtype):
    import transformers
    torch.manual_seed(0)
    heads = args.hidden // args.head_dim
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                                      num_hidden_layers=args.layers, num_attention_heads=heads,
                                      num_key_value_heads=heads // 4, head_dim=args.head_dim, vocab_size=4096,
                                      max_position_embeddings=max(args.lengths), use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.train()


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


class Variant:
    """Switches the model's attention to one of VARIANTS for the duration of a sample."""

    def __init__(self, name, sdpa_model, attnforge_model):
        self.name, self.model = name, attnforge_model if name == VARIANTS[2] else sdpa_model

    def __enter__(self):
        if self.name == VARIANTS[1]:
            attention.activate_flash_attention_impl("attnforge")
        return self.model

    def __exit__(self, *exc):
        if self.name == VARIANTS[1]:
            attention.restore_flash_attention_impl()


def attention_alone(args, dtype, length, g):
    heads = args.hidden // args.head_dim
    q = torch.randn(1, length, heads, args.head_dim, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, length, heads // 4, args.head_dim, generator=g).to(dtype).transpose(1, 2).requires_grad_()
            for _ in range(2))
    grad = torch.randn(1, heads, length, args.head_dim, generator=g).to(dtype)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None
    return run


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args, dtype, length):
    sdpa_model = build(args, dtype)
    attnforge_model = copy.deepcopy(sdpa_model)
    attnforge_model.set_attn_implementation("attnforge")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 4096, (1, length), generator=g)
    variants = [Variant(name, sdpa_model, attnforge_model) for name in VARIANTS]
    first_loss = {}
    for variant in variants:   # warm-up, and each variant's loss on the same weights
        with variant as model:
            first_loss[variant.name] = step(model, ids)
    alone = attention_alone(args, dtype, length, g)
    times = {name: [] for name in VARIANTS}
    alone_times = {"sdpa": [], "attnforge": []}
    for r in range(args.rounds):
        order = variants[r % 3:] + variants[:r % 3]
        for variant in order:
            with variant as model:
                times[variant.name].append(timed(lambda: step(model, ids)))
        for name in (("sdpa", "attnforge") if r % 2 else ("attnforge", "sdpa")):
            if name == "attnforge":
                attention.activate_flash_attention_impl("attnforge")
            try:
                alone_times[name].append(timed(alone))
            finally:
                if name == "attnforge":
                    attention.restore_flash_attention_impl()
    return ({n: statistics.median(t) for n, t in times.items()}, {n: statistics.median(t) for n, t in
                                                                   alone_times.items()}, first_loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64); 4 query heads a KV head")
    parser.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="sequence lengths, batch 1")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    aft.register()
    print(f"# {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), attnforge "
          f"{attnforge.__version__} (ISA {attnforge.get_isa()}); Llama hidden {args.hidden}, {args.layers} layers, "
          f"head dim {args.head_dim}, GQA 4:1, causal, batch 1; medians of {args.rounds} interleaved rounds")
    print("| dtype | L | sdpa step ms | + attnforge impl ms (x) | attn_implementation=attnforge ms (x) | "
          "attention fwd+bwd sdpa ms | attnforge ms (x) | first loss: impl, backend rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        for length in args.lengths:
            steps, alone, loss = measure(args, getattr(torch, dtype_name), length)
            base = steps[VARIANTS[0]]
            rel = [abs(loss[n] - loss[VARIANTS[0]]) / abs(loss[VARIANTS[0]]) for n in VARIANTS[1:]]
            print(f"| {dtype_name} | {length} | {base * 1e3:.1f} | {steps[VARIANTS[1]] * 1e3:.1f} "
                  f"({base / steps[VARIANTS[1]]:.2f}) | {steps[VARIANTS[2]] * 1e3:.1f} "
                  f"({base / steps[VARIANTS[2]]:.2f}) | {alone['sdpa'] * 1e3:.1f} | {alone['attnforge'] * 1e3:.1f} "
                  f"({alone['sdpa'] / alone['attnforge']:.2f}) | {rel[0]:.1e}, {rel[1]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
