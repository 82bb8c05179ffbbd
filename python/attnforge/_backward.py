"""The backward pass on torch tensors: allocates the gradients and calls the C library (af_sdpa_backward,
af_flash_attn_backward), the one module of the backward that does; the operators' autograd (_ops) and attnforge's
registration as PyTorch's flash attention call it.

    sdpa_backward(grad_out, query, key, value, out, lse, ...)   -> (dq, dk, dv)
    flash_backward(grad_out, q, k, v, out, lse, ...)             -> (dq, dk, dv, dsink or None)
    masked_rows_backward(grad_out, query, key, value, out, ...)  -> (dq, dk, dv, dsink or None)

The C backward reads each input with the forward's meaning but takes no broadcast batch or head dim: an input that
broadcasts is expanded here (stride 0, no copy where a view allows) and its gradient summed back over the expanded
dims. Grouped heads (enable_gqa, or key and value of one head each) stay grouped: C sums over a group itself.
CPU only: the C backward refuses CUDA tensors (its CUDA kernels are not written yet)."""
import math

import torch

from . import _C, _flash_call, _masked_rows
from ._sdpa_call import _merge_batch


def _detached(*tensors):
    """The tensors without autograd history (views): DLPack exports no tensor that requires grad."""
    return [t.detach() if t is not None else None for t in tensors]


def _pad(shape, rank):
    return (1,) * (rank - len(shape)) + tuple(shape)


def _expand_to(t, rank, lead, heads):
    """t padded to `rank` dims (a view) and expanded to batch dims `lead` and `heads` heads: stride 0 where it
    broadcasts (the C backward refuses size-1 dims read for larger ones, not zero strides)."""
    padded = t.reshape(_pad(t.shape, rank))
    return padded.expand(*lead, heads, *padded.shape[-2:])


def _repeat_heads(t, repeats):
    """Each head repeated `repeats` times in place (head h * repeats + j reads head h), as repeat_interleave."""
    if repeats == 1:
        return t
    shape = t.shape
    return t.unsqueeze(-3).expand(*shape[:-2], repeats, *shape[-2:]).reshape(*shape[:-3], shape[-3] * repeats,
                                                                            *shape[-2:])


def _merge(t, lead):
    """(*lead, H, N, D) → (prod(lead), H, N, D): a view where the strides allow, else a copy."""
    return t.reshape(math.prod(lead), *t.shape[-3:])


