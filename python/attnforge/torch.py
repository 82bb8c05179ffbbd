"""PyTorch helpers: record a module's scaled_dot_product_attention calls as samples, and apply a plan to a
module (its F.scaled_dot_product_attention calls go to attnforge while it runs).

    samples = attnforge.torch.record(model, x)             # the distinct SDPA calls of one forward pass
    provider = attnforge.FlashAttention4KernelProvider()
    if provider.prepare(samples):
        with attnforge.torch.apply(model, provider):
            y = model(x)
"""
import contextlib
import functools
import json
import logging
import os

import torch
import torch.nn.functional as F

from . import _C, _ops
from ._samples import sample_entry, samples_to_json, save_samples
from .provider import SUPPORTED_FUNCTION, FlashAttention4KernelProvider
from .torch_attention import register  # noqa: F401  ("attnforge" as PyTorch's flash attention: torch_attention)

logger = logging.getLogger("attnforge")


class Samples(list):
    """The distinct SDPA calls of a recorded run: a list of (args, kwargs) pairs (the seed's Sample), first
    seen first, with how often each was seen in `counts`."""

    def __init__(self, samples=(), counts=None):
        super().__init__(samples)
        self.counts = list(counts) if counts is not None else [1] * len(self)

    def to_json(self) -> str:
        """The samples file's JSON (docs/FORMATS.md)."""
        return samples_to_json(self, self.counts)

    def save(self, path) -> None:
        """Write the samples file, e.g. for `attnforge plan --samples PATH`."""
        save_samples(self, path, self.counts)


def _sdpa_function():
    return getattr(F, SUPPORTED_FUNCTION)


def _set_sdpa_function(function):
    setattr(F, SUPPORTED_FUNCTION, function)


@contextlib.contextmanager
def _patched(function):
    """F.scaled_dot_product_attention is `function` inside; PyTorch's own again after, also on exceptions."""
    previous = _sdpa_function()
    _set_sdpa_function(function)
    try:
        yield previous
    finally:
        _set_sdpa_function(previous)


def record(module, *inputs, **kwargs) -> Samples:
    """Run module(*inputs, **kwargs) once under torch.no_grad() and return the distinct
    F.scaled_dot_product_attention calls it made, each tensor with its device ("cpu", "cuda:0": samples recorded
    on CUDA give a cuda plan). Calls are the same when their tensors have the same shape, dtype, strides and
    device and their other arguments are equal (the seed compares shapes and values only; attnforge also keeps
    layouts apart, since they decide the copy-free path). Tensors of the first call seen are kept, as in the
    seed."""
    seen = {}
    samples, counts = [], []
    original = _sdpa_function()

    @functools.wraps(original)
    def recorder(*args, **call_kwargs):
        key = json.dumps(sample_entry(args, call_kwargs), sort_keys=True)
        if key in seen:
            counts[seen[key]] += 1
        else:
            seen[key] = len(samples)
            samples.append((args, dict(call_kwargs)))
            counts.append(1)
        return original(*args, **call_kwargs)

    with torch.no_grad(), _patched(recorder):
        module(*inputs, **kwargs)
    return Samples(samples, counts)


def _as_provider(provider_or_plan) -> FlashAttention4KernelProvider:
    if isinstance(provider_or_plan, FlashAttention4KernelProvider):
        return provider_or_plan
    if isinstance(provider_or_plan, dict):
        return FlashAttention4KernelProvider.from_dict(provider_or_plan)
    if isinstance(provider_or_plan, (str, bytes, os.PathLike)):
        return FlashAttention4KernelProvider.load(provider_or_plan)
    raise TypeError("apply(): expected a FlashAttention4KernelProvider, a plan dict or a plan file path, got "
                    f"{type(provider_or_plan).__name__}")


# Calls attnforge cannot run after all (a CUDA call on the general path where attnforge's CUDA backend is missing, an
# argument PyTorch accepts and attnforge's checks do not) go to PyTorch in eager mode; PyTorch then also raises for
# calls that are invalid for SDPA itself. Traced code has decided from metadata before (attnforge._guard).
_FALLBACK_ERRORS = (_C.InvalidArgumentError, _C.UnsupportedError, _C.PlanMismatchError, _C.RuntimeUnavailableError,
                    TypeError)


