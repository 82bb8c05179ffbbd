"""attnforge.flex.flex_attention against PyTorch's own torch.nn.attention.flex_attention in eager mode (its dense
math path, the reference PyTorch's CPU build runs without a compiler), with score_mods and mask_mods of PyTorch's
test suite and attention-gym's catalogue: output and LSE, f32 at the double reference's tolerances, bf16/f16 by the
ratio rule (attnforge's error against float64 at most twice PyTorch's own, plus a floor)."""
import math
import warnings

import pytest
import torch

from attnforge import flex
from attnforge.flex import ModTraceError, flex_attention

fa = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, HKV, L, S, E = 2, 4, 2, 130, 200, 32
SLOPES = torch.tensor([2.0 ** -(i + 1) for i in range(H)])
BIAS_HK = torch.randn(H, S, generator=torch.Generator().manual_seed(3))
REL = torch.randn(2 * S, generator=torch.Generator().manual_seed(4))
DOCS = torch.tensor([0] * 40 + [1] * 60 + [2] * 5 + [3] * 95, dtype=torch.int64)   # S keys, packed documents
PREFIX = 17


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def head_key_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS_HK[h, kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + REL[kv_idx - q_idx + S]


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def t5_buckets(score, b, h, q_idx, kv_idx):
    distance = (kv_idx - q_idx).abs()
    bucket = torch.where(distance < 8, distance,
                         (8 + torch.log(distance.float() / 8 + 1e-6) * 4).to(torch.int32).clamp(max=15))
    return score + BIAS_HK[h, bucket]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 24)


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def chunked(b, h, q_idx, kv_idx):
    return (q_idx // 32) == (kv_idx // 32)


def empty_rows(b, h, q_idx, kv_idx):   # rows q % 7 == 3 see no key: out 0, LSE -inf
    return (q_idx % 7 != 3) & ((kv_idx + h) % 3 == 0)


CASES = [
    ("alibi", alibi, None), ("head-key bias", head_key_bias, None), ("relative bias", relative_bias, None),
    ("softcap", softcap, None), ("t5 buckets", t5_buckets, None), ("causal", None, causal),
    ("alibi + causal", alibi, causal), ("sliding window", None, sliding_window), ("documents", None, document),
    ("prefix-LM", None, prefix_lm), ("chunked", None, chunked), ("softcap + empty rows", softcap, empty_rows),
]


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, HKV, S, E, generator=g).to(dtype)
    v = torch.randn(B, HKV, S, E + 16, generator=g).to(dtype)
    return q, k, v


def _torch_flex(q, k, v, score_mod, mask_mod, dtype=None):
    block_mask = fa.create_block_mask(mask_mod, B, H, L, S, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
        out, lse = fa.flex_attention(cast(q), cast(k), cast(v), score_mod=score_mod, block_mask=block_mask,
                                     enable_gqa=True, return_lse=True)
    return out, lse, block_mask


@pytest.mark.parametrize("name,score_mod,mask_mod", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_against_pytorch_flex(name, score_mod, mask_mod, dtype):
    q, k, v = _inputs(dtype)
    ref64, lse64, block_mask = _torch_flex(q, k, v, score_mod, mask_mod, torch.float64)
    ours, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                               return_lse=True)
    assert ours.dtype == dtype and ours.shape == (B, H, L, E + 16)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), "the rows that see no key differ"
    assert torch.all(ours[~finite] == 0), "a row that sees no key is not 0"
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), ref64, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[finite].double(), lse64[finite], atol=2e-5, rtol=1e-5)
    else:   # the ratio rule: attnforge's error against float64 at most twice PyTorch's own in this dtype
        theirs, their_lse, _ = _torch_flex(q, k, v, score_mod, mask_mod)
        our_err = (ours.double() - ref64).abs().max().item()
        their_err = (theirs.double() - ref64).abs().max().item()
        assert our_err <= 2 * their_err + 1e-3, f"{name}: error {our_err:.3g} against PyTorch's {their_err:.3g}"
        lse_err = (lse[finite].double() - lse64[finite]).abs().max().item()
        assert lse_err <= 2e-2, f"{name}: lse error {lse_err:.3g}"


def test_return_aux_and_scale():
    q, k, v = _inputs(torch.float32, seed=1)
    ref, ref_lse, _ = _torch_flex(q, k, v, alibi, None)
    out, aux = flex_attention(q, k, v, score_mod=alibi, enable_gqa=True, return_aux=fa.AuxRequest(lse=True))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, ref_lse, atol=2e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_scaled = fa.flex_attention(q, k, v, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(flex_attention(q, k, v, scale=0.3, enable_gqa=True), ref_scaled, atol=2e-5, rtol=1e-5)


def test_strided_inputs():
    q, k, v = _inputs(torch.float32, seed=2)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)   # (B, L, H, E) memory, as a transformer hands it over
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    ref, _, block_mask = _torch_flex(q, k, v, relative_bias, sliding_window)
    out = flex_attention(qt, kt, v[..., ::1], score_mod=relative_bias, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_what_cannot_be_expressed_is_named_before_any_work():
    q, k, v = _inputs(torch.float32)

    def branches(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score   # Python control flow on a value

    def whole_tensor(score, b, h, q_idx, kv_idx):
        return score + BIAS_HK.sum()

    for mod, expect in ((branches, "cannot be traced"), (whole_tensor, "sum")):
        with pytest.raises(ModTraceError, match=expect) as info:
            flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
        assert mod.__name__ in str(info.value) and "test_flex_attention.py" in str(info.value)


def test_bad_calls():
    q, k, v = _inputs(torch.float32)
    with pytest.raises(Exception, match="enable_gqa"):
        flex_attention(q, k, v)
    block_mask = fa.create_block_mask(causal, B, H, L + 1, S, device="cpu")
    with pytest.raises(Exception, match="block_mask"):
        flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    def out_of_range(score, b, h, q_idx, kv_idx):
        return score + SLOPES[kv_idx]   # 4 slopes, 200 keys

    with pytest.raises(Exception, match="outside its shape"):
        flex_attention(q, k, v, score_mod=out_of_range, enable_gqa=True)


def test_a_mod_is_traced_once_and_again_when_what_it_names_is_rebound():
    global _TABLE
    _TABLE = torch.tensor([1.0, 2.0])

    def bias(score, b, h, q_idx, kv_idx):
        return score + _TABLE[h % 2]

    assert flex.trace(bias, score=True) is flex.trace(bias, score=True), "traced twice"
    q, k, v = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.ones(1, 2, 1, 4)

    def lse():
        return flex_attention(q, k, v, score_mod=bias, return_lse=True)[1].flatten().tolist()

    assert lse() == pytest.approx([1.0, 2.0], abs=1e-5)
    _TABLE[0] = 7.0   # in place: the program reads the tensor at each call
    assert lse() == pytest.approx([7.0, 2.0], abs=1e-5)
    _TABLE = torch.tensor([5.0, 6.0])   # rebound: traced again
    assert lse() == pytest.approx([5.0, 6.0], abs=1e-5)

    def offset(c):   # a closure made anew per value: each its own program
        return lambda score, b, h, q_idx, kv_idx: score + c

    got = [flex_attention(q, k, v, score_mod=offset(c), return_lse=True)[1][0, 0, 0].item() for c in (3.0, 4.0)]
    assert got == pytest.approx([3.0, 4.0], abs=1e-5)
