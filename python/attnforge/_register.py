"""attnforge's PyTorch operators are registered whenever torch and attnforge are both imported, in either order,
without attnforge importing torch itself (the NumPy tier runs without it): so torch.export.load finds
torch.ops.attnforge.* in any process that imported attnforge."""
import importlib.abc
import importlib.util
import sys


def _register_now():
    from . import _ops  # noqa: F401  (defining the operators registers them)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch is first imported, wraps its loader so the operators register once torch
    has finished importing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)   # one-shot, and the lookup below must not find this finder again
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_torch = spec.loader.exec_module

        def exec_module(module):
            exec_torch(module)
            _register_now()

        spec.loader.exec_module = exec_module
        return spec


def register_operators():
    if sys.modules.get("torch") is not None:   # None: an import of torch that failed or was blocked
        _register_now()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())
