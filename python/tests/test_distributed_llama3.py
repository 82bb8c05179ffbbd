"""attnforge.distributed's llama3 form (ring-flash-attn's llama3_flash_attn_varlen_func): a packed batch of documents
cut into W equal contiguous pieces, documents straddling ranks, K/V all-gathered heads_k_stride heads at a time.
Every rank's out, lse, dq/dk/dv (and the sink's gradient summed over the ranks) against attnforge's
flash_attn_varlen_func on the whole batch in one process, at PyTorch's context-parallel tolerances; prepare's
cu_seqlens against their definition; the bad-input rules raise on every rank."""
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, __import__("os").path.dirname(__file__))
from dist_harness import run_group  # noqa: E402

# (causal, FlashAttention-2 window, sink, dtype name, heads_k_stride)
CASES = [
    (True, (-1, -1), False, "float32", 1),
    (False, (-1, -1), True, "float32", 2),
    (True, (7, -1), True, "float32", 1),
    (True, (-1, -1), False, "bfloat16", 2),
]


def _documents(world):
    """Global cu_seqlens whose total divides by W, with an empty document and documents crossing rank pieces."""
    return torch.tensor([0, 20, 21, 50, 50, 84, 96], dtype=torch.int32) * world


def _one_case(rank, world, causal, window, sink, dtype_name, stride):
    import attnforge
    import attnforge.distributed as ad
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(1234)
    cu = _documents(world)
    total, hq, hkv, e, ev = int(cu[-1]), 4, 2, 32, 24
    q = torch.randn(total, hq, e, dtype=dtype, requires_grad=True)
    k = torch.randn(total, hkv, e, dtype=dtype, requires_grad=True)
    v = torch.randn(total, hkv, ev, dtype=dtype, requires_grad=True)
    s = torch.randn(hq, requires_grad=True) if sink else None
    dout = torch.randn(total, hq, ev, dtype=dtype)
    left = None if window[0] < 0 else window[0]
    out, lse = attnforge.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                window_size=(left, 0 if causal else None), learnable_sink=s,
                                                return_lse=True)
    out.backward(dout)
    n = total // world
    rows = slice(rank * n, (rank + 1) * n)
    cu_q, cu_k, max_q, max_k, k_slice = ad.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
    lq, lk, lv = (t.detach()[rows].clone().requires_grad_() for t in (q, k, v))
    ls = s.detach().clone().requires_grad_() if sink else None
    o, l, none = ad.llama3_flash_attn_varlen_func(lq, lk, lv, cu_q, cu_k, max_q, max_k, stride, k_slice,
                                                  causal=causal, window_size=window, return_attn_probs=True,
                                                  learnable_sink=ls)
    o.backward(dout[rows])
    got = {"out": o, "lse": l, "dq": lq.grad, "dk": lk.grad, "dv": lv.grad}
    want = {"out": out[rows], "lse": lse[:, rows], "dq": q.grad[rows], "dk": k.grad[rows], "dv": v.grad[rows]}
    if sink:
        summed = ls.grad.clone()
        torch.distributed.all_reduce(summed)
        got["dsink"], want["dsink"] = summed, s.grad
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3 * world, rtol=1e-3 * world)
    failures = []
    for name in got:
        try:
            torch.testing.assert_close(got[name].float(), want[name].detach().float(), **tol)
        except AssertionError as error:
            failures.append(f"{name}: {str(error).splitlines()[0:3]}")
    return none is None, failures


def _all_cases(rank, world):
    return [_one_case(rank, world, *case) for case in CASES]


@pytest.mark.parametrize("world", [2, 3])
def test_llama3_matches_whole_batch(world):
    results = run_group(_all_cases, world, timeout=150)
    for rank, cases in enumerate(results):
        for case, (third_none, failures) in zip(CASES, cases):
            assert third_none, f"rank {rank} {case}: return_attn_probs's third value is not None"
            assert not failures, f"rank {rank} {case}: {failures}"


def test_prepare_cu_seqlens_definition():
    import attnforge.distributed as ad
    cu = torch.tensor([0, 5, 5, 17, 24], dtype=torch.int32)   # 24 tokens over 4 ranks: pieces of 6
    for causal in (True, False):
        for rank in range(4):
            cu_q, cu_k, max_q, max_k, k_slice = ad.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, 4)
            lo, hi = 6 * rank, 6 * rank + 6
            assert int(cu_q[0]) == 0 and int(cu_q[-1]) == 6
            # every query token of the piece is in the document cu_q places it in, at the right offset
            doc_starts = [int(c) for c in cu.tolist()]
            for t in range(lo, hi):
                d = max(i for i in range(len(doc_starts) - 1) if doc_starts[i] <= t < doc_starts[i + 1])
                local = t - lo
                j = max(i for i in range(len(cu_q) - 1) if int(cu_q[i]) <= local < int(cu_q[i + 1]))
                # the key range of that local document is the whole global document up to the piece (causal) or
                # to its end (non-causal)
                k_lo = k_slice.start + int(cu_k[j])
                k_hi = k_slice.start + int(cu_k[j + 1])
                assert k_lo == doc_starts[d]
                assert k_hi == (min(doc_starts[d + 1], hi) if causal else doc_starts[d + 1])
            assert max_q == max(int(b - a) for a, b in zip(cu_q[:-1], cu_q[1:]))
            assert max_k == max(int(b - a) for a, b in zip(cu_k[:-1], cu_k[1:]))


def _bad_stride(rank, world):
    import attnforge
    import attnforge.distributed as ad
    cu = torch.tensor([0, 16], dtype=torch.int32) * world
    q = torch.randn(16, 4, 8)
    k = torch.randn(16, 2, 8)
    prepared = ad.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    stride = 2 if rank == 0 else 3   # rank 1's stride does not divide its 2 K/V heads
    try:
        ad.llama3_flash_attn_varlen_func(q, k, k, *prepared[:4], stride, prepared[4], causal=True)
    except attnforge.InvalidArgumentError as error:
        return str(error)
    return None


def test_bad_input_raises_on_every_rank():
    messages = run_group(_bad_stride, 2, timeout=60, group_timeout=20)
    assert "heads_k_stride: must divide the 2 K/V heads, got 3" in messages[1]
    assert "rank 1 of the group refused its input" in messages[0]