def _sum_to(grad, shape, rank):
    """The gradient of an input of `shape` that was padded to `rank` dims and expanded to grad's shape: summed over
    the dims it broadcast along (keepdim), in `shape`."""
    padded = _pad(shape, rank)
    dims = [d for d in range(rank) if padded[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = grad.sum(dims, keepdim=True)
    return grad.reshape(shape)


def sdpa_backward(grad_out, query, key, value, out, lse, *, attn_mask=None, is_causal=False, scale=None,
                  enable_gqa=False, causal_bottom_right=False, reference=False):
    """The gradients of out = attnforge.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
    scale, enable_gqa, causal_bottom_right=...) with respect to query, key and value, for dLoss/dout = grad_out.
    q/k/v of any rank from 2 broadcast as PyTorch's SDPA (size-1 batch and head dims); out is the forward's output
    (its broadcast shape) and lse its float32 log-sum-exp (out.shape[:-1], natural log: PyTorch's flash layout).
    The mask gets no gradient. Returns (dq, dk, dv), each in its input's shape and dtype (contiguous)."""
    grad_out, query, key, value, out, lse, attn_mask = _detached(grad_out, query, key, value, out, lse, attn_mask)
    out_shape = tuple(out.shape)
    rank = max(len(out_shape), 4)
    padded_out = _pad(out_shape, rank)
    lead, heads, rows = padded_out[:rank - 3], padded_out[-3], padded_out[-2]
    hk, hv = _pad(key.shape, rank)[-3], _pad(value.shape, rank)[-3]
    # key and value read with one group size: grouped natively when they agree, else both repeated up to the least
    # common multiple of their head counts (a size-1 head count expands with stride 0)
    kv_heads = hk if hk == hv else math.lcm(hk, hv)
    q4 = _expand_to(query, rank, lead, heads)
    k4 = _repeat_heads(_expand_to(key, rank, lead, hk), kv_heads // hk if hk > 1 else 1)
    v4 = _repeat_heads(_expand_to(value, rank, lead, hv), kv_heads // hv if hv > 1 else 1)
    if hk == 1 and kv_heads > 1:
        k4 = k4.expand(*lead, kv_heads, *k4.shape[-2:])
    if hv == 1 and kv_heads > 1:
        v4 = v4.expand(*lead, kv_heads, *v4.shape[-2:])
    q4, k4, v4 = _merge(q4, lead), _merge(k4, lead), _merge(v4, lead)
    mask = attn_mask
    if mask is not None and (mask.dim() > 4 or rank > 4):
        mask = _merge_batch(mask, rank, lead)
    batch = math.prod(lead)
    out4 = out.reshape(batch, heads, rows, out_shape[-1])
    dout4 = grad_out.reshape(batch, heads, rows, out_shape[-1])
    lse4 = lse.reshape(batch, heads, rows)
    dq4, dk4, dv4 = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q4, k4, v4))
    kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": bool(is_causal), "scale": scale,
              "enable_gqa": bool(enable_gqa)}
    _C.sdpa_backward((q4, k4, v4), kwargs, out4, dout4, lse4, dq4, dk4, dv4, bool(causal_bottom_right),
                     bool(reference))
    dq = _sum_to(dq4.view(*lead, *dq4.shape[1:]), tuple(query.shape), rank)
    return dq, _kv_gradient(dk4, lead, hk, tuple(key.shape), rank), _kv_gradient(dv4, lead, hv, tuple(value.shape),
                                                                                 rank)


def _kv_gradient(grad4, lead, heads, shape, rank):
    """dk or dv back from the 4-D form: repeated heads summed into the head they copied, then the broadcast dims."""
    grad = grad4.view(*lead, *grad4.shape[1:])
    if heads > 1 and grad.shape[-3] != heads:
        grad = grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3)
    return _sum_to(grad, shape, rank)


def flash_backward(grad_out, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(None, None),
                   softcap=0.0, learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, seqused_k=None, reference=False, float32_grads=False, score_mod=None,
                   mask_mod=None):
    """The gradients of (out, lse) = flash_attn_func / flash_attn_varlen_func(q, k, v, ...) (FlashAttention-4's NHD
    layouts; window_size unresolved, as FA4 takes it) for dLoss/dout = grad_out: (dq, dk, dv, dsink), each in its
    input's shape and dtype (contiguous), dq/dk/dv in float32 with float32_grads (CPU: gradients that are summed
    later, attnforge.distributed's blocks, are not rounded first); dsink None without a learnable_sink."""
    grad_out, q, k, v, out, lse, learnable_sink = _detached(grad_out, q, k, v, out, lse, learnable_sink)
    causal, window = _flash_call.resolve_window(causal, window_size)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_k is not None
    rows, keys = _flash_call._bounds(tuple(q.shape), tuple(k.shape), cu_seqlens_q is not None,
                                     cu_seqlens_k is not None, None)
    if max_seqlen_q is None:
        max_seqlen_q = _flash_call._length_bound(cu_seqlens_q, rows) if varlen else 0
    if max_seqlen_k is None:
        max_seqlen_k = _flash_call._length_bound(cu_seqlens_k, keys) if varlen else 0
    dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32 if float32_grads else t.dtype, device=t.device)
                  for t in (q, k, v))
    dsink = None if learnable_sink is None else torch.empty(learnable_sink.shape, dtype=learnable_sink.dtype,
                                                              device=learnable_sink.device)
    _C.flash_attn_backward(q, k, v, out, grad_out, lse, dq, dk, dv, dsink, scale=softmax_scale, causal=causal,
                           window=window, softcap=float(softcap or 0.0), learnable_sink=learnable_sink,
                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                           max_seqlen_k=int(max_seqlen_k), seqused_k=seqused_k, reference=bool(reference),
                           score_mod=score_mod, mask_mod=mask_mod)
    return dq, dk, dv, dsink


