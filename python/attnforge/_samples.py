"""(args, kwargs) of recorded SDPA calls → the samples file's JSON (docs/FORMATS.md). Only descriptions:
tensors become {"shape", "dtype", "strides", "device"}; every rule about them lives in the C library."""
import json
import math
import numbers
import os

from . import _C


def _tensor_description(x):
    """A torch.Tensor or NumPy array as the samples file describes it, or None for anything else."""
    stride = getattr(x, "stride", None)
    if callable(stride) and hasattr(x, "shape") and hasattr(x, "dtype"):   # torch.Tensor
        dtype = str(x.dtype)
        return {"shape": list(x.shape), "dtype": dtype[len("torch."):] if dtype.startswith("torch.") else dtype,
                "strides": list(stride()), "device": str(x.device)}
    if hasattr(x, "__array_interface__") and hasattr(x, "strides") and hasattr(x, "itemsize"):   # NumPy
        itemsize = x.itemsize or 1
        return {"shape": list(x.shape), "dtype": x.dtype.name,
                "strides": [s // itemsize for s in x.strides], "device": "cpu"}
    return None


def describe(value):
    """One argument as a JSON value: tensors described, None/bool/numbers/strings as they are, lists as
    lists; any other object by its repr, as a string (so prepare refuses it by name instead of crashing)."""
    tensor = _tensor_description(value)
    if tensor is not None:
        return tensor
    if value is None or isinstance(value, (bool, str)):
        return value
    if getattr(value, "shape", None) == () and getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)   # numpy.bool_
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else repr(number)   # JSON has no NaN/Inf
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return repr(value)


def sample_entry(args, kwargs, count=1):
    return {"args": [describe(a) for a in args], "kwargs": {str(k): describe(v) for k, v in kwargs.items()},
            "count": int(count)}


def _entries(samples, counts=None):
    """Samples as (args, kwargs) pairs (the seed's Sample), optionally with a parallel list of counts."""
    counts = counts if counts is not None else getattr(samples, "counts", None)
    entries = []
    for i, sample in enumerate(samples):
        try:
            args, kwargs = sample
        except (TypeError, ValueError):
            raise TypeError(f"samples[{i}]: expected an (args, kwargs) pair, got {type(sample).__name__}") from None
        entries.append(sample_entry(tuple(args), dict(kwargs), counts[i] if counts is not None else 1))
    return entries


def samples_to_json(samples, counts=None) -> str:
    """The samples file's JSON text for a list of (args, kwargs) samples, as the C library reads it."""
    return json.dumps({"samples": _entries(samples, counts)})


def save_samples(samples, path, counts=None) -> None:
    """Write the samples file (checked and written in the C library's own form, so `attnforge plan` reads it)."""
    text = _C.samples_json(samples_to_json(samples, counts))
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        f.write(text)
        f.write("\n")


def load_samples(path) -> dict:
    """A samples file, read and checked by the C library, as a dict (descriptions; no tensors)."""
    return json.loads(_C.load_samples(path))
