"""Work that needs torch, done whenever torch and attnforge are both imported, in either order, without attnforge
importing torch itself (the NumPy tier runs without it): the operators register (so torch.export.load finds
torch.ops.attnforge.* in any process that imported attnforge), "attnforge" joins torch.nn.attention's
flash-attention registry, and attnforge's threads move to torch's."""
import importlib.abc
import importlib.util
import sys

_pending = []   # callables waiting for torch's import to finish, in the order they came


def _register_now():
    from . import _ops  # noqa: F401  (defining the operators registers them)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch is first imported, wraps its loader so that the pending callables run once
    torch has finished importing."""

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
            while _pending:
                _pending.pop(0)()

        spec.loader.exec_module = exec_module
        return spec


def after_torch_import(fn):
    """fn() now if torch is imported, else once torch has finished importing (once, however often it is asked)."""
    if sys.modules.get("torch") is not None:   # None: an import of torch that failed or was blocked
        fn()
        return
    if fn not in _pending:
        _pending.append(fn)
    if not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def register_operators():
    after_torch_import(_register_now)


def _register_attention_now():
    from . import torch_attention
    torch_attention.register()


def register_attention_impl():
    after_torch_import(_register_attention_now)
