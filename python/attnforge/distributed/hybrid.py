"""Hybrid context parallelism (USP, yunchang's LongContextAttention) on attnforge's kernels: Ulysses over one group,
ring attention over another. The Ulysses all-to-all turns each rank's (B, n, H, D) shard into (B, u·n, H/u, D),
the ring layout's shard of the ring rank with 1/u of the heads; attnforge's ring attention runs over the ring group
on it; the inverse all-to-all brings the output back. Backward: the same in reverse (the ring's backward between the
all-to-alls' opposites).

    ulysses_group, ring_group = hybrid_groups(ulysses_degree=2, ring_degree=2)      # every rank calls it
    local = hybrid_shard(x, "zigzag", rank, world, 2, 2)                           # this rank's input shard
    out = hybrid_attention(q, k, v, ulysses_group, ring_group, causal=True, layout="zigzag")

Ranks: the world is blocks of u·r ranks (one sequence each; more blocks = data parallelism). With use_ulysses_low
(the default, as yunchang's), a block's Ulysses groups are runs of u consecutive ranks (the fast links of one node)
and its ring groups take every u-th rank; otherwise the opposite. Shards (yunchang's order): the ring rank's layout
shard of the whole sequence, cut into u equal consecutive pieces by Ulysses rank, so that the all-to-all gathers
each ring rank's layout shard in order."""
import torch
import torch.distributed as dist

from .. import _C
from . import _comm, _layout, _ring, ulysses as _ulysses
from .shard import positions as _positions   # the package exports a function named shard


# ---------------------------------------------------------------- groups and ranks
def _degrees(ulysses_degree, ring_degree, world):
    """Checked (u, r); InvalidArgumentError unless both are positive ints whose product divides the world."""
    for name, d in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise _C.InvalidArgumentError(f"{name}: expected a positive int, got {d!r}")
    if world % (ulysses_degree * ring_degree):
        raise _C.InvalidArgumentError(f"ulysses_degree × ring_degree = {ulysses_degree * ring_degree} does not "
                                      f"divide the world's {world} ranks")
    return ulysses_degree, ring_degree


def hybrid_ranks(rank: int, world: int, ulysses_degree: int, ring_degree: int, use_ulysses_low: bool = True):
    """(ulysses rank, ring rank) of global rank `rank`: its place in its Ulysses group and in its ring group."""
    u, r = _degrees(ulysses_degree, ring_degree, world)
    local = rank % (u * r)   # the place in its block of u·r ranks
    if use_ulysses_low:
        return local % u, local // u
    return local // r, local % r


def _group_ranks(world: int, u: int, r: int, use_ulysses_low: bool):
    """Every Ulysses group's and every ring group's global ranks, in the order all ranks create them."""
    ulysses, ring = [], []
    for base in range(0, world, u * r):
        if use_ulysses_low:
            ulysses += [[base + i * u + j for j in range(u)] for i in range(r)]
            ring += [[base + j + i * u for i in range(r)] for j in range(u)]
        else:
            ring += [[base + i * r + j for j in range(r)] for i in range(u)]
            ulysses += [[base + j + i * r for i in range(u)] for j in range(r)]
    return ulysses, ring


def hybrid_groups(ulysses_degree: int, ring_degree: int, use_ulysses_low: bool = True):
    """(ulysses_group, ring_group) of this rank, creating every group of the world: every rank must call it, in
    the same order as its other new_group calls (dist.new_group is collective over the world)."""
    _, world, rank = _comm.group_info(None)
    u, r = _degrees(ulysses_degree, ring_degree, world)
    ulysses_lists, ring_lists = _group_ranks(world, u, r, use_ulysses_low)
    mine_u = mine_r = None
    for ranks in ulysses_lists:   # all Ulysses groups first, then all ring groups: one order on every rank
        group = _comm.guarded("hybrid_groups: new_group", dist.new_group, ranks=ranks)
        mine_u = group if rank in ranks else mine_u
    for ranks in ring_lists:
        group = _comm.guarded("hybrid_groups: new_group", dist.new_group, ranks=ranks)
        mine_r = group if rank in ranks else mine_r
    return mine_u, mine_r


# ---------------------------------------------------------------- shards
def hybrid_positions(layout: str, rank: int, world: int, ulysses_degree: int, ring_degree: int, length: int,
                     use_ulysses_low: bool = True) -> torch.Tensor:
    """The global positions (int64) rank `rank` holds of a sequence of `length` tokens, in local order."""
    u, r = _degrees(ulysses_degree, ring_degree, world)
    mu, rho = hybrid_ranks(rank, world, u, r, use_ulysses_low)
    ring_positions = _positions(layout, rho, r, length)
    if ring_positions.numel() % u:
        raise _C.InvalidArgumentError(f"length: a ring shard of {ring_positions.numel()} tokens does not divide "
                                      f"into ulysses_degree = {u} equal pieces")
    piece = ring_positions.numel() // u
    return ring_positions[mu * piece:(mu + 1) * piece]


