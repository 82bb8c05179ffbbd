"""attnforge.distributed.sharded_decode: a KV cache split along the sequence over the ranks of a gloo group, a few
query tokens per sequence. One spawned group of 4 ranks runs every case for world sizes 1, 2, 3 and 4 (sub-groups of
ranks [0, w)), then the refusals; the parent compares every rank's result with attnforge on the whole cache in one
process and with a float64 plain-PyTorch reference, and checks that all ranks returned the same bits."""
import math

import pytest
import torch

import attnforge
from attnforge.distributed import decode

from dist_harness import run_group

PAGE = 16
GARBAGE = 50.0   # fills storage no sequence uses: a kernel reading it would be far off


# ---------------------------------------------------------------- cases (built the same way in every process)
CASES = [
    # name, dtype, B, Lq, Hq, Hkv, E, Ev, form, causal, (left, right), softcap, sink, scale, lengths
    dict(name="full shards", dtype=torch.float32, B=2, Lq=1, Hq=4, Hkv=4, E=16, Ev=16, form="full", causal=True,
         window=(None, None), softcap=0.0, sink=False, scale=None, lengths="full"),
    dict(name="uneven gqa causal", dtype=torch.float32, B=3, Lq=3, Hq=4, Hkv=2, E=16, Ev=8, form="batched",
         causal=True, window=(None, None), softcap=0.0, sink=False, scale=0.3, lengths="uneven"),
    dict(name="paged softcap sink", dtype=torch.float32, B=3, Lq=1, Hq=4, Hkv=1, E=32, Ev=32, form="paged",
         causal=True, window=(None, None), softcap=5.0, sink=True, scale=None, lengths="uneven"),
    dict(name="paged bf16 speculative", dtype=torch.bfloat16, B=3, Lq=4, Hq=8, Hkv=2, E=16, Ev=16, form="paged",
         causal=True, window=(None, None), softcap=0.0, sink=True, scale=None, lengths="uneven"),
    dict(name="sliding window", dtype=torch.float32, B=3, Lq=2, Hq=4, Hkv=2, E=16, Ev=16, form="batched",
         causal=True, window=(6, None), softcap=0.0, sink=False, scale=None, lengths="uneven"),
    dict(name="bf16 batched softcap", dtype=torch.bfloat16, B=2, Lq=1, Hq=4, Hkv=2, E=32, Ev=32, form="batched",
         causal=True, window=(None, None), softcap=3.0, sink=False, scale=None, lengths="uneven"),
    dict(name="rows that see no key", dtype=torch.float32, B=3, Lq=3, Hq=2, Hkv=1, E=16, Ev=16, form="batched",
         causal=True, window=(None, None), softcap=0.0, sink=True, scale=None, lengths="short"),
    dict(name="non-causal window both sides", dtype=torch.float32, B=3, Lq=3, Hq=4, Hkv=2, E=16, Ev=16,
         form="paged", causal=False, window=(4, 1), softcap=0.0, sink=False, scale=None, lengths="uneven"),
    dict(name="a rank with no keys", dtype=torch.float32, B=2, Lq=2, Hq=4, Hkv=2, E=16, Ev=16, form="batched",
         causal=True, window=(None, None), softcap=2.0, sink=True, scale=None, lengths="empty rank"),
]
WORLDS = (1, 2, 3, 4)


def _lengths(case, world, gen):
    """n[r][b]: the keys rank r holds of sequence b (the shards lie in rank order)."""
    B, top = case["B"], (40 if case["form"] == "paged" else 12)
    if case["lengths"] == "full":
        per_rank = [int(torch.randint(3, 10, (1,), generator=gen)) for _ in range(world)]
        return [[per_rank[r]] * B for r in range(world)]
    n = torch.randint(0, top + 1, (world, B), generator=gen).tolist()
    if case["lengths"] == "uneven" and world > 1:
        n[world - 1][0] = 0          # the tail rank holds nothing of sequence 0: its tail is on a lower rank
        n[world - 1][1] = 1          # sequence 1's last Lq keys span two ranks (causal mask on both)
        n[world - 2][1] = max(n[world - 2][1], 3)
        if world > 2 and B > 2:
            n[1][2] = 0              # a middle rank with nothing of sequence 2
    elif case["lengths"] == "short":
        for r in range(world):
            n[r][0] = 1 if r == world - 1 else 0   # one key: the first Lq - 1 rows see none
            n[r][1] = 0                            # no key at all: every row sees none
    elif case["lengths"] == "empty rank" and world > 1:
        n[world - 1] = [0] * B
    return n


