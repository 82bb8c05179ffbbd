"""An independent reference for attnforge.distributed's ring attention: plain PyTorch in float64, its own layouts and
its own point-to-point ring over torch.distributed. Written from the definitions, not from attnforge's code, so that
a test comparing the two checks attnforge's layouts (shard()), block masks, lse merge and dK/dV ring at once.

Every token carries a tag (document, position in its document). A query sees a key when both are in one document and
-left <= key - query <= right (FlashAttention-2's window; None = unbounded; causal sets right = 0). Scores are
scale·q·k, mapped to softcap·tanh(s / softcap) when softcap > 0. A learnable sink adds exp(sink[h]) to every row's
denominator once, after all blocks are merged.

    result = ring_attention(q, k, v, dout, tags, group=None, left=None, right=0, ...)   # this rank's shards
    result["out"], result["lse"], result["dq"], result["dk"], result["dv"], result["dsink"]  (float64)

Shards are batched (B, n, H, D) with tags (n, 2), or packed (T, H, D) with tags (T, 2): a packed shard is treated as
one batch row whose documents the tags tell apart."""
from typing import List, Optional

import torch
import torch.distributed as dist

LAYOUTS = ("ring", "zigzag", "stripe")


# ---------------------------------------------------------------- layouts, from their definitions
def layout_positions(layout: str, rank: int, world: int, length: int) -> torch.Tensor:
    """Global positions (int64, in local order) that rank `rank` holds of a sequence of `length` tokens:
    ring: one contiguous run; zigzag: chunks rank and 2W-1-rank of 2W equal chunks; stripe: t with t % W == rank.
    One rank holds the whole sequence in order (any length)."""
    pieces = 2 * world if layout == "zigzag" and world > 1 else world
    if length % pieces:
        raise ValueError(f"{layout}: {length} tokens do not split into {pieces} equal pieces")
    if layout == "ring" or world == 1:
        n = length // world
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = length // (2 * world)
        first, second = rank, 2 * world - 1 - rank
        return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])
    if layout == "stripe":
        return torch.arange(rank, length, world)
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def extract(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of a batched x along its sequence dim."""
    return x.index_select(dim, layout_positions(layout, rank, world, x.shape[dim])).contiguous()


def doc_lengths(cu_seqlens) -> List[int]:
    bounds = [int(c) for c in cu_seqlens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def extract_varlen(x: torch.Tensor, cu_seqlens, layout: str, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s pieces of every document of a packed x (documents at the global cu_seqlens), in document
    order: each document sharded on its own."""
    start, pieces = 0, []
    for length in doc_lengths(cu_seqlens):
        pieces.append(start + layout_positions(layout, rank, world, length))
        start += length
    return x.index_select(dim, torch.cat(pieces)).contiguous()


def batched_tags(layout: str, rank: int, world: int, length: int) -> torch.Tensor:
    """(n, 2) tags (document 0, global position) of rank `rank`'s shard of one sequence."""
    pos = layout_positions(layout, rank, world, length)
    return torch.stack([torch.zeros_like(pos), pos], dim=1)


def varlen_tags(layout: str, rank: int, world: int, cu_seqlens) -> torch.Tensor:
    """(T_local, 2) tags (document, position in the document) of rank `rank`'s pieces of a packed batch."""
    rows = []
    for d, length in enumerate(doc_lengths(cu_seqlens)):
        pos = layout_positions(layout, rank, world, length)
        rows.append(torch.stack([torch.full_like(pos, d), pos], dim=1))
    return torch.cat(rows)


# ---------------------------------------------------------------- its own ring
class Neighbours:
    """Blocking shifts round the ring: each rank sends to rank + 1 and receives from rank - 1 (plain isend/irecv)."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.world = group, world
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next, self.prev = to_global((rank + 1) % world), to_global((rank - 1) % world)

    def shift(self, tensors):
        """The previous rank's tensors (same shapes and dtypes) in exchange for ours."""
        received = [torch.empty_like(t) for t in tensors]
        requests = [dist.isend(t.contiguous(), self.next, group=self.group) for t in tensors]
        requests += [dist.irecv(t, self.prev, group=self.group) for t in received]
        for request in requests:
            request.wait()
        return received


# ---------------------------------------------------------------- one block, explicit
def _visible(q_tags, k_tags, left: Optional[int], right: Optional[int]) -> torch.Tensor:
    """(n_q, n_k) bool: which keys each query sees under the global mask."""
    same_doc = q_tags[:, None, 0] == k_tags[None, :, 0]
    offset = k_tags[None, :, 1] - q_tags[:, None, 1]   # key position - query position
    seen = same_doc
    if left is not None:
        seen = seen & (offset >= -left)
    if right is not None:
        seen = seen & (offset <= right)
    return seen


def _scores(q, k, scale, softcap):
    """(capped scores, d capped / d raw) (B, H, n_q, n_k) with k already expanded to q's heads."""
    raw = torch.einsum("bqhe,bkhe->bhqk", q, k) * scale
    if softcap > 0:
        capped = softcap * torch.tanh(raw / softcap)
        return capped, 1.0 - (capped / softcap) ** 2
    return raw, torch.ones_like(raw)


def _expand(kv, heads: int):
    """K/V heads repeated for grouped-query attention: query head h reads K/V head h // (Hq / Hkv)."""
    return kv.repeat_interleave(heads // kv.shape[2], dim=2)


def _fold(grad, kv_heads: int):
    """A gradient over expanded heads summed back onto the K/V heads."""
    b, n, h, d = grad.shape
    return grad.view(b, n, kv_heads, h // kv_heads, d).sum(3)


def block_forward(q, k, v, seen, scale, softcap):
    """(out (B, n_q, H, Dv), lse (B, H, n_q)) of q against one block; rows that see nothing: out 0, lse -inf."""
    s, _ = _scores(q, _expand(k, q.shape[2]), scale, softcap)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)   # -inf - -inf: a row with no visible key
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.shape[2]))
    return out, lse


