"""Graph breaks of a 2-layer GQA model under attnforge.torch.apply, as a user meets them: torch._dynamo.explain,
torch.compile(fullgraph=True) and torch.export. Runs against any installed attnforge (before its PyTorch operators:
2 breaks, 3 graphs, fullgraph and export fail; with them: 0 breaks, 1 graph, both pass).
Usage: python bench/graph_breaks.py"""
import os
import sys

import torch
import torch.nn as nn

import attnforge as af
import attnforge.torch as aft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from gqa_block import Block, randn  # noqa: E402


def first_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def main():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.record(model, randn(2, 16, 64))), provider.reason
    x = randn(2, 16, 64)
    with torch.no_grad(), aft.apply(model, provider):
        explained = torch._dynamo.explain(model)(x)
        print(f"attnforge {af.__version__}: graph breaks {explained.graph_break_count}, "
              f"graphs {explained.graph_count}")
        for reason in explained.break_reasons[:1]:
            print("  first break:", str(reason.reason).splitlines()[0][:160])
        torch._dynamo.reset()
        try:
            torch.compile(model, fullgraph=True, backend="eager")(x)
            print("compile(fullgraph=True): ok")
        except Exception as error:   # what a user sees is the point: report any failure
            print("compile(fullgraph=True): fails:", first_line(error))
        try:
            program = torch.export.export(model, (x,))
            nodes = sum(str(n.target).startswith("attnforge.") for n in program.graph.nodes)
            print(f"torch.export: ok, {nodes} attnforge nodes")
        except Exception as error:
            print("torch.export: fails:", first_line(error))


if __name__ == "__main__":
    main()
