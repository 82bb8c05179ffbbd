"""Graph breaks of a 2-layer GQA model under attnforge.torch.apply: torch._dynamo.explain, compile(fullgraph=True) and
torch.export, as a user meets them. Usage: python bench/graph_breaks.py (with attnforge and torch installed)."""
import sys, torch, torch.nn as nn, torch.nn.functional as F
import attnforge as af, attnforge.torch as aft
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


torch.manual_seed(0)
model = nn.Sequential(Block(), Block()).eval()
p = af.FlashAttention4KernelProvider(); assert p.prepare(aft.record(model, randn(2, 16, 64)))
x = randn(2, 16, 64)
with torch.no_grad(), aft.apply(model, p):
    e = torch._dynamo.explain(model)(x)
    print("attnforge", af.__version__, "graph breaks:", e.graph_break_count, "graphs:", e.graph_count)
    for r in e.break_reasons[:1]: print("  reason:", str(r.reason).splitlines()[0][:160])
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True, backend="eager")(x); print("fullgraph: ok")
    except Exception as ex:
        print("fullgraph: fails:", type(ex).__name__, str(ex).splitlines()[0][:120])
    try:
        ep = torch.export.export(model, (x,)); print("export: ok,", sum("attnforge" in str(n.target) for n in ep.graph.nodes), "attnforge nodes")
    except Exception as ex:
        print("export: fails:", type(ex).__name__, str(ex).splitlines()[0][:120])
