"""The provider's "fa4" backend: FlashAttention-4 itself (`flash_attn.cute.flash_attn_func`), behind attnforge's plan,
JSON and per-call guard. What is FA4's own lives here: which samples and calls it computes with SDPA's meaning, loading
it lazily as the seed does, and the call (HND -> NHD, flash_kwargs, its (out, lse) tuple, NHD -> HND).
docs/PROVIDER.md ("Backends fa4 and auto") gives the rules and why."""
import functools
import importlib
import importlib.metadata
import logging
import sys

from . import _C

logger = logging.getLogger("attnforge")

# The seed's texts, verbatim.
RUNTIME_UNAVAILABLE_MESSAGE = "FlashAttention-4 is not available. Install it with `pip install --pre flash-attn-4`."
COPY_WARNING = ("FlashAttention-4 must copy query, key, and value tensors from HND to NHD layout on every call; "
                "this may reduce performance. Use HND views of NHD-contiguous tensors to enable the copy-free path.")

FA4_DTYPES = ("float16", "bfloat16")
FA4_ARCHES = (9, 10, 11)          # Hopper and Blackwell: the compute capabilities FA4's forward is written for
HEAD_DIM_ALIGNMENT = 8            # 16 bytes of float16/bfloat16
WINDOW_HEAD_DIM_MAX = 128         # the head dims whose FA4 kernels have always had local (windowed) masks
POINTER_ALIGNMENT = 16            # bytes: FA4 reads q/k/v with 16-byte (TMA / cp.async) loads


class _Testing:
    """Private test hook (python/tests/test_fa4_backend.py), never set outside tests. There is no GPU on the machines
    that run the tests, so they inject a stand-in flash_attn.cute and set:
    cpu_as_cuda: tensor -> an object whose DLPack export describes that tensor on cuda:0 (descriptors only; the C
        guard never reads data); while set, the fa4 path takes CPU tensors as tensors on cuda:0;
    capability: the (major, minor) compute capability every CUDA device is taken to have."""
    cpu_as_cuda = None
    capability = None


testing = _Testing()


# ---------------------------------------------------------------- runtime loading (the seed's rules)

@functools.lru_cache(maxsize=None)
def import_flash_attention4():
    """flash_attn.cute, imported once per process; None when it cannot be imported (also cached, as in the seed)."""
    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError:
        return None


def flash_attn_func():
    """FA4's flash_attn_func; RuntimeUnavailableError (a RuntimeError) with the seed's message when it is missing."""
    module = import_flash_attention4()
    function = getattr(module, "flash_attn_func", None) if module is not None else None
    if not callable(function):
        raise _C.RuntimeUnavailableError(RUNTIME_UNAVAILABLE_MESSAGE)
    return function


def version() -> str:
    """The seed's lookup: "v<__version__>" (unless "0.0.0"), else the flash-attn-4 or fa4 package's version, else
    "unknown version"; "cannot be imported" when flash_attn.cute does not import."""
    module = import_flash_attention4()
    if module is None:
        return "cannot be imported"
    declared = getattr(module, "__version__", None)
    if declared and declared != "0.0.0":
        return f"v{declared}"
    for package in ("flash-attn-4", "fa4"):
        try:
            return f"v{importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


# ---------------------------------------------------------------- what FA4 computes with SDPA's meaning

def _torch():
    return sys.modules.get("torch")   # FA4 imports torch; the routing never imports it for a NumPy user


@functools.lru_cache(maxsize=None)
def _device_capability(index: int):
    torch = _torch()
    if torch is None or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return tuple(torch.cuda.get_device_capability(index))


def capability(device: str):
    """(major, minor) of a CUDA device named like "cuda:1"; None where this process cannot ask (no GPU here)."""
    if testing.capability is not None:
        return tuple(testing.capability)
    _, _, index = device.partition(":")
    return _device_capability(int(index) if index.isdigit() else 0)


def _head_dims_refusal(e, ev, arch):
    aligned = e % HEAD_DIM_ALIGNMENT == 0 and ev % HEAD_DIM_ALIGNMENT == 0
    if arch == 9:
        if aligned and 8 <= e <= 256 and 8 <= ev <= 256:
            return None
        return "FlashAttention-4 on compute capability 9.x takes head dims from 8 to 256 in multiples of 8"
    if (aligned and 8 <= e <= 128 and 8 <= ev <= 128) or (e, ev) in ((192, 128), (256, 256)):
        return None
    where = "compute capability 10.x and 11.x" if arch is not None else "a GPU of unknown compute capability"
    return (f"FlashAttention-4 on {where} takes head dims (E, Ev) from 8 to 128 in multiples of 8, (192, 128) or "
            "(256, 256)")


