"""attnforge's PyTorch operators (namespace "attnforge", defined with torch.library.Library): a schema, CPU and CUDA
kernels (the C library through the binding) and a fake implementation giving the exact output shapes, dtypes and
strides.
torch.compile and torch.export see them as opaque operators, so attention stays in their graphs instead of breaking
them; the Python functions of attnforge route every torch-tensor call through them.

    torch.ops.attnforge.sdpa             SDPA's semantics on attnforge's general path (any mask, causal alignment)
    torch.ops.attnforge.provider_sdpa    one call of a plan (its JSON is an argument: exported programs carry it)
    torch.ops.attnforge.flash_attn       FlashAttention-4's flash_attn_func / flash_attn_varlen_func (paged too)
    torch.ops.attnforge.masked_rows      Transformers' softcap/sink layers under a mask (data-dependent: kept opaque)

Each operator has a backward: its Autograd kernel, for a call that needs a gradient, computes the forward's lse too,
saves q, k, v, out and lse, and its backward calls an operator of the backward (attnforge::sdpa_backward,
flash_attn_backward, masked_rows_backward; kernels in _backward), so gradients flow eagerly and under torch.compile.
No gradient for a mask, an lse output or a second derivative; CUDA tensors that need a gradient are refused (the C
backward runs on the CPU only), and the callers that can (apply(), the AITune provider, the Transformers backend)
send such calls to PyTorch first."""
import functools
import logging
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C, _backward, _flash_call, _masked_rows, _sdpa_call
from ._provider_call import runner_from_json
from ._tensors import new_lse, new_output
from ._guard import Call, PlanView, bind
from ._guard import refusal as _refusal

logger = logging.getLogger("attnforge")

_DEVICES = ("cpu", "cuda")


def _empty_lse(query: Tensor) -> Tensor:
    return query.new_empty((0,), dtype=torch.float32)   # return_lse=False: an operator cannot return None


def _broadcast_outputs(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], enable_gqa: bool,
                       return_lse: bool) -> Tuple[Tensor, Tensor]:
    """out (..., H, L, Ev) and lse as the kernels allocate them (_sdpa_call.run): the broadcast shape of PyTorch's
    rule, an HND view of NHD-contiguous memory in 4-D, viewed back to the call's rank."""
    call = _sdpa_call.layout(query, key, value, attn_mask, enable_gqa)
    out = call.from_4d(new_output(query, call.shape4))
    lse = call.lse_from_4d(new_lse(query, call.shape4[:3])) if return_lse else _empty_lse(query)
    return out, lse


def _check_rank(name: str, t: Tensor, rank: int) -> None:
    if t.dim() != rank:
        raise _C.InvalidArgumentError(f"{name}: expected {rank} dimensions, got {t.dim()}")


