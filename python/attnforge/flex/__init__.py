"""attnforge.flex: FlexAttention's score_mod / mask_mod on attnforge's kernels, without a compiler.

    from attnforge.flex import flex_attention
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)   # torch.nn.attention.flex_attention's call

A mod written with torch operations is traced (attnforge._mod_trace) into a small program that the C kernels
evaluate inside their tiles, vectorised over keys, on every ISA; the common ones are also built in (builtin: their
programs written out, nothing traced). A BlockMask contributes its mask_mod and its block lists: the kernels skip
the blocks it leaves out and evaluate no mask in its full blocks; create_block_mask builds one in C (_block_mask).
The forward runs with its LSE; the backward gives dq, dk, dv through the mods (their derivative from the traced
program) and the gradients of the tensors a score_mod captures."""
import math

import torch

from .. import _C
from . import _builtin as builtin
from ._block_mask import block_mask_args, create_block_mask
from .._mod_trace import ModTraceError, Program, trace

__all__ = ["flex_attention", "create_block_mask", "builtin", "trace", "ModTraceError", "Program"]


def _mask_mod_of(block_mask):
    """The BlockMask's mask_mod, or None when it is PyTorch's no-op mask (every key)."""
    if block_mask is None:
        return None
    mod = getattr(block_mask, "mask_mod", None)
    if mod is None or getattr(mod, "__name__", "") == "noop_mask":
        return None
    return mod


def _check(query, key, value, enable_gqa, block_mask):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise _C.InvalidArgumentError(f"{name}: expected a 4-D (B, H, L, E) torch.Tensor")
        if t.device.type != "cpu":
            raise _C.UnsupportedError(f"{name}: on {t.device}; attnforge.flex runs on the CPU")
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hq != Hkv and not enable_gqa:
        raise _C.InvalidArgumentError(f"query, key: {Hq} query heads and {Hkv} kv heads need enable_gqa=True "
                                      "(FlexAttention's rule)")
    if block_mask is not None:
        lengths = getattr(block_mask, "seq_lengths", None)
        if lengths is not None and tuple(lengths) != (query.shape[2], key.shape[2]):
            raise _C.InvalidArgumentError(f"block_mask: made for (Q_LEN, KV_LEN) = {tuple(lengths)}, the call has "
                                          f"({query.shape[2]}, {key.shape[2]}); BlockMask._adjust makes it fit")


def _run(query, key, value, call, want_lse):
    """One af_flex_attn call: (out, lse or None)."""
    B, Hq, L, _ = query.shape
    out = torch.empty(B, Hq, L, value.shape[-1], dtype=query.dtype)
    lse = torch.empty(B, Hq, L, dtype=torch.float32) if want_lse else None
    _C.flex_attn(query.detach(), key.detach(), value.detach(), out, lse, **call)   # DLPack takes no tensor needing grad
    return out, lse


class _Flex(torch.autograd.Function):
    """flex_attention with its backward: the forward keeps out and lse, the backward runs af_flex_attn_backward
    with the same programs, giving dq, dk, dv and the gradients of the score_mod's captured tensors (`captured`,
    inputs here so that autograd reaches them; the lse gets no gradient)."""

    @staticmethod
    def forward(ctx, query, key, value, call, *captured):
        out, lse = _run(query, key, value, call, want_lse=True)
        ctx.save_for_backward(query, key, value, out, lse, *captured)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        query, key, value, out, lse, *captured = (t.detach() for t in ctx.saved_tensors)
        if dout is None:
            return (None,) * (4 + len(captured))
        want = ctx.needs_input_grad
        dq = torch.empty_like(query, memory_format=torch.contiguous_format) if want[0] else None
        dk = torch.empty_like(key, memory_format=torch.contiguous_format) if want[1] else None
        dv = torch.empty_like(value, memory_format=torch.contiguous_format) if want[2] else None
        daux = [torch.empty(t.shape, dtype=torch.float32) if w and t.is_floating_point() else None
                for t, w in zip(captured, want[4:])]
        _C.flex_attn_backward(query, key, value, out, dout.detach(), lse, dq, dk, dv,
                              daux=daux if any(d is not None for d in daux) else None, **ctx.call)
        return (dq, dk, dv, None, *(d.to(t.dtype) if d is not None else None for d, t in zip(daux, captured)))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention's forward on attnforge: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev),
    float32 / float16 / bfloat16, any strides. score_mod(score, b, h, q_idx, kv_idx) sees the scaled float32 score
    (h: the query head); block_mask's blocks and mask_mod remove keys, as compiled flex does: its empty blocks are
    skipped, its full ones attended without the mask; a row that sees no key gets 0 and LSE -inf. Returns
    out, or (out, lse) with return_lse, or (out, AuxOutput) with return_aux=AuxRequest(lse=True). kernel_options
    are PyTorch's tuning hints and ignored. No compile step: a mod is traced once (a few ms) and its program kept."""
    _check(query, key, value, enable_gqa, block_mask)
    want_lse = return_lse
    if return_aux is not None:
        if getattr(return_aux, "max_scores", False):
            raise _C.UnsupportedError("return_aux: max_scores is not implemented")
        want_lse = want_lse or bool(getattr(return_aux, "lse", False))
    score_program = trace(score_mod, score=True) if score_mod is not None else None
    mask_fn = _mask_mod_of(block_mask)
    mask_program = trace(mask_fn, score=False) if mask_fn is not None else None
    call = dict(scale=None if scale is None else float(scale),
                score_mod=score_program.as_c() if score_program else None,
                mask_mod=mask_program.as_c() if mask_program else None,
                block_mask=block_mask_args(block_mask) if block_mask is not None else None)
    captured = list(score_program.aux) if score_program is not None else []
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *captured)):
        out, lse = _Flex.apply(query, key, value, call, *captured)
        lse = lse if want_lse else None
    else:
        out, lse = _run(query, key, value, call, want_lse)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        aux = AuxOutput(lse=lse if getattr(return_aux, "lse", False) else None)
        return (out, lse, aux) if return_lse else (out, aux)
    return (out, lse) if return_lse else out
