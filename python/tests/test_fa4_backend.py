"""Backend "fa4": FlashAttention-4 itself behind attnforge's plan, JSON and per-call guard, tested without a GPU and
without FA4. A stand-in flash_attn.cute (fake_flash_attn/) records what it is handed and computes FA4's documented
semantics on the CPU; samples are CUDA descriptors (fake_dlpack.FakeTensor), and calls run on CPU tensors through the
private testing hook attnforge._fa4.testing (CPU tensors stand for cuda:0 tensors; the C guard sees cuda:0
descriptors). FlashAttention-4 itself never runs here."""
import logging
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402
from attnforge import _C, _fa4  # noqa: E402
from fake_dlpack import KDL_CUDA, FakeTensor  # noqa: E402

STAND_IN = pathlib.Path(__file__).resolve().parent / "fake_flash_attn"
PYTORCH_SDPA = F.scaled_dot_product_attention
UNAVAILABLE = "FlashAttention-4 is not available. Install it with `pip install --pre flash-attn-4`."
SEED_COPY_WARNING = ("FlashAttention-4 must copy query, key, and value tensors from HND to NHD layout on every "
                     "call; this may reduce performance. Use HND views of NHD-contiguous tensors to enable the "
                     "copy-free path.")


def _forget_flash_attn():
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]
    _fa4.import_flash_attention4.cache_clear()
    _fa4._device_capability.cache_clear()


def _as_cuda0(t):
    """The C guard's view of a CPU tensor standing for a cuda:0 tensor: its descriptors, device cuda:0."""
    return FakeTensor(tuple(t.shape), str(t.dtype).replace("torch.", ""), device=(KDL_CUDA, 0), data=t.data_ptr(),
                      strides=tuple(t.stride()))


@pytest.fixture
def hooks():
    """CPU tensors stand for cuda:0 tensors of compute capability 10.0 (the private testing hook)."""
    _fa4.testing.cpu_as_cuda = _as_cuda0
    _fa4.testing.capability = (10, 0)
    yield _fa4.testing
    _fa4.testing.cpu_as_cuda = None
    _fa4.testing.capability = None


@pytest.fixture
def fa4(hooks, monkeypatch):
    """The stand-in flash_attn.cute on sys.path; its module (with .calls) is returned."""
    _forget_flash_attn()
    monkeypatch.syspath_prepend(str(STAND_IN))
    import flash_attn.cute as stand_in
    assert stand_in.__file__.startswith(str(STAND_IN))
    stand_in.calls.clear()
    yield stand_in
    _forget_flash_attn()


@pytest.fixture
def no_fa4(hooks, monkeypatch):
    """flash_attn.cute cannot be imported."""
    _forget_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)   # import raises ModuleNotFoundError
    yield
    _forget_flash_attn()


def cuda_sample(*tensors, **kwargs):
    """A sample as recorded on cuda:0 (descriptors of the CPU tensors, device cuda:0)."""
    return (tuple(_as_cuda0(t) for t in tensors), kwargs)


