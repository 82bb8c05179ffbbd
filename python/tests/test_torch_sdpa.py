"""attnforge against torch.nn.functional.scaled_dot_product_attention, the oracle: dtypes, head layouts,
causality with L = S and L != S (PyTorch's top-left), scale, masks, layouts, and calls through the provider."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # about one output rounding


def oracle(*args, **kwargs):
    """PyTorch's SDPA in float32 on the same (rounded) inputs, rounded once to the input dtype."""
    dtype = args[0].dtype
    up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    return F.scaled_dot_product_attention(*up, **kw).to(dtype)


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def qkv(B, hq, hkv, L, S, E, Ev, dtype, layout="hnd", seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(h, n, d):
        if layout == "nhd":   # HND view of NHD-contiguous memory: the copy-free layout
            return torch.randn(B, n, h, d, generator=g).to(dtype).transpose(1, 2)
        if layout == "sliced":   # neither: a view into a larger buffer
            return torch.randn(B, h, n, 2 * d, generator=g).to(dtype)[..., ::2]
        return torch.randn(B, h, n, d, generator=g).to(dtype)

    return make(hq, L, E), make(hkv, S, E), make(hkv, S, Ev)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(16, 16), (17, 19), (19, 17), (1, 33)], ids=lambda ls: f"L{ls[0]}S{ls[1]}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [None, 0.125], ids=["scale_default", "scale"])
def test_sdpa_matches_pytorch(dtype, heads, lengths, is_causal, scale):
    (hq, hkv), (L, S) = heads, lengths
    q, k, v = qkv(2, hq, hkv, L, S, 8, 8, dtype)
    gqa = hq != hkv
    got = af.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert_close(got, oracle(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["hnd", "nhd", "sliced"])
def test_layouts_and_value_head_dim(dtype, layout):
    q, k, v = qkv(2, 4, 2, 21, 37, 64, 40, dtype, layout=layout)
    got = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(got, oracle(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks(dtype):
    q, k, v = qkv(1, 2, 2, 6, 9, 16, 16, dtype)
    g = torch.Generator().manual_seed(1)
    bool_mask = torch.rand(6, 9, generator=g) < 0.6
    bool_mask[:, 0] = True   # a row with no key is NaN in PyTorch's math path, 0 in attnforge (documented)
    assert_close(af.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), oracle(q, k, v, attn_mask=bool_mask))
    additive = torch.randn(1, 2, 6, 9, generator=g).to(dtype)
    assert_close(af.scaled_dot_product_attention(q, k, v, attn_mask=additive), oracle(q, k, v, attn_mask=additive))


def test_lse_matches_logsumexp():
    q, k, v = qkv(1, 2, 2, 5, 7, 8, 8, torch.float32)
    out, lse = af.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)


def test_output_is_a_hnd_view_of_nhd_memory_like_pytorch_cpu_flash():
    q, k, v = qkv(2, 4, 4, 8, 8, 16, 16, torch.float32)
    out = af.scaled_dot_product_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("form", ["positional", "keyword"])
def test_provider_calls_match_pytorch(dtype, layout, form):
    q, k, v = qkv(2, 4, 4, 17, 19, 8, 8, dtype, layout=layout)
    provider = af.FlashAttention4KernelProvider()
    if form == "positional":
        sample = ((q, k, v), {"is_causal": True, "scale": 0.125})
    else:
        sample = ((), {"query": q, "key": k, "value": v, "is_causal": True, "scale": 0.125})
    assert provider.prepare([sample]), provider.reason
    assert provider.to_dict()["copy_free_layout"] is (layout == "nhd")
    got = provider(*sample[0], **sample[1])
    assert_close(got, oracle(q, k, v, is_causal=True, scale=0.125))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_seed_functional_check(heads):
    """The seed's GPU functional test, on the CPU: fp16 (1,H,16,64), causal, scale 0.125, within 2e-2."""
    hq, hkv = heads
    q, k, v = qkv(1, hq, hkv, 16, 16, 64, 64, torch.float16, layout="nhd")
    kwargs = {"is_causal": True, "scale": 0.125, "enable_gqa": hq != hkv}
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), kwargs)]), provider.reason
    torch.testing.assert_close(provider(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs),
                               atol=2e-2, rtol=2e-2)