def make_case(case, world, index):
    """The whole problem (q, K, V, N, sink) and each rank's shard arguments, deterministic in (world, index)."""
    gen = torch.Generator().manual_seed(1000 * world + index)
    B, Lq, Hq, Hkv, E, Ev = (case[x] for x in ("B", "Lq", "Hq", "Hkv", "E", "Ev"))
    n = _lengths(case, world, gen)
    totals = [sum(n[r][b] for r in range(world)) for b in range(B)]
    longest = max(1, max(totals))
    q = torch.randn(B, Lq, Hq, E, generator=gen).to(case["dtype"])
    K = torch.randn(B, longest, Hkv, E, generator=gen).to(case["dtype"])
    V = torch.randn(B, longest, Hkv, Ev, generator=gen).to(case["dtype"])
    sink = torch.randn(Hq, generator=gen) if case["sink"] else None
    shards = [_shard(case, K, V, n, r, gen) for r in range(world)]
    return dict(q=q, K=K, V=V, N=totals, sink=sink, shards=shards)


def _shard(case, K, V, n, rank, gen):
    """Rank `rank`'s k, v and index arguments: batched (padded with garbage), or pages of 16 in a shuffled table."""
    B = K.shape[0]
    starts = [sum(n[r][b] for r in range(rank)) for b in range(B)]
    pieces = [(K[b, starts[b]:starts[b] + n[rank][b]], V[b, starts[b]:starts[b] + n[rank][b]]) for b in range(B)]
    if case["form"] in ("full", "batched"):
        S = max(n[rank]) + (0 if case["form"] == "full" or max(n[rank]) == 0 else 2)
        k = torch.full((B, S) + K.shape[2:], GARBAGE, dtype=K.dtype)
        v = torch.full((B, S) + V.shape[2:], GARBAGE, dtype=V.dtype)
        for b, (kb, vb) in enumerate(pieces):
            k[b, :kb.shape[0]], v[b, :vb.shape[0]] = kb, vb
        seqlens = None if case["form"] == "full" else torch.tensor(n[rank], dtype=torch.int32)
        return dict(k=k, v=v, cache_seqlens=seqlens, page_table=None)
    need = [math.ceil(x / PAGE) for x in n[rank]]
    pool = sum(need) + 2
    order = torch.randperm(pool, generator=gen).tolist()
    k = torch.full((pool, PAGE) + K.shape[2:], GARBAGE, dtype=K.dtype)
    v = torch.full((pool, PAGE) + V.shape[2:], GARBAGE, dtype=V.dtype)
    table = torch.randint(0, pool, (B, max(need) + 1), generator=gen, dtype=torch.int32)   # unused entries: unread
    for b, (kb, vb) in enumerate(pieces):
        for i in range(need[b]):
            page = order.pop()
            table[b, i] = page
            rows = slice(i * PAGE, min((i + 1) * PAGE, kb.shape[0]))
            k[page, :rows.stop - rows.start], v[page, :rows.stop - rows.start] = kb[rows], vb[rows]
    return dict(k=k, v=v, cache_seqlens=torch.tensor(n[rank], dtype=torch.int32), page_table=table)


def _fa2(side):
    return -1 if side is None else side


def _decode_kwargs(case, problem, rank):
    shard = problem["shards"][rank]
    left, right = case["window"]
    return dict(cache_seqlens=shard["cache_seqlens"], page_table=shard["page_table"], softmax_scale=case["scale"],
                causal=case["causal"], window_size=(_fa2(left), _fa2(right)), softcap=case["softcap"],
                learnable_sink=problem["sink"])


# ---------------------------------------------------------------- the ranks
def _run_cases(rank, world, group):
    results = []
    for index, case in enumerate(CASES):
        problem = make_case(case, world, index)
        shard = problem["shards"][rank]
        kwargs = _decode_kwargs(case, problem, rank)
        with torch.no_grad():
            if case["dtype"] == torch.bfloat16 and case["softcap"]:   # the out-only return
                out, lse = decode.sharded_decode(problem["q"], shard["k"], shard["v"], group, **kwargs), None
            else:
                out, lse = decode.sharded_decode(problem["q"], shard["k"], shard["v"], group, return_lse=True,
                                                 **kwargs)
        results.append((out, lse))
    return results


def _expect_error(call):
    """(error type name, message) of call(), which must raise; ('none', '') when it returns."""
    try:
        call()
    except Exception as error:   # noqa: B902 (the test compares the type and the message)
        return type(error).__name__, str(error)
    return "none", ""


