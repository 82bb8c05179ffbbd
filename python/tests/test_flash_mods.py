"""score_mod / mask_mod on attnforge's flash_attn_func and flash_attn_varlen_func (FA4's arguments, attnforge's
torch-function mods): a packed varlen call gives each sequence what attnforge.flex_attention gives it alone (the
indices are the sequence's own), a mask_mod replaces causal and window_size, and gradients equal flex_attention's
(whose backward the flex suites check against autograd)."""
import pytest

torch = pytest.importorskip("torch")

import attnforge  # noqa: E402
from attnforge import flash_attn_func, flash_attn_varlen_func  # noqa: E402

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def local_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 5


def test_varlen_sequences_are_each_alone():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 30, 18]
    cu = torch.tensor([0, 7, 37, 55], dtype=torch.int32)
    q, k, v = (torch.randn(55, h, 16, generator=g) for h in (4, 2, 2))
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, score_mod=alibi, mask_mod=local_window)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = attnforge.flex_attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), score_mod=alibi,
                                         block_mask=attnforge.create_block_mask(local_window, 1, 1, n, n),
                                         enable_gqa=True)
        torch.testing.assert_close(out[rows], alone[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_mask_mod_replaces_causal_and_window():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 20, 4, 16, generator=g) for _ in range(3))
    with_flags, _ = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), mask_mod=local_window)
    without, _ = flash_attn_func(q, k, v, mask_mod=local_window)
    assert torch.equal(with_flags, without)


def test_gradients_equal_flex_attentions():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 24, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    out, _ = flash_attn_func(q, k, v, causal=True, score_mod=alibi)
    out.square().sum().backward()
    ref_inputs = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    causal = attnforge.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 24, 24)
    ref = attnforge.flex_attention(*ref_inputs, score_mod=alibi, block_mask=causal, enable_gqa=True)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    for got, want in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(got.grad, want.grad.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_what_is_refused():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(attnforge.InvalidArgumentError, match="softcap and score_mod cannot be used together"):
        flash_attn_func(q, q, q, softcap=2.0, score_mod=alibi)
    table = torch.zeros(8, requires_grad=True)
    with pytest.raises(attnforge.UnsupportedError, match="flex_attention"):
        flash_attn_func(q, q, q, score_mod=lambda s, b, h, qi, ki: s + table[ki])
    with pytest.raises(attnforge.UnsupportedError, match="score_mod_bwd"):
        flash_attn_func(q, q, q, score_mod=alibi, score_mod_bwd=alibi)
