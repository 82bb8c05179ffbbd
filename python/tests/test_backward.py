"""Gradients of attnforge's Python APIs and operators (the C backward through _backward and each operator's Autograd
kernel) against PyTorch's autograd of the same attention in float64 on the same inputs.

The bound is FlashAttention-4's rule (tests/cute/test_flash_attn.py): attnforge's error against the float64 gradient
is at most twice PyTorch's own error in the input dtype (the same computation by PyTorch's autograd in that dtype)
plus two units in the last place of the dtype at the gradient's largest magnitude (FA4 estimates that rounding as
|(r + 0.3) - 0.3 - r|, which can undershoot it: a dsink of 3.3 rounds to float16 by up to 1e-3 and that
estimate gave 2.7e-4), per gradient. For float32 the additive term has a floor
of 1e-5 x the gradient's largest magnitude: PyTorch's float32 error here is ~1e-7, below what any other summation
order of the same float32 products gives (a gradient sums S x E products through two chained matmuls), and 1e-5 is
still 400x below bfloat16's unit roundoff."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
from attnforge import _ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def grads_of(fn, inputs, grad_out):
    """The gradients of fn(*inputs) (its first output) for dLoss/dout = grad_out, with respect to inputs."""
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))


def assert_fa4_bound(got, low, ref, names):
    """FA4's rule per gradient: |got - ref| <= 2 |low - ref| + 2 ulp(max |ref|) (ref float64; low, got in the
    dtype)."""
    for name, g, p, r in zip(names, got, low, ref):
        assert g.shape == r.shape and g.dtype == p.dtype, name
        largest = r.abs().max().item()
        rounding = torch.finfo(p.dtype).eps * 2.0 ** math.floor(math.log2(largest)) if largest > 0 else 0.0
        if p.dtype == torch.float32:
            rounding = max(rounding, 1e-5 * largest)
        err = (g.double() - r).abs().max().item()
        bound = 2 * (p.double() - r).abs().max().item() + 2 * rounding
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def check(fn_af, fn_ref, inputs, dtype, seed=7, names=("dq", "dk", "dv")):
    """attnforge's gradients (fn_af on inputs in dtype) against fn_ref's in float64, bounded by fn_ref's in dtype."""
    low = leaves(inputs, dtype)
    out = fn_af(*low)
    out = out[0] if isinstance(out, tuple) else out
    grad_out = randn(*out.shape, seed=seed)
    got = torch.autograd.grad(out, low, grad_out.to(out.dtype))
    ref = grads_of(fn_ref, leaves(inputs, torch.float64), grad_out.double())
    pt = grads_of(fn_ref, leaves(inputs, dtype), grad_out)
    assert_fa4_bound(got, pt, ref, names)
    return got


# ---------------------------------------------------------------- attnforge.scaled_dot_product_attention
def bottom_right(L, S):
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)


SDPA_CASES = {
    # name: (q shape, k shape, v shape, kwargs)
    "plain": ((2, 3, 9, 16), (2, 3, 12, 16), (2, 3, 12, 16), {}),
    "causal_L<S": ((1, 2, 7, 16), (1, 2, 13, 16), (1, 2, 13, 8), {"is_causal": True}),
    "causal_L>S": ((1, 2, 13, 16), (1, 2, 7, 16), (1, 2, 7, 16), {"is_causal": True}),
    "bottom_right_L<S": ((1, 2, 7, 16), (1, 2, 13, 16), (1, 2, 13, 16), {"causal_bottom_right": True}),
    "bottom_right_L>S": ((1, 2, 13, 16), (1, 2, 7, 16), (1, 2, 7, 16), {"causal_bottom_right": True}),
    "gqa": ((2, 6, 9, 16), (2, 2, 11, 16), (2, 2, 11, 24), {"enable_gqa": True, "scale": 0.3}),
    "gqa_unequal_groups": ((1, 8, 5, 16), (1, 2, 6, 16), (1, 4, 6, 16), {"enable_gqa": True}),
    "mqa_broadcast": ((2, 4, 9, 16), (2, 1, 10, 16), (2, 1, 10, 16), {}),
    "broadcast_batch_and_heads": ((2, 4, 9, 16), (1, 4, 10, 16), (2, 1, 10, 16), {}),
    "broadcast_query": ((1, 1, 9, 16), (2, 3, 10, 16), (2, 3, 10, 16), {}),
    "bool_mask": ((2, 2, 9, 16), (2, 2, 10, 16), (2, 2, 10, 16), {"attn_mask": "bool"}),
    "additive_mask_broadcast": ((2, 2, 9, 16), (2, 2, 10, 16), (2, 2, 10, 16), {"attn_mask": "additive"}),
    "head_mask": ((2, 2, 9, 16), (2, 2, 10, 16), (2, 2, 10, 16), {"attn_mask": "heads"}),
    "rank3": ((3, 9, 16), (1, 10, 16), (3, 10, 16), {"is_causal": True}),
    "rank2": ((9, 16), (10, 16), (10, 8), {}),
    "rank5": ((2, 3, 2, 5, 16), (2, 1, 2, 6, 16), (1, 3, 2, 6, 16), {}),
}