def _refusals(rank, world):
    """Each refusal on the whole group (every rank must raise, none may hang), then a valid call."""
    case, index = CASES[0], 0
    problem = make_case(case, world, index)
    shard = problem["shards"][rank]
    q = problem["q"]
    errors = {}
    with torch.no_grad():
        bad_q = q[:, :0] if rank == 1 else q                                   # rank 1: Lq = 0
        errors["q shape"] = _expect_error(lambda: decode.sharded_decode(bad_q, shard["k"], shard["v"]))
        bad_window = (3, -1) if rank == 3 else (-1, -1)
        errors["window"] = _expect_error(lambda: decode.sharded_decode(q, shard["k"], shard["v"],
                                                                       window_size=bad_window))
    grad_q = q.clone().requires_grad_(rank == 2)
    errors["grad"] = _expect_error(lambda: decode.sharded_decode(grad_q, shard["k"], shard["v"]))
    paged = make_case(CASES[2], world, 2)
    pshard = paged["shards"][rank]
    table = pshard["page_table"].clone()
    if rank == 3:                                                              # only the kernel sees it
        table[int(torch.nonzero(pshard["cache_seqlens"])[0]), 0] = 10 ** 6
    with torch.no_grad():
        errors["kernel"] = _expect_error(lambda: decode.sharded_decode(
            paged["q"], pshard["k"], pshard["v"], cache_seqlens=pshard["cache_seqlens"], page_table=table))
        after = decode.sharded_decode(q, shard["k"], shard["v"], return_lse=True, **_decode_kwargs(case, problem, rank))
    return errors, after


def rank_main(rank, world):
    """Every case on sub-groups of 1, 2 and 3 ranks and on the whole group (group=None), then the refusals."""
    import torch.distributed as dist
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS if w < world}   # every rank creates every group
    results = {}
    for w in WORLDS:
        if rank < w:
            results[w] = _run_cases(rank, w, groups.get(w))
    errors, after = _refusals(rank, world)
    return dict(results=results, errors=errors, after=after)