def _dispatcher(previous, active):
    """F.scaled_dot_product_attention while apply() is in force: inside the module's forward (active holds its plan)
    the guarded call, anywhere else the function that was there before. Plain Python over metadata and
    torch.ops.attnforge operators, so torch.compile(fullgraph=True) and torch.export trace it without a break."""
    def scaled_dot_product_attention(*args, **kwargs):
        if not active:
            return previous(*args, **kwargs)
        view, uncovered = active[-1]
        if torch.compiler.is_compiling():
            return _ops.guarded_call(view, args, kwargs, fallback=previous, uncovered=uncovered)
        try:
            return _ops.guarded_call(view, args, kwargs, fallback=previous, uncovered=uncovered)
        except _FALLBACK_ERRORS as e:
            logger.debug("attnforge does not run this call (%s); using PyTorch's scaled_dot_product_attention", e)
            return previous(*args, **kwargs)

    scaled_dot_product_attention.__name__ = scaled_dot_product_attention.__qualname__ = SUPPORTED_FUNCTION
    return scaled_dot_product_attention


@contextlib.contextmanager
def apply(module, provider_or_plan, uncovered="pytorch"):
    """Inside the block, module's F.scaled_dot_product_attention calls run on attnforge's provider while the
    module runs (forward hooks mark when it runs, as the seed's KernelProviderRuntime); PyTorch's function is back
    after the block, also on exceptions.

    Calls the plan does not cover (the per-call guard decides: device, form, mask, causality, scale, GQA, layout)
    go to PyTorch's own SDPA; with uncovered="attnforge" they run on attnforge's general path with their own
    arguments instead. Calls attnforge cannot run at all (dropout, float64, CUDA calls that need gradients, ...) go to
    PyTorch. Calls that need gradients on the CPU run on attnforge, forward and backward.

    torch.compile and torch.export trace through it: the guard decides from metadata at trace time, a covered call
    becomes torch.ops.attnforge.provider_sdpa in the graph (carrying the plan), an uncovered one PyTorch's SDPA (or
    torch.ops.attnforge.sdpa), with no graph break. Compile inside the block; a graph compiled there keeps attnforge
    while it is in force (Dynamo guards on the function it traced and recompiles after the block).

    A cuda plan (recorded on CUDA tensors) runs the module's CUDA calls on attnforge's CUDA kernels, on any one
    CUDA device, enqueued on PyTorch's current stream; its CPU calls are not covered. A cpu plan does not cover
    CUDA calls. The plan's backend is loaded on entry: a cuda plan raises RuntimeUnavailableError here, not in
    the forward pass, where attnforge's CUDA backend, a driver or a GPU is missing. An fa4 plan runs the calls it
    covers on FlashAttention-4 itself and imports flash_attn.cute on entry (RuntimeUnavailableError where it is
    missing); calls it does not cover go to PyTorch as above.

    provider_or_plan: a prepared FlashAttention4KernelProvider, a plan dict (to_dict()) or a plan file path.
    Like the seed, this patches a process-wide function (not thread-safe) and only reaches code that looks up
    F.scaled_dot_product_attention when it calls it."""
    if uncovered not in ("pytorch", "attnforge"):
        raise ValueError(f'apply(): uncovered must be "pytorch" or "attnforge", got {uncovered!r}')
    provider = _as_provider(provider_or_plan)
    if not provider.is_prepared:
        raise _C.NotPreparedError(f"Kernel provider {provider.name} must be prepared before it is applied")
    provider.load_runtime_dependencies()   # raises now rather than inside the forward pass
    entry = (_ops.plan_view(provider), uncovered)
    active = []

    def before_forward(mod, inputs):
        active.append(entry)

    def after_forward(mod, inputs, output):
        if active:
            active.pop()

    pre = module.register_forward_pre_hook(before_forward)
    post = module.register_forward_hook(after_forward, always_call=True)
    previous = _sdpa_function()
    _set_sdpa_function(_dispatcher(previous, active))
    try:
        yield provider
    finally:
        pre.remove()
        post.remove()
        _set_sdpa_function(previous)
