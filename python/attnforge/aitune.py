"""attnforge as a kernel provider of NVIDIA AITune (aitune==0.6.0, `aitune.torch.kernel_forge`).

    from attnforge.aitune import AttnforgeKernelProvider
    optimizer = KernelOptimizer(kernel_providers=[AttnforgeKernelProvider(), ...])
    config = KernelSelectorBackendConfig(kernel_providers=[*_default_kernel_providers(), AttnforgeKernelProvider()])

AttnforgeKernelProvider is a subclass of AITune's own KernelProvider replacing scaled_dot_product_attention. It
accepts every SDPA call attnforge computes exactly (masks, causal with L != S, GQA/MQA, scale, any strides,
float32/float16/bfloat16, CPU and CUDA) and refuses the rest with False and a DEBUG line on "attnforge.aitune".
Calls run through attnforge's PyTorch operators (attnforge._ops), so a compiled delegate keeps them in its graph.

AITune is imported when AttnforgeKernelProvider is first used, not when attnforge (or this module) is imported.
Where `import aitune.torch` fails because one of AITune's optional backends (TensorRT, ONNX Runtime, ...) is not
installed, load_aitune(kernel_forge_only=True) imports its kernel_forge package alone (docs/AITUNE.md).
"""
import importlib
import logging
import os
import sys
import types

import torch

from . import _C, _ops   # _ops registers torch.ops.attnforge.* now, before any graph capture
from .provider import SUPPORTED_FUNCTION, FlashAttention4KernelProvider

PLAN_VERSION = 1   # the format of AttnforgeKernelProvider.to_dict(); from_dict reads this version and older
PYPI_HINT = "pip install aitune"
_KERNEL_PROVIDER_MODULE = "aitune.torch.kernel_forge.kernel_provider"
# AITune's package __init__ files that import every backend (TensorRT, Torch-TensorRT, ONNX Runtime, ModelOpt);
# kernel_forge itself needs none of them.
_BACKEND_IMPORTING_PACKAGES = ("aitune.torch", "aitune.torch.module", "aitune.torch.backend")
_BACKENDS = ("cpu", "cuda")
_PLAN_KEYS = {"type", "version", "attnforge_version", "backends", "plan"}

logger = logging.getLogger("attnforge.aitune")


# ---- loading AITune
def load_aitune(kernel_forge_only: bool = False) -> types.ModuleType:
    """AITune's aitune.torch.kernel_forge.kernel_provider module, imported the normal way.

    kernel_forge_only=True: where that import fails (an ImportError: `aitune.torch`'s package __init__ imports
    TensorRT and every other backend, which may not be installed), enter the three package __init__s that import
    backends (aitune.torch, aitune.torch.module, aitune.torch.backend) into sys.modules as plain packages over
    AITune's real folders, then import kernel_forge from them. AITune's own kernel_forge code runs as it is;
    what those __init__s export (aitune.torch.tune, the backends' classes) is then not available in this process.
    Where the normal import works, kernel_forge_only changes nothing."""
    loaded = set(sys.modules)
    try:
        return importlib.import_module(_KERNEL_PROVIDER_MODULE)
    except ImportError as error:
        _forget_half_imported(loaded)
        if _aitune_missing(error):
            raise ImportError(f"attnforge.aitune needs NVIDIA AITune (aitune 0.6.0): {PYPI_HINT}") from error
        if not kernel_forge_only:
            raise ImportError(
                f"attnforge.aitune: `import {_KERNEL_PROVIDER_MODULE}` failed ({error}): AITune's package "
                f"aitune.torch imports all its backends (TensorRT, Torch-TensorRT, ONNX Runtime, ModelOpt); install "
                f"them ({PYPI_HINT}), or, to use AITune's kernel_forge alone, call "
                f"attnforge.aitune.load_aitune(kernel_forge_only=True) first") from error
        return _import_kernel_forge_alone(error)


def _forget_half_imported(loaded) -> None:
    """A failed `import aitune.torch...` leaves the submodules it got through in sys.modules without their package;
    drop them, so that a retry imports (and fails) the same way and kernel_forge_only loads them afresh."""
    for name in [n for n in sys.modules if n.startswith("aitune.") and n not in loaded]:
        del sys.modules[name]


def _aitune_missing(error: ImportError) -> bool:
    return isinstance(error, ModuleNotFoundError) and error.name == "aitune"


