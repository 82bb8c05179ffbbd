"""A GQA attention block calling F.scaled_dot_product_attention, as a transformer does: shared by the operator tests
(test_torch_ops.py) and bench/graph_breaks.py (which also runs it against attnforge builds without the operators)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Block(nn.Module):
    """A GQA attention block calling F.scaled_dot_product_attention, as a transformer does."""

    def __init__(self, d=64, heads=4, kv_heads=2, causal=True):
        super().__init__()
        self.heads, self.kv_heads, self.e, self.causal = heads, kv_heads, d // heads, causal
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)
        self.k, self.v = nn.Linear(d, kv_heads * self.e), nn.Linear(d, kv_heads * self.e)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.e).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv_heads, self.e).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv_heads, self.e).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return x + self.o(y.transpose(1, 2).reshape(b, n, -1))
