#!/usr/bin/env python3
"""One training step (forward, loss, backward) of a Llama-shaped Transformers model with GQA on the CPU, three ways:
attn_implementation="sdpa" on PyTorch's CPU flash kernels, the same model after
torch.nn.attention.activate_flash_attention_impl("attnforge") (attnforge.torch_attention: PyTorch's flash operators on
attnforge, forward and backward), and attn_implementation="attnforge" (the Transformers backend, attnforge's
operators with their autograd). And the attention alone (forward + backward of F.scaled_dot_product_attention at
the model's shape), PyTorch's kernels against attnforge's, so the step's ratio can be read against the attention's.

With --model gemma2, a random-weight Gemma 2 (GQA, attn_logit_softcapping, sliding/global layers alternating, the
sliding window smaller than the lengths) two ways: attn_implementation="eager", Transformers' reference for the
softcap (Gemma 2 refuses "sdpa": _supports_sdpa is False, and sdpa_attention_forward raises on a softcap), and
attn_implementation="attnforge"; the attention alone is one sliding layer's, Gemma 2's eager_attention_forward with
the additive window mask eager gets against attnforge.transformers.attention_forward (no mask: the window and the
softcap go to the kernel). Its weights are drawn with --init-std 0.2 (Transformers' initializer_range is 0.02): at
0.02 the scores are ~1e-2, tanh(s/50)*50 is s to float32's precision and the loss is the same with the softcap off, so
the comparison would not test it; each row prints how far the eager loss moves with the softcap off.

    python bench/training_step.py                        # hidden 1024, 2 layers, L 1024 and 2048, float32
    python bench/training_step.py --dtypes float32 bfloat16 --lengths 512 2048 --rounds 9
    python bench/training_step.py --model gemma2 --window 512   # softcap 50, window 512 on every other layer

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
GEMMA2_VARIANTS = ("eager", "attn_implementation=attnforge")


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
    if args.model == "gemma2":   # layer_types default: sliding, full, sliding, ... as Gemma 2
        config = transformers.Gemma2Config(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                                           num_hidden_layers=args.layers, num_attention_heads=heads,
                                           num_key_value_heads=heads // 4, head_dim=args.head_dim, vocab_size=4096,
                                           query_pre_attn_scalar=args.head_dim, sliding_window=args.window,
                                           attn_logit_softcapping=args.softcap, initializer_range=args.init_std,
                                           max_position_embeddings=max(args.lengths), use_cache=False)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
        return model.train()
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
        self.name, self.model = name, attnforge_model if name.startswith("attn_implementation") else sdpa_model

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


def gemma2_attention_alone(args, dtype, length, g):
    """One sliding layer's attention, forward + backward: {"eager": ..., "attnforge": ...}."""
    import types
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    heads = args.hidden // args.head_dim
    q = torch.randn(1, length, heads, args.head_dim, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, length, heads // 4, args.head_dim, generator=g).to(dtype).transpose(1, 2).requires_grad_()
            for _ in range(2))
    grad = torch.randn(1, length, heads, args.head_dim, generator=g).to(dtype)
    i = torch.arange(length)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < args.window)   # as Transformers' sliding mask
    mask = torch.zeros(1, 1, length, length, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    module = types.SimpleNamespace(num_key_value_groups=4, head_dim=args.head_dim, training=True, is_causal=True)
    scaling = args.head_dim ** -0.5

    def run(name):
        if name == "eager":
            out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scaling, softcap=args.softcap)
        else:
            out, _ = aft.attention_forward(module, q, k, v, None, scaling=scaling, sliding_window=args.window,
                                           softcap=args.softcap)
        out.backward(grad)
        q.grad = k.grad = v.grad = None
    return {name: (lambda name=name: run(name)) for name in ("eager", "attnforge")}


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args, dtype, length):
    sdpa_model = build(args, dtype)   # Gemma 2: the eager model
    attnforge_model = copy.deepcopy(sdpa_model)
    attnforge_model.set_attn_implementation("attnforge")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 4096, (1, length), generator=g)
    names = GEMMA2_VARIANTS if args.model == "gemma2" else VARIANTS
    variants = [Variant(name, sdpa_model, attnforge_model) for name in names]
    first_loss = {}
    for variant in variants:   # warm-up, and each variant's loss on the same weights
        with variant as model:
            first_loss[variant.name] = step(model, ids)
    if args.model == "gemma2":   # the eager loss without the softcap: does it matter at these weights?
        layers = [layer.self_attn for layer in sdpa_model.model.layers]
        for layer in layers:
            layer.attn_logit_softcapping = None
        with torch.no_grad():
            first_loss["eager, softcap off"] = sdpa_model(input_ids=ids, labels=ids).loss.item()
        for layer in layers:
            layer.attn_logit_softcapping = args.softcap
    if args.model == "gemma2":
        alone = gemma2_attention_alone(args, dtype, length, g)
        alone_names = ("eager", "attnforge")
        for name in alone_names:   # warm-up
            alone[name]()
    else:
        alone = attention_alone(args, dtype, length, g)
        alone_names = ("sdpa", "attnforge")
    times = {name: [] for name in names}
    alone_times = {name: [] for name in alone_names}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            with variant as model:
                times[variant.name].append(timed(lambda: step(model, ids)))
        for name in (alone_names if r % 2 else alone_names[::-1]):
            if args.model == "gemma2":
                alone_times[name].append(timed(alone[name]))
                continue
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
    parser.add_argument("--model", default="llama", choices=["llama", "gemma2"],
                        help="llama (default: sdpa, sdpa + attnforge impl, attnforge) or gemma2 (eager, attnforge)")
    parser.add_argument("--window", type=int, default=512,
                        help="gemma2: sliding_window of every other layer (default 512; below the lengths)")
    parser.add_argument("--softcap", type=float, default=50.0,
                        help="gemma2: attn_logit_softcapping (default 50.0, Gemma 2's)")
    parser.add_argument("--init-std", type=float, default=0.2,
                        help="gemma2: initializer_range (default 0.2, so that the softcap changes the loss)")
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
    if args.model == "gemma2":
        return main_gemma2(args)
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


