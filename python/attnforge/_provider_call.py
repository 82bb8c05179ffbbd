"""A prepared plan's calls (the seed's _infer): the C provider's guard and kernels, or, for a plan on backend "fa4",
FlashAttention-4 itself (attnforge._fa4) where the guard covers the call; the outputs are allocated here. Below the
operators: attnforge::provider_sdpa's kernel (_ops) runs a plan it knows by its JSON alone as a PlanRunner, and
provider.FlashAttention4KernelProvider is one. A call an fa4 plan does not cover goes to the general path the runner
was given (attnforge.scaled_dot_product_attention, or the operator behind it), which this module does not import."""
import json
import logging

from . import _C, _fa4
from ._sdpa_call import layout
from ._tensors import call_stream, call_workspace, exportable, new_lse, new_output

logger = logging.getLogger("attnforge")


class PlanRunner:
    """The calls of a C provider's plan. c_provider: an attnforge._C.Provider (prepared or not); general_path:
    called like attnforge.scaled_dot_product_attention(*args, **kwargs, return_lse=...) for a call an fa4 plan does
    not cover (never for a plan on attnforge's own kernels: the C library runs those on its general path itself)."""

    def __init__(self, c_provider, general_path):
        self._c = c_provider
        self._plan = json.loads(c_provider.to_json()) if c_provider.is_prepared else None   # the plan while prepared
        self._general_path = general_path
        self._flash_attn_func = None   # FA4's function, once loaded (the seed's per-instance _backend)

    def infer(self, args=(), kwargs=None, *, strict=False):
        """The seed's _infer(args, kwargs): returns out (B, Hq, L, Ev), allocated like query. strict=True raises
        PlanMismatchError (running nothing) for a call the plan does not cover, instead of the general path."""
        kwargs = {} if kwargs is None else kwargs
        args = tuple(exportable(a) for a in args)
        kwargs = {k: exportable(v) for k, v in kwargs.items()}
        if self._is_fa4():
            return self._infer_fa4(args, kwargs, strict, False)[0]
        query = args[0] if args else kwargs.get("query")
        out = new_output(query, _out_shape(args, kwargs))
        self._c.infer(args, kwargs, out, None, strict, call_stream(query), call_workspace(query))
        return out

    def infer_with_lse(self, *args, **kwargs):
        """Like calling the provider, also returning the float32 log-sum-exp (B, Hq, L)."""
        args = tuple(exportable(a) for a in args)
        kwargs = {k: exportable(v) for k, v in kwargs.items()}
        if self._is_fa4():
            return self._infer_fa4(args, kwargs, False, True)
        query = args[0] if args else kwargs.get("query")
        shape = _out_shape(args, kwargs)
        out, lse = new_output(query, shape), new_lse(query, shape[:3])
        self._c.infer(args, kwargs, out, lse, False, call_stream(query), call_workspace(query))
        return out, lse

    # ---- the fa4 backend: the C guard, FA4's own limits, then FlashAttention-4 itself
    def _is_fa4(self) -> bool:
        return self._plan is not None and self._plan["backend"] == "fa4"

    def _fa4_function(self):
        if self._flash_attn_func is None:   # a failure is not cached: FA4 installed later is found
            self._flash_attn_func = _fa4.flash_attn_func()
        return self._flash_attn_func

    def _fa4_mismatch(self, args, kwargs):
        """Why the fa4 plan does not cover this call (the C guard first, then what FA4 computes), None if it does."""
        view = _fa4.testing.cpu_as_cuda
        guard_args, guard_kwargs = args, kwargs
        if view is not None:   # tests: CPU tensors stand for cuda:0 tensors; the guard reads descriptors only
            guard_args = tuple(view(a) if _fa4.is_on_cuda(a) else a for a in args)
            guard_kwargs = {k: view(v) if _fa4.is_on_cuda(v) else v for k, v in kwargs.items()}
        query = args[0] if args else kwargs.get("query")
        try:
            self._c.check_call(guard_args, guard_kwargs, call_stream(query))
        except _C.PlanMismatchError as e:
            return str(e)
        q, k, v = args[:3] if len(args) >= 3 else (kwargs["query"], kwargs["key"], kwargs["value"])
        if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[1] != v.shape[1]:   # the C guard lets these through
            return (f"FlashAttention-4 plan does not match this call (batch sizes {q.shape[0]}, {k.shape[0]}, "
                    f"{v.shape[0]} and key/value heads {k.shape[1]}, {v.shape[1]}: FA4 broadcasts neither)")
        why = _fa4.call_refusal(q, k, v, self._plan["flash_kwargs"]["causal"])
        return f"FlashAttention-4 plan does not match this call ({why})" if why else None

    def _infer_fa4(self, args, kwargs, strict, with_lse):
        """(out, lse or None): FlashAttention-4 on a covered call; the general path (attnforge's kernels with the
        call's own arguments) or, strict, PlanMismatchError for any other."""
        mismatch = self._fa4_mismatch(args, kwargs)
        if mismatch is None:
            q, k, v = args[:3] if len(args) >= 3 else (kwargs["query"], kwargs["key"], kwargs["value"])
            nhd = _fa4.to_nhd((q, k, v), self._plan["copy_free_layout"])
            unaligned = _fa4.misaligned(nhd)
            if unaligned is None:
                fa4_kwargs = _fa4.flash_kwargs(self._plan["flash_kwargs"], q.shape[2], k.shape[2])
                return _fa4.run(self._fa4_function(), nhd, fa4_kwargs, with_lse)
            mismatch = f"FlashAttention-4 plan does not match this call ({unaligned} is not 16-byte aligned)"
        if strict:
            raise _C.PlanMismatchError(mismatch)
        logger.debug("%s; running it on the general path", mismatch)
        result = self._general_path(*args, **kwargs, return_lse=with_lse)
        return result if with_lse else (result, None)


def _out_shape(args, kwargs):
    """The 4-D output (B, H, L, Ev) of a call as given to infer: q/k/v broadcast by PyTorch's rule (the C library's
    own checks name a call that breaks it, or one that is not 4-D)."""
    def arg(i, name):
        return args[i] if len(args) > i else kwargs.get(name)
    query, key, value, mask = arg(0, "query"), arg(1, "key"), arg(2, "value"), arg(3, "attn_mask")
    if any(getattr(t, "ndim", None) != 4 for t in (query, key, value)):
        return (0, 0, 0, 0)
    enable_gqa = arg(7, "enable_gqa")
    try:
        return layout(query, key, value, mask, bool(enable_gqa)).shape4
    except _C.InvalidArgumentError:   # a mask of more than 4 dims: the C checks name it
        return (0, 0, 0, 0)


def runner_from_json(text: str, general_path) -> PlanRunner:
    """The plan of a JSON text (attnforge's form or the seed's), ready to run: what an exported program carries."""
    return PlanRunner(_C.Provider.from_json(text), general_path)
