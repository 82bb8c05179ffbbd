"""ring-flash-attn's API (0.1.7/0.1.8) on attnforge: the same function names, argument names, defaults, layouts and
return values, so that changing the import line is the only change; every call runs on attnforge's kernels over
torch.distributed (gloo on CPUs, NCCL on GPUs).

    out = zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)          # (B, S_local, H, D) shards
    out, lse, _ = ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, return_attn_probs=True)

window_size follows FlashAttention-2's convention, as ring-flash-attn's does: (left, right), -1 = unbounded, causal
sets right = 0 (attnforge's own flash_attn_func takes FA4's: None = unbounded). Beyond ring-flash-attn: windows,
softcap and learnable_sink (keyword-only), grouped-query K/V (fewer K/V heads, never replicated), Ev != E, non-causal
zigzag and stripe, float32. lse is float32 natural-log, (B, H, S_local) or packed (H, T_local).

Shards: ring (contiguous) rank r holds tokens [r·n, (r+1)·n); zigzag: the sequence in 2W chunks, rank r holds chunks
r and 2W-1-r (S % 2W == 0); stripe: token t on rank t mod W. Varlen: each document of the packed batch sharded the
same way on its own (cu_seqlens are this rank's: the global ones divided by W). shard() / unshard() make and undo
each layout."""
from . import _ring


def _ring_call(what, layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group, softcap, learnable_sink, cu_seqlens=None, max_seqlen=None):
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
        raise TypeError(f"max_seqlen: expected an int, got {type(max_seqlen).__name__}")
    return _ring.ring_attention(what, q, k, v, group=group, layout=layout, causal=causal, window_size=window_size,
                                softmax_scale=softmax_scale, softcap=softcap, learnable_sink=learnable_sink,
                                cu_seqlens=cu_seqlens, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                                deterministic=deterministic, return_attn_probs=return_attn_probs)


def _batched(layout, name):
    def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
             deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
        return _ring_call(name, layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                          deterministic, return_attn_probs, group, softcap, learnable_sink)

    def kvpacked(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
        return _ring_call(name.replace("_func", "_kvpacked_func"), layout, q, kv[:, :, 0], kv[:, :, 1], dropout_p,
                          softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                          softcap, learnable_sink)

    def qkvpacked(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
        return _ring_call(name.replace("_func", "_qkvpacked_func"), layout, qkv[:, :, 0], qkv[:, :, 1],
                          qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          return_attn_probs, group, softcap, learnable_sink)

    shapes = {"": "q (B, S_local, Hq, E), k (B, S_local, Hkv, E), v (B, S_local, Hkv, Ev)",
              "_kvpacked": "q (B, S_local, Hq, E), kv (B, S_local, 2, Hkv, E)",
              "_qkvpacked": "qkv (B, S_local, 3, H, E)"}
    made = []
    for suffix, f in (("", func), ("_kvpacked", kvpacked), ("_qkvpacked", qkvpacked)):
        f.__name__ = f.__qualname__ = name.replace("_func", suffix + "_func")
        f.__doc__ = (f"ring-flash-attn's {f.__name__} on attnforge ({layout} shards): {shapes[suffix]} on every "
                     "rank of `group`. Returns out (B, S_local, Hq, Ev) in q's dtype, or (out, lse float32 "
                     "(B, Hq, S_local), None) with return_attn_probs. See the module's docstring.")
        made.append(f)
    return made


def _varlen(layout, name):
    def func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
             alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0,
             learnable_sink=None):
        return _ring_call(name, layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                          deterministic, return_attn_probs, group, softcap, learnable_sink, cu_seqlens, max_seqlen)

    def kvpacked(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                 window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                 *, softcap=0.0, learnable_sink=None):
        return _ring_call(name.replace("_func", "_kvpacked_func"), layout, q, kv[:, 0], kv[:, 1], dropout_p,
                          softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                          softcap, learnable_sink, cu_seqlens, max_seqlen)

    def qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0,
                  learnable_sink=None):
        return _ring_call(name.replace("_func", "_qkvpacked_func"), layout, qkv[:, 0], qkv[:, 1], qkv[:, 2],
                          dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          return_attn_probs, group, softcap, learnable_sink, cu_seqlens, max_seqlen)

    shapes = {"": "q (T_local, Hq, E), k (T_local, Hkv, E), v (T_local, Hkv, Ev)",
              "_kvpacked": "q (T_local, Hq, E), kv (T_local, 2, Hkv, E)", "_qkvpacked": "qkv (T_local, 3, H, E)"}
    made = []
    for suffix, f in (("", func), ("_kvpacked", kvpacked), ("_qkvpacked", qkvpacked)):
        f.__name__ = f.__qualname__ = name.replace("_func", suffix + "_func")
        f.__doc__ = (f"ring-flash-attn's {f.__name__} on attnforge ({layout} shards of each document): "
                     f"{shapes[suffix]}, cu_seqlens this rank's int32 (B + 1,) prefix sums (each document's local "
                     "length: its global length / W), max_seqlen their maximum. Returns out (T_local, Hq, Ev), or "
                     "(out, lse float32 (Hq, T_local), None) with return_attn_probs.")
        made.append(f)
    return made


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = \
    _batched("ring", "ring_flash_attn_func")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func = \
    _batched("zigzag", "zigzag_ring_flash_attn_func")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = \
    _batched("stripe", "stripe_flash_attn_func")
ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func = \
    _varlen("ring", "ring_flash_attn_varlen_func")
(zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func,
 zigzag_ring_flash_attn_varlen_qkvpacked_func) = _varlen("zigzag", "zigzag_ring_flash_attn_varlen_func")
stripe_flash_attn_varlen_func, stripe_flash_attn_varlen_kvpacked_func, stripe_flash_attn_varlen_qkvpacked_func = \
    _varlen("stripe", "stripe_flash_attn_varlen_func")
