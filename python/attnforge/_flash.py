"""FlashAttention-4's forward API on attnforge: flash_attn_func and flash_attn_varlen_func with the signatures of
flash_attn.cute (FA4 4.0.0b27), so code written for FA4 runs by changing the import. The C library
(af_flash_attn) checks every rule; this module refuses the FA4 features attnforge does not implement, only when
they are set, and routes the call: torch tensors through the attnforge::flash_attn operator (_ops), NumPy arrays to
_flash_call (which resolves window_size as FA4 does, allocates the outputs and calls the C library)."""
import functools

from . import _C
from ._flash_call import _check_int, resolve_window, run
from ._tensors import is_torch_tensor

# FA4 arguments attnforge cannot honour: an error names the argument when it is set (not None).
_NOT_IMPLEMENTED = {
    "qv": "MLA-absorbed attention (qv) is not implemented (FA4 4.0.0b27's 4th parameter is qv: pass cu_seqlens_q "
          "and the other varlen arguments by keyword)",
    "gather_kv_indices": "top-k sparse K/V gathering (gather_kv_indices, MLA only) is not implemented",
    "score_mod_bwd": "not needed: attnforge derives the score_mod's derivative from the traced mod itself",
    "aux_tensors": "attnforge's mods capture tensors as torch functions do (closures, globals); pass none here",
    "aux_scalars": "attnforge's mods capture values as torch functions do (closures, globals); pass none here",
    "block_sparse_tensors": "block sparsity is not implemented",
    "block_sparse_tensors_bwd": "block sparsity is not implemented",
    "seqused_q": "seqused_q is not implemented (give each sequence's real length through cu_seqlens_q)",
    "scheduler_metadata": "FA4's GPU scheduler metadata has no meaning on attnforge",
}


def _refuse_unimplemented(**arguments):
    for name, value in arguments.items():
        if value is not None:
            raise _C.UnsupportedError(f"{name}: {_NOT_IMPLEMENTED[name]}")


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


class _WithMods:
    """flash_attn_func / flash_attn_varlen_func with score_mod / mask_mod (torch functions, as attnforge.flex_attention
    takes them; FA4's meanings: sequence-local indices, a mask_mod replacing causal and window_size): traced into
    programs and run by the C call directly (not through the attnforge::flash_attn operator: a mod is no operator
    argument), with the C backward when q, k, v or learnable_sink need a gradient."""

    @staticmethod
    def run(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, varlen, score_mod,
            mask_mod, **tensors):
        from ._mod_trace import trace
        programs = {"score_mod": trace(score_mod, score=True) if score_mod is not None else None,
                    "mask_mod": trace(mask_mod, score=False) if mask_mod is not None else None}
        if any(p is not None and any(t.requires_grad for t in p.aux) for p in programs.values()) and \
                is_torch_tensor(q) and _torch_grad_enabled():
            raise _C.UnsupportedError("score_mod: gradients for the tensors a mod captures are computed by "
                                      "attnforge.flex_attention, not flash_attn_func; detach them here")
        mods = {name: (p.as_c() if p is not None else None) for name, p in programs.items()}
        resolved_causal, window = resolve_window(causal, window_size)
        softcap = 0.0 if softcap is None else softcap
        inputs = (q, k, v, learnable_sink)
        if is_torch_tensor(q) and _torch_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            unsupported = [n for n in ("page_table", "q_descale", "k_descale", "v_descale") if tensors.get(n) is not None]
            if unsupported:   # before the forward runs, as the calls without mods
                raise _C.UnsupportedError(f"{unsupported[0]}: paged and float8 K/V have no backward; call under "
                                          "torch.no_grad()")
            fa4 = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       learnable_sink=learnable_sink, **tensors)
            out, lse = _flash_mods_function().apply(q, k, v, learnable_sink, (resolved_causal, window, varlen, mods,
                                                                           fa4))
            return out, (lse if return_lse else None)
        return run(q, k, v, softmax_scale, resolved_causal, window, softcap, learnable_sink, return_lse=return_lse,
                   varlen=varlen, **mods, **tensors)


def _torch_grad_enabled():
    import torch
    return torch.is_grad_enabled()


# what flash_backward takes besides the tensors and the mods
_BACKWARD_ARGUMENTS = ("softmax_scale", "causal", "window_size", "softcap", "cu_seqlens_q", "cu_seqlens_k",
                       "max_seqlen_q", "max_seqlen_k", "seqused_k")