def test_calls_that_differ_from_the_plan_run_with_their_own_arguments():
    """The per-call guard: a call whose causality, scale, mask or layout differs from the plan is computed with
    its own arguments (general path), never with the plan's."""
    q, k, v = qkv(1, 2, 2, 9, 9, 8, 8, torch.float32, layout="nhd")
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    assert_close(provider(q, k, v), oracle(q, k, v))                                     # not causal
    assert_close(provider(q, k, v, is_causal=True, scale=0.3), oracle(q, k, v, is_causal=True, scale=0.3))
    mask = torch.rand(9, 9) < 0.5
    mask[:, 0] = True
    assert_close(provider(q, k, v, attn_mask=mask), oracle(q, k, v, attn_mask=mask))
    hq, hk, hv = (t.contiguous() for t in (q, k, v))                                     # no longer copy-free
    assert_close(provider(hq, hk, hv, is_causal=True), oracle(q, k, v, is_causal=True))
    assert_close(provider(query=q, key=k, value=v, is_causal=True), oracle(q, k, v, is_causal=True))
    assert_close(provider(q, k, value=v, is_causal=True), oracle(q, k, v, is_causal=True))  # neither form
    stats = af._C._testing_stats(provider._c)
    assert stats["plan_calls"] == 0 and stats["general_calls"] == 6
    assert_close(provider(q, k, v, is_causal=True), oracle(q, k, v, is_causal=True))
    assert af._C._testing_stats(provider._c)["plan_calls"] == 1


def test_strict_infer_refuses_uncovered_calls_without_running_them():
    q, k, v = qkv(1, 2, 2, 9, 9, 8, 8, torch.float32, layout="nhd")
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    with pytest.raises(af.PlanMismatchError, match="is_causal is false, the plan's is true"):
        provider.infer((q, k, v), {}, strict=True)
    with pytest.raises(af.PlanMismatchError, match="q/k/v passed as keyword_qkv"):
        provider.infer((), {"query": q, "key": k, "value": v, "is_causal": True}, strict=True)
    with pytest.raises(af.PlanMismatchError, match="no longer an HND view of NHD-contiguous memory"):
        provider.infer((q.contiguous(), k, v), {"is_causal": True}, strict=True)
    with pytest.raises(af.PlanMismatchError):   # neither the positional nor the keyword form
        provider.infer((q, k), {"value": v, "is_causal": True}, strict=True)
    stats = af._C._testing_stats(provider._c)
    assert stats["plan_calls"] == 0 and stats["general_calls"] == 0
    assert_close(provider.infer((q, k, v), {"is_causal": True}, strict=True), oracle(q, k, v, is_causal=True))


def test_causal_with_fewer_queries_than_keys_is_top_left_as_in_pytorch():
    """FlashAttention's causal is bottom-right when L != S; the provider keeps SDPA's top-left meaning."""
    q, k, v = qkv(1, 2, 2, 4, 12, 8, 8, torch.float32, layout="nhd")
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    assert_close(provider(q, k, v, is_causal=True), oracle(q, k, v, is_causal=True))


def test_errors_from_torch_tensors():
    q = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    with pytest.raises(af.UnsupportedError, match="query: dtype float64 is not supported"):
        af.scaled_dot_product_attention(q, q, q)
    x = torch.zeros(1, 1, 2, 4, requires_grad=True)
    assert af.scaled_dot_product_attention(x, x, x).requires_grad   # the operator's backward (test_backward.py)
    with pytest.raises(af.UnsupportedError, match="records no autograd"):   # out= bypasses the operator
        af.scaled_dot_product_attention(x, x, x, out=torch.empty(1, 1, 2, 4))
    with torch.no_grad():   # requires_grad under no_grad: exported as a view, no copy
        af.scaled_dot_product_attention(x, x, x)
    m = torch.zeros(1, 1, 2, 4, device="meta")
    shape_only = af.scaled_dot_product_attention(m, m, m)   # the operator's fake implementation: shapes, no data
    assert shape_only.device.type == "meta" and shape_only.shape == (1, 1, 2, 4)
    with pytest.raises(af.UnsupportedError, match="query: cannot be read through DLPack: .*meta"):
        af.scaled_dot_product_attention(m, m, m, out=torch.empty(1, 1, 2, 4, device="meta"))   # the C call itself
