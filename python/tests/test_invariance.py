"""Issue 46's invariants through the Python API, asserted with torch.equal as FlashAttention-4's own tests do: a
sequence's output and LSE do not depend on what it is batched with (varlen packing, the other sequences' lengths,
the batch size), on how its K/V are stored (contiguous, a transposed view, pages of any size in any order), or on the
thread count; and under attnforge.phase_invariant() a decode step gives the bits of the same row inside a prefill or
a chunked prefill. tests/test_batch_invariance.c covers every ISA and the emulated AMX products; this covers the
Python entry points on this machine's default ISA."""
import random

import pytest
import torch

import attnforge

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    attnforge.set_num_threads(0)


def _alone(q, k, v, causal, window):
    """The sequence by itself: a batch of one through flash_attn_func."""
    out, lse = attnforge.flash_attn_func(q[None], k[None], v[None], causal=causal, window_size=window,
                                         return_lse=True)
    return out[0], lse[0]


def _paged(k, v, page_size, rng):
    """k, v (S, Hkv, D) spread over shuffled pages of a pool with spare pages: (pool_k, pool_v, page_table)."""
    S = k.shape[0]
    pages = -(-S // page_size)
    pool = pages + 3
    order = list(range(pool))
    rng.shuffle(order)
    pool_k = torch.randn(pool, page_size, *k.shape[1:], dtype=k.dtype)
    pool_v = torch.randn(pool, page_size, *v.shape[1:], dtype=v.dtype)
    for g in range(pages):
        n = min(page_size, S - g * page_size)
        pool_k[order[g], :n] = k[g * page_size:g * page_size + n]
        pool_v[order[g], :n] = v[g * page_size:g * page_size + n]
    return pool_k, pool_v, torch.tensor([order[:pages]], dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_sequence_bits_do_not_depend_on_its_batch_layout_or_threads(dtype, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    Hq, Hkv, E, Ev = 8, 2, 64, 48
    causal = seed % 2 == 0
    window = (700, 0 if causal else 300) if seed == 3 else (None, None)
    # the checked sequence: a decode over a cache long enough to split its keys, a short chunk, or a prefill chunk
    L = [1, 3, 40, 1][seed]
    S = L + rng.randint(1100, 2600)
    q = torch.randn(L, Hq, E, dtype=dtype)
    k = torch.randn(S, Hkv, E, dtype=dtype)
    v = torch.randn(S, Hkv, Ev, dtype=dtype)
    attnforge.set_num_threads(1)
    ref_out, ref_lse = _alone(q, k, v, causal, window)

    # other sequences around it, decodes and prefill chunks of random lengths, in a varlen batch
    others = [(rng.choice([1, rng.randint(2, 5), rng.randint(20, 70)]), rng.randint(1, 2600)) for _ in range(4)]
    at = rng.randint(0, len(others))
    seqs = [(torch.randn(l, Hq, E, dtype=dtype), torch.randn(l + s, Hkv, E, dtype=dtype),
             torch.randn(l + s, Hkv, Ev, dtype=dtype)) for l, s in others]
    seqs.insert(at, (q, k, v))
    cu_q = torch.tensor([0] + [sum(x[0].shape[0] for x in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(x[1].shape[0] for x in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    for threads in (1, 2):
        attnforge.set_num_threads(threads)
        out, lse = attnforge.flash_attn_varlen_func(
            torch.cat([x[0] for x in seqs]), torch.cat([x[1] for x in seqs]), torch.cat([x[2] for x in seqs]),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(x[0].shape[0] for x in seqs),
            max_seqlen_k=max(x[1].shape[0] for x in seqs), causal=causal, window_size=window, return_lse=True)
        rows = slice(int(cu_q[at]), int(cu_q[at + 1]))
        assert torch.equal(out[rows], ref_out), f"{threads} threads: inside a varlen batch of {len(seqs)}"
        assert torch.equal(lse[:, rows], ref_lse)

        # K/V as a (B, S, H, D) view of (B, H, S, D) memory
        kt = k.transpose(0, 1).contiguous().transpose(0, 1)
        vt = v.transpose(0, 1).contiguous().transpose(0, 1)
        out, lse = _alone(q, kt, vt, causal, window)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"{threads} threads: transposed K/V"

        # paged, pages of several sizes in shuffled order
        for page_size in (1, 16, 64, 256):
            pk, pv, table = _paged(k, v, page_size, rng)
            out, lse = attnforge.flash_attn_varlen_func(
                q[None], pk, pv, page_table=table, seqused_k=torch.tensor([S], dtype=torch.int32), causal=causal,
                window_size=window, return_lse=True)
            assert torch.equal(out[0], ref_out), f"{threads} threads: paged K/V, pages of {page_size}"
            assert torch.equal(lse[0], ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_phase_invariant_decode_gives_the_prefill_row(dtype):
    torch.manual_seed(7)
    Hq, Hkv, E, S, chunk = 8, 2, 64, 1300, 300
    q = torch.randn(1, S, Hq, E, dtype=dtype)
    k = torch.randn(1, S, Hkv, E, dtype=dtype)
    v = torch.randn(1, S, Hkv, E, dtype=dtype)
    with attnforge.phase_invariant():
        assert attnforge.get_phase_invariant()
        prefill, prefill_lse = attnforge.flash_attn_func(q, k, v, causal=True, return_lse=True)
        chunked, chunked_lse = attnforge.flash_attn_func(q[:, S - chunk:], k, v, causal=True, return_lse=True)
        for i in (S - 1, S - 2, S - chunk, 700):
            step, step_lse = attnforge.flash_attn_func(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], causal=True,
                                                       return_lse=True)
            assert torch.equal(step[0, 0], prefill[0, i]), f"row {i}: the decode step against the prefill"
            assert torch.equal(step_lse[0, :, 0], prefill_lse[0, :, i])
            if i >= S - chunk:
                assert torch.equal(step[0, 0], chunked[0, i - (S - chunk)]), f"row {i}: against the chunked prefill"
                assert torch.equal(step_lse[0, :, 0], chunked_lse[0, :, i - (S - chunk)])
    assert not attnforge.get_phase_invariant()


def test_phase_invariant_is_a_switch_with_its_previous_value_restored():
    before = attnforge.get_phase_invariant()
    attnforge.set_phase_invariant(True)
    try:
        with attnforge.phase_invariant(False):
            assert not attnforge.get_phase_invariant()
        assert attnforge.get_phase_invariant()
    finally:
        attnforge.set_phase_invariant(before)