# ---------------------------------------------------------------- references in this process
def reference64(case, problem):
    """float64 matmul-softmax on the whole cache: the queries are each sequence's last Lq positions."""
    q, K, V, N, sink = (problem[x] for x in ("q", "K", "V", "N", "sink"))
    B, Lq, Hq, E = q.shape
    group = Hq // K.shape[2]
    scale = case["scale"] if case["scale"] is not None else 1.0 / math.sqrt(E)
    left, right = case["window"]
    if case["causal"]:
        right = 0
    out = torch.zeros(B, Lq, Hq, V.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = N[b]
        k = K[b, :n].double().repeat_interleave(group, dim=1)
        v = V[b, :n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("lhe,nhe->hln", q[b].double(), k) * scale
        if case["softcap"]:
            s = case["softcap"] * torch.tanh(s / case["softcap"])
        d = torch.arange(n)[None, :] - (n - Lq + torch.arange(Lq))[:, None]   # key position - query position
        visible = torch.ones(Lq, n, dtype=torch.bool)
        if left is not None:
            visible &= d >= -left
        if right is not None:
            visible &= d <= right
        s = s.masked_fill(~visible, float("-inf"))
        logits = s if sink is None else torch.cat([s, sink.double()[:, None, None].expand(Hq, Lq, 1)], -1)
        m = torch.logsumexp(logits, -1)
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("hln,nhe->lhe", p, v)
        lse[b] = m
    return out, lse


def whole_cache(case, problem):
    """attnforge on the whole cache in one process (FA4's window: None unbounded)."""
    N = torch.tensor(problem["N"], dtype=torch.int32)
    with torch.no_grad():
        return attnforge.flash_attn_varlen_func(problem["q"], problem["K"], problem["V"], seqused_k=N,
                                                softmax_scale=case["scale"], causal=case["causal"],
                                                window_size=case["window"], softcap=case["softcap"],
                                                learnable_sink=problem["sink"], return_lse=True)


def _tolerances(case, world):
    if case["dtype"] == torch.float32:
        return dict(atol=2e-6, rtol=1e-5)
    return dict(atol=8e-3 * world, rtol=1e-3 * world)


def _close(actual, expected, tol, what):
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), f"{what}: -inf/NaN where the reference has none (or not)"
    assert torch.equal(actual[~finite], expected[~finite]), f"{what}: non-finite values differ"
    error = (actual[finite] - expected[finite]).abs()
    bound = tol["atol"] + tol["rtol"] * expected[finite].abs()
    assert bool((error <= bound).all()), f"{what}: max error {float(error.max()):.3g} over the tolerance"


@pytest.fixture(scope="module")
def group_results():
    return run_group(rank_main, 4, timeout=150, group_timeout=60)


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_matches_whole_cache_and_float64(group_results, world):
    for index, case in enumerate(CASES):
        problem = make_case(case, world, index)
        ref_out, ref_lse = reference64(case, problem)
        af_out, af_lse = whole_cache(case, problem)
        tol = _tolerances(case, world)
        for rank in range(world):
            out, lse = group_results[rank]["results"][world][index]
            what = f"world {world}, rank {rank}, {case['name']}"
            assert out.dtype == case["dtype"] and out.shape == problem["q"].shape[:3] + (case["Ev"],), what
            _close(out, ref_out, tol, what + ": out vs float64")
            _close(out, af_out, tol, what + ": out vs attnforge on the whole cache")
            if lse is not None:
                assert lse.dtype == torch.float32 and lse.shape == af_lse.shape, what
                _close(lse, ref_lse, tol, what + ": lse vs float64")
                _close(lse, af_lse, tol, what + ": lse vs attnforge on the whole cache")
            if world == 1:   # a group of one rank is plain attnforge
                assert torch.equal(out, af_out), what


@pytest.mark.parametrize("world", WORLDS[1:])
def test_ranks_return_the_same_bits(group_results, world):
    for index, case in enumerate(CASES):
        first_out, first_lse = group_results[0]["results"][world][index]
        for rank in range(1, world):
            out, lse = group_results[rank]["results"][world][index]
            assert torch.equal(out, first_out), f"world {world}, {case['name']}: rank {rank}'s out differs"
            assert (lse is None) == (first_lse is None)
            assert lse is None or torch.equal(lse, first_lse)


def test_rows_that_see_no_key_are_zero_with_the_sink_lse(group_results):
    index = [c["name"] for c in CASES].index("rows that see no key")
    problem = make_case(CASES[index], 3, index)
    out, lse = group_results[0]["results"][3][index]
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(lse[1], problem["sink"][:, None].expand(-1, 3).float())   # no key: lse = sink


def test_mismatched_calls_raise_on_every_rank(group_results):
    for rank, result in enumerate(group_results):
        errors = result["errors"]
        kind, message = errors["q shape"]
        assert kind == "InvalidArgumentError" and "q shape differs" in message, (rank, message)
        kind, message = errors["window"]
        assert kind == "InvalidArgumentError" and "window differs" in message, (rank, message)


def test_grad_is_refused_on_every_rank(group_results):
    for rank, result in enumerate(group_results):
        kind, message = result["errors"]["grad"]
        assert kind == "InvalidArgumentError", (rank, kind, message)
        assert ("forward only" in message) if rank == 2 else ("rank 2 of the group refused" in message), message


def test_a_kernel_failure_on_one_rank_raises_on_every_rank(group_results):
    for rank, result in enumerate(group_results):
        kind, message = result["errors"]["kernel"]
        assert kind == "InvalidArgumentError", (rank, kind, message)
        assert "page_table" in message, message
        if rank != 3:
            assert "rank 3 of the group failed on its shard" in message, message


def test_the_group_works_after_the_refusals(group_results):
    for rank, result in enumerate(group_results):
        out, lse = result["after"]
        first_out, first_lse = group_results[rank]["results"][4][0]
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse), rank


# ---------------------------------------------------------------- in this process
def test_local_window_matches_the_global_mask():
    """FA4's local window on a shard sees exactly the keys the global window shows its rows."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(3000):
        lq, n, after = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 5), (0, 9), (0, 9)))
        left = None if torch.rand(1, generator=gen) < 0.3 else int(torch.randint(0, 12, (1,), generator=gen))
        right = None if torch.rand(1, generator=gen) < 0.3 else int(torch.randint(0, 4, (1,), generator=gen))
        total = n + after + int(torch.randint(0, 5, (1,), generator=gen))
        start = total - after - n
        i, j = torch.arange(lq)[:, None], torch.arange(n)[None, :]
        d = (start + j) - (total - lq + i)
        want = torch.ones(lq, n, dtype=torch.bool)
        if left is not None:
            want &= d >= -left
        if right is not None:
            want &= d <= right
        window = decode.local_window(left, right, after, n, lq)
        if window is decode.SKIP:
            got = torch.zeros(lq, n, dtype=torch.bool)
        else:
            lo, hi = window
            got = torch.ones(lq, n, dtype=torch.bool)
            if lo is not None:
                got &= j >= i + n - lq - lo
            if hi is not None:
                got &= j <= i + n - lq + hi
        assert torch.equal(got, want), (left, right, after, n, lq, window)


def test_without_torch_distributed_it_says_so():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("another test initialised torch.distributed in this process")
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(attnforge.InvalidArgumentError, match="not initialised"):
        decode.sharded_decode(q, q, q)
