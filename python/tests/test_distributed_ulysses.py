"""attnforge.distributed's Ulysses attention and the hybrid (USP: Ulysses over one group, ring over another).
Every rank's out, lse, dq/dk/dv (and the sink's gradient summed over the ranks) against attnforge's flash_attn_func on
the whole sequence in one process, at PyTorch's context-parallel tolerances; the bad-input rules raise on every rank
and hang none.

CI has 2 cores, so one group of 4 ranks is spawned once for the module: it makes sub-groups of 1, 2 and 3 ranks and
the hybrid's groups, runs every case inside, and returns each case's verdict per rank; the tests read the verdicts.
The head, replication and shard arithmetic is checked without spawning."""
import os
import sys
import traceback

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_group  # noqa: E402

WORLD = 4
N = 16   # tokens per rank: S = N * group size <= 64 * W


class Case:
    """One call: heads, head dims, flags (window in FlashAttention-2's convention), dtype."""

    def __init__(self, name, hq=8, hkv=8, e=16, ev=16, causal=False, window=(-1, -1), softcap=0.0, sink=False,
                 dtype="float32", batch=2):
        self.name, self.hq, self.hkv, self.e, self.ev = name, hq, hkv, e, ev
        self.causal, self.window, self.softcap, self.sink = causal, window, softcap, sink
        self.dtype, self.batch = dtype, batch


# cases run on groups of 1, 2 and 4 ranks (Hq = 8 divides by each)
ULYSSES_CASES = [
    Case("mha"),
    Case("causal_gqa_divisible", hkv=4, causal=True),
    Case("causal_gqa_replicated_ev_sink", hkv=2, ev=8, causal=True, sink=True),
    Case("mqa_window_softcap", hkv=1, window=(5, 3), softcap=2.0),
    Case("causal_window_sink", hkv=2, causal=True, window=(6, -1), sink=True),
    Case("bf16_causal_gqa_sink", hkv=2, ev=24, causal=True, sink=True, dtype="bfloat16"),
    Case("bf16_mha", dtype="bfloat16"),
]
# cases on a group of 3 ranks (Hq = 6)
ULYSSES3_CASES = [
    Case("gqa_divisible", hq=6, hkv=3, causal=True),
    Case("gqa_replicated_sink_ev", hq=6, hkv=2, ev=8, sink=True, window=(4, 4)),
    Case("bf16_causal_mqa", hq=6, hkv=1, causal=True, dtype="bfloat16"),
]
# hybrid at W = 4, u = 2, r = 2
HYBRID_CASES = [
    ("zigzag", True, Case("zigzag_causal", hkv=2, causal=True)),
    ("zigzag", True, Case("zigzag_causal_mqa_sink_ev", hkv=1, ev=8, causal=True, sink=True)),
    ("zigzag", True, Case("zigzag_bf16_causal", hkv=2, causal=True, dtype="bfloat16")),
    ("ring", True, Case("ring_window_softcap", hkv=4, window=(7, 2), softcap=3.0)),
    ("zigzag", False, Case("zigzag_causal_ring_low", hkv=2, causal=True, sink=True)),
]


# ---------------------------------------------------------------- on every rank
def _tolerances(dtype, world):
    """PyTorch's context-parallel tolerances: float32 atol 2e-6, rtol 1e-5; bfloat16 scaled by the world size."""
    if dtype == torch.float32:
        return dict(atol=2e-6, rtol=1e-5)
    return dict(atol=8e-3 * world, rtol=1e-3 * world)