def nhd_views(b, h, seq, d, dtype=torch.float16, seed=0):
    """HND views (b, h, seq, d) of NHD-contiguous memory: the seed's copy-free layout."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, seq, h, d, generator=g).to(dtype).transpose(1, 2)


def hnd(b, h, seq, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, seq, d, generator=g).to(dtype)


def sdpa_f32(q, k, v, **kwargs):
    return PYTORCH_SDPA(q.float(), k.float(), v.float(), **kwargs)


def close(out, expected, atol=2e-3):
    return torch.allclose(out.float(), expected.float(), atol=atol, rtol=1e-2)


def prepared(samples, backend="auto"):
    provider = af.FlashAttention4KernelProvider(backend)
    assert provider.prepare(samples), provider.reason
    return provider


def debug_lines(log):
    return [r.getMessage() for r in log.records if r.levelno == logging.DEBUG]


# ---------------------------------------------------------------- routing

def test_auto_plans_fa4_for_cuda_samples_it_computes(fa4, af_log):
    q, k, v = nhd_views(2, 4, 16, 64), nhd_views(2, 4, 16, 64, seed=1), nhd_views(2, 4, 16, 64, seed=2)
    provider = prepared([cuda_sample(q, k, v, is_causal=True)])
    assert provider.plan_backend == "fa4" and provider.fa4_refusals == []
    state = provider.to_dict()
    assert state == {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
                     "flash_kwargs": {"causal": True}, "copy_free_layout": True, "backend": "fa4"}
    assert "FlashAttention-4 takes these samples: the plan runs on backend fa4" in debug_lines(af_log)
    assert not any(r.levelno == logging.WARNING for r in af_log.records)   # copy-free: no copy warning
    restored = af.FlashAttention4KernelProvider.from_dict(state)
    assert restored.plan_backend == "fa4" and restored.to_dict() == state
    assert restored.name == f"attnforge FlashAttention-4 (fa4: FlashAttention-4 v4.0.0b27) {af.__version__}"
    assert fa4.calls == []   # planning never runs a kernel


@pytest.mark.parametrize("backend", ["auto", "attnforge"])
def test_cpu_samples_keep_the_cpu_plan_without_importing_fa4(backend, fa4, af_log):
    q = hnd(1, 2, 8, 64)
    provider = prepared([((q, q, q), {"is_causal": True})], backend)
    assert provider.plan_backend == "cpu" and provider.fa4_refusals == []
    assert _fa4.import_flash_attention4.cache_info().currsize == 0
    assert not any("FlashAttention-4 not supported" in line for line in debug_lines(af_log))


def test_attnforge_never_considers_fa4(fa4):
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)], "attnforge")
    assert provider.plan_backend == "cuda"
    assert _fa4.import_flash_attention4.cache_info().currsize == 0


def test_auto_without_fa4_plans_attnforge_and_says_why(no_fa4, af_log):
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)])
    assert provider.plan_backend == "cuda"
    assert provider.fa4_refusals == [f"flash_attn.cute cannot be imported: {UNAVAILABLE}"]
    lines = debug_lines(af_log)
    assert f"FlashAttention-4 not supported due to: flash_attn.cute cannot be imported: {UNAVAILABLE}" in lines
    assert "FlashAttention-4 cannot take these samples: the plan runs on attnforge's cuda backend" in lines


# (samples, capability, the reasons' texts): what FA4 cannot compute with SDPA's meaning
REFUSED = {
    "float32": ([cuda_sample(*(nhd_views(1, 2, 8, 64, torch.float32),) * 3)], (10, 0),
                ["FlashAttention-4 computes float16 and bfloat16 only (samples[0]: query is float32)"]),
    "head dim 36": ([cuda_sample(*(nhd_views(1, 2, 8, 36),) * 3)], (10, 0),
                    ["FlashAttention-4 on compute capability 10.x and 11.x takes head dims (E, Ev) from 8 to 128 in "
                     "multiples of 8, (192, 128) or (256, 256) (samples[0]: E 36, Ev 36)"]),
    "head dim 160 on sm100": ([cuda_sample(*(nhd_views(1, 2, 8, 160),) * 3)], (10, 0),
                              ["FlashAttention-4 on compute capability 10.x and 11.x takes head dims (E, Ev) from 8 to "
                               "128 in multiples of 8, (192, 128) or (256, 256) (samples[0]: E 160, Ev 160)"]),
    "sm80": ([cuda_sample(*(nhd_views(1, 2, 8, 64),) * 3)], (8, 0),
             ["FlashAttention-4 runs on compute capability 9.x, 10.x and 11.x only (samples[0]: cuda:0 is 8.0)"]),
    "causal L != S, head dim 192": (
        [cuda_sample(nhd_views(1, 2, 4, 192), nhd_views(1, 2, 9, 192), nhd_views(1, 2, 9, 128), is_causal=True)],
        (10, 0),
        ["FlashAttention-4's causal mask is bottom-right aligned; attnforge gives it SDPA's top-left mask for L != S "
         "through window_size, with head dims up to 128 only (samples[0]: L 4, S 9, E 192, Ev 128)"]),
    "empty": ([cuda_sample(*(nhd_views(1, 2, 0, 64),) * 3)], (10, 0),
              ["FlashAttention-4 is not given empty tensors (samples[0]: B 1, Hq 2, L 0, S 0)"]),
    "two reasons, second sample": (
        [cuda_sample(*(nhd_views(1, 2, 8, 64),) * 3), cuda_sample(*(nhd_views(1, 2, 8, 12, torch.float32),) * 3)],
        (10, 0),
        ["FlashAttention-4 computes float16 and bfloat16 only (samples[1]: query is float32)",
         "FlashAttention-4 on compute capability 10.x and 11.x takes head dims (E, Ev) from 8 to 128 in multiples "
         "of 8, (192, 128) or (256, 256) (samples[1]: E 12, Ev 12)"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_auto_falls_back_with_a_debug_line_per_reason(case, fa4, hooks, af_log):
    samples, capability, expected = REFUSED[case]
    hooks.capability = capability
    provider = prepared(samples)
    assert provider.plan_backend == "cuda"
    assert provider.fa4_refusals == expected
    lines = debug_lines(af_log)
    for reason in expected:
        assert lines.count(f"FlashAttention-4 not supported due to: {reason}") == 1


@pytest.mark.parametrize("case", ["float32", "head dim 36", "sm80", "causal L != S, head dim 192", "empty"])
def test_fa4_insists(case, fa4, hooks):
    samples, capability, expected = REFUSED[case]
    hooks.capability = capability
    provider = af.FlashAttention4KernelProvider("fa4")
    assert not provider.prepare(samples)
    assert provider.reason == "; ".join(expected)
    assert not provider.is_prepared and provider.plan_backend is None
    with pytest.raises(af.NotPreparedError):
        provider.to_dict()


def test_fa4_insists_on_cuda_samples(fa4):
    q = hnd(1, 2, 8, 64)
    provider = af.FlashAttention4KernelProvider("fa4")
    assert not provider.prepare([((q, q, q), {})])
    assert provider.reason == "FlashAttention-4 runs on CUDA tensors only (samples[0]: query is on 'cpu')"


def test_fa4_plans_where_fa4_is_not_installed(no_fa4):
    """Like the seed's prepare (and attnforge's cuda plans): planning needs neither FA4 nor a GPU; loading does."""
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)], "fa4")
    assert provider.plan_backend == "fa4"
    assert provider.name == f"attnforge FlashAttention-4 (fa4: FlashAttention-4 cannot be imported) {af.__version__}"
    with pytest.raises(af.RuntimeUnavailableError) as raised:
        provider.load_runtime_dependencies()
    assert str(raised.value) == UNAVAILABLE and isinstance(raised.value, RuntimeError)


def test_the_head_dims_of_compute_capability_9(fa4, hooks):
    hooks.capability = (9, 0)
    q = nhd_views(1, 2, 8, 160)
    assert prepared([cuda_sample(q, q, q)]).plan_backend == "fa4"
    hooks.capability = None   # unknown (no GPU here): what every FA4 GPU takes
    assert prepared([cuda_sample(q, q, q)]).plan_backend == "cuda"
    q = nhd_views(1, 2, 8, 256)
    assert prepared([cuda_sample(q, q, q)]).plan_backend == "fa4"


def test_the_c_plan_rules_come_first(fa4, af_log):
    q = nhd_views(1, 2, 8, 64)
    provider = af.FlashAttention4KernelProvider("fa4")
    assert not provider.prepare([cuda_sample(q, q, q, attn_mask=None, dropout_p=0.1)])
    assert "only supports dropout_p=0.0" in provider.reason
    with pytest.raises(ValueError, match='expected "auto", "attnforge" or "fa4"'):
        af.FlashAttention4KernelProvider("cuda")


# ---------------------------------------------------------------- the call

def test_copy_free_call_hands_fa4_the_callers_memory(fa4):
    q, k, v = nhd_views(2, 4, 16, 64), nhd_views(2, 4, 16, 64, seed=1), nhd_views(2, 4, 16, 32, seed=2)
    provider = prepared([cuda_sample(q, k, v, is_causal=True, scale=0.2)])
    with torch.no_grad():
        out = provider(q, k, v, is_causal=True, scale=0.2)
    (call,) = fa4.calls
    for name, t in zip("qkv", (q, k, v)):
        nhd = t.transpose(1, 2)
        assert call[name]["data_ptr"] == nhd.data_ptr()                        # no copy
        assert call[name]["shape"] == tuple(nhd.shape)                         # (B, L, H, D)
        assert call[name]["strides"] == tuple(nhd.contiguous().stride())       # NHD-contiguous
    assert call["kwargs"] == {"causal": True, "softmax_scale": 0.2}
    assert list(call["kwargs"]) == ["causal", "softmax_scale"]                 # the seed's order
    assert out.shape == (2, 4, 16, 32) and out.dtype == torch.float16
    assert out.transpose(1, 2).is_contiguous()                                 # an HND view of FA4's NHD output
    assert close(out, sdpa_f32(q, k, v, is_causal=True, scale=0.2))


def test_copy_plan_copies_to_nhd_and_warns_once(fa4, af_log):
    q, k, v = hnd(1, 4, 8, 64), hnd(1, 4, 8, 64, seed=1), hnd(1, 4, 8, 64, seed=2)
    provider = prepared([cuda_sample(q, k, v)])
    assert provider.to_dict()["copy_free_layout"] is False and provider.plan_backend == "fa4"
    warnings = [r.getMessage() for r in af_log.records if r.levelno == logging.WARNING]
    assert warnings == [SEED_COPY_WARNING]
    with torch.no_grad():
        out = provider(q, k, v)
    (call,) = fa4.calls
    for name, t in zip("qkv", (q, k, v)):
        assert call[name]["shape"] == (1, 8, 4, 64)
        assert call[name]["strides"] == (8 * 4 * 64, 4 * 64, 64, 1)            # a contiguous NHD copy
        assert call[name]["data_ptr"] != t.data_ptr()
    assert call["kwargs"] == {"causal": False}
    assert close(out, sdpa_f32(q, k, v))


def test_gqa_passes_pack_gqa_false(fa4):
    q, kv = nhd_views(1, 8, 16, 64), nhd_views(1, 2, 16, 64, seed=1)
    provider = prepared([cuda_sample(q, kv, kv, enable_gqa=True, is_causal=True)])
    with torch.no_grad():
        out = provider(q, kv, kv, enable_gqa=True, is_causal=True)
    assert fa4.calls[-1]["kwargs"] == {"causal": True, "pack_gqa": False}
    assert close(out, sdpa_f32(q, kv, kv, enable_gqa=True, is_causal=True))


@pytest.mark.parametrize("seq_q, seq_k", [(5, 13), (13, 5), (1, 9), (9, 1)])
def test_causal_with_l_not_s_reaches_fa4_only_top_left_aligned(seq_q, seq_k, fa4):
    q = nhd_views(1, 2, seq_q, 64)
    k, v = nhd_views(1, 2, seq_k, 64, seed=1), nhd_views(1, 2, seq_k, 64, seed=2)
    provider = prepared([cuda_sample(q, k, v, is_causal=True)])
    assert provider.plan_backend == "fa4"
    with torch.no_grad():
        out = provider(q, k, v, is_causal=True)
    (call,) = fa4.calls
    assert call["kwargs"] == {"causal": False, "window_size": (None, seq_q - seq_k)}
    top_left = sdpa_f32(q, k, v, is_causal=True)
    assert close(out, top_left)
    # FA4's own causal (bottom-right) computes something else here: the test would see a wrong alignment
    bottom_right, _ = fa4.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert not close(bottom_right.transpose(1, 2), top_left)


def test_no_causal_call_with_l_not_s_is_handed_fa4s_causal(fa4):
    """Across every causal call this module makes through the provider, none reaches FA4 as causal=True with L != S."""
    q, kv = nhd_views(1, 2, 3, 64), nhd_views(1, 2, 7, 64, seed=1)
    provider = prepared([cuda_sample(q, kv, kv, is_causal=True)])
    with torch.no_grad():
        for seq_q in (3, 7, 11):
            qq = nhd_views(1, 2, seq_q, 64, seed=seq_q)
            assert close(provider(qq, kv, kv, is_causal=True), sdpa_f32(qq, kv, kv, is_causal=True))
    assert len(fa4.calls) == 3
    for call in fa4.calls:
        if call["q"]["shape"][1] != call["k"]["shape"][1]:
            assert call["kwargs"]["causal"] is False and call["kwargs"]["window_size"][0] is None


def test_keyword_plan_and_lse(fa4):
    q, k, v = nhd_views(1, 2, 6, 64), nhd_views(1, 2, 10, 64, seed=1), nhd_views(1, 2, 10, 64, seed=2)
    provider = prepared([((), {"query": _as_cuda0(q), "key": _as_cuda0(k), "value": _as_cuda0(v)})])
    assert provider.to_dict()["qkv_source"] == "keyword_qkv"
    with torch.no_grad():
        out, lse = provider.infer_with_lse(query=q, key=k, value=v)
    assert fa4.calls[-1]["kwargs"] == {"causal": False, "return_lse": True}
    expected_lse = torch.logsumexp((q.float() @ k.float().transpose(-1, -2)) / 8.0, dim=-1)
    assert lse.shape == (1, 2, 6) and lse.dtype == torch.float32
    assert torch.allclose(lse, expected_lse, atol=1e-4)
    assert close(out, sdpa_f32(q, k, v))


def test_fa4_tuple_or_a_bare_output(fa4, monkeypatch):
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)])
    original = fa4.flash_attn_func
    monkeypatch.setattr(fa4, "flash_attn_func", lambda *a, **kw: original(*a, **kw)[0])   # an older FA4
    with torch.no_grad():
        assert close(af.FlashAttention4KernelProvider.from_dict(provider.to_dict())(q, q, q), sdpa_f32(q, q, q))


# ---------------------------------------------------------------- the guard and the fallbacks

def test_uncovered_calls_never_reach_fa4(fa4, hooks, af_log):
    q, k, v = nhd_views(1, 2, 8, 64), nhd_views(1, 2, 8, 64, seed=1), nhd_views(1, 2, 8, 64, seed=2)
    provider = prepared([cuda_sample(q, k, v, is_causal=True)])
    mask = torch.rand(8, 8) > 0.3
    q32, k32, v32 = (t.float() for t in (q, k, v))
    q36 = nhd_views(1, 2, 8, 36)
    cases = [   # (args, kwargs, what the guard says)
        ((q, k, v), {"is_causal": False}, "is_causal is false, the plan's is true"),
        ((q, k, v), {"is_causal": True, "scale": 0.5}, "scale is 0.5, the plan's is None"),
        ((q, k, v), {"attn_mask": mask}, "the call has an attn_mask"),
        ((), {"query": q, "key": k, "value": v, "is_causal": True}, "the plan has positional_qkv"),
        ((hnd(1, 2, 8, 64), k, v), {"is_causal": True}, "query is no longer an HND view of NHD-contiguous memory"),
        ((q32, k32, v32), {"is_causal": True}, "FlashAttention-4 computes float16 and bfloat16 only"),
        ((q36, q36, q36), {"is_causal": True}, "takes head dims (E, Ev) from 8 to 128"),
    ]
    with torch.no_grad():
        for args, kwargs, why in cases:
            with pytest.raises(af.PlanMismatchError, match="FlashAttention-4 plan does not match this call") as e:
                provider.infer(args, kwargs, strict=True)
            assert why in str(e.value)
            qkv = args or (kwargs["query"], kwargs["key"], kwargs["value"])
            others = {n: x for n, x in kwargs.items() if n not in ("query", "key", "value")}
            assert close(provider(*args, **kwargs), sdpa_f32(*qkv, **others)), why   # the call's own arguments
        hooks.capability = (8, 0)   # the call's device cannot run FA4
        with pytest.raises(af.PlanMismatchError, match=r"compute capability 9.x, 10.x and 11.x only \(cuda:0 is 8.0\)"):
            provider.infer((q, k, v), {"is_causal": True}, strict=True)
    assert fa4.calls == []
    assert sum("; running it on the general path" in line for line in debug_lines(af_log)) == len(cases)


def test_misaligned_memory_takes_the_general_path(fa4):
    base = torch.randn(1 + 1 * 8 * 2 * 64, dtype=torch.float16)
    q = base[1:].view(1, 8, 2, 64).transpose(1, 2)   # NHD-contiguous, 2 bytes past an aligned address
    provider = prepared([cuda_sample(q, q, q)])
    with pytest.raises(af.PlanMismatchError, match="query is not 16-byte aligned"):
        provider.infer((q, q, q), strict=True)
    with torch.no_grad():
        assert close(provider(q, q, q), sdpa_f32(q, q, q))
    assert fa4.calls == []


def test_the_c_library_never_runs_an_fa4_plan_itself():
    plan = {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
            "flash_kwargs": {"causal": False}, "copy_free_layout": True, "backend": "fa4"}
    c_provider = _C.Provider.from_json(af.FlashAttention4KernelProvider.from_dict(plan).to_json())
    assert c_provider.name == f"attnforge FlashAttention-4 (fa4) {af.__version__}"
    with pytest.raises(af.UnsupportedError, match="only the Python provider"):
        c_provider.load_runtime_dependencies()


# ---------------------------------------------------------------- runtime loading (the seed's rules)

def test_flash_attn_cute_is_imported_once(fa4, monkeypatch):
    imports = []
    real = _fa4.importlib.import_module
    monkeypatch.setattr(_fa4.importlib, "import_module", lambda name: imports.append(name) or real(name))
    _fa4.import_flash_attention4.cache_clear()
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)], "fa4")
    assert imports == []   # "fa4" prepares without importing
    provider.load_runtime_dependencies()
    provider.load_runtime_dependencies()
    assert provider.name.startswith("attnforge FlashAttention-4 (fa4: FlashAttention-4 v4.0.0b27)")
    assert imports == ["flash_attn.cute"]


@pytest.mark.parametrize("function", ["missing", None])
def test_unavailable_when_flash_attn_func_is_missing(function, fa4, monkeypatch):
    if function == "missing":
        monkeypatch.delattr(fa4, "flash_attn_func")
    else:
        monkeypatch.setattr(fa4, "flash_attn_func", None)
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)], "fa4")
    with pytest.raises(af.RuntimeUnavailableError, match="pip install --pre flash-attn-4"):
        provider.load_runtime_dependencies()


def test_the_version_lookup(fa4, monkeypatch):
    asked = []

    def metadata_version(package):
        asked.append(package)
        if package == "fa4":
            return "4.0.0b26"
        raise _fa4.importlib.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(fa4, "__version__", "0.0.0")
    monkeypatch.setattr(_fa4.importlib.metadata, "version", metadata_version)
    assert _fa4.version() == "v4.0.0b26" and asked == ["flash-attn-4", "fa4"]
    monkeypatch.setattr(_fa4.importlib.metadata, "version",
                        lambda p: (_ for _ in ()).throw(_fa4.importlib.metadata.PackageNotFoundError(p)))
    assert _fa4.version() == "unknown version"


# ---------------------------------------------------------------- attnforge.torch.apply

class Attention(nn.Module):
    def forward(self, q, k, v, causal=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_apply_runs_covered_calls_on_fa4_and_others_on_pytorch(fa4, monkeypatch):
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q, is_causal=True)])
    pytorch_calls = []

    def counting_sdpa(*args, **kwargs):
        pytorch_calls.append(kwargs.get("is_causal"))
        return PYTORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    module = Attention()
    with torch.no_grad(), aft.apply(module, provider.to_dict()):
        covered = module(q, q, q)
        uncovered = module(q, q, q, causal=False)
    assert len(fa4.calls) == 1 and pytorch_calls == [False]
    assert close(covered, sdpa_f32(q, q, q, is_causal=True)) and close(uncovered, sdpa_f32(q, q, q))
    assert F.scaled_dot_product_attention is counting_sdpa


def test_apply_loads_fa4_on_entry(no_fa4):
    q = nhd_views(1, 2, 8, 64)
    provider = prepared([cuda_sample(q, q, q)], "fa4")
    with pytest.raises(af.RuntimeUnavailableError, match="pip install --pre flash-attn-4"):
        with aft.apply(Attention(), provider):
            pass
    assert F.scaled_dot_product_attention is PYTORCH_SDPA