@functools.lru_cache(maxsize=None)
def _flash_mods_function():
    """The autograd Function of a call with mods, made on first use (this module imports no torch for NumPy)."""
    import torch

    from ._backward import flash_backward

    class FlashModsFunction(torch.autograd.Function):
        """The forward through the C call with the mods (out and lse kept), the backward through flash_backward with
        the same mods; lse gets no gradient."""

        @staticmethod
        def forward(ctx, q, k, v, learnable_sink, spec):
            causal, window, varlen, mods, fa4 = spec
            detached = [t.detach() if t is not None else None for t in (q, k, v, learnable_sink)]
            tensors = {n: t for n, t in fa4.items() if n not in ("softmax_scale", "causal", "window_size", "softcap",
                                                                 "learnable_sink")}
            out, lse = run(*detached[:3], fa4["softmax_scale"], causal, window, fa4["softcap"], detached[3],
                           return_lse=True, varlen=varlen, **mods, **tensors)
            ctx.save_for_backward(*detached, out, lse)
            ctx.mods = mods
            ctx.fa4 = {n: t for n, t in fa4.items() if n in _BACKWARD_ARGUMENTS}
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, sink, out, lse = ctx.saved_tensors
            if dout is None:
                return None, None, None, None, None
            dq, dk, dv, dsink = flash_backward(dout, q, k, v, out, lse, learnable_sink=sink, **ctx.fa4, **ctx.mods)
            return dq, dk, dv, dsink, None

    return FlashModsFunction


def _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, varlen,
              score_mod=None, mask_mod=None, **tensors):
    """Checked arguments → the attnforge::flash_attn operator for torch tensors (so torch.compile and torch.export
    keep the call in their graph), the C call directly for NumPy arrays; a call with mods: _WithMods."""
    if score_mod is not None or mask_mod is not None:
        return _WithMods.run(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse,
                             varlen, score_mod, mask_mod, **tensors)
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
    them. score_mod / mask_mod: torch functions as attnforge.flex_attention takes them (docs/FLEX.md), with FA4's
    meanings (a mask_mod replaces causal and window_size; not with softcap for a score_mod); traced once and run
    inside the kernels, CPU only. qv, gather_kv_indices, score_mod_bwd (derived), aux_*, block_sparse_* raise
    UnsupportedError when set.
    Gradients (the C backward, CPU only) flow to q, k, v and learnable_sink when they require grad; paged and
    float8 K/V have no backward (UnsupportedError before the forward runs), and lse gets no gradient.
    """
    _refuse_unimplemented(qv=qv, gather_kv_indices=gather_kv_indices,
                          score_mod_bwd=score_mod_bwd, aux_tensors=aux_tensors,
                          aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                          block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    _check_hints(num_splits, pack_gqa, deterministic)
    return _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, False,
                     score_mod=score_mod, mask_mod=mask_mod, q_descale=q_descale, k_descale=k_descale,
                     v_descale=v_descale)


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
    tensors). Masks, softcap, sink, score_mod / mask_mod and hints as in flash_attn_func, each sequence aligned on
    its own lengths (a mod's q_idx and kv_idx count from the sequence's first row and key, b is the sequence).
    Returns (out, lse): out like q with head dim Ev; lse float32 (Hq, total_q) with packed q, (B, Hq, Lq) with
    batched q; None unless return_lse. seqused_q, scheduler_metadata and the flash_attn_func features listed
    there raise UnsupportedError when set; dtypes and q/k/v_descale (B, Hkv) as in flash_attn_func; min_seqlen_k,
    seqlen_k_per_split and disable_scheduler_metadata are hints (checked, not needed).
    """
    _refuse_unimplemented(qv=qv, gather_kv_indices=gather_kv_indices,
                          score_mod_bwd=score_mod_bwd, aux_tensors=aux_tensors,
                          aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors, seqused_q=seqused_q,
                          scheduler_metadata=scheduler_metadata)
    _check_hints(num_splits, pack_gqa, deterministic, min_seqlen_k, seqlen_k_per_split)
    _check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    _check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    return _dispatch(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse, True,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table, q_descale=q_descale,
                     k_descale=k_descale, v_descale=v_descale, score_mod=score_mod, mask_mod=mask_mod)