# torch.library.custom_op wraps each call in Python layers (autograd redispatch, aliasing checks, Dynamo's disable
# wrapper): 30-40 us a call, more than a whole tiny decode. Here each operator is defined with a Library and its
# Autograd kernel runs an eager call on plain tensors itself: one Python kernel a call (about 7 us). The schemas are
# the ones custom_op inferred, so exported programs are unchanged.
_LIB = torch.library.Library("attnforge", "DEF")
_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _needs_grad(args) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def _plain(args) -> bool:
    """Real CPU/CUDA tensors outside any tracing: no subclass (FakeTensor, FunctionalTensor, ...), no dispatch or
    function mode (make_fx, FakeTensorMode, ...), no meta tensor. Anything else goes on down the dispatcher."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return all(type(a) is Tensor and not a.is_meta for a in args if isinstance(a, Tensor))


class _Differentiable(torch.autograd.Function):
    """The outputs of one operator call with its rule's backward: forward runs rule.forward (the kernel below
    autograd, the lse computed too), saves every tensor argument with out and lse, and backward calls the rule's
    backward operator; the same eagerly and when AOTAutograd traces it under torch.compile."""

    @staticmethod
    def forward(ctx, rule, below, *args):
        outputs, out, lse = rule.forward(below, args)
        ctx.rule = rule
        ctx.constants = [None if isinstance(a, Tensor) else a for a in args]
        ctx.save_for_backward(*(a if isinstance(a, Tensor) else None for a in args), out, lse)
        if isinstance(outputs, tuple):   # an lse output gets no gradient
            ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_out, *unused):
        saved = ctx.saved_tensors
        args = [c if t is None else t for c, t in zip(ctx.constants, saved[:-2])]
        return (None, None, *ctx.rule.backward(grad_out, args, *saved[-2:]))


class _Operator:
    """attnforge::name as its Python callers call it: an eager call on plain tensors that needs no gradient runs the
    kernel directly (the dispatcher's round trip into Python is about 7 us, a quarter of a tiny call); anything else
    (torch.compile, export, fake tensors, modes, autograd, a running torch.profiler, which records the operator by
    name) goes through the operator, which Dynamo puts in its graph."""

    def __init__(self, op, kernel):
        self.op, self.kernel = op, kernel

    def __call__(self, *args):
        if not torch.compiler.is_compiling() and not torch.autograd._profiler_enabled() and _plain(args) and \
                not _needs_grad(args):
            return self.kernel(*args)
        return self.op(*args)


def _operator(name: str, schema: str, kernel, fake, rule=None):
    """Define attnforge::name with its CPU and CUDA kernel, its fake and an Autograd kernel: an eager call on plain
    tensors runs the kernel there and then, anything else goes on down the dispatcher; a call that needs a gradient
    goes through _Differentiable with `rule` (the backward), or raises for an operator of the backward (rule None).
    Returns the _Operator to call."""
    _LIB.define(name + schema)
    for device in _DEVICES:
        _LIB.impl(name, kernel, device.upper())
    torch.library.register_fake(f"attnforge::{name}", fake, lib=_LIB)
    operator = _Operator(getattr(torch.ops.attnforge, name).default, kernel)
    if rule is not None:
        def autograd(keyset, *args):
            plain = _plain(args)
            if not _needs_grad(args):
                return kernel(*args) if plain else operator.op.redispatch(keyset & _BELOW_AUTOGRAD, *args)
            rule.check(args)
            forward = rule.forward_operator or operator   # provider_sdpa's forward is attnforge::sdpa's (it has lse)
            below = forward.kernel if plain else functools.partial(forward.op.redispatch, keyset & _BELOW_AUTOGRAD)
            return _Differentiable.apply(rule, below, *args)
    else:   # an operator of the backward: a second derivative is refused, never silently zero
        def autograd(keyset, *args):
            if _needs_grad(args):
                raise _C.UnsupportedError(f"attnforge::{name}: attnforge computes no second derivatives (call "
                                          "backward without create_graph=True)")
            return kernel(*args) if _plain(args) else operator.op.redispatch(keyset & _BELOW_AUTOGRAD, *args)
    _LIB.impl(name, autograd, "Autograd", with_keyset=True)
    return operator


def _refuse_cuda(query: Tensor) -> None:
    if query.device.type != "cpu":
        raise _C.UnsupportedError(f"query: on {query.device}; attnforge's PyTorch backward runs on the CPU only (the C "
                                  "library's CUDA backward has not run on a GPU yet): run this call under "
                                  "torch.no_grad(), or on PyTorch")


def _refuse_mask_gradient(mask) -> None:
    if isinstance(mask, Tensor) and mask.requires_grad:
        raise _C.UnsupportedError("attn_mask: requires grad; attnforge's backward pass computes no gradient for the "
                                  "mask (detach it, or run this call on PyTorch)")


# ---------------------------------------------------------------- attnforge::sdpa
def _sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
                 return_lse):
    result = _sdpa_call.run(False, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            causal_bottom_right, None, return_lse)
    return result if return_lse else (result, _empty_lse(query))


def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
               return_lse):
    return _broadcast_outputs(query, key, value, attn_mask, enable_gqa, return_lse)


def _sdpa_backward_kernel(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa,
                          causal_bottom_right):
    grads = _backward.sdpa_backward(grad_out, query, key, value, out, lse, attn_mask=attn_mask, is_causal=is_causal,
                                    scale=scale, enable_gqa=enable_gqa, causal_bottom_right=causal_bottom_right)
    return tuple(g.contiguous() for g in grads)   # the fake's strides


def _sdpa_backward_fake(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa,
                        causal_bottom_right):
    return tuple(t.new_empty(t.shape) for t in (query, key, value))


_sdpa_backward_op = _operator("sdpa_backward", "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
                              "Tensor lse, Tensor? attn_mask, bool is_causal, float? scale, bool enable_gqa, "
                              "bool causal_bottom_right) -> (Tensor, Tensor, Tensor)", _sdpa_backward_kernel,
                              _sdpa_backward_fake)


class _SdpaRule:
    """attnforge::sdpa's backward: out and lse from the forward (lse asked for whatever return_lse says)."""
    forward_operator = None

    @staticmethod
    def check(args):
        _refuse_cuda(args[0])
        _refuse_mask_gradient(args[3])

    @staticmethod
    def forward(below, args):
        out, lse = below(*args[:9], True)
        return (out, lse if args[9] else _empty_lse(args[0])), out, lse

    @staticmethod
    def backward(grad_out, args, out, lse):
        query, key, value, attn_mask, _, is_causal, scale, enable_gqa, bottom_right, _ = args
        dq, dk, dv = _sdpa_backward_op(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa,
                                       bottom_right)
        return dq, dk, dv, None, None, None, None, None, None, None


_sdpa_op = _operator("sdpa", "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
                     "bool is_causal, float? scale, bool enable_gqa, bool causal_bottom_right, bool return_lse) -> "
                     "(Tensor, Tensor)", _sdpa_kernel, _sdpa_fake, _SdpaRule)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         causal_bottom_right=False, return_lse=False):
    """attnforge.scaled_dot_product_attention on torch tensors, through attnforge::sdpa."""
    out, lse = _sdpa_op(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                        None if scale is None else float(scale), bool(enable_gqa), bool(causal_bottom_right),
                        bool(return_lse))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- attnforge::provider_sdpa