def _inputs(case, length, seed):
    """The whole sequence's q, k, v, sink and dout, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    shape = lambda h, d: (case.batch, length, h, d)   # noqa: E731
    q = torch.randn(shape(case.hq, case.e), generator=g).to(dtype)
    k = torch.randn(shape(case.hkv, case.e), generator=g).to(dtype)
    v = torch.randn(shape(case.hkv, case.ev), generator=g).to(dtype)
    dout = torch.randn(shape(case.hq, case.ev), generator=g).to(dtype)
    sink = torch.randn(case.hq, generator=g) if case.sink else None
    return q, k, v, sink, dout


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def _reference(case, q, k, v, sink, dout):
    """attnforge.flash_attn_func on the whole sequence in this process: out, lse, dq, dk, dv, dsink."""
    import attnforge
    q, k, v, sink = (_leaf(t) for t in (q, k, v, sink))
    fa4_window = tuple(None if w < 0 else w for w in case.window)   # FA4: None = unbounded; causal sets right = 0
    out, lse = attnforge.flash_attn_func(q, k, v, causal=case.causal, window_size=fa4_window, softcap=case.softcap,
                                         learnable_sink=sink, return_lse=True)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad, None if sink is None else sink.grad


def _compare(case, world, group, cut, got, want, sink_heads):
    """got: this rank's (out, lse, dq, dk, dv, dsink); want: the whole sequence's; cut(x, dim) this rank's shard.
    dsink: zero outside this rank's heads, and its sum over the group equals the whole sequence's."""
    import torch.distributed as dist
    tol = _tolerances(getattr(torch, case.dtype), world)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got[:5], want[:5]):
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
        torch.testing.assert_close(g, cut(w, 2 if name == "lse" else 1), msg=lambda m: f"{name}: {m}", **tol)
    if case.sink:
        dsink = got[5].clone()
        outside = torch.ones_like(dsink, dtype=torch.bool)
        outside[sink_heads] = False
        assert bool((dsink[outside] == 0).all()), f"dsink non-zero outside this rank's heads: {dsink}"
        dist.all_reduce(dsink, group=group)
        torch.testing.assert_close(dsink, want[5], msg=lambda m: f"dsink summed: {m}",
                                   **_tolerances(torch.float32, world))


def _ulysses_case(case, group, world, rank, seed):
    from attnforge.distributed import shard, ulysses_attention
    q, k, v, sink, dout = _inputs(case, N * world, seed)
    want = _reference(case, q, k, v, sink, dout)
    cut = lambda x, dim: shard(x, "ring", rank, world, dim=dim)   # noqa: E731
    ql, kl, vl = (_leaf(cut(t, 1)) for t in (q, k, v))
    sl = _leaf(sink)
    out, lse, none = ulysses_attention(ql, kl, vl, group=group, causal=case.causal, window_size=case.window,
                                       softcap=case.softcap, learnable_sink=sl, return_attn_probs=True)
    assert none is None and lse.dtype == torch.float32 and lse.shape == (case.batch, case.hq, N)
    out.backward(cut(dout, 1))
    heads = case.hq // world
    got = (out.detach(), lse, ql.grad, kl.grad, vl.grad, None if sl is None else sl.grad)
    _compare(case, world, group, cut, got, want, slice(rank * heads, (rank + 1) * heads))
    plain = ulysses_attention(ql, kl, vl, group=group, causal=case.causal, window_size=case.window,
                              softcap=case.softcap, learnable_sink=sl)   # without lse: the same out
    assert torch.equal(plain, out.detach())


def _hybrid_case(case, layout, low, groups, rank, seed):
    import torch.distributed as dist
    from attnforge.distributed import hybrid_attention, hybrid_shard
    from attnforge.distributed.hybrid import hybrid_ranks
    u, r = 2, 2
    q, k, v, sink, dout = _inputs(case, N * WORLD, seed)
    want = _reference(case, q, k, v, sink, dout)
    cut = lambda x, dim: hybrid_shard(x, layout, rank, WORLD, u, r, dim=dim, use_ulysses_low=low)   # noqa: E731
    ql, kl, vl = (_leaf(cut(t, 1)) for t in (q, k, v))
    sl = _leaf(sink)
    ulysses_group, ring_group = groups
    out, lse, _ = hybrid_attention(ql, kl, vl, ulysses_group, ring_group, causal=case.causal,
                                   window_size=case.window, softcap=case.softcap, learnable_sink=sl, layout=layout,
                                   return_attn_probs=True)
    out.backward(cut(dout, 1))
    mu, _ = hybrid_ranks(rank, WORLD, u, r, low)
    heads = case.hq // u
    got = (out.detach(), lse, ql.grad, kl.grad, vl.grad, None if sl is None else sl.grad)
    _compare(case, WORLD, dist.group.WORLD, cut, got, want, slice(mu * heads, (mu + 1) * heads))


def _expect_refusal(function, *words):
    """'ok' when function() raises InvalidArgumentError whose message has every word, else what happened."""
    import attnforge
    try:
        function()
    except attnforge.InvalidArgumentError as error:
        missing = [w for w in words if w not in str(error)]
        return "ok" if not missing else f"message lacks {missing}: {error}"
    except BaseException as error:   # noqa: B902 (reported as the verdict)
        return f"raised {type(error).__name__} instead: {error}"
    return "no error raised"


def _bad_inputs(rank, hybrid_groups_low):
    """Each refusal on every rank (none hangs: the next case would time out)."""
    from attnforge.distributed import hybrid_attention, ulysses_attention
    verdicts = {}
    t = lambda *shape: torch.randn(*shape)   # noqa: E731
    verdicts["bad hq not divisible"] = _expect_refusal(
        lambda: ulysses_attention(t(1, 8, 6, 16), t(1, 8, 2, 16), t(1, 8, 2, 16)), "Hq % degree")
    n = 8 if rank == 0 else 16   # rank 0 alone differs
    verdicts["bad shapes differ"] = _expect_refusal(
        lambda: ulysses_attention(t(1, n, 8, 16), t(1, n, 8, 16), t(1, n, 8, 16), causal=True), "q shape")
    flag = rank == 2   # one rank asks for a window the others do not
    verdicts["bad flags differ"] = _expect_refusal(
        lambda: ulysses_attention(t(1, 8, 4, 16), t(1, 8, 4, 16), t(1, 8, 4, 16), window_size=(3 if flag else -1, -1)),
        "window")
    n = 8 if rank == 3 else 16   # one rank of the second Ulysses group differs: its ring peers must stop too
    verdicts["bad hybrid shapes differ"] = _expect_refusal(
        lambda: hybrid_attention(t(1, n, 4, 16), t(1, n, 4, 16), t(1, n, 4, 16), *hybrid_groups_low, causal=True),
        "q shape")
    verdicts["bad hybrid hq not divisible"] = _expect_refusal(
        lambda: hybrid_attention(t(1, 8, 3, 16), t(1, 8, 3, 16), t(1, 8, 3, 16), *hybrid_groups_low), "Hq % degree")
    return verdicts


def _run(verdicts, name, function, *args):
    """function(*args) as the verdict of `name`: 'ok' or the traceback."""
    try:
        function(*args)
        verdicts[name] = "ok"
    except BaseException:   # noqa: B902 (one case's failure must not stop the others: the ranks stay in step)
        verdicts[name] = traceback.format_exc()


def _rank_main(rank, world):
    """Every case on this rank; {case name: 'ok' or what went wrong}."""
    import torch.distributed as dist
    from attnforge.distributed import hybrid_groups
    singles = [dist.new_group([r]) for r in range(world)]   # every rank makes every group, in one order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    low, high = hybrid_groups(2, 2), hybrid_groups(2, 2, use_ulysses_low=False)
    verdicts = _bad_inputs(rank, low)
    subgroups = [(1, singles[rank], 0), (2, pairs[rank // 2], rank % 2), (4, None, rank)]
    for seed, case in enumerate(ULYSSES_CASES):
        for size, group, group_rank in subgroups:
            _run(verdicts, f"ulysses W={size} {case.name}", _ulysses_case, case, group, size, group_rank, seed)
    if rank < 3:
        for seed, case in enumerate(ULYSSES3_CASES):
            _run(verdicts, f"ulysses W=3 {case.name}", _ulysses_case, case, triple, 3, rank, 100 + seed)
    for seed, (layout, use_low, case) in enumerate(HYBRID_CASES):
        _run(verdicts, f"hybrid {case.name}", _hybrid_case, case, layout, use_low, low if use_low else high, rank,
             200 + seed)
    return verdicts


# ---------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def verdicts():
    """Each rank's {case: verdict} from one spawned group of 4 ranks."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return run_group(_rank_main, WORLD, timeout=150, group_timeout=40)