def sdpa_mask(kind, dtype):
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(2, 1, 9, 10, generator=g) > 0.4
        mask[..., 0] = True   # every row sees a key (PyTorch's math gives NaN rows otherwise)
        return mask
    if kind == "additive":
        return torch.randn(9, 10, generator=g).to(dtype)
    return torch.randn(1, 2, 1, 10, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_gradients(case, dtype):
    qs, ks, vs, kwargs = SDPA_CASES[case]
    kwargs = dict(kwargs)
    inputs = [randn(*qs, seed=1), randn(*ks, seed=2), randn(*vs, seed=3)]
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = sdpa_mask(kwargs["attn_mask"], dtype)

    def ref(q, k, v):
        kw = dict(kwargs)
        if kw.pop("causal_bottom_right", False):
            kw["attn_mask"] = bottom_right(q.shape[-2], k.shape[-2])
        mask = kw.get("attn_mask")
        if mask is not None and mask.dtype != torch.bool:
            kw["attn_mask"] = mask.to(q.dtype)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    got = check(lambda q, k, v: af.scaled_dot_product_attention(q, k, v, **kwargs), ref, inputs, dtype)
    for g, t in zip(got, inputs):
        assert g.shape == t.shape


def test_sdpa_backward_contract():
    """_backward.sdpa_backward as PyTorch's flash-attention registration calls it: lse (B, H, L) float32 from the
    forward, gradients in the inputs' shapes (broadcast ones summed back) and dtypes; the reference twin agrees."""
    from attnforge import _backward
    q, k, v = randn(2, 4, 6, 16, seed=1), randn(1, 2, 7, 16, seed=2), randn(1, 2, 7, 16, seed=3)
    out, lse = af.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, return_lse=True)
    grad_out = randn(*out.shape, seed=4)
    fast = _backward.sdpa_backward(grad_out, q, k, v, out, lse, is_causal=True, enable_gqa=True)
    slow = _backward.sdpa_backward(grad_out, q, k, v, out, lse, is_causal=True, enable_gqa=True, reference=True)
    q2, k2, v2 = leaves((q, k, v), torch.float64)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True),
                               (q2, k2, v2), grad_out.double())
    for f, s, w, t in zip(fast, slow, want, (q, k, v)):
        assert f.shape == t.shape and f.dtype == t.dtype
        torch.testing.assert_close(f.double(), w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(s.double(), w, atol=2e-5, rtol=2e-5)


def test_mask_gradient_is_refused_not_dropped():
    q = randn(1, 2, 4, 8).requires_grad_()
    mask = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(af.UnsupportedError, match="attn_mask: requires grad"):
        af.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert af.scaled_dot_product_attention(q, q, q, attn_mask=mask.detach()).requires_grad


# ---------------------------------------------------------------- flash_attn_func / flash_attn_varlen_func
def flash_reference(q, k, v, sink=None, scale=None, causal=False, window_size=(None, None), softcap=0.0):
    """FA4's meaning in plain PyTorch ops (differentiable): q (B, Lq, Hq, E), k/v (B, S, Hkv, D), bottom-right
    windows with literal sides (None unbounded), softcap through tanh, a sink logit per head in the denominator."""
    B, Lq, Hq, E = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bqhe,bkhe->bhqk", q, k) * (E ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    if causal:
        right = 0
    i, j = torch.arange(Lq)[:, None] + S - Lq, torch.arange(S)[None, :]
    ok = torch.ones(Lq, S, dtype=torch.bool)
    if right is not None:
        ok &= j <= i + right
    if left is not None:
        ok &= j >= i - left
    s = s.masked_fill(~ok, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype)[None, :, None, None].expand(B, Hq, Lq, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:   # a row that sees no key: out 0, no gradient (softmax of nothing would be NaN)
        seen = ok.any(-1)[:, None]
        p = torch.softmax(torch.where(seen, s, 0.0), dim=-1) * seen
    return torch.einsum("bhqk,bkhe->bqhe", p, v)


FLASH_CASES = {
    # name: (Lq, S, Hq, Hkv, kwargs)
    "plain_gqa": (9, 12, 4, 2, {}),
    "causal_L<S": (7, 13, 2, 2, {"causal": True}),
    "causal_L>S": (13, 7, 2, 1, {"causal": True}),
    "window": (11, 11, 2, 2, {"window_size": (3, 2)}),
    "window_negative_right": (11, 14, 2, 2, {"window_size": (None, -1)}),
    "window_negative_left": (11, 11, 2, 2, {"window_size": (-2, 5)}),
    "softcap": (9, 10, 4, 2, {"softcap": 0.8, "softmax_scale": 0.5}),
    "sink": (9, 10, 4, 2, {"sink": True, "causal": True}),
    "softcap_sink_window": (10, 12, 4, 1, {"sink": True, "softcap": 1.5, "window_size": (4, 0)}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attn_func_gradients(case, dtype):
    Lq, S, Hq, Hkv, kwargs = FLASH_CASES[case]
    kwargs = dict(kwargs)
    inputs = [randn(2, Lq, Hq, 16, seed=1), randn(2, S, Hkv, 16, seed=2), randn(2, S, Hkv, 12, seed=3)]
    names = ["dq", "dk", "dv"]
    if kwargs.pop("sink", False):
        inputs.append(randn(Hq, seed=4))
        names.append("dsink")

    def ours(q, k, v, sink=None):
        return af.flash_attn_func(q, k, v, learnable_sink=sink, **kwargs)[0]

    def ref(q, k, v, sink=None):
        kw = dict(kwargs)
        return flash_reference(q, k, v, sink, scale=kw.pop("softmax_scale", None), **kw)

    check(ours, ref, inputs, dtype, names=names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flash_attn_varlen_func_gradients(dtype):
    """Packed sequences of different lengths (one with no query row), causal, a window and a sink; each sequence's
    reference on its own slice."""
    lens_q, lens_k = [3, 0, 6], [5, 4, 6]
    cu_q = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 15], dtype=torch.int32)
    inputs = [randn(9, 4, 16, seed=1), randn(15, 2, 16, seed=2), randn(15, 2, 16, seed=3), randn(4, seed=4)]
    kwargs = {"causal": True, "window_size": (2, None), "softcap": 2.0}

    def ours(q, k, v, sink):
        return af.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=sink,
                                         **kwargs)[0]

    def ref(q, k, v, sink):
        outs = []
        for b in range(3):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            outs.append(flash_reference(q[None, qs], k[None, ks], v[None, ks], sink, **kwargs)[0])
        return torch.cat(outs)

    assert sum(lens_q) == 9 and sum(lens_k) == 15
    check(ours, ref, inputs, dtype, names=("dq", "dk", "dv", "dsink"))


def test_flash_refusals_before_the_forward():
    q, k, v = randn(1, 4, 2, 8).requires_grad_(), randn(4, 1, 2, 8), randn(4, 1, 2, 8)
    table = torch.arange(4, dtype=torch.int32)[None]
    with pytest.raises(af.UnsupportedError, match="page_table: paged K/V has no backward"):
        af.flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=torch.tensor([4], dtype=torch.int32))


# ---------------------------------------------------------------- attnforge::masked_rows (Transformers' path)
def masked_rows_reference(q, k, v, mask, scale, softcap, sink):
    """Transformers' eager attention (softcap, mask, a sink per head) on (B, H, L, D) → (B, L, Hq, Ev)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p[..., :-1] if sink is not None else p)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap,sink", [(1.5, False), (0.0, True), (3.0, True)], ids=["softcap", "sink", "both"])
def test_masked_rows_gradients(softcap, sink, dtype):
    """Causal rows under left padding (each row one contiguous key range; with a sink, a padded row that sees no key
    at all): softcap and sink through the masked_rows operator and its PyTorch backward."""
    B, Hq, Hkv, L, S = 2, 4, 2, 7, 9
    mask = bottom_right(L, S).repeat(B, 1, 1, 1)
    mask[1, :, :, :4] = False    # left padding of the second sequence: its first rows see nothing
    if not sink:
        mask[1, :, :, 3] = True  # without a sink every row needs a key (the reference's NaN otherwise)
    inputs = [randn(B, Hq, L, 16, seed=1), randn(B, Hkv, S, 16, seed=2), randn(B, Hkv, S, 16, seed=3)]
    names = ["dq", "dk", "dv"]
    if sink:
        inputs.append(randn(Hq, seed=4))
        names.append("dsink")

    def ours(q, k, v, s=None):
        return _ops.masked_rows(q, k, v, mask, 0.25, softcap, s)

    def ref(q, k, v, s=None):
        return masked_rows_reference(q, k, v, mask, 0.25, softcap, s)

    check(ours, ref, inputs, dtype, names=names)


# ---------------------------------------------------------------- opcheck, torch.compile
def _opcheck_args():
    g = lambda *s, seed=0: randn(*s, seed=seed).requires_grad_()   # noqa: E731
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(2)
    mask[1, :, :, :2] = False
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    return {
        "sdpa": (torch.ops.attnforge.sdpa.default,
                 (g(2, 4, 5, 8, seed=1), g(2, 2, 7, 8, seed=2), g(2, 2, 7, 8, seed=3), mask, 0.0, False, 0.3, True,
                  False, False)),
        "sdpa_lse": (torch.ops.attnforge.sdpa.default,
                     (g(1, 2, 5, 8, seed=1), g(1, 2, 7, 8, seed=2), g(1, 2, 7, 8, seed=3), None, 0.0, False, None,
                      False, True, True)),
        "flash_attn": (torch.ops.attnforge.flash_attn.default,
                       (g(2, 5, 4, 8, seed=1), g(2, 7, 2, 8, seed=2), g(2, 7, 2, 8, seed=3), None, False, True, 3, -1,
                        5.0, g(4, seed=4), None, None, None, None, None, None, None, None, None, False, False)),
        "flash_attn_varlen": (torch.ops.attnforge.flash_attn.default,
                              (g(7, 4, 8, seed=1), g(9, 2, 8, seed=2), g(9, 2, 8, seed=3), None, True, False, None,
                               None, 0.0, None, cu_q, cu_k, 4, 5, None, None, None, None, None, True, True)),
        "masked_rows": (torch.ops.attnforge.masked_rows.default,
                        (g(2, 4, 5, 8, seed=1), g(2, 2, 7, 8, seed=2), g(2, 2, 7, 8, seed=3), mask, None, 1.5,
                         g(4, seed=4))),
    }


@pytest.mark.parametrize("name", ["sdpa", "sdpa_lse", "flash_attn", "flash_attn_varlen", "masked_rows"])
def test_opcheck_with_gradients(name):
    op, args = _opcheck_args()[name]
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"} and "test_aot_dispatch_dynamic" in result


def test_opcheck_provider_sdpa_with_gradients():
    q, k, v = (randn(1, 4, 6, 16, seed=i).requires_grad_() for i in range(3))
    provider = af.FlashAttention4KernelProvider()
    with torch.no_grad():
        import attnforge.torch as aft
        module = torch.nn.Module()
        module.forward = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert provider.prepare(aft.record(module, q, k, v))
    view = _ops.plan_view(provider)
    result = torch.library.opcheck(torch.ops.attnforge.provider_sdpa.default, (view.json, q, k, v, True, None, False,
                                                                               False))
    assert set(result.values()) == {"SUCCESS"}


def test_compiled_backward_equals_eager():
    """torch.compile(fullgraph=True): the backward of every operator traced by AOTAutograd gives eager's gradients."""
    q, k, v = randn(2, 4, 6, 16, seed=1), randn(2, 2, 8, 16, seed=2), randn(2, 2, 8, 16, seed=3)
    sink = randn(4, seed=4)
    mask = torch.ones(2, 1, 6, 8, dtype=torch.bool).tril(2)

    def step(q, k, v, sink):
        a = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b, _ = af.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softcap=2.0,
                                  window_size=(3, 1), learnable_sink=sink)
        c = _ops.masked_rows(q, k, v, mask, None, 1.5, sink)
        return (a.square().sum() + b.transpose(1, 2).sin().sum() + c.cos().sum()) * 1.0

    eager_in = leaves((q, k, v, sink))
    want = torch.autograd.grad(step(*eager_in), eager_in)
    compiled_in = leaves((q, k, v, sink))
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(*compiled_in), compiled_in)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_second_derivative_is_refused():
    """create_graph=True would record the backward operators for a second derivative, which they do not have: an
    error there, never a silently zero second derivative."""
    q = randn(1, 2, 4, 8).requires_grad_()
    with pytest.raises(af.UnsupportedError, match="no second derivatives"):
        torch.autograd.grad(af.scaled_dot_product_attention(q, q, q).square().sum(), q, create_graph=True)
    with pytest.raises(af.UnsupportedError, match="no second derivatives"):
        torch.autograd.grad(af.flash_attn_func(q, q, q)[0].sum(), q, create_graph=True)


def test_lse_output_has_no_gradient():
    q = randn(1, 2, 4, 8).requires_grad_()
    out, lse = af.scaled_dot_product_attention(q, q, q, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    assert math.isfinite(torch.autograd.grad(out.sum(), q)[0].sum().item())
