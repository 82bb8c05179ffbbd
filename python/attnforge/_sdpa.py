"""One SDPA call on torch tensors or NumPy arrays, like torch.nn.functional.scaled_dot_product_attention: torch
tensors go through the attnforge::sdpa operator (_ops), NumPy arrays (and out=) to _sdpa_call, which allocates and
calls the C library."""
from ._sdpa_call import run
from ._tensors import is_torch_tensor


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_bottom_right=False, out=None, return_lse=False):
    """PyTorch's SDPA semantics (is_causal top-left aligned) computed by attnforge's FlashAttention kernel.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev): float32/float16/bfloat16 torch tensors (CPU
    or CUDA) or float32/float16 NumPy arrays, any non-negative strides, any rank from 2, broadcast as PyTorch does
    (docs/PYTORCH.md, "The broadcasting rule": size-1 batch and head dims broadcast; enable_gqa groups heads); never
    copied, except to merge the batch dims of a 5-D+ tensor whose strides do not allow a view. All tensors of a call
    live on one device; CUDA calls are enqueued on torch.cuda.current_stream(query.device), like a torch op. Returns
    out (..., H, L, Ev) of the broadcast batch dims in query's dtype (allocated like query unless given), and with
    return_lse=True also the float32 log-sum-exp (..., H, L).
    causal_bottom_right=True is FlashAttention's alignment (row i sees keys j <= i + S - L).
    Torch tensors that require grad get gradients (attnforge's backward, CPU only; none for the mask or lse);
    with out= the call records no autograd.
    """
    if out is None and is_torch_tensor(query):   # an operator torch.compile and torch.export keep in their graphs
        from . import _ops
        return _ops.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
                         return_lse)
    return run(False, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right, out,
               return_lse)


def scaled_dot_product_attention_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                           scale=None, enable_gqa=False, *, causal_bottom_right=False, out=None,
                                           return_lse=False):
    """The same call computed by the plain double-precision reference (slow; for checking)."""
    return run(True, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
               out, return_lse)