def _assert_cases(verdicts, prefix, expected):
    """Every case named `prefix`... passed on every rank that ran it, and `expected` cases ran on some rank."""
    seen = set()
    failures = []
    for rank, results in enumerate(verdicts):
        for name, verdict in results.items():
            if name.startswith(prefix):
                seen.add(name)
                if verdict != "ok":
                    failures.append(f"rank {rank}, {name}:\n{verdict}")
    assert len(seen) == expected, f"{prefix}: {len(seen)} cases ran, {expected} expected: {sorted(seen)}"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_ulysses_matches_one_process(verdicts, size):
    _assert_cases(verdicts, f"ulysses W={size} ", len(ULYSSES_CASES))


def test_ulysses_three_ranks(verdicts):
    _assert_cases(verdicts, "ulysses W=3 ", len(ULYSSES3_CASES))
    assert not any(n.startswith("ulysses W=3") for n in verdicts[3])   # rank 3 is outside the group of 3


def test_hybrid_matches_one_process(verdicts):
    _assert_cases(verdicts, "hybrid ", len(HYBRID_CASES))


def test_bad_input_raises_on_every_rank(verdicts):
    _assert_cases(verdicts, "bad ", 5)
    assert all(len([n for n in v if n.startswith("bad ")]) == 5 for v in verdicts)


