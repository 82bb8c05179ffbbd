"""attnforge's PyTorch operators (torch.library custom ops, namespace "attnforge"): a schema, CPU and CUDA kernels
(the C library through the binding) and a fake implementation giving the exact output shapes, dtypes and strides.
torch.compile and torch.export see them as opaque operators, so attention stays in their graphs instead of breaking
them; the Python functions of attnforge route every torch-tensor call through them.

    torch.ops.attnforge.sdpa             SDPA's semantics on attnforge's general path (any mask, causal alignment)
    torch.ops.attnforge.provider_sdpa    one call of a plan (its JSON is an argument: exported programs carry it)
    torch.ops.attnforge.flash_attn       FlashAttention-4's flash_attn_func / flash_attn_varlen_func (paged too)
    torch.ops.attnforge.masked_rows      Transformers' softcap/sink layers under a mask (data-dependent: kept opaque)

No operator has a backward: attnforge computes no gradients, and each one's autograd registration raises saying so.
Callers that may meet autograd (attnforge.torch.apply, the AITune provider) send such calls to PyTorch's own SDPA
before they reach an operator (guarded_call)."""
import functools
import logging
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _flash, _sdpa
from ._tensors import new_lse, new_output
from ._guard import Call, PlanView, bind
from ._guard import refusal as _refusal

logger = logging.getLogger("attnforge")

_DEVICES = ("cpu", "cuda")
_NO_GRADIENTS = ("attnforge computes no gradients: run attention under torch.no_grad() or torch.inference_mode(), "
                 "or let attnforge.torch.apply send calls that need autograd to PyTorch")


def _empty_lse(query: Tensor) -> Tensor:
    return query.new_empty((0,), dtype=torch.float32)   # return_lse=False: an operator cannot return None


def _broadcast_outputs(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], enable_gqa: bool,
                       return_lse: bool) -> Tuple[Tensor, Tensor]:
    """out (..., H, L, Ev) and lse as the kernels allocate them (_sdpa.run): the broadcast shape of PyTorch's rule, an
    HND view of NHD-contiguous memory in 4-D, viewed back to the call's rank."""
    call = _sdpa.layout(query, key, value, attn_mask, enable_gqa)
    out = call.from_4d(new_output(query, call.shape4))
    lse = call.lse_from_4d(new_lse(query, call.shape4[:3])) if return_lse else _empty_lse(query)
    return out, lse


def _check_rank(name: str, t: Tensor, rank: int) -> None:
    if t.dim() != rank:
        raise _C.InvalidArgumentError(f"{name}: expected {rank} dimensions, got {t.dim()}")


def _refuse_backward(ctx, *grads):
    raise _C.UnsupportedError(_NO_GRADIENTS)


def _no_gradients(op):
    """Say in the registration that there is no backward (an error at backward time, not a silent zero)."""
    op.register_autograd(_refuse_backward, setup_context=lambda ctx, inputs, output: None)
    return op


# ---------------------------------------------------------------- attnforge::sdpa
@torch.library.custom_op("attnforge::sdpa", mutates_args=(), device_types=_DEVICES)
def _sdpa_op(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
             is_causal: bool, scale: Optional[float], enable_gqa: bool, causal_bottom_right: bool,
             return_lse: bool) -> Tuple[Tensor, Tensor]:
    result = _sdpa.run(False, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       causal_bottom_right, None, return_lse)
    return result if return_lse else (result, _empty_lse(query))


@_sdpa_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right, return_lse):
    return _broadcast_outputs(query, key, value, attn_mask, enable_gqa, return_lse)


_no_gradients(_sdpa_op)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         causal_bottom_right=False, return_lse=False):
    """attnforge.scaled_dot_product_attention on torch tensors, through attnforge::sdpa."""
    _refuse_autograd(query, key, value, attn_mask)
    out, lse = _sdpa_op(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                        None if scale is None else float(scale), bool(enable_gqa), bool(causal_bottom_right),
                        bool(return_lse))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- attnforge::provider_sdpa
_live_providers = weakref.WeakValueDictionary()   # plan JSON -> the provider plan_view() was asked about


@functools.lru_cache(maxsize=64)
def _provider_from_json(plan_json: str):
    from .provider import FlashAttention4KernelProvider
    return FlashAttention4KernelProvider.from_json(plan_json)


def _provider_for(plan_json: str):
    """The provider of a plan: the caller's own while it lives in this process (its scratch, its FlashAttention-4
    state), else one made once from the JSON (an exported program loaded elsewhere carries the JSON only)."""
    provider = _live_providers.get(plan_json)
    return provider if provider is not None else _provider_from_json(plan_json)


@torch.library.custom_op("attnforge::provider_sdpa", mutates_args=(), device_types=_DEVICES)
def _provider_op(plan: str, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: Optional[float],
                 enable_gqa: bool, keyword_qkv: bool) -> Tensor:
    kwargs = {"is_causal": is_causal, "enable_gqa": enable_gqa}
    if scale is not None:
        kwargs["scale"] = scale
    if keyword_qkv:   # the plan's qkv_source is part of its guard: the call keeps its form
        return _provider_for(plan).infer((), dict(kwargs, query=query, key=key, value=value))
    return _provider_for(plan).infer((query, key, value), kwargs)


@_provider_op.register_fake
def _(plan, query, key, value, is_causal, scale, enable_gqa, keyword_qkv):
    return _broadcast_outputs(query, key, value, None, enable_gqa, False)[0]


_no_gradients(_provider_op)


