"""float8 K/V through attnforge.flash_attn_func / flash_attn_varlen_func: torch.float8_e4m3fn and torch.float8_e5m2
tensors cross DLPack as they are (codes 10 and 12, 8 bits), under float32/float16/bfloat16 queries (a quantised KV
cache) or as all of q, k and v (FA4's case, out bfloat16), with FA3/FA4's q/k/v_descale (B, Hkv) keywords; checked
against a float64 reference written here: scores scale·q·k·q_descale·k_descale, out softmax·v·v_descale per
(batch, kv head), lse of the descaled scores."""
import math

import pytest

torch = pytest.importorskip("torch")

import attnforge as af  # noqa: E402

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # about one output rounding


def reference(q, k, v, scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None):
    """q (B, Lq, Hq, E), k (B, S, Hkv, E), v (B, S, Hkv, Ev), descales (B, Hkv) -> out (B, Lq, Hq, Ev), lse
    (B, Hq, Lq), float64. Query head h reads kv head h // (Hq / Hkv); causal is bottom-right aligned."""
    B, Lq, Hq, E = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    per_head = lambda d: d.double().repeat_interleave(group, dim=1)   # (B, Hkv) -> (B, Hq)
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, dim=2), v.double().repeat_interleave(group, dim=2)
    s = torch.einsum("blhe,bshe->bhls", qd, kd) * (1.0 / math.sqrt(E) if scale is None else scale)
    for d in (q_descale, k_descale):
        if d is not None:
            s = s * per_head(d)[:, :, None, None]
    if causal:
        i, j = torch.arange(Lq)[:, None], torch.arange(S)[None, :]
        s = s.masked_fill(j > i + S - Lq, float("-inf"))
    out = torch.einsum("bhls,bshe->blhe", torch.softmax(s, dim=-1), vd)
    if v_descale is not None:
        out = out * per_head(v_descale)[:, None, :, None]
    return out, torch.logsumexp(s, dim=-1)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def descales(B, Hkv, seed):
    g = torch.Generator().manual_seed(seed)
    return [0.25 * 16.0 ** torch.rand(B, Hkv, generator=g) for _ in range(3)]


