"""float32 out and gradients under a float16/bfloat16 call (CPU): af_flash_attn writes a float32 out, and
af_flash_attn_backward float32 dq/dk/dv, so partial results that are summed later (attnforge.distributed's ring blocks
and reduce-scattered dK/dV) are not rounded to 16 bits first. Checked against the float64 references (the widened
result must be closer to them than the 16-bit one, and within float32 accumulation error of the kernel run on the
same inputs in float32), and refused where not supported (CUDA tensors, float64, a dtype that is neither)."""
import pytest

torch = pytest.importorskip("torch")

import attnforge  # noqa: E402
from attnforge import _C, _backward, _flash_call  # noqa: E402


def _inputs(dtype, varlen=False):
    torch.manual_seed(7)
    if varlen:
        cu = torch.tensor([0, 5, 37, 64], dtype=torch.int32)
        q, k, v = torch.randn(64, 4, 48), torch.randn(64, 2, 48), torch.randn(64, 2, 40)
        return [t.to(dtype) for t in (q, k, v)], dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32,
                                                      max_seqlen_k=32, varlen=True)
    q, k, v = torch.randn(2, 33, 4, 48), torch.randn(2, 47, 2, 48), torch.randn(2, 47, 2, 40)
    return [t.to(dtype) for t in (q, k, v)], {}


def _reference_forward(q, k, v, window, extra):
    """float64 reference of the same call (af_flash_attn_reference on float32 copies of the 16-bit inputs)."""
    q32, k32, v32 = (t.float() for t in (q, k, v))
    out, lse = _flash_call._outputs(q32, v32, "cu_seqlens_q" in extra, True)
    _C.flash_attn(q32, k32, v32, out, lse, causal=False, window=window, softcap=0.0,
                  cu_seqlens_q=extra.get("cu_seqlens_q"), cu_seqlens_k=extra.get("cu_seqlens_k"),
                  max_seqlen_q=extra.get("max_seqlen_q", 0), max_seqlen_k=extra.get("max_seqlen_k", 0),
                  reference=True)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("window", [None, (5, 0), (None, 3)])
def test_float32_out_and_gradients(dtype, varlen, window):
    (q, k, v), extra = _inputs(dtype, varlen)
    out32, lse32 = _flash_call.run(q, k, v, None, False, window, 0.0, None, return_lse=True, float32_out=True,
                                   **extra)
    out16, lse16 = _flash_call.run(q, k, v, None, False, window, 0.0, None, return_lse=True, **extra)
    ref_out, ref_lse = _reference_forward(q, k, v, window, extra)
    assert out32.dtype == torch.float32 and out16.dtype == dtype
    err32 = (out32 - ref_out).abs().max().item()
    err16 = (out16.float() - ref_out).abs().max().item()
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3   # P·V runs on 16-bit P in the kernel; out is not rounded
    assert err32 < bound and err32 < err16, (err32, err16)
    torch.testing.assert_close(lse32, lse16, atol=1e-4, rtol=1e-5)   # exp2 is more exact for a float32 out
    torch.testing.assert_close(lse32, ref_lse, atol=1e-4, rtol=1e-5)

    dout = torch.randn(out32.shape)
    window_size = window if window is not None else (None, None)
    bw = dict(cu_seqlens_q=extra.get("cu_seqlens_q"), cu_seqlens_k=extra.get("cu_seqlens_k"),
              max_seqlen_q=extra.get("max_seqlen_q"), max_seqlen_k=extra.get("max_seqlen_k"))
    wide = _backward.flash_backward(dout, q, k, v, out32, lse32, window_size=window_size, float32_grads=True, **bw)
    narrow = _backward.flash_backward(dout.to(dtype), q, k, v, out16, lse16, window_size=window_size, **bw)
    ref = _backward.flash_backward(dout, q.float(), k.float(), v.float(), ref_out, ref_lse, window_size=window_size,
                                   reference=True, **bw)
    for name, w, n, r, t in zip("qkv", wide[:3], narrow[:3], ref[:3], (q, k, v)):
        assert w.dtype == torch.float32 and n.dtype == dtype and w.shape == t.shape
        err_w = (w - r).abs().max().item()
        err_n = (n.float() - r).abs().max().item()
        assert err_w <= err_n and err_w < 0.05 * r.abs().max().item() + 1e-3, (name, err_w, err_n)


def test_widening_refused_where_not_taken():
    (q, k, v), _ = _inputs(torch.float32)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float16)
    with pytest.raises(attnforge.InvalidArgumentError, match="out: dtype float16 does not match query's float32"):
        _C.flash_attn(q, k, v, out, None, causal=False, window=None, softcap=0.0)
    (q, k, v), _ = _inputs(torch.bfloat16)
    out, lse = _flash_call.run(q, k, v, None, False, None, 0.0, None, return_lse=True, float32_out=True)
    dq = torch.empty(q.shape, dtype=torch.float16)   # only float32 widens
    dk, dv = torch.empty(k.shape, dtype=torch.float32), torch.empty(v.shape, dtype=torch.float32)
    with pytest.raises(attnforge.InvalidArgumentError, match="dq: dtype float16 does not match query's bfloat16"):
        _C.flash_attn_backward(q, k, v, out, torch.zeros_like(out), lse, dq, dk, dv, None, causal=False,
                               window=None, softcap=0.0)
    dout16 = torch.zeros(out.shape, dtype=torch.bfloat16)   # dout must be out's dtype, never widened
    with pytest.raises(attnforge.InvalidArgumentError, match="dout: dtype bfloat16 does not match out's float32"):
        _C.flash_attn_backward(q, k, v, out, dout16, lse, torch.empty(q.shape), dk, dv, None, causal=False,
                               window=None, softcap=0.0)
