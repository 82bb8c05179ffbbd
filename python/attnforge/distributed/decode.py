"""Sharded decode: attention of a few new query tokens per sequence against a KV cache that is split along the sequence
over the ranks of a torch.distributed group (each rank holds a contiguous piece of every sequence's keys), so that a
cache too long for one device is read where it lives and only the small per-row results travel.

    out = sharded_decode(q, k_shard, v_shard, group, cache_seqlens=used)           # every rank: the same q
    out, lse = sharded_decode(q, pages_k, pages_v, page_table=table, cache_seqlens=used, return_lse=True)

Each rank runs attnforge's kernel on its shard (one call; a few when a mask cuts through shards differently per
sequence), and the partial results are merged by their log-sum-exp after ONE all_gather of a packed float32 buffer
[out, lse, status]; every rank merges the same bytes in rank order, so every rank returns bit-identical results.

Which keys a rank holds (the rule): for sequence b, rank r's shard holds the keys at global positions
[P_r[b], P_r[b] + n_r[b]), P_r[b] = n_0[b] + ... + n_{r-1}[b], where n_r[b] is the keys rank r uses
(cache_seqlens[b], or the shard's length S_shard without cache_seqlens): the sequence's keys laid out over the ranks
in rank order, any rank's piece possibly empty. The sequence's length is N[b] = sum over ranks of n_r[b], and the
Lq query tokens are its last Lq positions N[b] - Lq, ..., N[b] - 1: their own keys are already in the cache (append
the new tokens' K/V to the last rank that holds keys of the sequence, or a later one, before the call).

Masks use global positions, with FlashAttention-2's window convention as attnforge.distributed.ring does:
window_size = (left, right), -1 unbounded; key g is visible to query p when p - left <= g <= p + right; causal (the
default) sets right = 0. With Lq == 1 and no left window no mask applies; otherwise each rank needs the keys the
higher ranks hold (one small all_gather of B int64 lengths before the kernels) and runs one kernel call per distinct
local window among its sequences (sequences whose keys all count share one call; those that see none are skipped).
"""
import numbers
from typing import NamedTuple, Optional

import torch

from .. import _C
from .._flash import flash_attn_varlen_func
from . import _comm, _layout, _local, _merge

WHAT = "sharded_decode"
SKIP = None   # a sequence of which no row sees any key of this shard


class _Problem(NamedTuple):
    """One checked call: the tensors and the global window (left, right), None = unbounded."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_seqlens: Optional[torch.Tensor]
    page_table: Optional[torch.Tensor]
    scale: Optional[float]
    softcap: float
    sink: Optional[torch.Tensor]
    left: Optional[int]
    right: Optional[int]

    @property
    def positional(self) -> bool:
        """Whether the mask depends on where keys lie: a left window always (the query is at the end), a right
        bound (causal included) only with several query tokens (a single query at the end sees every key)."""
        return self.left is not None or (self.right is not None and self.q.shape[1] > 1)


# ---------------------------------------------------------------- checks
def _tensor_error(name, t, dims):
    if not isinstance(t, torch.Tensor):
        return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
    if t.dim() != dims:
        return f"{name}: expected {dims} dimensions, got {tuple(t.shape)}"
    return None


def _index_error(name, t, shape):
    """An int32 index tensor of `shape` (a dim of None: any size), or why not."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != len(shape) or \
            any(s is not None and s != d for s, d in zip(shape, t.shape)):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = ", ".join("any" if s is None else str(s) for s in shape)
        return f"{name}: expected an int32 tensor of shape ({want}), got {got}"
    return None


