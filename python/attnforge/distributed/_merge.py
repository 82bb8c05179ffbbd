"""Partial attention results merged by their log-sum-exp, in float32, in the overflow-free form every peer converged
on: new = logaddexp(lse, block_lse); out += exp(block_lse - new) * (block_out - out). exp's argument is never above
0, rows that saw no key yet (lse = -inf) take the block as it is, and rows that see no key in a block (block_lse =
-inf) keep what they had; a row that never sees a key stays out = 0, lse = -inf (attnforge's rule).

Accumulators are row-major: out (..., L, H, Dv) and lse_t (..., L, H), the transposed layout of the kernels' lse, so
that a block's rows are one index along the same dim of both."""
import torch


def new_accumulators(rows_shape, heads: int, dv: int, device):
    """out zeros (*rows_shape, heads, dv) and lse_t -inf (*rows_shape, heads), both float32."""
    out = torch.zeros((*rows_shape, heads, dv), dtype=torch.float32, device=device)
    lse_t = torch.full((*rows_shape, heads), float("-inf"), dtype=torch.float32, device=device)
    return out, lse_t


def merge_(out, lse_t, block_out, block_lse_t):
    """Merge one block into (out, lse_t) in place. block_out like out (any float dtype), block_lse_t like lse_t."""
    new = torch.logaddexp(lse_t, block_lse_t)
    weight = torch.exp(block_lse_t - new).nan_to_num_(0.0)   # -inf - -inf: a row no block has seen yet
    out.lerp_(block_out.to(torch.float32), weight.unsqueeze(-1))
    lse_t.copy_(new)


def add_sink_(out, lse_t, sink):
    """The learnable sink (one logit per head, (H,)) counted once, in the merged softmax: its exp joins every row's
    denominator, so out shrinks by exp(lse - new) and lse becomes logaddexp(lse, sink)."""
    logit = sink.detach().to(torch.float32)
    new = torch.logaddexp(lse_t, logit)
    out.mul_(torch.exp(lse_t - new).nan_to_num_(0.0).unsqueeze(-1))
    lse_t.copy_(new)


def sink_gradient(out, dout, lse_t, sink):
    """d loss / d sink from this rank's rows: -sum over rows of p_sink * rowsum(dout * out), p_sink = exp(sink -
    lse) with the final (sink-inclusive) lse. (H,) float32; the caller sums it over the ranks that hold rows."""
    d = (dout.to(torch.float32) * out.to(torch.float32)).sum(-1)                 # (..., L, H)
    p_sink = torch.exp(sink.detach().to(torch.float32) - lse_t).nan_to_num_(0.0)
    return -(p_sink * d).reshape(-1, lse_t.shape[-1]).sum(0)