_live_providers = weakref.WeakValueDictionary()   # plan JSON -> the provider plan_view() was asked about


@functools.lru_cache(maxsize=64)
def _provider_from_json(plan_json: str):
    """A plan known by its JSON alone, run as a FlashAttention4KernelProvider of that plan runs it: a call an fa4 plan
    does not cover goes to attnforge.scaled_dot_product_attention, which for these torch tensors is sdpa below."""
    return runner_from_json(plan_json, sdpa)


def _provider_for(plan_json: str):
    """The provider of a plan: the caller's own while it lives in this process (its scratch, its FlashAttention-4
    state), else one made once from the JSON (an exported program loaded elsewhere carries the JSON only)."""
    provider = _live_providers.get(plan_json)
    return provider if provider is not None else _provider_from_json(plan_json)


def _provider_kernel(plan, query, key, value, is_causal, scale, enable_gqa, keyword_qkv):
    kwargs = {"is_causal": is_causal, "enable_gqa": enable_gqa}
    if scale is not None:
        kwargs["scale"] = scale
    if keyword_qkv:   # the plan's qkv_source is part of its guard: the call keeps its form
        return _provider_for(plan).infer((), dict(kwargs, query=query, key=key, value=value))
    return _provider_for(plan).infer((query, key, value), kwargs)


def _provider_fake(plan, query, key, value, is_causal, scale, enable_gqa, keyword_qkv):
    return _broadcast_outputs(query, key, value, None, enable_gqa, False)[0]


class _ProviderRule:
    """attnforge::provider_sdpa's backward: a call that needs a gradient runs attnforge::sdpa with the call's own
    arguments (what the plan covers is that call: the same math), which gives the lse the backward needs."""
    forward_operator = _sdpa_op

    @staticmethod
    def check(args):
        _refuse_cuda(args[1])

    @staticmethod
    def forward(below, args):
        _, query, key, value, is_causal, scale, enable_gqa, _ = args
        out, lse = below(query, key, value, None, 0.0, is_causal, scale, enable_gqa, False, True)
        return out, out, lse

    @staticmethod
    def backward(grad_out, args, out, lse):
        _, query, key, value, is_causal, scale, enable_gqa, _ = args
        dq, dk, dv = _sdpa_backward_op(grad_out, query, key, value, out, lse, None, is_causal, scale, enable_gqa,
                                       False)
        return None, dq, dk, dv, None, None, None, None


