"""attnforge as PyTorch's own attention: the implementation "attnforge" of torch.nn.attention's flash-attention
registry (PyTorch 2.15+), forward and backward, for training as well as inference.

    import attnforge                                   # registers "attnforge" once torch is imported (a dict entry)
    torch.nn.attention.activate_flash_attention_impl("attnforge")
    loss = model(x).sum(); loss.backward()             # every CPU SDPA call of PyTorch's flash backend on attnforge
    torch.nn.attention.restore_flash_attention_impl()  # PyTorch's own kernels again

Activation overrides the CPU kernels of the two operators PyTorch's CPU flash backend is made of,
aten::_scaled_dot_product_flash_attention_for_cpu and its _backward, with torch.library (as torch/nn/attention/_fa4.py
does for CUDA). Nothing else changes: PyTorch still chooses the backend (F.scaled_dot_product_attention takes flash on
the CPU unless dropout, Ev != E, broadcast batch/heads, a non-unit last stride, ... send it to math), its autograd
formula still pairs the two operators, torch.compile and torch.export still trace the aten operators (Inductor calls
them at run time: attnforge runs there too). The outputs keep PyTorch's layouts exactly (out like query, logsumexp
(B, H, L) float32 of (B, L, H) memory, gradients of (B, L, H, E) memory, empty rows' logsumexp 0), so PyTorch's
backward consumes attnforge's forward and attnforge's backward PyTorch's forward. A call attnforge cannot run (float64,
dropout, a mask of another dtype than query's, a mask with is_causal, ...) goes to the kernel it replaced.

CUDA is not overridden: attnforge's CUDA backward (C library) has never run on a GPU, and PyTorch's own CUDA flash operators (or FA4 through
this same registry) keep running there (docs/PYTORCH.md)."""
import logging

import torch

from . import _backward, _ops, _sdpa

NAME = "attnforge"
_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"

logger = logging.getLogger("attnforge")


def register() -> bool:
    """Register "attnforge" with torch.nn.attention.register_flash_attention_impl (idempotent; nothing is overridden
    until activate_flash_attention_impl("attnforge")). False when this torch has no such registry (before 2.15)."""
    registry = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if registry is None:
        return False
    registry(NAME, register_fn=_activate)
    return True


class _Handle:
    """What activate_flash_attention_impl keeps: remove() (restore_flash_attention_impl) drops the overrides."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()   # deregisters now, not whenever the garbage collector runs
            self.library = None


def _activate() -> _Handle:
    """The registry's register_fn: PyTorch's CPU kernels as they are now (restore ran first) become the fallback, then
    attnforge's kernels replace them."""
    original_forward = torch.library.get_kernel(f"aten::{_FORWARD}", "CPU")
    original_backward = torch.library.get_kernel(f"aten::{_BACKWARD}", "CPU")
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl(_FORWARD, _forward_kernel(original_forward), "CPU", with_keyset=True)
        library.impl(_BACKWARD, _backward_kernel(original_backward), "CPU", with_keyset=True)
    except Exception:
        library._destroy()
        raise
    return _Handle(library)


def _refusal(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """Why attnforge does not take this call of the flash operators (None when it does): their 4-D q/k/v with E == Ev
    and no bool mask (anything else is PyTorch's error to give), then attnforge's own rule for an SDPA call
    (_ops.refusal), grouped heads as the operators read them (Hq a multiple of Hkv)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or value.shape[-1] != query.shape[-1]:
        return "not the flash operators' 4-D call with one head dimension"
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # F.sdpa converts it first; the operator refuses it
        return "a bool mask"
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
              "enable_gqa": query.shape[1] != key.shape[1]}
    with torch.no_grad():   # inside an operator's CPU kernel: autograd is PyTorch's business, not a reason to refuse
        return _ops.refusal((query, key, value), kwargs)


def _forward_kernel(original):
    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        why = _refusal(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if why is not None:
            _debug("aten::%s on PyTorch's kernel: %s", _FORWARD, why)
            return original.call_boxed(keyset, query, key, value, dropout_p, is_causal, attn_mask=attn_mask,
                                       scale=scale)
        with torch.no_grad():
            out, lse = _sdpa.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale,
                                                          query.shape[1] != key.shape[1], return_lse=True)
        return _like(out, torch.empty_like(query)), _pytorch_lse(lse)
    return forward


def _backward_kernel(original):
    def backward(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                 scale=None):
        why = _refusal(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if why is None and (grad_out.dtype != query.dtype or out.dtype != query.dtype):
            why = "grad_out or out in another dtype than query's"
        if why is not None:
            _debug("aten::%s on PyTorch's kernel: %s", _BACKWARD, why)
            return original.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                                       attn_mask=attn_mask, scale=scale)
        with torch.no_grad():
            grads = _backward.sdpa_backward(grad_out, query, key, value, out, logsumexp, attn_mask=attn_mask,
                                            is_causal=is_causal, scale=scale,
                                            enable_gqa=query.shape[1] != key.shape[1])
        return tuple(_like(g, _nhd_empty(g)) for g in grads)
    return backward


def _like(t, target):
    """t with target's strides (what PyTorch's kernel and its meta function give): t itself when they differ only
    in size-1 dims (a view), else copied into target."""
    if t.stride() == target.stride():
        return t
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), target.stride(), t.shape)):
        return t.as_strided(t.shape, target.stride(), t.storage_offset())
    return target.copy_(t)


def _nhd_empty(t):
    """Gradients as PyTorch's CPU flash backward allocates them: (B, H, L, E) views of (B, L, H, E) memory."""
    return torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)


def _pytorch_lse(lse):
    """attnforge's (B, H, L) log-sum-exp as PyTorch's CPU flash kernel gives it: (B, L, H) memory, and 0 rather than
    -inf for a row that sees no key (PyTorch's backward reads -inf as NaN gradients; exp(-inf - 0) is the 0 wanted)."""
    b, h, l = lse.shape
    pytorch = torch.empty((b, l, h), dtype=torch.float32, device=lse.device).transpose(1, 2)
    return pytorch.copy_(lse).masked_fill_(lse == float("-inf"), 0.0)


def _debug(message, *values):
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(message, *values)