def _import_kernel_forge_alone(first_error: ImportError) -> types.ModuleType:
    """Import kernel_forge with the backend-importing package __init__s replaced by plain packages; on failure
    restore sys.modules as it was and say what kernel_forge itself lacks."""
    aitune = importlib.import_module("aitune")
    root = os.path.dirname(aitune.__file__)
    entered = [name for name in _BACKEND_IMPORTING_PACKAGES if name not in sys.modules]
    for name in entered:
        _enter_plain_package(name, root)
    try:
        module = importlib.import_module(_KERNEL_PROVIDER_MODULE)
    except ImportError as error:
        for name in reversed(entered):
            _remove_plain_package(name)
        raise ImportError(f"attnforge.aitune: AITune's kernel_forge cannot be imported even without "
                          f"aitune.torch's package __init__ ({first_error}): {error}") from error
    logger.debug("AITune's kernel_forge imported without the package __init__s of %s (%s)",
                 ", ".join(entered), first_error)
    return module


def _enter_plain_package(name: str, root: str) -> None:
    """A package object for `name` over AITune's real folder, without running its __init__.py."""
    package = types.ModuleType(name, f"{name}: AITune's folder, loaded by attnforge.aitune without its __init__ "
                                     f"(load_aitune(kernel_forge_only=True))")
    package.__path__ = [os.path.join(root, *name.split(".")[1:])]
    package.__package__ = name
    package.__attnforge_kernel_forge_only__ = True
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, package)