def merge(out, lse, block_out, block_lse):
    """Two partial softmaxes as one: each weighted by exp(its lse - the joint lse)."""
    joint = torch.logaddexp(lse, block_lse)
    mine = torch.exp(lse - joint).nan_to_num(0.0)
    theirs = torch.exp(block_lse - joint).nan_to_num(0.0)
    out = out * mine.transpose(1, 2).unsqueeze(-1) + block_out * theirs.transpose(1, 2).unsqueeze(-1)
    return out, joint


def block_backward(q, k, v, seen, dout, lse, delta, scale, softcap):
    """(dq, dk, dv) of one block from the final lse (P recomputed: the global softmax's probabilities) and
    delta = rowsum(dout * out) of the final out."""
    heads, kv_heads = q.shape[2], k.shape[2]
    ke, ve = _expand(k, heads), _expand(v, heads)
    s, dcap = _scores(q, ke, scale, softcap)
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~seen, 0.0).nan_to_num(0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
    ds = p * (dp - delta.unsqueeze(-1)) * dcap * scale
    dq = torch.einsum("bhqk,bkhe->bqhe", ds, ke)
    dk = torch.einsum("bhqk,bqhe->bkhe", ds, q)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


# ---------------------------------------------------------------- the ring call
def ring_attention(q, k, v, dout, tags, *, group=None, left=None, right=None, softmax_scale=None, softcap=0.0,
                   sink=None):
    """This rank's results of attention over the whole ring, float64: out and lse like the API's (batched: out
    (B, n, Hq, Dv), lse (B, Hq, n); packed: (T, Hq, Dv), (Hq, T)), dq/dk/dv of this rank's shards, and dsink this
    rank's share of the sink's gradient (summed over ranks it is the whole one). tags (n, 2): (document, position)
    of this rank's tokens; the K/V tags travel the ring with K/V."""
    packed = q.dim() == 3
    if packed:
        q, k, v, dout = (t.unsqueeze(0) for t in (q, k, v, dout))
    q, k, v, dout = (t.to(torch.float64) for t in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    ring = Neighbours(group, rank, world) if world > 1 else None
    out, lse = _forward(q, k, v, tags, ring, world, left, right, scale, softcap)
    if sink is not None:   # counted once, in the merged denominator
        logit = sink.detach().to(torch.float64).view(1, -1, 1)
        with_sink = torch.logaddexp(lse, logit)
        out = out * torch.exp(lse - with_sink).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
        lse = with_sink
    delta = (dout * out).sum(-1).transpose(1, 2)   # (B, H, n)
    dq, dk, dv = _backward(q, k, v, tags, dout, lse, delta, ring, world, left, right, scale, softcap)
    dsink = None
    if sink is not None:   # d out / d sink = -p_sink · out on every row
        p_sink = torch.exp(sink.detach().to(torch.float64).view(1, -1, 1) - lse)
        dsink = -(p_sink * delta).sum(dim=(0, 2))
    if packed:
        out, lse, dq, dk, dv = out[0], lse[0], dq[0], dk[0], dv[0]
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsink": dsink}


def _forward(q, k, v, tags, ring, world, left, right, scale, softcap):
    """Merged (out, lse) over the W blocks; K/V and their tags shift one rank a step."""
    b, n, heads, _ = q.shape
    out = torch.zeros(b, n, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, heads, n), float("-inf"), dtype=torch.float64)
    k_tags = tags
    for step in range(world):
        seen = _visible(tags, k_tags, left, right)
        block_out, block_lse = block_forward(q, k, v, seen, scale, softcap)
        out, lse = merge(out, lse, block_out, block_lse)
        if step + 1 < world:
            k, v, k_tags = ring.shift([k, v, k_tags])
    return out, lse


def _backward(q, k, v, tags, dout, lse, delta, ring, world, left, right, scale, softcap):
    """(dq, dk, dv): dq stays here; each K/V's dk/dv accumulator travels with it and reaches its owner after W hops."""
    dq = torch.zeros_like(q)
    k_tags, dk_acc, dv_acc = tags, None, None
    for step in range(world):
        seen = _visible(tags, k_tags, left, right)
        bq, bk, bv = block_backward(q, k, v, seen, dout, lse, delta, scale, softcap)
        dq += bq
        dk_acc = bk if dk_acc is None else dk_acc + bk
        dv_acc = bv if dv_acc is None else dv_acc + bv
        if step + 1 < world:
            k, v, k_tags, dk_acc, dv_acc = ring.shift([k, v, k_tags, dk_acc, dv_acc])
    if world > 1:   # the last hop: the accumulators of rank + 1's K/V go home
        dk_acc, dv_acc = ring.shift([dk_acc, dv_acc])
    return dq, dk_acc, dv_acc
