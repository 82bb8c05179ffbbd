"""FlashAttention-4's forward API on attnforge: flash_attn_func and flash_attn_varlen_func with the signatures of
flash_attn.cute (FA4 4.0.0b27), so code written for FA4 runs by changing the import. The C library
(af_flash_attn) checks every rule; this module resolves window_size as FA4 does, allocates the outputs and refuses
the FA4 features attnforge does not implement, only when they are set."""
import numbers

from . import _C
from ._tensors import call_stream, call_workspace, exportable, is_torch_tensor, _torch

# FA4 arguments attnforge cannot honour: an error names the argument when it is set (not None).
_NOT_IMPLEMENTED = {
    "qv": "MLA-absorbed attention (qv) is not implemented (FA4 4.0.0b27's 4th parameter is qv: pass cu_seqlens_q "
          "and the other varlen arguments by keyword)",
    "gather_kv_indices": "top-k sparse K/V gathering (gather_kv_indices, MLA only) is not implemented",
    "score_mod": "CuTe-DSL score_mod callables cannot run on attnforge (use softcap for tanh capping)",
    "score_mod_bwd": "CuTe-DSL score_mod callables cannot run on attnforge (softcap's backward is built in)",
    "mask_mod": "CuTe-DSL mask_mod callables cannot run on attnforge (use causal / window_size)",
    "aux_tensors": "aux_tensors only feed score_mod / mask_mod, which attnforge does not run",
    "aux_scalars": "aux_scalars only feed score_mod / mask_mod, which attnforge does not run",
    "block_sparse_tensors": "block sparsity is not implemented",
    "block_sparse_tensors_bwd": "block sparsity is not implemented",
    "seqused_q": "seqused_q is not implemented (give each sequence's real length through cu_seqlens_q)",
    "scheduler_metadata": "FA4's GPU scheduler metadata has no meaning on attnforge",
}


def _refuse_unimplemented(**arguments):
    for name, value in arguments.items():
        if value is not None:
            raise _C.UnsupportedError(f"{name}: {_NOT_IMPLEMENTED[name]}")


