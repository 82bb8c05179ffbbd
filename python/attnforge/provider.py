"""The seed's FlashAttention4KernelProvider, backed by the C library's af_provider: the accepted subset,
the plan, its JSON and the per-call guard are all decided in C; this class only carries calls across, and for a
plan on backend "fa4" calls FlashAttention-4 itself (attnforge._fa4) where the C guard covers the call. Its calls
run in _provider_call (PlanRunner, which the attnforge::provider_sdpa operator uses too); a call an fa4 plan does not
cover goes to attnforge.scaled_dot_product_attention."""
import json
import logging
import os

from . import _C, _fa4
from ._provider_call import PlanRunner
from ._samples import _entries
from ._sdpa import scaled_dot_product_attention

SUPPORTED_FUNCTION = _C.SUPPORTED_FUNCTION   # "scaled_dot_product_attention"
BACKENDS = ("auto", "attnforge", "fa4")

logger = logging.getLogger("attnforge")


class FlashAttention4KernelProvider(PlanRunner):
    """Run attnforge's FlashAttention kernel with a sample-derived argument and layout plan.

    provider = FlashAttention4KernelProvider()
    if provider.prepare([((q, k, v), {"is_causal": True})]):
        out = provider(q, k, v, is_causal=True)      # like F.scaled_dot_product_attention
        state = provider.to_dict()                   # same JSON as `attnforge plan` writes

    backend: which kernels a plan for CUDA samples runs on (docs/PROVIDER.md, "Backends fa4 and auto"):
    "auto" (default): FlashAttention-4 itself (flash_attn.cute) where it imports and computes every sample with SDPA's
        meaning, else attnforge's own CUDA kernels; CPU samples always plan attnforge's CPU kernels;
    "attnforge": attnforge's own kernels only;
    "fa4": FlashAttention-4 or nothing: prepare() returns False, with the reason, when it cannot take the samples.
    """

    supported_function = SUPPORTED_FUNCTION

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f'FlashAttention4KernelProvider(backend=...): expected "auto", "attnforge" or "fa4", '
                             f"got {backend!r}")
        # _c, _plan (the plan's JSON as a dict while prepared: None) and FA4's function (once loaded: None); a call
        # an fa4 plan does not cover runs as attnforge.scaled_dot_product_attention
        super().__init__(_C.Provider(), scaled_dot_product_attention)
        self._backend = backend
        self._refusal = ""   # a refusal found before (or, for "fa4", after) the C provider saw the samples
        self.fa4_refusals = []

    # ---- identity
    @property
    def name(self) -> str:
        """Human-readable name with the version, e.g. "attnforge FlashAttention-4 (cpu, avx2) 0.1.0"; for an fa4 plan
        also FA4's version, e.g. "attnforge FlashAttention-4 (fa4: FlashAttention-4 v4.0.0b27) 0.1.0" (reading it
        imports flash_attn.cute, as the seed's name does)."""
        if self._is_fa4():
            return f"attnforge FlashAttention-4 (fa4: FlashAttention-4 {_fa4.version()}) {_C.__version__}"
        return self._c.name

    @property
    def backend(self) -> str:
        """The backend asked for: "auto", "attnforge" or "fa4" (plan_backend says where the plan runs)."""
        return self._backend

    @property
    def plan_backend(self):
        """Where the plan runs: "cpu", "cuda" (attnforge's kernels) or "fa4" (FlashAttention-4); None unprepared."""
        return self._plan["backend"] if self._plan is not None else None

    def __repr__(self) -> str:
        return self.name

    # ---- prepare
    def prepare(self, samples) -> bool:
        """Select one plan for all representative samples; each sample is (args, kwargs) exactly as passed to
        F.scaled_dot_product_attention. False (with `reason`, and a DEBUG log on "attnforge") when a sample is
        outside the supported subset or the samples disagree; never runs a kernel or loads a runtime.
        Unlike the seed's base class, a prepared provider re-derives its plan (the C library's rule).
        Backends "auto" and "fa4" then decide whether FlashAttention-4 runs the plan (fa4_refusals says why not);
        "auto" imports flash_attn.cute for CUDA samples, "fa4" never does (the plan may be made where FA4 is not)."""
        try:
            entries = _entries(samples)
        except TypeError as e:   # not a list of (args, kwargs): the caller's mistake, said plainly
            raise TypeError(f"prepare(samples): {e}") from None
        self._refusal, self._plan, self.fa4_refusals = "", None, []
        try:
            prepared = self._c.prepare(json.dumps({"samples": entries}))
        except _C.ParseError as e:   # a description the C library cannot read (e.g. an exotic dtype): not supported
            self._c = _C.Provider()   # as after any failed prepare: unprepared
            self._refusal = str(e)
            logger.debug("FlashAttention-4 not supported due to: %s", e)
            return False
        if not prepared:
            return False
        self._plan = json.loads(self._c.to_json())
        return self._route(entries) if self._backend != "attnforge" else True

    def _route(self, entries) -> bool:
        """The C plan accepted the samples; FlashAttention-4 runs it when it computes every sample with SDPA's meaning
        (and, for "auto", imports). A DEBUG line per reason it cannot, in the seed's words."""
        if self._plan["backend"] == "cpu" and self._backend == "auto":
            return True   # FA4 is a CUDA backend: CPU samples keep attnforge's CPU plan
        reasons = _fa4.sample_refusals(entries)
        if self._backend == "auto" and self._plan["backend"] == "cuda":
            try:
                _fa4.flash_attn_func()
            except _C.RuntimeUnavailableError as e:
                reasons.insert(0, f"flash_attn.cute cannot be imported: {e}")
        for reason in reasons:
            logger.debug("FlashAttention-4 not supported due to: %s", reason)
        self.fa4_refusals = reasons
        if reasons and self._backend == "auto":
            logger.debug("FlashAttention-4 cannot take these samples: the plan runs on attnforge's %s backend",
                         self._plan["backend"])
            return True
        if reasons:   # "fa4" insists
            self._c, self._plan = _C.Provider(), None
            self._refusal = "; ".join(reasons)
            return False
        self._c = _C.Provider.from_json(json.dumps(dict(self._plan, backend="fa4")))
        self._plan = json.loads(self._c.to_json())
        logger.debug("FlashAttention-4 takes these samples: the plan runs on backend fa4")
        if not self._plan["copy_free_layout"]:
            logger.warning(_fa4.COPY_WARNING)
        return True

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

    def load_runtime_dependencies(self) -> None:
        """Load the plan's backend now (before graph capture) instead of on the first call. Idempotent. An fa4 plan
        imports flash_attn.cute (the seed's order: its version, then flash_attn_func), RuntimeUnavailableError with the
        seed's message where it is missing."""
        if self._is_fa4():
            _fa4.version()
            self._fa4_function()
            return
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
        self = cls()
        self._c = c_provider
        self._plan = json.loads(c_provider.to_json())
        return self