def _remove_plain_package(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
        delattr(sys.modules[parent], child)


def __getattr__(name):
    """AttnforgeKernelProvider is made on first use: AITune's KernelProvider must be importable by then."""
    if name == "AttnforgeKernelProvider":
        cls = _provider_class(load_aitune())
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _provider_class(kernel_provider_module):
    """AITune registers providers by class name when the class is made; made once per process."""
    cls = type("AttnforgeKernelProvider", (_AttnforgeProvider, kernel_provider_module.KernelProvider),
               {"__module__": __name__, "__qualname__": "AttnforgeKernelProvider",
                "__doc__": _AttnforgeProvider.__doc__})
    return cls


# ---- the provider
def _query(args, kwargs):
    return args[0] if args else kwargs.get("query")


def _sample_backends(samples) -> tuple:
    """Where the samples' calls run: ("cpu",), ("cuda",) or both, from each query's device."""
    found = {"cpu" if _query(args, kwargs).device.type == "cpu" else "cuda" for args, kwargs in samples}
    return tuple(b for b in _BACKENDS if b in found)


def _minimal_plan(backend: str) -> dict:
    """The smallest attnforge plan for a backend: loading it loads that backend and nothing else."""
    return {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
            "flash_kwargs": {"causal": False}, "copy_free_layout": False, "backend": backend}


class _AttnforgeProvider:
    """AITune kernel provider for scaled_dot_product_attention on attnforge's kernels (CPU and CUDA).

    prepare(samples) accepts every call attnforge computes exactly and builds attnforge's C plan from the samples;
    where the C plan cannot serve them (a mask, samples that differ in causality or scale, ...) every call runs on
    attnforge's general path with its own arguments. Calls run through attnforge's PyTorch operators: covered ones
    on the plan, uncovered ones on the general path, ones attnforge cannot compute on PyTorch's SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self._provider = None   # attnforge's FlashAttention4KernelProvider holding the C plan, or None
        self._view = None       # what the per-call guard reads of that plan, made outside any traced code
        self._backends = ()     # "cpu"/"cuda": where the samples' calls run (the general path loads these)

    # ---- identity
    @property
    def supported_function(self) -> str:
        return SUPPORTED_FUNCTION

    @property
    def name(self) -> str:
        """attnforge's version and where it runs: before prepare "attnforge 0.1.0 (cpu: avx512, cuda)" (the
        samples' device decides), then "attnforge 0.1.0 (cpu plan, avx512)", "... (cuda plan)", or
        "... (general path on cpu, avx512)" where the C plan does not serve the samples."""
        return f"attnforge {_C.__version__} ({self._route()})"

    def _route(self) -> str:
        isa = _C.get_isa()
        if self._provider is not None:
            backend = self._provider.plan_backend
            return f"{backend} plan, {isa}" if backend == "cpu" else f"{backend} plan"
        if self._backends:
            where = "+".join(self._backends)
            return f"general path on {where}, {isa}" if "cpu" in self._backends else f"general path on {where}"
        return f"cpu: {isa}, cuda"

    @property
    def attnforge_provider(self):
        """attnforge's FlashAttention4KernelProvider with the C plan the samples gave, or None (general path)."""
        return self._provider

    # ---- prepare
    def _prepare(self, samples) -> bool:
        samples = list(samples)
        if not samples:
            logger.debug("attnforge not supported due to: no representative samples")
            return False
        for i, (args, kwargs) in enumerate(samples):
            why = _ops.refusal(args, kwargs)
            if why is not None:
                logger.debug("attnforge not supported due to: samples[%d]: %s", i, why)
                return False
        self._backends = _sample_backends(samples)
        self._set_plan(self._c_plan(samples))
        return True

    def _set_plan(self, provider) -> None:
        self._provider = provider
        self._view = _ops.plan_view(provider)

    @staticmethod
    def _c_plan(samples):
        """attnforge's C plan for the samples, or None where it cannot serve them all (every sample is one
        attnforge computes, so the general path runs them)."""
        provider = FlashAttention4KernelProvider(backend="attnforge")
        if provider.prepare(samples):
            logger.debug("attnforge plans these samples: %s", provider.to_json())
            return provider
        logger.debug("attnforge's plan does not cover these samples (%s); every call runs on attnforge's general "
                     "path with its own arguments", provider.reason)
        return None

    # ---- inference
    def _infer(self, *args, **kwargs):
        # PyTorch's builtin, not F.scaled_dot_product_attention: the runtime has patched that to this provider
        return _ops.guarded_call(self._view, args, kwargs, fallback=torch._C._nn.scaled_dot_product_attention,
                                 uncovered="attnforge")

    def _load_runtime_dependencies(self) -> None:
        """Load the backends the samples run on (CPU, CUDA) before graph capture, not inside it;
        RuntimeUnavailableError where the CUDA backend is missing (AITune calls this when it applies a plan)."""
        if self._provider is not None:
            self._provider.load_runtime_dependencies()
        planned = self._provider.plan_backend if self._provider is not None else None
        for backend in self._backends:
            if backend != planned:
                FlashAttention4KernelProvider.from_dict(_minimal_plan(backend)).load_runtime_dependencies()

    # ---- serialization
    def _to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "attnforge_version": _C.__version__, "backends": list(self._backends),
                "plan": self._provider.to_dict() if self._provider is not None else None}

    @classmethod
    def _from_dict(cls, state_dict: dict):
        _check_plan_fields(state_dict)
        provider = cls()
        provider._backends = tuple(state_dict["backends"])
        plan = state_dict["plan"]
        if plan is not None:
            planned = FlashAttention4KernelProvider.from_dict(plan)   # the C library checks each field
            if planned.plan_backend not in provider._backends:
                raise ValueError(f"AttnforgeKernelProvider.from_dict: plan.backend {planned.plan_backend!r} is not "
                                 f"one of backends {list(provider._backends)}")
            provider._set_plan(planned)
        return provider


def _check_plan_fields(state: dict) -> None:
    """The provider's own fields, each named where it is wrong (the C plan inside is checked by the C library)."""
    where = "AttnforgeKernelProvider.from_dict"
    if not isinstance(state, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state).__name__}")
    unknown = sorted(set(state) - _PLAN_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}")
    missing = sorted(_PLAN_KEYS - {"type"} - set(state))
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: version must be a positive integer, got {version!r}")
    if version > PLAN_VERSION:
        raise ValueError(f"{where}: version {version} is newer than this attnforge ({_C.__version__}) reads "
                         f"({PLAN_VERSION}); upgrade attnforge")
    if not isinstance(state["attnforge_version"], str):
        raise ValueError(f"{where}: attnforge_version must be a string, got {state['attnforge_version']!r}")
    backends = state["backends"]
    if not isinstance(backends, list) or not backends or any(b not in _BACKENDS for b in backends):
        raise ValueError(f"{where}: backends must be a non-empty list of 'cpu' and 'cuda', got {backends!r}")
    if state["plan"] is not None and not isinstance(state["plan"], dict):
        raise ValueError(f"{where}: plan must be attnforge's plan (a dict) or None, got "
                         f"{type(state['plan']).__name__}")
