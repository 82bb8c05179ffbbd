"""attnforge.flex_attention's backward against autograd through a dense PyTorch reference of the same mods (PyTorch's
CPU flex has no backward): the scores (B, H, L, S) in float64, the score_mod and mask_mod applied on broadcast index
tensors, softmax, values; dq, dk, dv compared in f32 at the double reference's tolerances and in bf16 by a bound on
the largest element. The mods exercise each derivative rule the programs carry (sums, products, quotients, tanh,
sigmoid, exp / log, pow, abs, where, max, loads that are constant in the score), with causal, document and
sliding-window block masks."""
import warnings

import pytest
import torch

from attnforge.flex import flex_attention

fa = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, HKV, L, S, E, EV = 2, 4, 2, 90, 130, 16, 24
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
REL = torch.randn(2 * S, generator=torch.Generator().manual_seed(7))
DOCS = torch.tensor([0] * 30 + [1] * 50 + [2] * 50, dtype=torch.int64)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx) * 0.1


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + REL[kv_idx - q_idx + S]


def softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


def square(score, b, h, q_idx, kv_idx):
    return score + 0.3 * score * score


def quotient(score, b, h, q_idx, kv_idx):
    return score / (1.0 + 0.1 * score * score)


def silu(score, b, h, q_idx, kv_idx):
    return score * torch.sigmoid(score)


def softplus(score, b, h, q_idx, kv_idx):
    return torch.log(1.0 + torch.exp(score))


def power(score, b, h, q_idx, kv_idx):
    return torch.pow(score.abs() + 1.0, 1.5)


def leaky(score, b, h, q_idx, kv_idx):
    return torch.where(score > 0, score, 0.25 * score)


def floor_at(score, b, h, q_idx, kv_idx):
    return torch.maximum(score, torch.full_like(score, -0.2)) + torch.sin(score) * 0.1


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 20


MODS = [alibi, relative_bias, softcap, square, quotient, silu, softplus, power, leaky, floor_at, None]
MASKS = [None, causal, document, window]


def _dense(q, k, v, score_mod, mask_mod):
    """The attention of the mods in float64 on whole (B, H, L, S) tensors: what autograd differentiates."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    idx = [torch.arange(n).view(*[-1 if d == i else 1 for d in range(4)]) for i, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), float("-inf"))
    seen = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=-1) * seen
    return p @ v


@pytest.mark.parametrize("mask_mod", MASKS, ids=[m.__name__ if m else "no mask" for m in MASKS])
@pytest.mark.parametrize("score_mod", MODS, ids=[m.__name__ if m else "no score_mod" for m in MODS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_against_autograd(score_mod, mask_mod, dtype):
    if score_mod is None and mask_mod is None:
        pytest.skip("plain attention: the SDPA suites' backward")
    if dtype == torch.bfloat16 and MODS.index(score_mod) % 2 != MASKS.index(mask_mod) % 2:
        pytest.skip("bf16: every other combination")
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, L, E, generator=gen)
    k = torch.randn(B, HKV, S, E, generator=gen)
    v = torch.randn(B, HKV, S, EV, generator=gen)
    dout = torch.randn(B, H, L, EV, generator=gen)
    # the reference on the inputs as the call sees them (rounded to dtype): a kink of a mod (max, where) is then on the
    # same side for both
    q64, k64, v64 = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    _dense(q64, k64, v64, score_mod, mask_mod).backward(dout.to(dtype).double())
    qd, kd, vd = (t.to(dtype).requires_grad_() for t in (q, k, v))
    block_mask = fa.create_block_mask(mask_mod, 1, 1, L, S, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    out = flex_attention(qd, kd, vd, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    out.backward(dout.to(dtype))
    for name, ours, ref in (("dq", qd.grad, q64.grad), ("dk", kd.grad, k64.grad), ("dv", vd.grad, v64.grad)):
        assert ours.dtype == dtype and ours.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours.double(), ref, atol=2e-5 * (1 + ref.abs().max().item()), rtol=1e-4,
                                       msg=lambda m: f"{name}: {m}")
        else:
            gap = (ours.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)
            assert gap <= 4e-2, f"{name}: {gap:.3g} of the largest element"


def test_gradients_of_what_the_call_asks_for():
    q = torch.randn(1, 2, 40, 16)
    k = torch.randn(1, 2, 50, 16, requires_grad=True)
    v = torch.randn(1, 2, 50, 16)
    out, lse = flex_attention(q, k, v, score_mod=softcap, return_lse=True)
    assert not lse.requires_grad
    out.sum().backward()
    assert k.grad is not None and q.grad is None and v.grad is None
    k64 = k.detach().double().requires_grad_()
    _dense(q.double(), k64, v.double(), softcap, None).sum().backward()
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-5, rtol=1e-4)


LEARNED = [("alibi slopes", lambda p: (lambda score, b, h, q_idx, kv_idx: score + p[h] * (kv_idx - q_idx) * 0.1),
            lambda: torch.tensor([0.5, 0.25, 0.125, 0.0625])),
           ("bias by (head, key)", lambda p: (lambda score, b, h, q_idx, kv_idx: score + p[h, kv_idx]),
            lambda: 0.3 * torch.randn(H, S, generator=torch.Generator().manual_seed(3))),
           ("relative bias, scaled score", lambda p: (lambda score, b, h, q_idx, kv_idx:
                                                      score * torch.sigmoid(p[kv_idx - q_idx + S]) + p[q_idx]),
            lambda: 0.5 * torch.randn(2 * S, generator=torch.Generator().manual_seed(4)))]


@pytest.mark.parametrize("name,make_mod,init", LEARNED, ids=[x[0] for x in LEARNED])
@pytest.mark.parametrize("mask_mod", [None, causal], ids=["no mask", "causal"])
def test_captured_tensor_gradients_against_autograd(name, make_mod, init, mask_mod):
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(B, H, L, E, generator=gen)
    k = torch.randn(B, HKV, S, E, generator=gen)
    v = torch.randn(B, HKV, S, EV, generator=gen)
    dout = torch.randn(B, H, L, EV, generator=gen)
    ref_param = init().double().requires_grad_()
    q64 = q.double().requires_grad_()
    _dense(q64, k.double(), v.double(), make_mod(ref_param), mask_mod).backward(dout.double())
    param = init().requires_grad_()
    qd = q.clone().requires_grad_()
    block_mask = fa.create_block_mask(mask_mod, 1, 1, L, S, device="cpu") if mask_mod else None
    flex_attention(qd, k, v, score_mod=make_mod(param), block_mask=block_mask, enable_gqa=True).backward(dout)
    assert param.grad is not None and param.grad.dtype == param.dtype and param.grad.shape == param.shape
    torch.testing.assert_close(param.grad.double(), ref_param.grad, atol=1e-4 * (1 + ref_param.grad.abs().max().item()),
                               rtol=1e-4)
    torch.testing.assert_close(qd.grad.double(), q64.grad, atol=2e-5 * (1 + q64.grad.abs().max().item()), rtol=1e-4)


def test_only_captured_tensors_need_a_gradient():
    bias = torch.zeros(S, requires_grad=True)
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    out = flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[kv_idx])
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    with torch.no_grad():
        flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[kv_idx])