_provider_op = _operator("provider_sdpa", "(str plan, Tensor query, Tensor key, Tensor value, bool is_causal, "
                         "float? scale, bool enable_gqa, bool keyword_qkv) -> Tensor", _provider_kernel,
                         _provider_fake, _ProviderRule)


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


# ---------------------------------------------------------------- attnforge::flash_attn
def _flash_kernel(q, k, v, softmax_scale, causal, windowed, window_left, window_right, softcap, learnable_sink,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale,
                  v_descale, return_lse, varlen):
    window = (window_left, window_right) if windowed else None
    out, lse = _flash_call.run(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, cu_seqlens_q,
                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale,
                               k_descale, v_descale, return_lse, varlen)
    return out, lse if lse is not None else _empty_lse(q)


def _flash_fake(q, k, v, softmax_scale, causal, windowed, window_left, window_right, softcap, learnable_sink,
                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale,
                v_descale, return_lse, varlen):
    packed_q = cu_seqlens_q is not None
    _check_rank("q", q, 3 if packed_q else 4)
    float8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16 if float8 else q.dtype)
    if not return_lse:
        return out, _empty_lse(q)
    lse_shape = (q.shape[1], q.shape[0]) if packed_q else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)   # (Hq, total_q) or (B, Hq, Lq), as _flash_call._outputs