def plan_view(provider) -> Optional[PlanView]:
    """What the per-call guard reads of a prepared FlashAttention4KernelProvider (kept on it: made once, outside
    any traced code); None when it is not prepared."""
    if provider is None or not provider.is_prepared:
        return None
    view = getattr(provider, "_attnforge_plan_view", None)
    if view is None or view.json != provider.to_json():
        from . import _fa4
        plan = provider.to_dict()
        view = PlanView(plan, provider.to_json(), plan["backend"] == "fa4" and _fa4.testing.cpu_as_cuda is not None)
        provider._attnforge_plan_view = view
        _live_providers[view.json] = provider
    return view


def refusal(args, kwargs):
    """Why attnforge cannot compute this F.scaled_dot_product_attention(*args, **kwargs) call, from metadata alone
    (a reason for the DEBUG log), or None when it can."""
    call, why = bind(args, kwargs)
    return why if call is None else _refusal(call, torch)


def guarded_call(view, args, kwargs, *, fallback, uncovered="pytorch"):
    """One SDPA call made like F.scaled_dot_product_attention(*args, **kwargs), routed from metadata so that a traced
    graph takes the same branch as eager mode: a call the plan covers → attnforge::provider_sdpa; one it does not
    cover → attnforge::sdpa when uncovered == "attnforge", else fallback(*args, **kwargs); a call attnforge cannot
    compute (autograd, dropout, float64, ...) → fallback. view: plan_view(provider), or None for no plan."""
    call, why = bind(args, kwargs)   # bound once: the refusal and the plan's guard read the same Call
    if why is None:
        why = _refusal(call, torch)
    if why is not None:
        _debug("attnforge does not run this call (%s); using PyTorch's scaled_dot_product_attention", why)
        return fallback(*args, **kwargs)
    mismatch = view.mismatch(call) if view is not None else "no plan"
    if mismatch is None:
        return _provider_op(view.json, call.query, call.key, call.value, call.is_causal,
                            None if call.scale is None else float(call.scale), call.enable_gqa, call.keyword_qkv)
    if uncovered == "attnforge":
        _debug("FlashAttention-4 plan does not match this call (%s); running it on attnforge's general path",
               mismatch)
        return sdpa(call.query, call.key, call.value, call.attn_mask, call.dropout_p, call.is_causal, call.scale,
                    call.enable_gqa)
    _debug("FlashAttention-4 plan does not match this call (%s); using PyTorch's scaled_dot_product_attention",
           mismatch)
    return fallback(*args, **kwargs)


def _debug(message, *values):
    if not torch.compiler.is_compiling():   # logging inside a traced region would break the graph
        logger.debug(message, *values)


def _refuse_autograd(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise _C.UnsupportedError(_NO_GRADIENTS)


# ---------------------------------------------------------------- attnforge::flash_attn
@torch.library.custom_op("attnforge::flash_attn", mutates_args=(), device_types=_DEVICES)
def _flash_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool, windowed: bool,
              window_left: Optional[int], window_right: Optional[int], softcap: float,
              learnable_sink: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
              max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], seqused_k: Optional[Tensor],
              page_table: Optional[Tensor], q_descale: Optional[Tensor], k_descale: Optional[Tensor],
              v_descale: Optional[Tensor], return_lse: bool, varlen: bool) -> Tuple[Tensor, Tensor]:
    window = (window_left, window_right) if windowed else None
    out, lse = _flash.run(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale,
                          v_descale, return_lse, varlen)
    return out, lse if lse is not None else _empty_lse(q)


@_flash_op.register_fake
def _(q, k, v, softmax_scale, causal, windowed, window_left, window_right, softcap, learnable_sink, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale, v_descale, return_lse,
      varlen):
    packed_q = cu_seqlens_q is not None
    _check_rank("q", q, 3 if packed_q else 4)
    float8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16 if float8 else q.dtype)
    if not return_lse:
        return out, _empty_lse(q)
    lse_shape = (q.shape[1], q.shape[0]) if packed_q else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)   # (Hq, total_q) or (B, Hq, Lq), as _flash._outputs


_no_gradients(_flash_op)


def flash_attn(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, return_lse, varlen,
               cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
               page_table=None, q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_func / flash_attn_varlen_func on torch tensors (checked, window resolved) → (out, lse or None)."""
    _refuse_autograd(q, k, v, learnable_sink, q_descale, k_descale, v_descale)
    left, right = window if window is not None else (None, None)
    out, lse = _flash_op(q, k, v, None if softmax_scale is None else float(softmax_scale), bool(causal),
                         window is not None, left, right, float(softcap), learnable_sink, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale, v_descale,
                         bool(return_lse), bool(varlen))
    return out, (lse if return_lse else None)


# ---------------------------------------------------------------- attnforge::masked_rows
@torch.library.custom_op("attnforge::masked_rows", mutates_args=(), device_types=_DEVICES)
def _masked_rows_op(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: Optional[float],
                    softcap: float, sink: Optional[Tensor]) -> Tensor:
    from . import transformers as hf   # its kernel reads the mask's values: opaque to the graph for that reason
    return hf.masked_rows(query, key, value, mask, scale, softcap, sink)


@_masked_rows_op.register_fake
def _(query, key, value, mask, scale, softcap, sink):
    b, hq, l = query.shape[0], query.shape[1], query.shape[2]
    return query.new_empty((b, l, hq, value.shape[-1]))


_no_gradients(_masked_rows_op)


def masked_rows(query, key, value, mask, scale, softcap, sink):
    """Transformers' softcap/sink attention under a mask, (B, L, Hq, Ev), through attnforge::masked_rows."""
    _refuse_autograd(query, key, value, mask, sink)
    return _masked_rows_op(query, key, value, mask, None if scale is None else float(scale), float(softcap), sink)


OPERATORS: List[str] = ["sdpa", "provider_sdpa", "flash_attn", "masked_rows"]
