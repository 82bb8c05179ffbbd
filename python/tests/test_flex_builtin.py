"""attnforge.flex.builtin: the built-in mods against PyTorch's eager flex_attention called with the same objects (each
is also the torch function it stands for), their block masks against PyTorch's create_block_mask, gradients of
their learnable tables against the same mods traced, and no trace taken for them."""
import warnings

import pytest
import torch

import attnforge
from attnforge import _mod_trace as _trace
from attnforge.flex import builtin, flex_attention

fa = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, HKV, L, S, E = 2, 4, 2, 96, 96, 16
DOCS = torch.tensor([0] * 20 + [1] * 41 + [2] * 35)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
TABLE = torch.randn(H, S, generator=torch.Generator().manual_seed(1))
REL = torch.randn(2 * S, generator=torch.Generator().manual_seed(2))

SCORE_MODS = {
    "alibi": builtin.alibi(SLOPES),
    "bias by (h, kv)": builtin.bias(TABLE, "h", "kv"),
    "relative bias": builtin.bias(REL, "rel", rel_offset=S),
    "softcap": builtin.softcap(3.0),
    None: None,
}
MASKS = {
    "causal": builtin.causal(),
    "window": builtin.sliding_window(10, 2),
    "chunked": builtin.chunked(32),
    "documents, causal": builtin.and_masks(builtin.causal(), builtin.document(DOCS)),
    "prefix-LM by batch": builtin.prefix_lm(torch.tensor([7, 40])),
    "prefix or window": builtin.or_masks(builtin.prefix_lm(5), builtin.sliding_window(3)),
    None: None,
}


# every mask alone, every score_mod under a mask (PyTorch's eager flex compiles each pair: about 0.5 s)
PAIRS = [(None, m) for m in MASKS if m] + [(sm, m) for sm, m in zip([s for s in SCORE_MODS if s], list(MASKS)[3:])]


@pytest.mark.parametrize("score_name,mask_name", PAIRS, ids=str)
def test_against_pytorch_flex(score_name, mask_name, monkeypatch):
    score_mod, mask_mod = SCORE_MODS[score_name], MASKS[mask_name]
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(B, H, L, E, generator=g), torch.randn(B, HKV, S, E, generator=g), \
        torch.randn(B, HKV, S, E, generator=g)
    theirs_mask = fa.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    ours_mask = attnforge.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=32) if mask_mod else None
    if mask_mod:
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(ours_mask, name), getattr(theirs_mask, name)), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = fa.flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod, block_mask=theirs_mask,
                                enable_gqa=True)

    def no_trace(*args):
        raise AssertionError("a built-in mod was traced")

    monkeypatch.setattr(_trace, "_trace", no_trace)
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_mask, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_learnable_tables_get_the_traced_mods_gradients():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, H, L, E, generator=g), torch.randn(1, H, S, E, generator=g), \
        torch.randn(1, H, S, E, generator=g)
    results = []
    for built in (True, False):
        slopes, table = SLOPES.clone().requires_grad_(), REL.clone().requires_grad_()
        if built:
            mods = [builtin.alibi(slopes), builtin.bias(table, "rel", rel_offset=S)]
        else:
            mods = [lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
                    lambda score, b, h, q_idx, kv_idx: score + table[kv_idx - q_idx + S]]
        out = sum(flex_attention(q, k, v, score_mod=m) for m in mods)
        out.square().sum().backward()
        results.append((slopes.grad, table.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)


def test_bad_declarations():
    with pytest.raises(ValueError, match="cap"):
        builtin.softcap(0)
    with pytest.raises(ValueError, match="dims"):
        builtin.bias(TABLE, "h", "x")
    with pytest.raises(TypeError, match="table"):
        builtin.bias(TABLE, "h")
    with pytest.raises(TypeError, match="built-in mask_mods"):
        builtin.and_masks(builtin.causal(), builtin.softcap(2.0))
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(_trace.ModTraceError, match="built-in mask_mod where a score_mod"):
        flex_attention(q, q, q, score_mod=builtin.causal())
