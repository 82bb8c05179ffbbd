"""One block of a ring on attnforge's own kernels: the forward with its float32 lse (out in float32 on the CPU, so a
bf16 block is not rounded before the merge), and the backward with the merged out and lse (gradients in float32 on
the CPU, summed over blocks unrounded); sharded decode's per-shard call too. It calls below the public API (the
flash call and its backward: the public functions return q's dtype); the C checks still see every argument."""
import torch

from .. import _backward, _flash_call


def _window_args(window):
    """A block window (FULL or FA4's (left, right)) as the flash call's (causal, window)."""
    if window == "full":
        return False, None
    return _flash_call.resolve_window(False, window)


def forward(q, k, v, scale, window, softcap, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, seqused_k=None, page_table=None):
    """(out, lse float32) of q against k, v under the block window: 4-D NHD, packed 3-D with cu_seqlens, or paged
    K/V (sharded decode); out float32 on the CPU, q's dtype on CUDA."""
    causal, resolved = _window_args(window)
    wide = q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16)
    varlen = any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table))
    out, lse = _flash_call.run(q, k, v, scale, causal, resolved, softcap, None, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               seqused_k=seqused_k, page_table=page_table, return_lse=True, varlen=varlen,
                               float32_out=wide)
    return out, lse


def backward(dout, q, k, v, out, lse, scale, window, softcap, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """(dq, dk, dv) of one block, from the merged out and lse (P = exp(s - lse) is then the global softmax's,
    D = rowsum(dout * out) the global one): float32 on the CPU (they are summed over blocks unrounded), q/k/v's dtypes
    on CUDA. out and dout: float32 under a CPU f16/bf16 q, else q's dtype."""
    causal, resolved = _window_args(window)
    window_size = resolved if resolved is not None else (None, None)
    dq, dk, dv, _ = _backward.flash_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                             window_size=window_size, softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                                             cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                             max_seqlen_k=max_seqlen_k, float32_grads=q.device.type == "cpu")
    return dq, dk, dv


def out_dtype(q):
    """The dtype the ring keeps out and dout in for the per-block backward: float32 where the CPU kernels take it."""
    return torch.float32 if q.device.type == "cpu" else q.dtype
