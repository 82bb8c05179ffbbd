"""Prefill and generate tokens/s of a small random Llama-style model (GQA) with attn_implementation "attnforge"
against "sdpa", on the CPU. The model is built from a config in code (no download); the two implementations are
timed interleaved (sdpa, attnforge, sdpa, attnforge) and the best of each is kept, since the machine's speed drifts.
Generate tokens/s counts the decode steps alone: generate(new + 1) minus generate(1), which is the prefill.

Usage: python bench/transformers_tokens.py [--prompt 512] [--new-tokens 64] [--threads 0]
(needs torch, transformers and attnforge's Python package; --threads sets attnforge's threads, 0 = all cores)
"""
import argparse
import time

import torch
import transformers

import attnforge
import attnforge.transformers as aft


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    parser.add_argument("--threads", type=int, default=0, help="attnforge threads, 0 = all cores (default)")
    args = parser.parse_args()

    aft.register()
    attnforge.set_num_threads(args.threads)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(3, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    def generate(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    results = {}
    for impl in ("sdpa", "attnforge", "sdpa", "attnforge"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            prefill = best_seconds(lambda: model(ids), 3)
            decode = best_seconds(generate(args.new_tokens + 1), 2) - best_seconds(generate(1), 2)
        now = (args.prompt / prefill, args.new_tokens / decode)
        prev = results.get(impl, now)
        results[impl] = (max(prev[0], now[0]), max(prev[1], now[1]))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, torch threads "
          f"{torch.get_num_threads()}, attnforge threads {attnforge.get_num_threads()}, prompt {args.prompt}, "
          f"new tokens {args.new_tokens}")
    for impl, (prefill, generate_rate) in results.items():
        print(f"{impl:10s} prefill {prefill:8.0f} tokens/s   generate {generate_rate:6.1f} tokens/s")


if __name__ == "__main__":
    main()