# ---------------------------------------------------------------- arithmetic without processes
def test_kv_head_replication_is_minimal():
    from attnforge.distributed.ulysses import kv_head_index
    assert kv_head_index(8, 4, 4) is None and kv_head_index(8, 8, 2) is None   # divisible: no replication
    assert kv_head_index(8, 2, 4) == [0, 0, 1, 1]      # each K/V head twice: one per rank
    assert kv_head_index(8, 1, 4) == [0, 0, 0, 0]
    assert kv_head_index(6, 2, 3) == [0, 0, 0, 1, 1, 1]  # rank 1's query heads 2, 3 read K/V heads 0 and 1
    for hq, hkv, p in ((8, 2, 4), (6, 2, 3), (12, 6, 4), (6, 3, 2), (16, 2, 8)):
        index = kv_head_index(hq, hkv, p)
        m, local = len(index) // p, hq // p
        for h in range(hq):   # local query head i reads local K/V head i // (local / m): the right global one
            r, i = divmod(h, local)
            assert index[r * m + i // (local // m)] == h // (hq // hkv)


@pytest.mark.parametrize("layout", ["zigzag", "ring", "stripe"])
@pytest.mark.parametrize("low", [True, False])
def test_hybrid_shard_order(layout, low):
    """After the Ulysses all-to-all (the u pieces of a ring rank in Ulysses order) each ring rank holds its layout
    shard; hybrid_unshard inverts hybrid_shard."""
    from attnforge.distributed import hybrid_shard, hybrid_unshard, shard
    from attnforge.distributed.hybrid import hybrid_ranks
    u, r, world = 2, 3, 12   # two blocks of u·r: data parallel copies
    x = torch.arange(2 * 48 * 2).reshape(2, 48, 2)
    shards = [hybrid_shard(x, layout, rank, world, u, r, use_ulysses_low=low) for rank in range(world)]
    for rho in range(r):
        pieces = sorted((hybrid_ranks(rank, world, u, r, low)[0], rank) for rank in range(6)
                        if hybrid_ranks(rank, world, u, r, low)[1] == rho)
        gathered = torch.cat([shards[rank] for _, rank in pieces], dim=1)
        assert torch.equal(gathered, shard(x, layout, rho, r))
    assert torch.equal(hybrid_unshard(shards[:6], layout, u, r, use_ulysses_low=low), x)
    assert torch.equal(shards[6], shards[0])   # the second block holds the same sequence


def test_hybrid_group_ranks():
    from attnforge.distributed.hybrid import _group_ranks, hybrid_ranks
    assert _group_ranks(4, 2, 2, True) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert _group_ranks(4, 2, 2, False) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    ulysses, ring = _group_ranks(8, 2, 2, True)
    assert ulysses == [[0, 1], [2, 3], [4, 5], [6, 7]] and ring == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for low in (True, False):   # a rank's place in its groups is hybrid_ranks'
        ulysses, ring = _group_ranks(12, 2, 3, low)
        for rank in range(12):
            mu, rho = hybrid_ranks(rank, 12, 2, 3, low)
            assert [g.index(rank) for g in ulysses if rank in g] == [mu]
            assert [g.index(rank) for g in ring if rank in g] == [rho]