def hybrid_shard(x: torch.Tensor, layout: str, rank: int, world: int, ulysses_degree: int, ring_degree: int,
                 dim: int = 1, use_ulysses_low: bool = True) -> torch.Tensor:
    """Rank `rank`'s input shard of x along `dim` (the sequence dim), contiguous: its ring rank's `layout` shard of
    the whole sequence, then its Ulysses rank's piece of that."""
    index = hybrid_positions(layout, rank, world, ulysses_degree, ring_degree, x.shape[dim], use_ulysses_low)
    return x.index_select(dim, index.to(x.device)).contiguous()


def hybrid_unshard(shards, layout: str, ulysses_degree: int, ring_degree: int, dim: int = 1,
                   use_ulysses_low: bool = True) -> torch.Tensor:
    """The whole sequence from the shards of one block of u·r ranks (in rank order): hybrid_shard's inverse."""
    world = len(shards)
    length = sum(s.shape[dim] for s in shards)
    out = shards[0].new_empty((*shards[0].shape[:dim], length, *shards[0].shape[dim + 1:]))
    for rank, s in enumerate(shards):
        index = hybrid_positions(layout, rank, world, ulysses_degree, ring_degree, length, use_ulysses_low)
        out.index_copy_(dim, index.to(s.device), s)
    return out


# ---------------------------------------------------------------- the call
def _refusal(q, k, v, sink, call, layout, u, r):
    """This rank's own reason to refuse a hybrid call, or None."""
    error = _ulysses.refusal(q, k, v, sink, call.softcap, u, "the Ulysses group's size")
    if error is not None:
        return error
    if layout not in _layout.LAYOUTS:
        return f"layout: expected one of {_layout.LAYOUTS}, got {layout!r}"
    rule = _layout.length_rule(layout, r)
    if (u * q.shape[1]) % rule:
        return (f"q: a ring shard of {u * q.shape[1]} tokens (ulysses_degree × S_local) is odd; layout {layout!r} "
                f"needs the global length to divide into 2 × ring_degree = {2 * r} equal chunks")
    return None


def _check(what, q, k, v, sink, call, layout, return_attn_probs, ulysses, ring):
    """Every rank of both groups raises when any rank of its block refused or differs, before any transfer: the
    Ulysses group's verdict travels into the ring group's check (every ring group holds one rank of each Ulysses
    group), so no rank goes on into an all-to-all or ring whose peers have stopped."""
    (ug, u, _), (rg, r, _) = ulysses, ring
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    fields = _ulysses.call_fields(what, q, k, v, sink, call, return_attn_probs,
                                  {"layout": layout, "ulysses_degree": u, "ring_degree": r})
    error = _refusal(q, k, v, sink, call, layout, u, r)
    try:
        _comm.check_consistent(ug, u, device, what + " (Ulysses group)", fields, error)
    except _C.InvalidArgumentError as refused:
        error = str(refused)
    _comm.check_consistent(rg, r, device, what + " (ring group)", fields, error)


def _ring_attend(what, ring_group, layout):
    """attnforge's ring attention over ring_group as the attention between the all-to-alls: (out, lse)."""
    def attend(q, k, v, sink, call):
        window = (-1 if call.left is None else call.left, -1 if call.right is None else call.right)
        out, lse, _ = _ring.ring_attention(what + " (ring)", q, k, v, group=ring_group, layout=layout, causal=False,
                                           window_size=window, softmax_scale=call.softmax_scale,
                                           softcap=call.softcap, learnable_sink=sink, return_attn_probs=True)
        return out, lse
    return attend


def hybrid_attention(q, k, v, ulysses_group, ring_group, causal=False, softmax_scale=None, window_size=(-1, -1),
                     softcap=0.0, learnable_sink=None, layout="zigzag", return_attn_probs=False):
    """USP attention: q (B, S_local, Hq, E), k (B, S_local, Hkv, E), v (B, S_local, Hkv, Ev), each rank holding its
    hybrid_shard of the sequence (layout "zigzag", "ring" or "stripe" over the ring group). Hq must divide by the
    Ulysses degree u (Hkv need not: K/V heads are replicated as needed). window_size: FlashAttention-2's
    convention (-1 = unbounded, causal sets right = 0). Returns out (B, S_local, Hq, Ev) in q's dtype, or (out, lse
    float32 (B, Hq, S_local), None) with return_attn_probs. Gradients flow to q, k, v and learnable_sink (non-zero
    on this rank's Ulysses heads; sum it over the ranks). Errors as ulysses_attention's, on every rank."""
    what = "hybrid_attention"
    call = _ulysses.make_call(causal, window_size, softmax_scale, softcap)
    ulysses = _comm.group_info(ulysses_group)
    ring = _comm.group_info(ring_group)
    _check(what, q, k, v, learnable_sink, call, layout, return_attn_probs, ulysses, ring)
    group, u, mu = ulysses
    out, lse = _ulysses.ulysses_core(q, k, v, learnable_sink, call, group, u, mu, what,
                                     _ring_attend(what, ring[0], layout), return_attn_probs)
    return (out, lse, None) if return_attn_probs else out
