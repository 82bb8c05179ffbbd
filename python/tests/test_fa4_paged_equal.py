"""FlashAttention-4's paged-K/V regression tests, ported to attnforge on the CPU (written anew after reading
Dao-AILab/flash-attention's tests/cute/test_flash_attn.py, a version after 4.0.0b27: test_flash_attn_paged_deepseek,
test_flash_attn_paged_hd256_sm100_tma, _tma_gqa and _tma_shuffled). Each compares flash_attn_varlen_func over paged
K/V with the same call over packed K/V. FA4 asserts torch.equal for the first and allows 1e-3 for the others;
attnforge guarantees the same bits for all (docs/API.md; before the tile products took paged K/V, 15 of these cases
differed by up to 1.6e-2 in bf16), so every case here asserts torch.equal, in FA4's bfloat16 and in float16.
Shorter than FA4's where its sizes would cost CI minutes (hd256 at 2048 queries)."""
import pytest

torch = pytest.importorskip("torch")

import attnforge as af  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def _paged(k, v, cu, page_size, order=None):
    """The packed (total, H, D) K/V of the sequences at cu as pages of page_size keys (zero-filled past a sequence's
    end), in the page order `order` (a permutation of the pages; default: in sequence order)."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    per_seq = max(-(-n // page_size) for n in lengths)
    pages = len(lengths) * per_seq
    order = list(range(pages)) if order is None else order
    k_pages = torch.zeros(pages, page_size, *k.shape[1:], dtype=k.dtype)
    v_pages = torch.zeros(pages, page_size, *v.shape[1:], dtype=v.dtype)
    table = torch.zeros(len(lengths), per_seq, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for g in range(per_seq):
            slot = order[b * per_seq + g]
            table[b, g] = slot
            lo, hi = int(cu[b]) + g * page_size, min(int(cu[b]) + n, int(cu[b]) + (g + 1) * page_size)
            if hi > lo:
                k_pages[slot, :hi - lo] = k[lo:hi]
                v_pages[slot, :hi - lo] = v[lo:hi]
    return k_pages, v_pages, table, torch.tensor(lengths, dtype=torch.int32)


def _both(q, k, v, cu, page_size, order=None, **kwargs):
    out_ref, lse_ref = af.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, **kwargs)
    k_pages, v_pages, table, used = _paged(k, v, cu, page_size, order)
    out, lse = af.flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=cu, seqused_k=used, page_table=table,
                                         return_lse=True, **kwargs)
    return out, out_ref, lse, lse_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("seqlen", [64, 128, 256])
def test_paged_deepseek_shape(seqlen, page_size, dtype):
    """FA4's test_flash_attn_paged_deepseek: DeepSeek's MLA shapes (E 192, Ev 128), 16 heads, causal, one
    sequence, pages in order."""
    torch.manual_seed(0)
    q = torch.randn(seqlen, 16, 192).to(dtype)
    k = torch.randn(seqlen, 16, 192).to(dtype)
    v = torch.randn(seqlen, 16, 128).to(dtype)
    cu = torch.tensor([0, seqlen], dtype=torch.int32)
    out, out_ref, lse, lse_ref = _both(q, k, v, cu, page_size, causal=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen", [128, 512])
def test_paged_hd256(seqlen, dtype):
    """FA4's test_flash_attn_paged_hd256_sm100_tma: head dim 256, two sequences, 128-key pages, full attention;
    twice, for determinism."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2 * seqlen, 16, 256).to(dtype) for _ in range(3))
    cu = torch.arange(3, dtype=torch.int32) * seqlen
    out, out_ref, lse, lse_ref = _both(q, k, v, cu, 128)
    again, _, _, _ = _both(q, k, v, cu, 128)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref) and torch.equal(out, again)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_kv", [2, 4, 8])
def test_paged_hd256_gqa(nheads_kv, dtype):
    """FA4's ..._tma_gqa: the same with grouped K/V heads (a query head's K/V head must come from its group)."""
    torch.manual_seed(0)
    q = torch.randn(2 * 256, 16, 256).to(dtype)
    k, v = (torch.randn(2 * 256, nheads_kv, 256).to(dtype) for _ in range(2))
    cu = torch.arange(3, dtype=torch.int32) * 256
    out, out_ref, lse, lse_ref = _both(q, k, v, cu, 128)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_hd256_shuffled(dtype):
    """FA4's ..._tma_shuffled: each sequence's pages in reverse physical order (a kernel ignoring the page table
    would read the wrong keys)."""
    torch.manual_seed(42)
    q, k, v = (torch.randn(2 * 512, 16, 256).to(dtype) for _ in range(3))
    cu = torch.arange(3, dtype=torch.int32) * 512
    order = [p for b in range(2) for p in range((b + 1) * 4 - 1, b * 4 - 1, -1)]
    out, out_ref, lse, lse_ref = _both(q, k, v, cu, 128, order=order)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
