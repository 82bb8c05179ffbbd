"""Block masks on attnforge.flex: attnforge.create_block_mask against PyTorch's create_block_mask (the same tensors,
bit for bit, its q-side included), and flex_attention on block masks whose blocks disagree with their mask_mod —
a full block the mask_mod would thin, a partial one it would not, blocks left out that it keeps — against PyTorch's
eager flex_attention given the dense mask those blocks mean, read from the block lists by PyTorch's own
_ordered_to_dense. A mask evaluated in a full block, a block skipped that should be computed, or a block boundary
one off gives a different result."""
import warnings

import pytest
import torch

import attnforge
from attnforge.flex import flex_attention

fa = pytest.importorskip("torch.nn.attention.flex_attention")

DOCS = torch.tensor([0] * 40 + [1] * 61 + [2] * 3 + [3] * 96 + [4] * 56, dtype=torch.int64)   # 256 keys
PREFIX = torch.tensor([17, 100])


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 40)


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def prefix_lm_by_batch(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


def chunked(b, h, q_idx, kv_idx):
    return (q_idx // 32) == (kv_idx // 32)


def head_stripes(b, h, q_idx, kv_idx):
    return (kv_idx + h) % 3 != 0


MASKS = [causal, sliding_window, document, prefix_lm_by_batch, chunked, head_stripes]
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("mask_mod", MASKS, ids=[m.__name__ for m in MASKS])
@pytest.mark.parametrize("block", [128, 64, (16, 48), (7, 3)], ids=str)
def test_create_block_mask_is_pytorchs(mask_mod, block):
    for L, S, separate in ((256, 256, True), (130, 200, True), (130, 200, False)):
        ours = attnforge.create_block_mask(mask_mod, 2, 3, L, S, BLOCK_SIZE=block, separate_full_blocks=separate)
        theirs = fa.create_block_mask(mask_mod, 2, 3, L, S, device="cpu", BLOCK_SIZE=block,
                                      separate_full_blocks=separate)
        assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE and ours.seq_lengths == theirs.seq_lengths
        for name in FIELDS:
            a, b = getattr(ours, name), getattr(theirs, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), f"{mask_mod.__name__}, {block}, {L}x{S}: {name} differs"


def _random_block_mask(B, Hm, L, S, qb, kb, seed):
    """A BlockMask.from_kv_blocks of random classes (empty, partial, full) in a random order per row, junk past the
    counts, and the dense (B, Hm, nq, nk) maps of its partial and full blocks as PyTorch reads them."""
    g = torch.Generator().manual_seed(seed)
    nq, nk = -(-L // qb), -(-S // kb)
    cls = torch.randint(0, 3, (B, Hm, nq, nk), generator=g)
    cls[torch.rand(B, Hm, nq, generator=g) < 0.1] = 0   # some query blocks see nothing
    lists = []
    for kind in (1, 2):
        chosen = (cls == kind).int()
        order = torch.argsort(chosen * 2 + torch.rand(chosen.shape, generator=g), dim=-1, descending=True)
        num = chosen.sum(-1).int()
        junk = torch.arange(nk).expand_as(order) >= num[..., None]
        lists += [num, torch.where(junk, torch.full_like(order, 7777), order).int()]
    dense = [fa._ordered_to_dense(n, i, nk) for n, i in ((lists[0], lists[1]), (lists[2], lists[3]))]
    return lists, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qb,kb,Hm", [(128, 128, 1), (32, 48, 4), (50, 7, 1), (1, 64, 4)])
def test_blocks_mean_what_compiled_flex_does(dtype, qb, kb, Hm):
    B, H, HKV, L, S, E = 2, 4, 2, 130, 256, 32
    (num, ind, full_num, full_ind), (partial_dense, full_dense) = _random_block_mask(B, Hm, L, S, qb, kb, qb + kb)
    block_mask = fa.BlockMask.from_kv_blocks(num, ind, full_num, full_ind, BLOCK_SIZE=(qb, kb), mask_mod=document,
                                             seq_lengths=(L, S))

    def meaning(b, h, q_idx, kv_idx):   # what the blocks mean: full ones whole, partial ones through the mask_mod
        hh = h if Hm > 1 else 0
        full = full_dense[b, hh, q_idx // qb, kv_idx // kb] > 0
        partial = partial_dense[b, hh, q_idx // qb, kv_idx // kb] > 0
        return full | (partial & document(b, h, q_idx, kv_idx))

    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, E, generator=g).to(dtype)
    k = torch.randn(B, HKV, S, E, generator=g).to(dtype)
    v = torch.randn(B, HKV, S, E, generator=g).to(dtype)

    def slope(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (h + 1) * (kv_idx - q_idx) / S

    dense = fa.create_mask(meaning, B, H, L, S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, ref_lse = fa.flex_attention(q.double(), k.double(), v.double(), score_mod=slope, enable_gqa=True,
                                         block_mask=fa.create_block_mask(meaning, B, H, L, S, device="cpu"),
                                         return_lse=True)
    out, lse = flex_attention(q, k, v, score_mod=slope, block_mask=block_mask, enable_gqa=True, return_lse=True)
    seen = dense.any(-1)
    assert torch.equal(torch.isfinite(lse), seen), "the rows that see no key differ"
    assert torch.all(out[~seen] == 0)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], **tol)


def test_a_block_mask_that_does_not_fit_is_named():
    q = torch.randn(1, 2, 64, 16)
    bad = fa.BlockMask.from_kv_blocks(torch.tensor([[[1]]], dtype=torch.int32), torch.tensor([[[5]]], dtype=torch.int32),
                                      BLOCK_SIZE=64, seq_lengths=(64, 64), compute_q_blocks=False)
    with pytest.raises(attnforge.InvalidArgumentError, match=r"block_mask.kv_indices: entry \[0\]\[0\]\[0\]\[0\] is 5"):
        flex_attention(q, q, q, block_mask=bad)