def _check_int(name, value, minimum=None, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise _C.InvalidArgumentError(f"{name}: must be >= {minimum}, got {value}")


def _check_hints(num_splits, pack_gqa, deterministic, min_seqlen_k=None, seqlen_k_per_split=None):
    """Scheduling hints: they change how FA4 splits the work on a GPU, never the result; attnforge schedules its
    own work (deterministic passes, forward and backward) and only checks their types."""
    _check_int("num_splits", num_splits, allow_none=False)
    for name, value in (("pack_gqa", pack_gqa), ("deterministic", deterministic)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool{' or None' if name == 'pack_gqa' else ''}, "
                            f"got {type(value).__name__}")
    _check_int("min_seqlen_k", min_seqlen_k, minimum=0)
    _check_int("seqlen_k_per_split", seqlen_k_per_split, minimum=1)


def resolve_window(causal, window_size):
    """FA4's (causal, window_size) → (causal, window): window None (no window) or (left, right). As FA4 resolves
    them: causal sets right = 0; a pair whose sum is negative ((-1, -1), (-1, 0)) is no window; (None, 0) is causal;
    any other window is local (and causal is then False). Every int side is a literal offset, negative ones too
    ((None, -1): keys up to one before the diagonal); a None side stays None (unbounded), which the C library reads
    as AF_WINDOW_UNBOUNDED."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a (left, right) pair of ints or None, got {window_size!r}")
    left, right = window_size
    _check_int("window_size[0]", left)
    _check_int("window_size[1]", right)
    causal = bool(causal)
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        return causal, None
    if left is None and right == 0:
        return True, None
    return False, (None if left is None else int(left), None if right is None else int(right))


def _is_float8(x):
    return is_torch_tensor(x) and x.dtype in (_torch().float8_e4m3fn, _torch().float8_e5m2)


def _empty(like, shape, float32=False):
    """Uninitialised memory of `shape` on like's device (torch), or a NumPy array; like's dtype or float32
    (a float8 q: bfloat16, FA4's output dtype for float8 inputs)."""
    if is_torch_tensor(like):
        torch = _torch()
        dtype = torch.float32 if float32 else torch.bfloat16 if _is_float8(like) else like.dtype
        return torch.empty(shape, dtype=dtype, device=like.device)
    import numpy
    return numpy.empty(shape, dtype=numpy.float32 if float32 else like.dtype)


def _shape(x, name):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a tensor (torch.Tensor or NumPy array), got {type(x).__name__}")
    return tuple(int(d) for d in shape)


def _outputs(q, v, varlen_q, return_lse):
    """out (*q.shape[:-1], Ev) in q's dtype, NHD-contiguous; lse (B, Hq, Lq), varlen (Hq, total_q), f32 or None.
    A q or v of the wrong rank gets an empty out: the C checks then name the bad argument."""
    q_shape, v_shape = _shape(q, "q"), _shape(v, "v")
    rank = 3 if varlen_q else 4
    if len(q_shape) != rank or len(v_shape) < 3:
        return _empty(q, (0,) * rank), (_empty(q, (0,) * (rank - 1), float32=True) if return_lse else None)
    out = _empty(q, q_shape[:-1] + (v_shape[-1],))
    if not return_lse:
        return out, None
    lse_shape = (q_shape[1], q_shape[0]) if varlen_q else (q_shape[0], q_shape[2], q_shape[1])
    return out, _empty(q, lse_shape, float32=True)


def _bounds(q_shape, k_shape, varlen_q, varlen_k, page_table):
    """Upper bounds on any sequence's query rows and keys, from the shapes alone (FA4's max_seqlen defaults):
    the packed total, the padded length, or max_pages · page_size. 0 where a shape is malformed (the C checks
    name it)."""
    rows = q_shape[0] if varlen_q else (q_shape[1] if len(q_shape) > 1 else 0)
    if page_table is not None:
        pages = _shape(page_table, "page_table")
        keys = pages[-1] * k_shape[1] if len(pages) == 2 and len(k_shape) > 1 else 0
    else:
        keys = k_shape[0] if varlen_k else (k_shape[1] if len(k_shape) > 1 else 0)
    return rows, keys


def _length_bound(cu_seqlens, fallback):
    """FA4's max_seqlen default, tightened where it costs nothing: the longest sequence of a CPU cu_seqlens,
    else `fallback` (a bound: the packed total, as FA4 takes it; reading a GPU tensor would synchronise)."""
    if cu_seqlens is None or not is_torch_tensor(cu_seqlens) or cu_seqlens.device.type != "cpu":
        return fallback
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        return fallback   # the C checks name the bad cu_seqlens
    return max(0, int((cu_seqlens[1:].long() - cu_seqlens[:-1].long()).max()))


def run(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, cu_seqlens_q=None, cu_seqlens_k=None,
        max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, page_table=None, q_descale=None, k_descale=None,
        v_descale=None, return_lse=False, varlen=False):
    """One af_flash_attn call on checked, resolved arguments (window from resolve_window): allocates (out, lse)
    and runs the C library; the kernel of the attnforge::flash_attn operators and the NumPy path. Reads
    cu_seqlens only where it is on the CPU (flash_attn_varlen_func's max_seqlen defaults; 0 for flash_attn_func,
    whose lengths are the tensors')."""
    varlen_q = cu_seqlens_q is not None
    out, lse = _outputs(q, v, varlen_q, return_lse)
    rows, keys = _bounds(_shape(q, "q"), _shape(k, "k"), varlen_q, cu_seqlens_k is not None, page_table)
    if max_seqlen_q is None:
        max_seqlen_q = _length_bound(cu_seqlens_q, rows) if varlen else 0
    if max_seqlen_k is None:
        max_seqlen_k = _length_bound(cu_seqlens_k, keys) if varlen else 0
    tensors = [exportable(t) for t in (q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                                       q_descale, k_descale, v_descale)]
    (q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, q_descale, k_descale,
     v_descale) = tensors
    _C.flash_attn(q, k, v, out, lse, scale=softmax_scale, causal=causal, window=window, softcap=float(softcap),
                  learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), seqused_k=seqused_k,
                  page_table=page_table, stream=call_stream(q), q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, workspace=call_workspace(q))
    return out, lse


def _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, varlen, **tensors):
    """Checked arguments → the attnforge::flash_attn operator for torch tensors (so torch.compile and torch.export
    keep the call in their graph), the C call directly for NumPy arrays."""
    causal, window = resolve_window(causal, window_size)
    softcap = 0.0 if softcap is None else softcap
    if is_torch_tensor(q):
        from . import _ops
        return _ops.flash_attn(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, return_lse, varlen,
                               **tensors)
    return run(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, return_lse=return_lse, varlen=varlen,
               **tensors)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False, *,
                    q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention-4's flash_attn_func (forward) computed by attnforge.

    q (B, Lq, Hq, E), k (B, S, Hkv, E), v (B, S, Hkv, Ev): NHD, float32/float16/bfloat16 (FA4 takes no float32;
    attnforge does), or torch.float8_e4m3fn / float8_e5m2 (all three, FA4's case, out then bfloat16; or k and v
    alone under a float32/float16/bfloat16 q: a quantised KV cache), any non-negative strides, never copied; Hq a
    multiple of Hkv (query head h reads K/V head h // (Hq / Hkv)). causal and window_size=(left, right) are
    bottom-right aligned: row i sees keys j with i + S - Lq - left <= j <= i + S - Lq + right (None = unbounded).
    softcap > 0 maps each scaled score s to softcap * tanh(s / softcap). learnable_sink (Hq,) adds exp(sink) to each
    row's softmax denominator.
    q_descale, k_descale, v_descale (keyword-only; float8 K/V only; FA3/FA4's): float32 (B, Hkv): scores use
    q·k·softmax_scale·q_descale·k_descale and out is multiplied by v_descale, per (batch, kv head).
    Returns (out, lse): out (B, Lq, Hq, Ev) in q's dtype (bfloat16 for a float8 q), lse float32 (B, Hq, Lq), natural
    log, or None unless return_lse. Rows that see no key get out = 0 and lse = -inf (lse = sink with a sink).
    num_splits, pack_gqa and deterministic are GPU scheduling hints: checked, and the result does not depend on
    them. qv, gather_kv_indices, score_mod(_bwd), mask_mod, aux_*, block_sparse_* raise UnsupportedError when set.
    Gradients (the C backward, CPU only) flow to q, k, v and learnable_sink when they require grad; paged and
    float8 K/V have no backward (UnsupportedError before the forward runs), and lse gets no gradient.
    """
    _refuse_unimplemented(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                          score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                          aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                          block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    _check_hints(num_splits, pack_gqa, deterministic)
    return _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, False,
                     q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False, *,
                           q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention-4's flash_attn_varlen_func (forward) computed by attnforge.

    Queries: packed q (total_q, Hq, E) with cu_seqlens_q (B + 1,) int32 prefix sums, or batched (B, Lq, Hq, E)
    without. Keys and values: packed k (total_k, Hkv, E) / v (total_k, Hkv, Ev) with cu_seqlens_k; batched
    (B, S, Hkv, E); or paged (num_pages, page_size, Hkv, E) with page_table (B, max_pages) int32 and
    seqused_k (B,) int32 (the keys each sequence uses; also allowed without paging). page_table and cu_seqlens_k
    exclude each other. max_seqlen_q / max_seqlen_k bound the sequences' lengths (default: derived from the
    tensors). Masks, softcap, sink and hints as in flash_attn_func, each sequence aligned on its own lengths.
    Returns (out, lse): out like q with head dim Ev; lse float32 (Hq, total_q) with packed q, (B, Hq, Lq) with
    batched q; None unless return_lse. seqused_q, scheduler_metadata and the flash_attn_func features listed
    there raise UnsupportedError when set; dtypes and q/k/v_descale (B, Hkv) as in flash_attn_func; min_seqlen_k,
    seqlen_k_per_split and disable_scheduler_metadata are hints (checked, not needed).
    """
    _refuse_unimplemented(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                          score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                          aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors, seqused_q=seqused_q,
                          scheduler_metadata=scheduler_metadata)
    _check_hints(num_splits, pack_gqa, deterministic, min_seqlen_k, seqlen_k_per_split)
    _check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    _check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    return _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, True,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table, q_descale=q_descale,
                     k_descale=k_descale, v_descale=v_descale)
