"""The seed's unit tests (research/aitune.md §8), on attnforge's provider: every rejection, the plan's
flash_kwargs, serialization, the copy warning, runtime loading, and data pointers in copy-free mode."""
import json
import logging

import pytest

torch = pytest.importorskip("torch")

import attnforge as af  # noqa: E402
from attnforge import FlashAttention4KernelProvider  # noqa: E402


def hnd(*shape, nhd=False):
    """A (B,H,N,D) tensor; nhd=True makes it an HND view of NHD-contiguous memory (the copy-free layout)."""
    b, h, n, d = shape
    return torch.randn(b, n, h, d).transpose(1, 2) if nhd else torch.randn(b, h, n, d)


def seed_qkv(nhd=False):
    return hnd(2, 4, 17, 8, nhd=nhd), hnd(2, 4, 19, 8, nhd=nhd), hnd(2, 4, 19, 8, nhd=nhd)


def rejected(samples, log, expected):
    provider = FlashAttention4KernelProvider()
    assert provider.prepare(samples) is False
    assert not provider.is_prepared
    assert expected in provider.reason
    assert any(r.levelno == logging.DEBUG and r.name == "attnforge" for r in log.records)
    return provider


# ---- identity and runtime

def test_name_and_supported_function():
    provider = FlashAttention4KernelProvider()
    assert provider.supported_function == "scaled_dot_product_attention"
    assert FlashAttention4KernelProvider.supported_function == af.SUPPORTED_FUNCTION
    assert provider.name.startswith("attnforge FlashAttention-4 (cpu, ") and provider.name.endswith(af.__version__)
    assert repr(provider) == provider.name


def test_prepare_does_not_load_or_run_the_runtime():
    provider = FlashAttention4KernelProvider()
    q, k, v = seed_qkv()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    assert af._C._testing_runtime_loaded(provider._c) is False
    provider.load_runtime_dependencies()
    provider.load_runtime_dependencies()   # idempotent
    assert af._C._testing_runtime_loaded(provider._c) is True


def test_unprepared_provider_refuses_to_run_and_to_serialize():
    provider = FlashAttention4KernelProvider()
    q, k, v = seed_qkv()
    with pytest.raises(RuntimeError, match="must be prepared before inference"):
        provider(q, k, v)
    with pytest.raises(af.NotPreparedError):
        provider.to_dict()
    assert provider.flash_kwargs == {}


# ---- every rejection of the seed's unit tests

def test_empty_samples(af_log):
    rejected([], af_log, "requires consistent representative samples")


def test_attn_mask(af_log):
    q, k, v = seed_qkv()
    rejected([((q, k, v), {"attn_mask": torch.ones(17, 19, dtype=torch.bool)})], af_log, "does not support attn_mask")


def test_mixed_positional_and_keyword(af_log):
    q, k, v = seed_qkv()
    rejected([((q, k, v), {}), ((), {"query": q, "key": k, "value": v})], af_log,
             "requires consistent representative samples")


def test_dropout(af_log):
    q, k, v = seed_qkv()
    rejected([((q, k, v), {"dropout_p": 0.1})], af_log, "only supports dropout_p=0.0")
    assert any("dropout_p=0.0" in r.getMessage() for r in af_log.records)


def test_integer_zero_dropout_is_accepted():
    q, k, v = seed_qkv()
    assert FlashAttention4KernelProvider().prepare([((q, k, v), {"dropout_p": 0})])


def test_unknown_kwarg(af_log):
    q, k, v = seed_qkv()
    rejected([((q, k, v), {"unsupported": True})], af_log, "does not support kwargs: ['unsupported']")
    assert any("does not support kwargs" in r.getMessage() for r in af_log.records)


@pytest.mark.parametrize("case, expected", [
    ("q_none", "requires tensor query, key and value"),
    ("q_3d", "requires 4D query, key and value"),
    ("batch", "requires matching batch dimensions"),
    ("v_seq", "requires matching key/value sequence lengths"),
    ("k_head_dim", "requires matching query/key head dimensions"),
    ("v_heads", "requires matching key/value head counts"),
    ("gqa_without_enable", "requires valid grouped-query attention"),
    ("two_positionals", "only supports positional or query/key/value qkv arguments"),
    ("zero_kv_heads", "requires valid grouped-query attention"),   # ZeroDivisionError in the seed
])
def test_invalid_inputs(case, expected, af_log):
    q, k, v = hnd(2, 4, 17, 8), hnd(2, 4, 19, 8), hnd(2, 4, 19, 8)
    kwargs = {}
    args = {
        "q_none": lambda: (None, k, v),
        "q_3d": lambda: (q[0], k, v),
        "batch": lambda: (hnd(3, 4, 17, 8), k, v),
        "v_seq": lambda: (q, k, hnd(2, 4, 20, 8)),
        "k_head_dim": lambda: (q, hnd(2, 4, 19, 7), v),
        "v_heads": lambda: (q, k, hnd(2, 2, 19, 8)),
        "gqa_without_enable": lambda: (q, hnd(2, 2, 19, 8), hnd(2, 2, 19, 8)),
        "two_positionals": lambda: (q, k),
        "zero_kv_heads": lambda: (q, hnd(2, 0, 19, 8), hnd(2, 0, 19, 8)),
    }[case]()
    if case == "zero_kv_heads":
        kwargs["enable_gqa"] = True
    rejected([(args, kwargs)], af_log, "FlashAttention-4 provider " + expected)


