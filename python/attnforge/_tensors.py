"""Outputs for the C library to write into, allocated like the inputs (torch or NumPy), and the one
torch-specific step before export: detaching from autograd."""
import sys

from . import _C


def _torch():
    return sys.modules.get("torch")   # never import torch here: the NumPy tier must run without it


def is_torch_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def exportable(x):
    """x, ready for DLPack: a tensor that requires grad is detached (a view, no copy) under no_grad, which is where
    the operators' Autograd kernels run the kernels; with grad mode on it is refused (UnsupportedError): only the
    operators record autograd, a direct call (out=, the reference) would silently drop the gradient."""
    if getattr(x, "requires_grad", False):   # torch tensors only (NumPy has no such attribute); cheap per call
        if _torch().is_grad_enabled():
            raise _C.UnsupportedError(
                "this call records no autograd (only attnforge's operators do: call it without out=, or under "
                "torch.no_grad())")
        return x.detach()
    return x


def call_stream(query):
    """The CUDA stream a call on query's device runs on: PyTorch's current stream there (its cudaStream_t as an int,
    0 for the legacy default stream), so attnforge's kernels are ordered like any torch op and need no extra
    synchronisation; None off CUDA (and for non-torch producers: the legacy default stream)."""
    if getattr(query, "is_cuda", False):   # torch CUDA tensors only; an attribute read, cheap on every CPU call
        return _torch().cuda.current_stream(query.device).cuda_stream
    return None


def call_workspace(query):
    """Where a CUDA call's scratch comes from (copies of q/k/v the tensor cores cannot read in place, split-KV
    partials): for torch CUDA tensors PyTorch's caching allocator, as (alloc, free) for the binding's `workspace`
    argument, so memory PyTorch already holds serves attnforge too, shows in torch.cuda.memory_stats, and under
    torch.cuda.graph comes from the graph's private pool (stream-ordered, no synchronisation); None otherwise
    (attnforge's own pool on each device)."""
    if getattr(query, "is_cuda", False):
        cuda = _torch().cuda
        return cuda.caching_allocator_alloc, cuda.caching_allocator_delete
    return None


def new_output(query, shape):
    """shape (B, H, L, Ev), the call's broadcast output (_sdpa_call.layout), in query's dtype: an HND view of
    NHD-contiguous memory, as PyTorch's CPU flash kernel and FlashAttention-4 return it (so
    out.transpose(1, 2).reshape(B, L, H * Ev) costs nothing)."""
    b, h, l, ev = shape
    nhd = _empty_like(query, (b, l, h, ev))
    return nhd.transpose(1, 2) if is_torch_tensor(nhd) else nhd.transpose(0, 2, 1, 3)


def new_lse(query, shape):
    """(B, H, L) float32, natural-log log-sum-exp."""
    if is_torch_tensor(query):
        return _torch().empty(tuple(shape), dtype=_torch().float32, device=query.device)
    import numpy
    return numpy.empty(tuple(shape), dtype=numpy.float32)


def _empty_like(query, shape):
    if is_torch_tensor(query):
        return _torch().empty(shape, dtype=query.dtype, device=query.device)
    import numpy
    return numpy.empty(shape, dtype=query.dtype)