def _shape_error(q, k, v, cache_seqlens, page_table):
    """This rank's shapes and dtypes, or why not (they are the kernel's rules, checked before any transfer)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        error = _tensor_error(name, t, 4)
        if error:
            return error
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"q, k, v: one dtype of float32, float16, bfloat16 expected, got {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape[:3] != v.shape[:3]:
        return f"k, v: shapes {tuple(k.shape)} and {tuple(v.shape)} differ before the head dim"
    if q.shape[-1] != k.shape[-1]:
        return f"k: head dim {k.shape[-1]} differs from q's {q.shape[-1]}"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return f"q: {q.shape[2]} heads are not a multiple of k's {k.shape[2]} (grouped-query attention)"
    batch = q.shape[0]
    if page_table is None and k.shape[0] != batch:
        return f"k: batch {k.shape[0]} differs from q's {batch} (a batched shard is (B, S_shard, Hkv, D))"
    if page_table is not None:
        error = _index_error("page_table", page_table, (batch, None))
        if error:
            return error
        if cache_seqlens is None:
            return "cache_seqlens: required with page_table (the keys each sequence uses on this rank)"
    if cache_seqlens is not None:
        return _index_error("cache_seqlens", cache_seqlens, (batch,)) or _lengths_error(k, cache_seqlens, page_table)
    return None


def _lengths_error(k, cache_seqlens, page_table):
    """cache_seqlens' values against the shard's capacity, where reading them is free (CPU); the kernel checks them
    on a GPU."""
    if cache_seqlens.device.type != "cpu" or cache_seqlens.numel() == 0:
        return None
    capacity = k.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
    if low < 0 or high > capacity:
        return f"cache_seqlens: values must lie in [0, {capacity}] (this shard's keys), got {cache_seqlens.tolist()}"
    return None


def _flag_error(causal, softmax_scale, softcap, sink, q):
    if not isinstance(causal, bool):
        return f"causal: expected a bool, got {type(causal).__name__}"
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or
                                      not isinstance(softmax_scale, numbers.Real)):
        return f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}"
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not softcap >= 0:
        return f"softcap: expected a float >= 0, got {softcap!r}"
    if sink is not None and (not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (q.shape[2],)):
        return f"learnable_sink: expected a ({q.shape[2]},) tensor, one logit per query head"
    return None


def _refusal(q, k, v, cache_seqlens, page_table, causal, softmax_scale, softcap, sink):
    """This rank's own reason to refuse the call (before any transfer), or None."""
    error = _shape_error(q, k, v, cache_seqlens, page_table) or _flag_error(causal, softmax_scale, softcap, sink, q)
    if error:
        return error
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink)):
        return ("sharded_decode is forward only (decode): an input requires grad under grad mode; call it under "
                "torch.no_grad() / torch.inference_mode(), or pass detached tensors")
    return None


def _window(causal, window_size):
    """FlashAttention-2's (causal, window_size) as global (left, right), None = unbounded; or the reason not."""
    try:
        return _layout.global_window(causal, window_size), None
    except TypeError as error:
        return (None, None), str(error)


def _fields(q, k, v, page_table, causal, window, softmax_scale, softcap, sink) -> dict:
    """What every rank's call must agree on. The shards' lengths (S_shard, num_pages, max_pages) may differ."""
    shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else None   # noqa: E731
    dtype = lambda t: str(t.dtype) if isinstance(t, torch.Tensor) else None     # noqa: E731
    heads = lambda t: (shape(t) or (None,) * 4)[2:]                               # noqa: E731
    return {"function": WHAT, "q shape": shape(q), "dtypes": (dtype(q), dtype(k), dtype(v)),
            "k heads and head dim": heads(k), "v heads and head dim": heads(v),
            "paged": page_table is not None, "causal": causal, "window": window, "softmax_scale": softmax_scale,
            "softcap": float(softcap) if isinstance(softcap, numbers.Real) else repr(softcap),
            "learnable_sink": sink is not None}


# ---------------------------------------------------------------- where this rank's keys lie
def _local_lengths(p: _Problem):
    """The keys this rank uses per sequence, (B,) int64 on q's device."""
    if p.cache_seqlens is not None:
        return p.cache_seqlens.to(device=p.q.device, dtype=torch.int64)
    return torch.full((p.q.shape[0],), p.k.shape[1], dtype=torch.int64, device=p.q.device)


