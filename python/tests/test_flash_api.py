"""attnforge.flash_attn_func / flash_attn_varlen_func against a float64 reference written here from FlashAttention-4's
documented semantics: NHD layouts, bottom-right causal and sliding windows (with FA4's window_size resolution),
softcap, a learned sink in the denominator, GQA, LSE, variable length, paged K/V, edge cases and errors."""
import inspect
import math

import pytest

torch = pytest.importorskip("torch")

import attnforge as af  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # about one output rounding
NEG_INF = float("-inf")


# ---------------------------------------------------------------- the reference (one sequence, float64)

def visible(Lq, S, causal, left, right):
    """(Lq, S) bool: row i sees key j iff i + S - Lq - left <= j <= i + S - Lq + right (None = unbounded);
    causal = right 0. Here left/right are already resolved (the tests state FA4's resolution separately)."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(S)[None, :]
    offset = S - Lq
    ok = torch.ones(Lq, S, dtype=torch.bool)
    if causal:
        right = 0
    if right is not None:
        ok &= j <= i + offset + right
    if left is not None:
        ok &= j >= i + offset - left
    return ok


def reference_sequence(q, k, v, scale=None, causal=False, left=None, right=None, softcap=0.0, sink=None):
    """q (Lq, Hq, E), k (S, Hkv, E), v (S, Hkv, Ev) -> out (Lq, Hq, Ev) float64, lse (Hq, Lq) float64."""
    q, k, v = q.double(), k.double(), v.double()
    Lq, Hq, E = q.shape
    S, Hkv = k.shape[:2]
    group = Hq // Hkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    s = torch.einsum("qhe,khe->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(Lq, S, causal, left, right)[None], NEG_INF)
    if sink is not None:   # one more logit per head, in the denominator only
        s = torch.cat([s, sink.double()[:, None, None].expand(Hq, Lq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)                          # (Hq, Lq); -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khe->qhe", p, v)
    return out, lse


def reference_batched(q, k, v, **kw):
    outs, lses = zip(*(reference_sequence(q[b], k[b], v[b], **kw) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def assert_out(got, want, dtype, tol_scale=1.0):
    assert got.dtype == dtype
    assert got.shape == want.shape
    tol = TOL[dtype] * tol_scale
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def assert_lse(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "rows without keys must have lse = -inf, and only those"
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got.double()[finite], want[finite], atol=1e-4, rtol=1e-5)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def nhd(B, Lq, S, hq, hkv, E, Ev=None, dtype=torch.float32, seed=0):
    Ev = E if Ev is None else Ev
    return (randn(B, Lq, hq, E, dtype=dtype, seed=seed), randn(B, S, hkv, E, dtype=dtype, seed=seed + 1),
            randn(B, S, hkv, Ev, dtype=dtype, seed=seed + 2))


# ---------------------------------------------------------------- the signatures

FA4_FUNC = ["q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size", "learnable_sink",
            "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd", "mask_mod",
            "aux_tensors", "aux_scalars", "block_sparse_tensors", "block_sparse_tensors_bwd", "return_lse"]
FA4_VARLEN = ["q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "min_seqlen_k",
              "seqused_q", "seqused_k", "gather_kv_indices", "page_table", "softmax_scale", "causal", "window_size",
              "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd",
              "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars", "return_lse", "scheduler_metadata",
              "seqlen_k_per_split", "disable_scheduler_metadata"]


DESCALES = ["q_descale", "k_descale", "v_descale"]   # FA3/FA4's float8 descales: keyword-only here


def test_signatures_are_fa4s():
    """flash_attn.cute 4.0.0b27's parameter order, so positional calls written for FA4 mean the same here; the float8
    descales follow, keyword-only."""
    for func, names in ((af.flash_attn_func, FA4_FUNC), (af.flash_attn_varlen_func, FA4_VARLEN)):
        parameters = inspect.signature(func).parameters
        assert list(parameters) == names + DESCALES
        assert all(parameters[n].kind == inspect.Parameter.KEYWORD_ONLY for n in DESCALES)
    defaults = {n: p.default for n, p in inspect.signature(af.flash_attn_func).parameters.items()}
    assert defaults["window_size"] == (None, None) and defaults["softcap"] == 0.0 and defaults["num_splits"] == 1
    assert defaults["return_lse"] is False and defaults["causal"] is False and defaults["pack_gqa"] is None


def test_returns_out_and_lse_pair():
    q, k, v = nhd(2, 5, 7, 2, 2, 8)
    result = af.flash_attn_func(q, k, v)
    assert isinstance(result, tuple) and len(result) == 2 and result[1] is None
    out, lse = af.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 5, 2, 8) and out.is_contiguous() and lse.shape == (2, 2, 5)
    assert torch.equal(out, result[0])


# ---------------------------------------------------------------- flash_attn_func

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(16, 16), (5, 23), (23, 5), (1, 40)], ids=lambda ls: f"L{ls[0]}S{ls[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_func_matches_reference(dtype, heads, lengths, causal):
    (hq, hkv), (Lq, S) = heads, lengths
    q, k, v = nhd(2, Lq, S, hq, hkv, 16, dtype=dtype)
    out, lse = af.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    want, want_lse = reference_batched(q, k, v, causal=causal)
    assert_out(out, want, dtype)
    assert_lse(lse, want_lse)
    if causal and Lq > S:   # bottom-right: the first Lq - S rows see nothing
        assert torch.all(out[:, : Lq - S] == 0) and torch.all(lse[:, :, : Lq - S] == NEG_INF)


def test_causal_is_bottom_right_aligned():
    """FA4's documented example: sq = 2, sk = 5 gives [1 1 1 1 0; 1 1 1 1 1] (not PyTorch's top-left)."""
    q, k, v = nhd(1, 2, 5, 1, 1, 8)
    v = torch.eye(5)[None, :, None, :].expand(1, 5, 1, 5).contiguous()   # out row = its attention weights
    out, _ = af.flash_attn_func(q, k, v, causal=True)
    seen = out[0, :, 0] > 0
    assert seen.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


WINDOWS = [(2, 0), (3, 1), (0, 0), (None, 2), (5, None), (1, 4), (100, 100), (0, None)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("lengths", [(12, 12), (4, 19), (19, 4)], ids=lambda ls: f"L{ls[0]}S{ls[1]}")
def test_sliding_windows(window, lengths):
    Lq, S = lengths
    q, k, v = nhd(2, Lq, S, 4, 2, 16, seed=3)
    out, lse = af.flash_attn_func(q, k, v, window_size=window, return_lse=True)
    want, want_lse = reference_batched(q, k, v, left=window[0], right=window[1])
    assert_out(out, want, torch.float32)
    assert_lse(lse, want_lse)


@pytest.mark.parametrize("causal, window, meaning", [
    (False, (-1, -1), dict()),                     # a pair summing below 0 is no window
    (False, (-1, 0), dict()),                      # ... even (-1, 0): FA4 drops it (no causality)
    (False, (None, 0), dict(causal=True)),         # (None, 0) is causal
    (True, (3, None), dict(left=3, right=0)),      # causal sets right = 0
    (True, (3, 7), dict(left=3, right=0)),
    (True, (None, None), dict(causal=True)),
    (False, (4, -1), dict(left=4, right=-1)),      # an int side is literal, -1 too (FA4; FA2 read it unbounded)
    (False, (None, -1), dict(right=-1)),           # keys up to one before the diagonal: row 0 of L = S sees none
    (False, (None, -2), dict(right=-2)),
    (False, (-1, None), dict(left=-1)),            # keys from one after the diagonal
    (False, (2, -1), dict(left=2, right=-1)),      # the two keys before the diagonal
    (False, (-2, 5), dict(left=-2, right=5)),      # keys d + 2 .. d + 5
    (False, (-3, 1), dict()),                      # both ints, sum < 0: no window
    (True, (2, -1), dict(left=2, right=0)),        # causal sets right = 0 first
], ids=str)
def test_window_resolution_is_fa4s(causal, window, meaning):
    q, k, v = nhd(1, 9, 13, 2, 2, 8, seed=4)
    out, lse = af.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    want, want_lse = reference_batched(q, k, v, **meaning)
    assert_out(out, want, torch.float32)
    assert_lse(lse, want_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logit_scale", [1.0, 1e4], ids=["logits1", "logits1e4"])
def test_softcap(dtype, logit_scale):
    """softcap·tanh(s/softcap) on the scaled score, with logits of ±1e4 (saturated tanh) too."""
    q, k, v = nhd(2, 11, 17, 4, 2, 16, dtype=dtype, seed=5)
    q = (q.double() * math.sqrt(logit_scale)).to(dtype)
    k = (k.double() * math.sqrt(logit_scale)).to(dtype)
    out, lse = af.flash_attn_func(q, k, v, softcap=30.0, causal=True, return_lse=True)
    want, want_lse = reference_batched(q, k, v, softcap=30.0, causal=True)
    assert_out(out, want, dtype)
    assert_lse(lse, want_lse)
    plain, _ = af.flash_attn_func(q, k, v, causal=True)
    assert not torch.allclose(plain.double(), want, atol=1e-3), "softcap must change these results"


@pytest.mark.parametrize("sink_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sink_scale", [1.0, 30.0], ids=["sink", "dominating_sink"])
def test_learnable_sink(sink_dtype, sink_scale):
    q, k, v = nhd(2, 10, 14, 4, 2, 16, seed=6)
    sink = randn(4, dtype=sink_dtype, seed=7, scale=sink_scale)
    out, lse = af.flash_attn_func(q, k, v, learnable_sink=sink, causal=True, window_size=(3, None),
                                  return_lse=True)
    want, want_lse = reference_batched(q, k, v, sink=sink, left=3, right=0)
    assert_out(out, want, torch.float32)
    assert_lse(lse, want_lse)
    plain, plain_lse = af.flash_attn_func(q, k, v, causal=True, window_size=(3, None), return_lse=True)
    assert torch.all(lse >= plain_lse), "the sink only adds to the denominator"


def test_scale_softcap_sink_window_gqa_together():
    q, k, v = nhd(3, 13, 29, 8, 2, 32, Ev=24, dtype=torch.bfloat16, seed=8)
    sink = randn(8, seed=9)
    out, lse = af.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(6, None), softcap=5.0,
                                  learnable_sink=sink, return_lse=True)
    want, want_lse = reference_batched(q, k, v, scale=0.3, left=6, right=0, softcap=5.0, sink=sink)
    assert out.shape == (3, 13, 8, 24)
    assert_out(out, want, torch.bfloat16)
    assert_lse(lse, want_lse)


def test_strided_inputs_are_read_in_place():
    """HND tensors transposed to NHD (what Hugging Face models hold) and sliced views: no copy needed."""
    base = randn(2, 4, 9, 32, seed=10)
    q = base[..., ::2].transpose(1, 2)               # (2, 9, 4, 16), neither contiguous nor NHD-packed
    k = randn(2, 2, 15, 16, seed=11).transpose(1, 2)
    v = randn(2, 2, 15, 16, seed=12).transpose(1, 2)
    out, _ = af.flash_attn_func(q, k, v, causal=True)
    want, _ = reference_batched(q, k, v, causal=True)
    assert_out(out, want, torch.float32)


def test_scheduling_hints_do_not_change_results():
    q, k, v = nhd(2, 9, 33, 6, 2, 16, seed=13)
    base, _ = af.flash_attn_func(q, k, v, causal=True)
    for hints in (dict(num_splits=0), dict(num_splits=4), dict(pack_gqa=True), dict(pack_gqa=False),
                  dict(deterministic=True)):
        assert torch.equal(af.flash_attn_func(q, k, v, causal=True, **hints)[0], base), hints


# ---------------------------------------------------------------- edge cases

def test_no_keys_gives_zeros_and_minus_inf_or_the_sink():
    q, k, v = nhd(2, 3, 0, 2, 2, 8)
    out, lse = af.flash_attn_func(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    sink = torch.tensor([0.5, -2.0])
    out, lse = af.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    assert torch.all(out == 0)
    assert torch.equal(lse, sink[None, :, None].expand(2, 2, 3))


def test_no_queries():
    q, k, v = nhd(2, 0, 5, 2, 2, 8)
    out, lse = af.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)


def test_window_zero_sees_only_the_diagonal():
    q, k, v = nhd(1, 6, 6, 2, 2, 8, seed=14)
    out, _ = af.flash_attn_func(q, k, v, window_size=(0, 0))
    assert_out(out, v.double(), torch.float32)   # one visible key: weight 1 on it


# ---------------------------------------------------------------- varlen

def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(2, 1)), dict(causal=True, softcap=4.0)],
                         ids=["full", "causal", "window", "causal_softcap"])
def test_varlen_packed(dtype, mask):
    q_lens, k_lens = [5, 0, 1, 9, 3], [7, 4, 6, 9, 0]   # an empty query run and an empty key run
    hq, hkv, E = 4, 2, 16
    q = randn(sum(q_lens), hq, E, dtype=dtype, seed=15)
    k = randn(sum(k_lens), hkv, E, dtype=dtype, seed=16)
    v = randn(sum(k_lens), hkv, E, dtype=dtype, seed=17)
    sink = randn(hq, seed=18)
    out, lse = af.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens),
                                         learnable_sink=sink, return_lse=True, **mask)
    assert out.shape == q.shape and lse.shape == (hq, sum(q_lens))
    window = mask.get("window_size", (None, None))
    kw = dict(causal=mask.get("causal", False), left=window[0], right=window[1], softcap=mask.get("softcap", 0.0),
              sink=sink)
    qs, ks = cu(q_lens).tolist(), cu(k_lens).tolist()
    for b in range(len(q_lens)):
        want, want_lse = reference_sequence(q[qs[b]:qs[b + 1]], k[ks[b]:ks[b + 1]], v[ks[b]:ks[b + 1]], **kw)
        assert_out(out[qs[b]:qs[b + 1]], want, dtype)
        assert_lse(lse[:, qs[b]:qs[b + 1]], want_lse)


def test_varlen_max_seqlen_given_or_derived():
    q_lens, k_lens = [3, 6], [4, 8]
    q, k, v = randn(9, 2, 8, seed=19), randn(12, 2, 8, seed=20), randn(12, 2, 8, seed=21)
    lengths = dict(cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens))
    derived, _ = af.flash_attn_varlen_func(q, k, v, causal=True, **lengths)
    given, _ = af.flash_attn_varlen_func(q, k, v, max_seqlen_q=6, max_seqlen_k=8, causal=True, **lengths)
    assert torch.equal(derived, given)
    with pytest.raises(af.InvalidArgumentError, match="max_seqlen_q"):
        af.flash_attn_varlen_func(q, k, v, max_seqlen_q=5, max_seqlen_k=8, **lengths)
    with pytest.raises(af.UnsupportedError, match="by keyword"):   # FA4 b27's 4th parameter is qv, not cu_seqlens_q
        af.flash_attn_varlen_func(q, k, v, cu(q_lens), cu(k_lens))


def test_varlen_batched_keys_with_seqused_k():
    """Batched 4-D q/k/v with seqused_k: sequence b uses its first seqused_k[b] keys."""
    q, k, v = nhd(3, 4, 10, 2, 1, 8, seed=22)
    used = torch.tensor([10, 3, 0], dtype=torch.int32)
    out, lse = af.flash_attn_varlen_func(q, k, v, seqused_k=used, causal=True, return_lse=True)
    for b, n in enumerate(used.tolist()):
        want, want_lse = reference_sequence(q[b], k[b, :n], v[b, :n], causal=True)
        assert_out(out[b], want, torch.float32)
        assert_lse(lse[b], want_lse)


# ---------------------------------------------------------------- paged K/V

@pytest.mark.parametrize("page_size", [1, 3, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_kv(page_size, dtype):
    """Pages in any order, a page shared by two sequences, page sizes 1 and not a multiple of any tile."""
    hq, hkv, E = 4, 2, 16
    used = [11, 5, 0, 7]
    max_pages = max(-(-n // page_size) for n in used) + 1   # one page more than the longest needs
    num_pages = len(used) * max_pages + 3
    k_pages = randn(num_pages, page_size, hkv, E, dtype=dtype, seed=23)
    v_pages = randn(num_pages, page_size, hkv, E, dtype=dtype, seed=24)
    g = torch.Generator().manual_seed(25)
    table = torch.randperm(num_pages, generator=g)[: len(used) * max_pages].reshape(len(used), max_pages)
    table[3, 0] = table[0, 0]   # sequences 0 and 3 share their first page
    table = table.to(torch.int32).contiguous()
    q_lens = [3, 5, 2, 1]
    q = randn(sum(q_lens), hq, E, dtype=dtype, seed=26)
    sink = randn(hq, seed=27)
    out, lse = af.flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=cu(q_lens), page_table=table,
                                         seqused_k=torch.tensor(used, dtype=torch.int32), causal=True,
                                         learnable_sink=sink, return_lse=True)
    qs = cu(q_lens).tolist()
    for b, n in enumerate(used):
        keys = torch.cat([k_pages[p] for p in table[b].tolist()])[:n]
        values = torch.cat([v_pages[p] for p in table[b].tolist()])[:n]
        want, want_lse = reference_sequence(q[qs[b]:qs[b + 1]], keys, values, causal=True, sink=sink)
        assert_out(out[qs[b]:qs[b + 1]], want, dtype)
        assert_lse(lse[:, qs[b]:qs[b + 1]], want_lse)


def test_paged_decode_batched_query():
    """Decode: one new token per sequence as batched (B, 1, Hq, E) q over a paged cache."""
    k_pages, v_pages = randn(6, 4, 1, 8, seed=28), randn(6, 4, 1, 8, seed=29)
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    used = torch.tensor([6, 8], dtype=torch.int32)
    q = randn(2, 1, 2, 8, seed=30)
    out, lse = af.flash_attn_varlen_func(q, k_pages, v_pages, page_table=table, seqused_k=used, return_lse=True)
    assert out.shape == (2, 1, 2, 8) and lse.shape == (2, 2, 1)
    for b in range(2):
        keys = torch.cat([k_pages[p] for p in table[b].tolist()])[: used[b]]
        values = torch.cat([v_pages[p] for p in table[b].tolist()])[: used[b]]
        want, want_lse = reference_sequence(q[b], keys, values)
        assert_out(out[b], want, torch.float32)
        assert_lse(lse[b], want_lse)


def test_paged_without_seqused_k_uses_every_page():
    """FA4: page_table without seqused_k gives every sequence max_pages * page_size keys (all its pages)."""
    k_pages, v_pages = randn(6, 4, 1, 8, seed=31), randn(6, 4, 1, 8, seed=32)
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    q = randn(2, 3, 2, 8, seed=33)
    out, lse = af.flash_attn_varlen_func(q, k_pages, v_pages, page_table=table, causal=True, return_lse=True)
    for b in range(2):
        keys = torch.cat([k_pages[p] for p in table[b].tolist()])
        values = torch.cat([v_pages[p] for p in table[b].tolist()])
        want, want_lse = reference_sequence(q[b], keys, values, causal=True)
        assert_out(out[b], want, torch.float32)
        assert_lse(lse[b], want_lse)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("name, value", [("qv", "q"), ("gather_kv_indices", "idx"), ("score_mod_bwd", lambda *a: a[0]),
                                         ("aux_tensors", []), ("block_sparse_tensors", object())])
def test_fa4_features_attnforge_lacks_are_refused_when_set(name, value):
    q, k, v = nhd(1, 4, 4, 2, 2, 8)
    tensors = {"q": q, "idx": torch.zeros(1, 4, 2, dtype=torch.int32)}
    with pytest.raises(af.UnsupportedError, match=name):
        af.flash_attn_func(q, k, v, **{name: tensors.get(value, value) if isinstance(value, str) else value})
    with pytest.raises(af.UnsupportedError, match="seqused_q"):
        af.flash_attn_varlen_func(q, k, v, seqused_q=torch.tensor([4], dtype=torch.int32))


def test_argument_errors_name_the_argument():
    q, k, v = nhd(2, 4, 6, 4, 2, 8)
    qp, kp, vp = q.reshape(8, 4, 8), k.reshape(12, 2, 8), v.reshape(12, 2, 8)
    cases = [
        (lambda: af.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=torch.tensor([0, 5, 4, 8], dtype=torch.int32),
                                           cu_seqlens_k=torch.tensor([0, 6, 6, 12], dtype=torch.int32),
                                           max_seqlen_q=8, max_seqlen_k=8),
         af.InvalidArgumentError, "non-decreasing"),
        (lambda: af.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu([4, 4]).long(), cu_seqlens_k=cu([6, 6])),
         (af.InvalidArgumentError, af.UnsupportedError), "int32"),
        (lambda: af.flash_attn_func(q, k, v, window_size=(-2.0, 5)), TypeError, "window_size"),
        (lambda: af.flash_attn_func(q, k, v, learnable_sink=torch.zeros(3)), af.InvalidArgumentError,
         "learnable_sink"),
        (lambda: af.flash_attn_func(q, k[:, :, :1].expand(2, 6, 3, 8), v[:, :, :1].expand(2, 6, 3, 8)),
         af.InvalidArgumentError, "heads"),
        (lambda: af.flash_attn_func(q, k, v, softcap=-1.0), af.InvalidArgumentError, "softcap"),
        (lambda: af.flash_attn_func(q, k, v, window_size=(1,)), TypeError, "window_size"),
        (lambda: af.flash_attn_func(q, k, v, num_splits=1.5), TypeError, "num_splits"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text):
            call()


def test_paged_errors():
    k_pages, v_pages = randn(4, 2, 1, 8), randn(4, 2, 1, 8)
    q = randn(2, 1, 1, 8)
    used = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(af.InvalidArgumentError, match="page_table"):   # page 4 of 4 pages
        af.flash_attn_varlen_func(q, k_pages, v_pages, page_table=torch.tensor([[0, 4], [1, 2]], dtype=torch.int32),
                                  seqused_k=used)
    with pytest.raises(af.InvalidArgumentError, match="cu_seqlens_k"):
        af.flash_attn_varlen_func(q.reshape(2, 1, 8), k_pages, v_pages, cu_seqlens_q=cu([1, 1]),
                                  cu_seqlens_k=cu([3, 3]), page_table=torch.tensor([[0, 1], [1, 2]],
                                                                                  dtype=torch.int32),
                                  seqused_k=used)


def test_gradients_flow_not_dropped():
    """A call that needs a gradient gets one (refused while attnforge had no backward; test_backward.py checks the
    values); under no_grad the output has none."""
    q, k, v = nhd(1, 4, 4, 2, 2, 8)
    q.requires_grad_(True)
    out, _ = af.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all()
    with torch.no_grad():
        out, _ = af.flash_attn_func(q, k, v)
    assert not out.requires_grad