def refusals(dtype, device, q_shape, k_shape, v_shape, causal, arch_capability):
    """Why FA4 cannot compute this SDPA call with SDPA's meaning: [(rule, detail), ...], [] when it can. The call is
    one the C plan accepted (4-D, one CUDA device, q/k/v of one dtype, no mask, no dropout, valid GQA)."""
    found = []
    b, hq, seq_q, e = q_shape
    s, ev = k_shape[2], v_shape[3]
    if dtype not in FA4_DTYPES:
        found.append(("FlashAttention-4 computes float16 and bfloat16 only", f"query is {dtype}"))
    arch = arch_capability[0] if arch_capability is not None else None
    if arch is not None and arch not in FA4_ARCHES:
        found.append(("FlashAttention-4 runs on compute capability 9.x, 10.x and 11.x only",
                      f"{device} is {arch_capability[0]}.{arch_capability[1]}"))
    head_dims = _head_dims_refusal(e, ev, arch)
    if head_dims:
        found.append((head_dims, f"E {e}, Ev {ev}"))
    if min(b, hq, seq_q, s) == 0:   # attnforge's own kernels define every empty case exactly
        found.append(("FlashAttention-4 is not given empty tensors", f"B {b}, Hq {hq}, L {seq_q}, S {s}"))
    if causal and seq_q != s and max(e, ev) > WINDOW_HEAD_DIM_MAX:
        found.append(("FlashAttention-4's causal mask is bottom-right aligned; attnforge gives it SDPA's top-left "
                      f"mask for L != S through window_size, with head dims up to {WINDOW_HEAD_DIM_MAX} only",
                      f"L {seq_q}, S {s}, E {e}, Ev {ev}"))
    return found


def _sample_qkv(entry):
    args, kwargs = entry["args"], entry["kwargs"]
    return tuple(args[:3]) if len(args) == 3 else (kwargs["query"], kwargs["key"], kwargs["value"])


def sample_refusals(entries):
    """Why FA4 cannot take the samples (entries of the samples file, which the C plan accepted): a list of reasons in
    the C library's style, "<rule> (samples[i]: <detail>)", one per sample and rule."""
    found = []
    for i, entry in enumerate(entries):
        q, k, v = _sample_qkv(entry)
        device = q.get("device", "cpu")
        if not device.startswith("cuda"):
            found.append(f"FlashAttention-4 runs on CUDA tensors only (samples[{i}]: query is on '{device}')")
            continue
        causal = bool(entry["kwargs"].get("is_causal", False))
        for rule, detail in refusals(q["dtype"], device, q["shape"], k["shape"], v["shape"], causal,
                                     capability(device)):
            found.append(f"{rule} (samples[{i}]: {detail})")
    return found


def is_on_cuda(tensor) -> bool:
    """A CUDA torch tensor, or (under the testing hook) a CPU one standing in for it."""
    torch = _torch()
    if torch is None or not isinstance(tensor, torch.Tensor):
        return False
    return tensor.device.type == "cuda" or (testing.cpu_as_cuda is not None and tensor.device.type == "cpu")


def call_refusal(q, k, v, causal):
    """Why FA4 cannot compute this call (which the C guard found covered by the plan) with SDPA's meaning; None when
    it can."""
    if not all(is_on_cuda(t) for t in (q, k, v)):
        return "FlashAttention-4 runs on CUDA torch tensors only"
    device = f"cuda:{q.device.index or 0}"
    dtype = str(q.dtype).replace("torch.", "")
    found = refusals(dtype, device, tuple(q.shape), tuple(k.shape), tuple(v.shape), causal, capability(device))
    return "; ".join(f"{rule} ({detail})" for rule, detail in found) or None


# ---------------------------------------------------------------- the call

def flash_kwargs(plan_kwargs: dict, seq_q: int, seq_k: int) -> dict:
    """FA4's keyword arguments for a call of L = seq_q queries and S = seq_k keys under the plan's flash_kwargs (SDPA's
    meaning). The seed's causal, softmax_scale and pack_gqa; SDPA's top-left causal mask is FA4's bottom-right one when
    L == S, and otherwise window_size=(None, L - S): FA4 lets row i see keys j <= i + (S - L) + right, i.e. j <= i."""
    causal = bool(plan_kwargs.get("causal", False))
    kwargs = {"causal": causal and seq_q == seq_k}
    if "softmax_scale" in plan_kwargs:
        kwargs["softmax_scale"] = float(plan_kwargs["softmax_scale"])
    if "pack_gqa" in plan_kwargs:
        kwargs["pack_gqa"] = False
    if causal and seq_q != seq_k:
        kwargs["window_size"] = (None, seq_q - seq_k)
    return kwargs


def to_nhd(tensors, copy_free: bool):
    """The seed's HND -> NHD: views of NHD-contiguous memory (copy-free plan), else .contiguous() copies (which copy
    only a tensor that is not NHD-contiguous already)."""
    if copy_free:
        return tuple(t.transpose(1, 2) for t in tensors)
    return tuple(t.transpose(1, 2).contiguous() for t in tensors)


def misaligned(nhd_tensors):
    """The name of the first NHD tensor FA4 would be handed at an address that is not 16-byte aligned, else None."""
    for name, t in zip(("query", "key", "value"), nhd_tensors):
        if t.data_ptr() % POINTER_ALIGNMENT:
            return name
    return None


def run(function, nhd_tensors, kwargs, return_lse=False):
    """FA4 on NHD q/k/v: out as an HND view (B, Hq, L, Ev) of FA4's NHD output, and its float32 (B, Hq, L) lse when
    asked for. FA4's flash_attn_func returns (out, lse); an older one returned out alone."""
    if return_lse:
        kwargs = dict(kwargs, return_lse=True)
    result = function(*nhd_tensors, **kwargs)
    out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    return out.transpose(1, 2), lse