def _flash_backward_kernel(grad_out, q, k, v, out, lse, softmax_scale, causal, windowed, window_left, window_right,
                           softcap, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):
    window = (window_left, window_right) if windowed else (None, None)   # resolved already: resolving again keeps it
    dq, dk, dv, dsink = _backward.flash_backward(
        grad_out, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    return dq, dk, dv, dsink if dsink is not None else _empty_lse(q)


def _flash_backward_fake(grad_out, q, k, v, out, lse, softmax_scale, causal, windowed, window_left, window_right,
                         softcap, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):
    dsink = learnable_sink.new_empty(learnable_sink.shape) if learnable_sink is not None else _empty_lse(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


_flash_backward_op = _operator("flash_attn_backward", "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
                               "Tensor lse, float? softmax_scale, bool causal, bool windowed, SymInt? window_left, "
                               "SymInt? window_right, float softcap, Tensor? learnable_sink, Tensor? cu_seqlens_q, "
                               "Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, Tensor? seqused_k) "
                               "-> (Tensor, Tensor, Tensor, Tensor)", _flash_backward_kernel, _flash_backward_fake)


class _FlashRule:
    """attnforge::flash_attn's backward (learnable_sink's gradient too); paged and float8 K/V have none."""
    forward_operator = None

    @staticmethod
    def check(args):
        _refuse_cuda(args[0])
        if args[15] is not None:
            raise _C.UnsupportedError("page_table: paged K/V has no backward pass (FlashAttention-4 has none either); "
                                      "train on contiguous or varlen K/V, or run this call under torch.no_grad()")
        for name, t in zip(("q_descale", "k_descale", "v_descale"), args[16:19]):
            if t is not None:
                raise _C.UnsupportedError(f"{name}: float8 attention has no backward pass (FlashAttention-4 has none "
                                          "either); run this call under torch.no_grad()")

    @staticmethod
    def forward(below, args):
        out, lse = below(*args[:19], True, args[20])
        return (out, lse if args[19] else _empty_lse(args[0])), out, lse

    @staticmethod
    def backward(grad_out, args, out, lse):
        (q, k, v, softmax_scale, causal, windowed, left, right, softcap, sink, cu_q, cu_k, max_q, max_k,
         seqused_k) = args[:15]
        dq, dk, dv, dsink = _flash_backward_op(grad_out, q, k, v, out, lse, softmax_scale, causal, windowed, left,
                                               right, softcap, sink, cu_q, cu_k, max_q, max_k, seqused_k)
        return (dq, dk, dv, None, None, None, None, None, None, dsink if sink is not None else None,
                *(None,) * 11)


_flash_op = _operator("flash_attn", "(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, bool windowed, "
                      "SymInt? window_left, SymInt? window_right, float softcap, Tensor? learnable_sink, "
                      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, "
                      "Tensor? seqused_k, Tensor? page_table, Tensor? q_descale, Tensor? k_descale, "
                      "Tensor? v_descale, bool return_lse, bool varlen) -> (Tensor, Tensor)", _flash_kernel,
                      _flash_fake, _FlashRule)


def flash_attn(q, k, v, softmax_scale, causal, window, softcap, learnable_sink, return_lse, varlen,
               cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
               page_table=None, q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_func / flash_attn_varlen_func on torch tensors (checked, window resolved) → (out, lse or None)."""
    left, right = window if window is not None else (None, None)
    out, lse = _flash_op(q, k, v, None if softmax_scale is None else float(softmax_scale), bool(causal),
                         window is not None, left, right, float(softcap), learnable_sink, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, seqused_k, page_table, q_descale, k_descale, v_descale,
                         bool(return_lse), bool(varlen))
    return out, (lse if return_lse else None)


# ---------------------------------------------------------------- attnforge::masked_rows
def _masked_rows_kernel(query, key, value, mask, scale, softcap, sink):
    return _masked_rows.masked_rows(query, key, value, mask, scale, softcap, sink)   # reads the mask's values


def _masked_rows_fake(query, key, value, mask, scale, softcap, sink):
    b, hq, l = query.shape[0], query.shape[1], query.shape[2]
    return query.new_empty((b, l, hq, value.shape[-1]))


def _masked_rows_backward_kernel(grad_out, query, key, value, out, mask, scale, softcap, sink):
    dq, dk, dv, dsink = _backward.masked_rows_backward(grad_out, query, key, value, out, mask, scale, softcap, sink)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsink if dsink is not None else _empty_lse(query)


def _masked_rows_backward_fake(grad_out, query, key, value, out, mask, scale, softcap, sink):
    dsink = sink.new_empty(sink.shape) if sink is not None else _empty_lse(query)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dsink


_masked_rows_backward_op = _operator("masked_rows_backward", "(Tensor grad_out, Tensor query, Tensor key, "
                                     "Tensor value, Tensor out, Tensor mask, float? scale, float softcap, "
                                     "Tensor? sink) -> (Tensor, Tensor, Tensor, Tensor)",
                                     _masked_rows_backward_kernel, _masked_rows_backward_fake)


class _MaskedRowsRule:
    """attnforge::masked_rows' backward (_backward.masked_rows_backward: PyTorch's, not the C one; no lse needed)."""
    forward_operator = None

    @staticmethod
    def check(args):
        _refuse_cuda(args[0])
        _refuse_mask_gradient(args[3])

    @staticmethod
    def forward(below, args):
        out = below(*args)
        return out, out, None

    @staticmethod
    def backward(grad_out, args, out, lse):
        query, key, value, mask, scale, softcap, sink = args
        dq, dk, dv, dsink = _masked_rows_backward_op(grad_out, query, key, value, out, mask, scale, softcap, sink)
        return dq, dk, dv, None, None, None, dsink if sink is not None else None


_masked_rows_op = _operator("masked_rows", "(Tensor query, Tensor key, Tensor value, Tensor mask, float? scale, "
                            "float softcap, Tensor? sink) -> Tensor", _masked_rows_kernel, _masked_rows_fake,
                            _MaskedRowsRule)


def masked_rows(query, key, value, mask, scale, softcap, sink):
    """Transformers' softcap/sink attention under a mask, (B, L, Hq, Ev), through attnforge::masked_rows."""
    return _masked_rows_op(query, key, value, mask, None if scale is None else float(scale), float(softcap), sink)


OPERATORS: List[str] = ["sdpa", "provider_sdpa", "flash_attn", "masked_rows"]
