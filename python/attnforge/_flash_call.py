"""One FlashAttention-4 call as the C library takes it (af_flash_attn): window_size resolved as FA4 resolves it, the
outputs allocated and the C call made. The kernel of attnforge::flash_attn (_ops) and of masked_rows, and the NumPy
path of flash_attn_func / flash_attn_varlen_func (_flash), below all of them: it imports none."""
import numbers

from . import _C
from ._tensors import call_stream, call_workspace, exportable, is_torch_tensor, _torch


def _check_int(name, value, minimum=None, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise _C.InvalidArgumentError(f"{name}: must be >= {minimum}, got {value}")


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


def _outputs(q, v, varlen_q, return_lse, float32_out=False):
    """out (*q.shape[:-1], Ev) in q's dtype (float32 with float32_out), NHD-contiguous; lse (B, Hq, Lq), varlen
    (Hq, total_q), f32 or None. A q or v of the wrong rank gets an empty out: the C checks then name the bad
    argument."""
    q_shape, v_shape = _shape(q, "q"), _shape(v, "v")
    rank = 3 if varlen_q else 4
    if len(q_shape) != rank or len(v_shape) < 3:
        return _empty(q, (0,) * rank), (_empty(q, (0,) * (rank - 1), float32=True) if return_lse else None)
    out = _empty(q, q_shape[:-1] + (v_shape[-1],), float32=float32_out)
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
        v_descale=None, return_lse=False, varlen=False, float32_out=False, score_mod=None, mask_mod=None):
    """One af_flash_attn call on checked, resolved arguments (window from resolve_window): allocates (out, lse)
    and runs the C library; the kernel of the attnforge::flash_attn operators and the NumPy path. Reads
    cu_seqlens only where it is on the CPU (flash_attn_varlen_func's max_seqlen defaults; 0 for flash_attn_func,
    whose lengths are the tensors'). float32_out: out in float32 under a float16/bfloat16 q (CPU; partial results
    that are merged later, attnforge.distributed's ring). score_mod / mask_mod: traced programs' (code, aux)."""
    varlen_q = cu_seqlens_q is not None
    out, lse = _outputs(q, v, varlen_q, return_lse, float32_out)
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
                  v_descale=v_descale, workspace=call_workspace(q), score_mod=score_mod, mask_mod=mask_mod)
    return out, lse
