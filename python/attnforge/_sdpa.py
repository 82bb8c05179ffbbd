"""One SDPA call on torch tensors or NumPy arrays, like torch.nn.functional.scaled_dot_product_attention."""
from . import _C
from ._tensors import call_stream, call_workspace, exportable, is_torch_tensor, new_lse, new_output


def run(reference, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
        out, return_lse):
    query, key, value, attn_mask = (exportable(t) for t in (query, key, value, attn_mask))
    if out is None:
        out = new_output(query, value)
    lse = new_lse(query) if return_lse else None
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
              "enable_gqa": enable_gqa}
    _C.sdpa((query, key, value), kwargs, out, lse, causal_bottom_right, reference, call_stream(query),
            call_workspace(query))
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_bottom_right=False, out=None, return_lse=False):
    """PyTorch's SDPA semantics (is_causal top-left aligned) computed by attnforge's FlashAttention kernel.

    query (B,Hq,L,E), key (B,Hkv,S,E), value (B,Hkv,S,Ev): float32/float16/bfloat16 torch tensors (CPU or CUDA)
    or float32/float16 NumPy arrays, any non-negative strides; never copied. All tensors of a call live on one
    device; CUDA calls are enqueued on torch.cuda.current_stream(query.device), like a torch op. Returns out
    (B,Hq,L,Ev) in query's dtype (allocated like query unless given), and with return_lse=True also the float32
    log-sum-exp (B,Hq,L).
    causal_bottom_right=True is FlashAttention's alignment (row i sees keys j <= i + S - L).
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