def test_a_non_json_value_is_refused_not_crashed(af_log):
    q, k, v = seed_qkv()
    rejected([((q, k, v), {"scale": object()})], af_log, "scale")
    rejected([((q, k, v), {"dropout_p": float("nan")})], af_log, "dropout_p")


def test_exotic_dtype_is_refused(af_log):
    q, k, v = (t.to(torch.float64) for t in seed_qkv())
    rejected([((q, k, v), {})], af_log, "float64")
    q, k, v = (t.to(torch.int32) for t in seed_qkv())
    rejected([((q, k, v), {})], af_log, "int32")


# ---- the plan

@pytest.mark.parametrize("form", ["positional", "keyword"])
@pytest.mark.parametrize("copy_free", [False, True], ids=["copy", "copy_free"])
def test_seed_plan_and_output(form, copy_free, af_log):
    q, k, v = seed_qkv(nhd=copy_free)
    kwargs = {"is_causal": True, "scale": 0.125}
    sample = ((q, k, v), kwargs) if form == "positional" else ((), {"query": q, "key": k, "value": v, **kwargs})
    provider = FlashAttention4KernelProvider()
    assert provider.prepare([sample])
    assert provider.flash_kwargs == {"causal": True, "softmax_scale": 0.125}
    state = provider.to_dict()
    assert state["type"] == "FlashAttention4KernelProvider"
    assert state["qkv_source"] == ("positional_qkv" if form == "positional" else "keyword_qkv")
    assert state["copy_free_layout"] is copy_free
    warnings = [r for r in af_log.records if r.levelno == logging.WARNING]
    assert bool(warnings) is not copy_free
    if warnings:
        assert "must copy query, key, and value tensors from HND to NHD layout on every call" in warnings[0].getMessage()
    af._C._testing_spy(provider._c)
    out = provider(*sample[0], **sample[1])
    assert out.shape == q.shape
    seen = af._C._testing_seen()
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if copy_free:   # the kernel reads the caller's memory: same data pointers (the seed's test)
        assert seen == pointers
    else:           # HND-contiguous inputs are copied to NHD for the kernel
        assert all(s != p for s, p in zip(seen, pointers))


def test_gqa_plan():
    q, k, v = hnd(2, 4, 17, 8), hnd(2, 2, 19, 8), hnd(2, 2, 19, 8)
    provider = FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"enable_gqa": True})])
    assert provider.flash_kwargs == {"causal": False, "pack_gqa": False}


def test_samples_must_agree_on_the_plan(af_log):
    q, k, v = seed_qkv()
    for other in ({"is_causal": False}, {"is_causal": True, "scale": 0.5}):
        rejected([((q, k, v), {"is_causal": True}), ((q, k, v), other)], af_log,
                 "requires consistent representative samples")
    qn, kn, vn = seed_qkv(nhd=True)
    rejected([((q, k, v), {}), ((qn, kn, vn), {})], af_log, "requires consistent representative samples")


def test_prepare_re_derives_the_plan():
    """The seed's base class returns True without re-deriving once READY; attnforge re-derives (C rule)."""
    provider = FlashAttention4KernelProvider()
    q, k, v = seed_qkv()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    assert provider.prepare([((q, k, v), {})]) and provider.flash_kwargs == {"causal": False}
    assert not provider.prepare([]) and not provider.is_prepared


# ---- serialization

def test_to_dict_from_dict_round_trip():
    q, k, v = seed_qkv(nhd=True)
    provider = FlashAttention4KernelProvider()
    assert provider.prepare([((), {"query": q, "key": k, "value": v, "is_causal": True})])
    state = json.loads(json.dumps(provider.to_dict()))
    restored = FlashAttention4KernelProvider.from_dict(state)
    assert restored.is_prepared and restored.to_dict() == state
    torch.testing.assert_close(restored(query=q, key=k, value=v, is_causal=True),
                               provider(query=q, key=k, value=v, is_causal=True))


def test_reads_the_seeds_own_form():
    seed = {"type": "FlashAttention4KernelProvider", "qkv_source": "keyword_qkv", "flash_kwargs": {"causal": True},
            "copy_free_layout": True}
    provider = FlashAttention4KernelProvider.from_dict(seed)
    assert provider.flash_kwargs == {"causal": True} and provider.to_dict()["qkv_source"] == "keyword_qkv"


@pytest.mark.parametrize("state, expected", [
    ({"type": "TorchSDPAKernelProvider", "backend": "FLASH_ATTENTION"}, "TorchSDPAKernelProvider"),
    ({"type": "FlashAttention4KernelProvider", "version": 99, "qkv_source": "keyword_qkv",
      "flash_kwargs": {"causal": True}, "copy_free_layout": True}, "version"),
    ({"type": "FlashAttention4KernelProvider", "qkv_source": "keyword_qkv"}, "flash_kwargs"),
])
def test_from_dict_rejects_bad_documents(state, expected):
    with pytest.raises(ValueError, match=expected):
        FlashAttention4KernelProvider.from_dict(state)


def test_save_and_load(tmp_path):
    q, k, v = seed_qkv()
    provider = FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    provider.save(tmp_path / "plan.json")
    assert FlashAttention4KernelProvider.load(tmp_path / "plan.json").to_dict() == provider.to_dict()
    with pytest.raises(af.FileError):
        FlashAttention4KernelProvider.load(tmp_path / "missing.json")