def _keys_after(p: _Problem, group, world: int, rank: int):
    """(this rank's lengths, keys the higher ranks hold) per sequence, host lists: one all_gather of B int64s."""
    mine = _local_lengths(p)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
    _comm.guarded(f"{WHAT}: exchanging the shards' lengths (all_gather)", torch.distributed.all_gather_into_tensor,
                  every, mine.contiguous(), group=group)
    after = every.view(world, -1)[rank + 1:].sum(0)
    return mine.tolist(), after.tolist()


def local_window(left, right, after: int, n: int, lq: int):
    """FA4's local window (lo, hi) (None sides unbounded) of a shard of n keys with `after` keys behind it, for lq
    query tokens at the sequence's end under the global window (left, right); SKIP when no row sees any key.

    FA4 aligns bottom-right: row i sees local key j iff i + n - lq - lo <= j <= i + n - lq + hi. Local key j is at
    global distance (n - 1 - j) + after from the last key, so lo = left - after and hi = right + after; sides past
    the shard are dropped (unbounded), so that sequences whose keys all count share one call."""
    if n == 0:
        return SKIP
    lo = None if left is None else left - after
    hi = None if right is None else right + after
    if hi is not None and hi >= lq - 1:
        hi = None                       # the first row already sees the shard's last key
    elif hi is not None and hi < 1 - n:
        return SKIP                     # even the last row stops before the shard's first key
    if lo is not None and lo >= n - 1:
        lo = None                       # the last row already reaches the shard's first key
    elif lo is not None and lo < 1 - lq:
        return SKIP                     # even the first row starts after the shard's last key
    if lo is not None and hi is not None and lo + hi < 0:
        return SKIP                     # an empty band (FA4 would read a negative-sum window as no window)
    return lo, hi


def _groups(p: _Problem, placement):
    """[(window, batch rows or None for all)]: the sequences that share one local window, SKIP ones left out.
    placement: None (no mask depends on positions) or (this rank's lengths, keys behind them) per sequence."""
    if placement is None:
        return [((None, None), None)]
    by_window = {}
    for b, (n, a) in enumerate(zip(*placement)):
        window = local_window(p.left, p.right, a, n, p.q.shape[1])
        if window is not SKIP:
            by_window.setdefault(window, []).append(b)
    if len(by_window) == 1 and len(next(iter(by_window.values()))) == p.q.shape[0]:
        return [(next(iter(by_window)), None)]
    return list(by_window.items())


# ---------------------------------------------------------------- this rank's partial result
def _rows(p: _Problem, rows):
    """(q, k, v, page_table, seqused_k) of some batch rows. A batched shard becomes paged without a copy: its
    (B, S, H, D) storage is B pages of S keys, sequence b reading page b."""
    if rows is None:
        return p.q, p.k, p.v, p.page_table, p.cache_seqlens
    index = torch.tensor(rows, dtype=torch.int64, device=p.q.device)
    q = p.q.index_select(0, index)
    if p.page_table is not None:
        return q, p.k, p.v, p.page_table.index_select(0, index), p.cache_seqlens.index_select(0, index)
    table = index.to(torch.int32).view(-1, 1)
    used = p.cache_seqlens.index_select(0, index) if p.cache_seqlens is not None else \
        torch.full((len(rows),), p.k.shape[1], dtype=torch.int32, device=p.q.device)
    return q, p.k, p.v, table, used


def _has_work(p: _Problem) -> bool:
    """Whether there are query rows and the shard stores any key (shapes only: else no kernel call is made)."""
    return p.q.numel() > 0 and p.k.shape[0] * p.k.shape[1] > 0 and \
        (p.page_table is None or p.page_table.shape[1] > 0)