def assert_close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * max(1.0, float(want.abs().max())), rtol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("with_descale", [False, True])
@pytest.mark.parametrize("Lq,S,causal", [(1, 700, False), (9, 70, True)])   # decode (split-KV, direct), prefill
def test_float8_cache_under_a_float_query(fmt, q_dtype, with_descale, Lq, S, causal):
    B, Hq, Hkv, E = 2, 8, 2, 64
    q = randn(B, Lq, Hq, E, dtype=q_dtype, seed=1)
    k, v = randn(B, S, Hkv, E, dtype=fmt, seed=2), randn(B, S, Hkv, E, dtype=fmt, seed=3)
    qd, kd, vd = descales(B, Hkv, 4) if with_descale else (None, None, None)
    with torch.no_grad():
        out, lse = af.flash_attn_func(q, k, v, causal=causal, return_lse=True, q_descale=qd, k_descale=kd,
                                      v_descale=vd)
    want, want_lse = reference(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_close(out, want, q_dtype)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_float8_gives_bfloat16_as_fa4(fmt):
    B, Lq, S, Hq, Hkv, E = 1, 5, 90, 4, 4, 32
    q, k, v = (randn(B, n, Hq if i == 0 else Hkv, E, dtype=fmt, seed=10 + i) for i, n in enumerate((Lq, S, S)))
    qd, kd, vd = descales(B, Hkv, 11)
    out, _ = af.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    want, _ = reference(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_close(out, want, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_float8_cache_with_varlen_queries(fmt):
    """Two sequences (3 and 1 query rows, 40 and 29 keys) over pages of 16 float8 keys in shuffled order."""
    Hq, Hkv, E, page = 4, 2, 32, 16
    lengths_q, lengths_k = [3, 1], [40, 29]
    q = randn(sum(lengths_q), Hq, E, dtype=torch.float16, seed=20)
    k_seq = [randn(1, n, Hkv, E, dtype=fmt, seed=21 + b) for b, n in enumerate(lengths_k)]
    v_seq = [randn(1, n, Hkv, E, dtype=fmt, seed=31 + b) for b, n in enumerate(lengths_k)]
    pages_of = [math.ceil(n / page) for n in lengths_k]
    order = torch.randperm(sum(pages_of), generator=torch.Generator().manual_seed(5))
    k_cache = torch.zeros(sum(pages_of), page, Hkv, E, dtype=fmt)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(2, max(pages_of), dtype=torch.int32)
    at = 0
    for b, n in enumerate(lengths_k):
        for p in range(pages_of[b]):
            index = int(order[at])
            at += 1
            table[b, p] = index
            rows = slice(p * page, min(n, (p + 1) * page))
            k_cache[index, : rows.stop - rows.start] = k_seq[b][0, rows]
            v_cache[index, : rows.stop - rows.start] = v_seq[b][0, rows]
    qd, kd, vd = descales(2, Hkv, 6)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    out, _ = af.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=3, page_table=table,
                                       seqused_k=torch.tensor(lengths_k, dtype=torch.int32), causal=True,
                                       q_descale=qd, k_descale=kd, v_descale=vd)
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        want, _ = reference(q[rows][None], k_seq[b], v_seq[b], causal=True, q_descale=qd[b:b + 1],
                            k_descale=kd[b:b + 1], v_descale=vd[b:b + 1])
        assert_close(out[rows][None], want, torch.float16)


def test_float8_tensors_are_read_in_place():
    """No copy: a float8 view with strides (a slice of a bigger cache) is read through its strides, and bytes outside
    it (NaN here) never reach the result."""
    big = torch.full((1, 50, 4, 32), float("nan")).to(torch.float8_e4m3fn)
    big[:, :40, 1:3] = randn(1, 40, 2, 32, dtype=torch.float8_e4m3fn, seed=40)
    k = big[:, :40, 1:3]
    v = big[:, :40, 1:3].flip(1)
    q = randn(1, 2, 4, 32, dtype=torch.float32, seed=41)
    out, _ = af.flash_attn_func(q, k, v)
    want, _ = reference(q, k, v)
    assert_close(out, want, torch.float32)


def test_float8_errors_name_the_rule():
    q = randn(1, 2, 2, 16, dtype=torch.float16, seed=50)
    k16 = randn(1, 8, 2, 16, dtype=torch.float16, seed=51)
    k8 = k16.to(torch.float8_e4m3fn)
    d = torch.ones(1, 2)
    with pytest.raises(af.InvalidArgumentError, match="q_descale/k_descale/v_descale are only supported for FP8"):
        af.flash_attn_func(q, k16, k16, k_descale=d)
    with pytest.raises(af.UnsupportedError, match="k and v must have the same dtype"):
        af.flash_attn_func(q, k8, k16.to(torch.float8_e5m2))
    with pytest.raises(af.InvalidArgumentError, match=r"v_descale: expected shape \(1, 2\), got \(2, 1\)"):
        af.flash_attn_func(q, k8, k8, v_descale=torch.ones(2, 1))
    with pytest.raises(af.InvalidArgumentError, match="q_descale: dtype must be float32, got float16"):
        af.flash_attn_func(q, k8, k8, q_descale=d.half())
    with pytest.raises(af.UnsupportedError, match="q, k, v, and qv must have the same dtype"):
        af.flash_attn_func(q.to(torch.float8_e4m3fn), k16, k16)
    with pytest.raises(af.UnsupportedError, match="not supported by af_sdpa"):   # SDPA keeps its meaning
        af.scaled_dot_product_attention(q.transpose(1, 2), k8.transpose(1, 2), k8.transpose(1, 2), enable_gqa=True)
