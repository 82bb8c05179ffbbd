"""The seed's FlashAttention4KernelProvider, backed by the C library's af_provider: the accepted subset,
the plan, its JSON and the per-call guard are all decided in C; this class only carries calls across."""
import json
import logging
import os

from . import _C
from ._samples import samples_to_json
from ._tensors import call_stream, exportable, new_lse, new_output

SUPPORTED_FUNCTION = _C.SUPPORTED_FUNCTION   # "scaled_dot_product_attention"

logger = logging.getLogger("attnforge")


class FlashAttention4KernelProvider:
    """Run attnforge's FlashAttention kernel with a sample-derived argument and layout plan.

    provider = FlashAttention4KernelProvider()
    if provider.prepare([((q, k, v), {"is_causal": True})]):
        out = provider(q, k, v, is_causal=True)      # like F.scaled_dot_product_attention
        state = provider.to_dict()                   # same JSON as `attnforge plan` writes
    """

    supported_function = SUPPORTED_FUNCTION

    def __init__(self):
        self._c = _C.Provider()
        self._refusal = ""   # a refusal found before the C provider saw the samples

    # ---- identity
    @property
    def name(self) -> str:
        """Human-readable name with the version, e.g. "attnforge FlashAttention-4 (cpu, avx2) 0.1.0"."""
        return self._c.name

    def __repr__(self) -> str:
        return self.name

    # ---- prepare
    def prepare(self, samples) -> bool:
        """Select one plan for all representative samples; each sample is (args, kwargs) exactly as passed to
        F.scaled_dot_product_attention. False (with `reason`, and a DEBUG log on "attnforge") when a sample is
        outside the supported subset or the samples disagree; never runs a kernel or loads a runtime.
        Unlike the seed's base class, a prepared provider re-derives its plan (the C library's rule)."""
        try:
            text = samples_to_json(samples)
        except TypeError as e:   # not a list of (args, kwargs): the caller's mistake, said plainly
            raise TypeError(f"prepare(samples): {e}") from None
        self._refusal = ""
        try:
            return self._c.prepare(text)
        except _C.ParseError as e:   # a description the C library cannot read (e.g. an exotic dtype): not supported
            self._c = _C.Provider()   # as after any failed prepare: unprepared
            self._refusal = str(e)
            logger.debug("FlashAttention-4 not supported due to: %s", e)
            return False

    @property
    def reason(self) -> str:
        """Why the last prepare() returned False; "" after a successful one."""
        return self._refusal or self._c.reason

    @property
    def is_prepared(self) -> bool:
        return self._c.is_prepared

    @property
    def flash_kwargs(self) -> dict:
        """The kernel arguments of the plan (the seed's flash_kwargs); {} before prepare."""
        return self.to_dict()["flash_kwargs"] if self.is_prepared else {}

    # ---- inference
    def __call__(self, *args, **kwargs):
        """Run the plan on one call made like F.scaled_dot_product_attention(*args, **kwargs). A call that does
        not match the plan runs with its own arguments (the C library's guard), never with the plan's."""
        return self.infer(args, kwargs)

    def infer(self, args=(), kwargs=None, *, strict=False):
        """The seed's _infer(args, kwargs): returns out (B, Hq, L, Ev), allocated like query. strict=True raises
        PlanMismatchError (running nothing) for a call the plan does not cover, instead of the general path."""
        kwargs = {} if kwargs is None else kwargs
        args = tuple(exportable(a) for a in args)
        kwargs = {k: exportable(v) for k, v in kwargs.items()}
        query = args[0] if args else kwargs.get("query")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        out = new_output(query, value)
        self._c.infer(args, kwargs, out, None, strict, call_stream(query))
        return out

    def infer_with_lse(self, *args, **kwargs):
        """Like calling the provider, also returning the float32 log-sum-exp (B, Hq, L)."""
        args = tuple(exportable(a) for a in args)
        kwargs = {k: exportable(v) for k, v in kwargs.items()}
        query = args[0] if args else kwargs.get("query")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        out, lse = new_output(query, value), new_lse(query)
        self._c.infer(args, kwargs, out, lse, False, call_stream(query))
        return out, lse

    def load_runtime_dependencies(self) -> None:
        """Load the plan's backend now (before graph capture) instead of on the first call. Idempotent."""
        self._c.load_runtime_dependencies()

    # ---- serialization (the same JSON as the C library and the `attnforge` command)
    def to_dict(self) -> dict:
        return json.loads(self._c.to_json())

    def to_json(self) -> str:
        return self._c.to_json()

    @classmethod
    def from_dict(cls, state_dict: dict) -> "FlashAttention4KernelProvider":
        """Restore a plan (attnforge's form, version 1, or the seed's own); the provider comes back prepared."""
        return cls._wrap(_C.Provider.from_json(json.dumps(state_dict)))

    @classmethod
    def from_json(cls, text: str) -> "FlashAttention4KernelProvider":
        return cls._wrap(_C.Provider.from_json(text))

    @classmethod
    def load(cls, path) -> "FlashAttention4KernelProvider":
        """Read a plan file (as written by save() or `attnforge plan`)."""
        return cls._wrap(_C.Provider.load(os.fspath(path)))

    def save(self, path) -> None:
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(self._c.to_json())
            f.write("\n")

    @classmethod
    def _wrap(cls, c_provider):
        self = cls.__new__(cls)
        self._c = c_provider
        self._refusal = ""
        return self