def _partial_(p: _Problem, groups, out, lse_t):
    """This rank's attention over its shard into out (B, Lq, Hq, Ev) and lse_t (B, Lq, Hq), float32, which hold 0
    and -inf (no key seen) where nothing is written. Out stays float32 on the CPU (not rounded before the merge)."""
    if not _has_work(p):
        return
    for window, rows in groups:   # FA4's local (left, right), as the ring's blocks: the same block call
        q, k, v, table, used = _rows(p, rows)
        block_out, block_lse = _local.forward(q, k, v, p.scale, window, p.softcap, seqused_k=used, page_table=table)
        if rows is None:
            out.copy_(block_out)
            lse_t.copy_(block_lse.transpose(1, 2))
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=out.device)
            out.index_copy_(0, index, block_out.to(torch.float32))
            lse_t.index_copy_(0, index, block_lse.transpose(1, 2))


# ---------------------------------------------------------------- the one collective and the merge
class _Packed:
    """One rank's message: out (B, Lq, Hq, Ev), lse_t (B, Lq, Hq) and a status (0 ok, 1 this rank failed), float32,
    in one flat buffer so that a single all_gather carries all of it."""

    def __init__(self, flat, batch, lq, heads, dv):
        n_out = batch * lq * heads * dv
        self.flat = flat
        self.out = flat[:n_out].view(batch, lq, heads, dv)
        self.lse_t = flat[n_out:n_out + batch * lq * heads].view(batch, lq, heads)
        self.status = flat[-1:]

    @staticmethod
    def size(batch, lq, heads, dv) -> int:
        return batch * lq * heads * (dv + 1) + 1


def _exchange(p: _Problem, group, world: int, rank: int):
    """Every rank's _Packed, in rank order, after this rank computed its own: one all_gather_into_tensor. A rank
    whose computation failed still takes part (status 1), so that its peers raise instead of waiting for it."""
    batch, lq, heads, _ = p.q.shape
    dv = p.v.shape[-1]
    size = _Packed.size(batch, lq, heads, dv)
    send = _Packed(torch.zeros(size, dtype=torch.float32, device=p.q.device), batch, lq, heads, dv)
    send.lse_t.fill_(float("-inf"))
    placement = _keys_after(p, group, world, rank) if p.positional else None   # every rank, before any kernel
    failure = None
    try:
        _partial_(p, _groups(p, placement), send.out, send.lse_t)
    except Exception as error:   # noqa: B902 (reported on every rank after the exchange)
        failure = error
        send.status.fill_(1.0)
    every = torch.empty(world * size, dtype=torch.float32, device=p.q.device)
    _comm.guarded(f"{WHAT}: gathering the partial results (all_gather)", torch.distributed.all_gather_into_tensor,
                  every, send.flat, group=group)
    _raise_failures(group, world, every.view(world, size)[:, -1].tolist(), failure)
    return [_Packed(every[r * size:(r + 1) * size], batch, lq, heads, dv) for r in range(world)]


