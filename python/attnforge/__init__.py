"""attnforge: exact scaled-dot-product attention (PyTorch semantics) with a FlashAttention-4-style CPU kernel.

The work is done by the C library (attnforge._C, built from the same sources as libattnforge); this package
only turns Python calls into C calls:

- scaled_dot_product_attention(...): one call, like torch.nn.functional.scaled_dot_product_attention;
- flash_attn_func / flash_attn_varlen_func: FlashAttention-4's forward API (windows, softcap, sinks, varlen, paged);
- FlashAttention4KernelProvider: the seed's provider API (prepare / call / to_dict / from_dict);
- attnforge.torch: record a module's SDPA calls and apply a plan to it (imports torch);
- attnforge.torch_attention: "attnforge" as PyTorch's flash attention, forward and backward
  (torch.nn.attention.activate_flash_attention_impl("attnforge"));
- attnforge.transformers: register() adds attn_implementation="attnforge" to Hugging Face Transformers.
"""
import atexit as _atexit
import contextlib as _contextlib
import logging as _logging

from . import _C, _register
from . import _host_threads
from ._C import (
    Error,
    FileError,
    InternalError,
    InvalidArgumentError,
    NotPreparedError,
    ParseError,
    PlanMismatchError,
    RuntimeUnavailableError,
    UnsupportedError,
)
from ._flash import flash_attn_func, flash_attn_varlen_func
from ._sdpa import scaled_dot_product_attention, scaled_dot_product_attention_reference
from ._samples import load_samples, samples_to_json, save_samples
from .provider import SUPPORTED_FUNCTION, FlashAttention4KernelProvider

__version__ = _C.__version__

# torch.ops.attnforge.* exist as soon as torch is imported too (torch.export.load needs them)
_register.register_operators()

# ... and "attnforge" is in torch.nn.attention's flash-attention registry (nothing is overridden until
# torch.nn.attention.activate_flash_attention_impl("attnforge"): attnforge.torch_attention)
_register.register_attention_impl()

# Once torch is imported (before or after attnforge), attnforge's parallel work runs on torch's OpenMP threads
_host_threads.install()

# Silent by default, like the C library: the embedding program configures the "attnforge" logger.
_logging.getLogger("attnforge").addHandler(_logging.NullHandler())
# The C log callback calls into Python; detach it before the interpreter goes away.
_atexit.register(_C._shutdown)


def set_num_threads(n: int) -> None:
    """Threads one call uses; 0 = all cores (the default).
    On torch's OpenMP threads (set_host_threads), 0 = torch.get_num_threads() on the calling thread."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """Threads one call will use."""
    return _C.get_num_threads()


def set_host_threads(enabled: bool) -> None:
    """True (the default; ATTNFORGE_HOST_THREADS=0 makes it False): once torch is imported, and where it runs its
    operators on GNU OpenMP (its CPU wheels' torch/lib/libgomp.so.1), attnforge's parallel work runs on torch's
    OpenMP threads, torch.get_num_threads() of them unless set_num_threads chose a count, instead of attnforge's own
    thread pool, which would wait for the cores torch's spinning threads hold. False: attnforge's own pool."""
    _host_threads.set_host_threads(enabled)


def get_host_threads():
    """Path of the OpenMP runtime whose threads run attnforge's parallel work, or None: attnforge's own pool."""
    return _host_threads.get_host_threads()


def set_isa(name: str) -> None:
    """Kernel ISA: "portable", "avx2", "avx512" or "amx" (UnsupportedError when this machine lacks it)."""
    _C.set_isa(name)


def get_isa() -> str:
    """The ISA the kernels use now."""
    return _C.get_isa()


def isa_available(name: str) -> bool:
    """Whether this machine (CPU and OS) can run the ISA."""
    return _C.isa_available(name)


def __getattr__(name):
    """attnforge.flex_attention / create_block_mask / flex, imported on first use (they need torch; attnforge itself
    does not)."""
    if name in ("flex", "flex_attention", "create_block_mask"):
        import importlib   # not "from . import flex": that asks this function for the attribute again
        _flex = importlib.import_module(".flex", __name__)
        return _flex if name == "flex" else getattr(_flex, name)
    raise AttributeError(f"module 'attnforge' has no attribute {name!r}")


def set_phase_invariant(on: bool) -> None:
    """True: a decoded token's output and lse are bit for bit those of the same row inside a prefill or chunked
    prefill (every row runs on the tile products; decode takes longer, docs/API.md "Invariance"). False (the default,
    or ATTNFORGE_PHASE_INVARIANT=1 for True): decode steps read K/V in place, within the error bound of the prefill's
    row. Either way a row's bits never depend on its K/V layout, its batch or the thread count. Process-wide."""
    _C.set_phase_invariant(bool(on))


def get_phase_invariant() -> bool:
    """Whether decode rows run on the prefill's arithmetic (set_phase_invariant)."""
    return _C.get_phase_invariant()


@_contextlib.contextmanager
def phase_invariant(on: bool = True):
    """set_phase_invariant(on) inside the block, the previous setting after it."""
    before = get_phase_invariant()
    set_phase_invariant(on)
    try:
        yield
    finally:
        set_phase_invariant(before)


def cuda_check_errors(device=0) -> None:
    """Raise InvalidArgumentError for the first bad cu_seqlens / seqused_k / page_table entry that flash_attn calls on
    CUDA device `device` (an int or a torch.device) met since the last check, and clear the record; None when there
    was none. On CUDA those arrays are checked on the device so that calls stay asynchronous and capturable: a bad
    entry gives its sequence's rows NaN (docs/CUDA.md). This waits for the device's work; not during graph capture."""
    index = getattr(device, "index", device)
    _C.cuda_check_errors(0 if index is None else index)


def isas() -> list:
    """The ISAs compiled into this build, from "portable" up; isa_available says which run here."""
    return _C.isas()


__all__ = [
    "Error", "FileError", "InternalError", "InvalidArgumentError", "NotPreparedError", "ParseError",
    "PlanMismatchError", "RuntimeUnavailableError", "UnsupportedError",
    "FlashAttention4KernelProvider", "SUPPORTED_FUNCTION",
    "scaled_dot_product_attention", "scaled_dot_product_attention_reference",
    "flash_attn_func", "flash_attn_varlen_func",
    "samples_to_json", "save_samples", "load_samples",
    "set_num_threads", "get_num_threads", "set_isa", "get_isa", "isa_available", "isas", "cuda_check_errors",
    "set_host_threads", "get_host_threads", "set_phase_invariant", "get_phase_invariant", "phase_invariant",
    "__version__",
]