# rows of scores a chunk of masked_rows_backward holds at once, per (batch, head): bounds its L x S memory
_ROWS_PER_CHUNK_ELEMENTS = 1 << 22


def masked_rows_backward(grad_out, query, key, value, out, mask, scale, softcap, sink):
    """The gradients of attnforge::masked_rows (Transformers' softcap/sink attention under a mask; (B, L, Hq, Ev)
    out) for dLoss/dout = grad_out: (dq, dk, dv, dsink or None) in the inputs' shapes and dtypes.

    Not the C backward: the forward reads each query row's own key range through a page table of one-token pages,
    and neither C backward takes that (paged K/V has none; af_sdpa's has no softcap or sink), so this is the explicit
    FlashAttention-2 backward in PyTorch (float32, float64 for float64 inputs), P recomputed with its log-sum-exp,
    chunked over query rows so that memory stays O(chunk x S) per head. The mask gets no gradient."""
    B, Hq, L, E = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    groups = Hq // Hkv
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = E ** -0.5 if scale is None else float(scale)
    visible = _masked_rows._visible(mask, B, L, S)                         # (B, L, S) bool
    q = query.to(acc).unflatten(1, (Hkv, groups))                         # (B, Hkv, G, L, E)
    k, v = key.to(acc).unsqueeze(2), value.to(acc).unsqueeze(2)           # (B, Hkv, 1, S, D)
    o = out.to(acc).transpose(1, 2).unflatten(1, (Hkv, groups))           # (B, Hkv, G, L, Ev)
    do = grad_out.to(acc).transpose(1, 2).unflatten(1, (Hkv, groups))
    sink_logit = None if sink is None else sink.to(acc).reshape(1, Hkv, groups, 1)
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k.squeeze(2))
    dv = torch.zeros_like(v.squeeze(2))
    dsink = None if sink is None else torch.zeros(Hkv, groups, dtype=acc, device=query.device)
    chunk = max(1, _ROWS_PER_CHUNK_ELEMENTS // max(1, B * Hq * S))
    for i in range(0, L, chunk):
        rows = slice(i, min(L, i + chunk))
        s = scale * torch.matmul(q[:, :, :, rows], k.transpose(-1, -2))   # (B, Hkv, G, rows, S)
        if softcap:
            t = torch.tanh(s / softcap)
            s = softcap * t
        s = s.masked_fill(~visible[:, None, None, rows], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        if sink_logit is not None:
            lse = torch.logaddexp(lse, sink_logit.expand_as(lse))
        finite = torch.isfinite(lse)                                       # a row that sees nothing: no gradient
        p = torch.where(finite[..., None], torch.exp(s - lse.masked_fill(~finite, 0)[..., None]), 0)
        d = (do[:, :, :, rows] * o[:, :, :, rows]).sum(-1)                 # rowsum(dO ∘ O)
        dp = torch.matmul(do[:, :, :, rows], v.transpose(-1, -2))
        ds = p * (dp - d[..., None])
        if softcap:
            ds = ds * (1 - t * t)                                          # through tanh
        dv += torch.matmul(p.transpose(-1, -2), do[:, :, :, rows]).sum(2)
        dk += scale * torch.matmul(ds.transpose(-1, -2), q[:, :, :, rows]).sum(2)
        dq[:, :, :, rows] = scale * torch.matmul(ds, k)
        if dsink is not None:                                             # d lse / d sink = p_sink; dsink = -p_sink·D
            p_sink = torch.where(finite, torch.exp(sink_logit - lse.masked_fill(~finite, 0)), 0)
            dsink -= (p_sink * d).sum((0, 3))
    dq = dq.flatten(1, 2).to(query.dtype)
    return (dq, dk.to(key.dtype), dv.to(value.dtype),
            None if dsink is None else dsink.reshape(sink.shape).to(sink.dtype))