def _raise_failures(group, world, statuses, failure):
    """When a rank failed to compute its part, raise on every rank: the failed one its own error, the others one
    naming it (its message fetched by all_gather_object, on this path only)."""
    failed = [r for r, status in enumerate(statuses) if status != 0.0]
    if not failed:
        return
    messages = [None] * world
    _comm.guarded(f"{WHAT}: gathering a rank's failure (all_gather_object)", torch.distributed.all_gather_object,
                  messages, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    raise _C.InvalidArgumentError(f"{WHAT}: rank {failed[0]} of the group failed on its shard ({messages[failed[0]]}); "
                                  "every rank stops")


def _merged(p: _Problem, parts):
    """(out float32 (B, Lq, Hq, Ev), lse_t (B, Lq, Hq)): the parts merged by lse in rank order, then the sink once."""
    out, lse_t = _merge.new_accumulators(p.q.shape[:2], p.q.shape[2], p.v.shape[-1], p.q.device)
    for part in parts:
        _merge.merge_(out, lse_t, part.out, part.lse_t)
    if p.sink is not None:
        _merge.add_sink_(out, lse_t, p.sink)
    return out, lse_t


def _single(p: _Problem):
    """A group of one rank: plain attnforge on the whole cache (the shard is the cache), no transfer."""
    return flash_attn_varlen_func(p.q, p.k, p.v, seqused_k=p.cache_seqlens, page_table=p.page_table,
                                  softmax_scale=p.scale, causal=False, window_size=(p.left, p.right),
                                  softcap=p.softcap, learnable_sink=p.sink, return_lse=True)


# ---------------------------------------------------------------- the API
def sharded_decode(q, k, v, group=None, *, cache_seqlens=None, page_table=None, softmax_scale=None, causal=True,
                   window_size=(-1, -1), softcap=0.0, learnable_sink=None, return_lse=False):
    """Attention of the new query tokens against a KV cache sharded along the sequence over `group`'s ranks.

    q (B, Lq, Hq, E): the same on every rank (the Lq newest tokens of each sequence: decode Lq = 1, speculative
    decode or a short chunk Lq > 1). k, v: this rank's shard of the cache, either batched (B, S_shard, Hkv, E) /
    (..., Ev) with optional cache_seqlens (B,) int32 (the keys each sequence uses here; default S_shard), or paged
    (num_pages, page_size, Hkv, E) / (..., Ev) with page_table (B, max_pages) int32 and cache_seqlens (required;
    FA4's seqused_k). Shard lengths, num_pages, page_size and max_pages may differ between ranks; q's shape, the
    dtypes (float32, float16, bfloat16, one for all three), head counts and dims, and every flag may not (every rank
    raises, none waits). Hq a multiple of Hkv (grouped-query attention).
    Positions: rank r holds keys [n_0 + ... + n_{r-1}, + n_r) of each sequence (n_r its used keys) and the queries
    are the sequence's last Lq positions (the module's docstring). causal (default True) and window_size = (left,
    right) (FlashAttention-2's convention, -1 = unbounded; causal sets right = 0) mask by those global positions.
    softmax_scale (default 1/sqrt(E)), softcap (> 0: s -> softcap·tanh(s / softcap)) and learnable_sink (Hq,)
    (counted once, after the merge) as in attnforge.flash_attn_func.
    Returns out (B, Lq, Hq, Ev) in q's dtype on every rank (bit-identical on all of them), or (out, lse) with
    return_lse, lse float32 (B, Hq, Lq) natural log. A row that sees no key anywhere gets out = 0, lse = -inf (lse =
    sink with a sink). Forward only: an input that requires grad under grad mode is refused. A group of one rank is
    attnforge.flash_attn_varlen_func on the shard. Transfers: one all_gather of B·Lq·Hq·(Ev + 1) + 1 float32 per
    rank; with a mask that depends on positions (a left window; with Lq > 1 causal or a right window) first one of
    B int64; the consistency check (attnforge.distributed.set_consistency_check) one of a few int64. q's and the
    sink's values are not compared between ranks (only shapes and flags): they must be the same. Failures of a transfer raise
    CommunicationError; a rank whose kernel fails raises its error and its peers an InvalidArgumentError naming it.
    """
    group, world, rank = _comm.group_info(group)
    (left, right), window_error = _window(causal, window_size)
    error = window_error or _refusal(q, k, v, cache_seqlens, page_table, causal, softmax_scale, softcap,
                                     learnable_sink)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    _comm.check_consistent(group, world, device, WHAT,
                           _fields(q, k, v, page_table, causal, (left, right), softmax_scale, softcap,
                                   learnable_sink), error)
    p = _Problem(q.detach(), k.detach(), v.detach(), cache_seqlens, page_table,
                 None if softmax_scale is None else float(softmax_scale), float(softcap),
                 None if learnable_sink is None else learnable_sink.detach(), left, right)
    if world == 1:
        out, lse = _single(p)
    else:
        out_f, lse_t = _merged(p, _exchange(p, group, world, rank))
        out, lse = out_f.to(q.dtype), lse_t.permute(0, 2, 1).contiguous()
    return (out, lse) if return_lse else out
