"""Train a small Llama-shaped model with context parallelism on the CPU: every sequence of 256 tokens is split over
the ranks (zigzag shards), each attention call runs attnforge's ring over gloo, and the losses equal those of the same
training in one process.

    torchrun --nproc_per_node 2 examples/train_context_parallel.py           # context parallel over 2 ranks
    python examples/train_context_parallel.py --single                       # the same training, one process
    torchrun --nproc_per_node 2 examples/train_context_parallel.py --check   # both; asserts the losses agree

Needs transformers and an installed attnforge (`pip install .`, or scripts/test-python.sh's venv). --check trains the
single-process reference on every rank too and asserts that each step's loss agrees to 1e-4 relative.

The task: each sequence counts up from a random token by a random step of 1 to 7 (mod 128); the step can only be
read from earlier tokens, so the model has to learn to attend, and the loss falls from ln 128 = 4.85 to about 2.7
within 20 steps (AdamW, float32)."""
import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

SEQ, BATCH, STEPS, VOCAB = 256, 2, 20, 128
LR = 1e-2
TOLERANCE = 1e-4   # relative, per step


def make_model(implementation: str):
    """The tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128), float32, seeded: the same weights in
    every process."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                         tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.set_attn_implementation(implementation)
    return model.train()


def make_batch(step: int) -> torch.Tensor:
    """Step `step`'s (BATCH, SEQ) token ids, from a generator seeded by the step: identical on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    stride = torch.randint(1, 8, (BATCH, 1), generator=generator)
    first = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    return (first + stride * torch.arange(SEQ)) % VOCAB


def train_single(steps: int = STEPS, log=print):
    """The reference: whole sequences in this process on attnforge's attention, Transformers' own causal-LM loss."""
    import attnforge.transformers
    attnforge.transformers.register()
    model = make_model("attnforge")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        ids = make_batch(step)
        loss = model(input_ids=ids, labels=ids).loss   # Transformers shifts the labels of the whole sequence
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        log(f"single  step {step + 1:2d}/{steps}  loss {losses[-1]:.6f}  {1e3 * (time.perf_counter() - start):.0f} ms")
    return losses


def train_context_parallel(steps: int = STEPS, group=None, layout: str = "zigzag", log=print):
    """Each rank of `group` holds 1/W of every sequence; attention runs on the ring, everything else on the shard."""
    import attnforge.distributed.transformers as cpt
    cpt.register()
    model = make_model(cpt.NAME)   # "attnforge_cp": the ring inside context_parallel(), attnforge outside
    _broadcast_parameters(model, group)   # seeded alike already; DDP/FSDP would broadcast rank 0's too
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    with cpt.context_parallel(group, layout):
        for step in range(steps):
            start = time.perf_counter()
            # this rank's tokens, their global positions (RoPE) and labels shifted over the whole sequence
            batch = cpt.shard_batch(make_batch(step), layout=layout, group=group)
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            # the loss from the logits: Transformers' labels= would shift the shard's labels a second time
            loss = cpt.loss_across_ranks(*cpt.loss_sum(logits, batch.labels), group)
            optimizer.zero_grad()
            loss.backward()   # the ring's backward sends dK/dV back to the ranks that own those tokens
            # each rank's parameter gradients cover its own tokens only: summed over the CP group, as DDP or FSDP
            # over the CP dimension would, they are the gradient of the whole batch's mean loss
            cpt.sum_gradients(model, group)
            optimizer.step()
            losses.append(loss.item())
            log(f"cp      step {step + 1:2d}/{steps}  loss {losses[-1]:.6f}  "
                f"{1e3 * (time.perf_counter() - start):.0f} ms")
    return losses


def _broadcast_parameters(model, group):
    """Every rank starts from the first rank's weights."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for p in model.parameters():
        dist.broadcast(p.data, src=source, group=group)


def max_relative_difference(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def check(steps: int = STEPS, group=None, layout: str = "zigzag", log=print):
    """Both trainings on this rank (the single one needs no peer); (single losses, CP losses, max relative
    difference); raises AssertionError when a step differs by more than TOLERANCE."""
    single = train_single(steps, log)
    parallel = train_context_parallel(steps, group, layout, log)
    worst = max_relative_difference(parallel, single)
    log(f"max relative difference over {steps} steps: {worst:.3g}")
    assert len(parallel) == len(single) == steps
    assert worst <= TOLERANCE, f"CP losses differ from single-process ones by {worst:.3g} (relative) > {TOLERANCE}"
    return single, parallel, worst


def _init_group():
    """gloo from torchrun's environment, or a group of one (from a temporary file) without torchrun."""
    timeout = datetime.timedelta(seconds=120)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
        return
    path = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1, timeout=timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", action="store_true", help="train in this process without context parallelism")
    parser.add_argument("--check", action="store_true", help="train both ways and assert the losses agree")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "ring", "stripe"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # one rank a core
    import attnforge
    attnforge.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.single or (world == 1 and not args.check):
        log = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)   # torchrun: rank 0 speaks
        losses = train_single(args.steps, log)
        log("losses:", " ".join(f"{x:.6f}" for x in losses))
        return 0
    _init_group()
    rank = dist.get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    try:
        if args.check:
            _, losses, worst = check(args.steps, None, args.layout, log)
            log(f"check passed: {world} ranks, max relative difference {worst:.3g} <= {TOLERANCE}")
        else:
            losses = train_context_parallel(args.steps, None, args.layout, log)
        log("losses:", " ".join(f"{x:.6f}" for x in losses))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