def main_gemma2(args):
    if args.window >= min(args.lengths):
        raise SystemExit(f"--window {args.window} must be below the lengths measured, or the window does not matter")
    print(f"# {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), attnforge "
          f"{attnforge.__version__} (ISA {attnforge.get_isa()}); Gemma 2 hidden {args.hidden}, {args.layers} layers "
          f"(sliding, full, ...), head dim {args.head_dim}, GQA 4:1, attn softcap {args.softcap}, window {args.window}, "
          f"init std {args.init_std}, causal, batch 1; medians of {args.rounds} interleaved rounds")
    print("| dtype | L | eager step ms | attn_implementation=attnforge ms (x) | sliding-layer attention fwd+bwd "
          "eager ms | attnforge ms (x) | first loss eager | attnforge | rel. diff | eager softcap off: rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        for length in args.lengths:
            steps, alone, loss = measure(args, getattr(torch, dtype_name), length)
            base, af = steps[GEMMA2_VARIANTS[0]], steps[GEMMA2_VARIANTS[1]]
            ref = loss[GEMMA2_VARIANTS[0]]
            rel = abs(loss[GEMMA2_VARIANTS[1]] - ref) / abs(ref)
            off = abs(loss["eager, softcap off"] - ref) / abs(ref)
            print(f"| {dtype_name} | {length} | {base * 1e3:.1f} | {af * 1e3:.1f} ({base / af:.2f}) | "
                  f"{alone['eager'] * 1e3:.1f} | {alone['attnforge'] * 1e3:.1f} "
                  f"({alone['eager'] / alone['attnforge']:.2f}) | {ref:.7f} | {loss[GEMMA2_VARIANTS[1]]:.7f} | "
                  f"{rel:.1e} | {off:.1e} |", flush=True)


if __name__ == "__main__":
    main()
