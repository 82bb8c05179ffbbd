"""Cutting a whole sequence into one rank's shard and putting shards back together, for each layout of the ring
(what ring-flash-attn's tests call extract_local): the inputs of a context-parallel call, its labels and positions,
and checking a result against a single-process one.

    local = shard(x, "zigzag", rank, world, dim=1)            # x (B, S, ...) -> (B, S / W, ...)
    whole = unshard([local_0, ..., local_{W-1}], "zigzag", dim=1)
    local = shard_varlen(x, cu_seqlens, "zigzag", rank, world)  # packed (T, ...) documents -> this rank's pieces
"""
import torch

from .. import _C
from . import _layout


def positions(layout: str, rank: int, world: int, length: int) -> torch.Tensor:
    """The global positions (int64) rank `rank` holds of a sequence of `length` tokens, in local order."""
    if layout not in _layout.LAYOUTS:
        raise _C.InvalidArgumentError(f"layout: expected one of {_layout.LAYOUTS}, got {layout!r}")
    rule = world * _layout.length_rule(layout, world)
    if length % rule:
        raise _C.InvalidArgumentError(f"length: {length} tokens do not divide into the {rule} equal pieces layout "
                                      f"{layout!r} needs over {world} ranks")
    n = length // world
    return torch.cat([torch.arange(s.start, s.start + s.count * s.stride, s.stride, dtype=torch.int64)
                      for s in _layout.segments(layout, rank, world, n)])


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of x along `dim` (the sequence dim), contiguous."""
    index = positions(layout, rank, world, x.shape[dim]).to(x.device)
    return x.index_select(dim, index).contiguous()


def unshard(shards, layout: str, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (in rank order)."""
    world = len(shards)
    length = sum(s.shape[dim] for s in shards)
    out = shards[0].new_empty((*shards[0].shape[:dim], length, *shards[0].shape[dim + 1:]))
    for r, s in enumerate(shards):
        out.index_copy_(dim, positions(layout, r, world, length).to(s.device), s)
    return out


def _varlen_positions(bounds, layout: str, rank: int, world: int) -> torch.Tensor:
    """The packed positions rank `rank` holds of the documents at `bounds` (global cu_seqlens), in document order."""
    pieces = [bounds[d] + positions(layout, rank, world, bounds[d + 1] - bounds[d]) for d in range(len(bounds) - 1)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def shard_varlen(x: torch.Tensor, cu_seqlens, layout: str, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s pieces of every document of a packed x (documents at the global cu_seqlens along `dim`), in
    document order: the input of a *_varlen_func whose cu_seqlens are cu_seqlens // world."""
    bounds = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
    return x.index_select(dim, _varlen_positions(bounds, layout, rank, world).to(x.device)).contiguous()


def unshard_varlen(shards, cu_seqlens, layout: str, dim: int = 0) -> torch.Tensor:
    """The packed whole from every rank's shard_varlen pieces."""
    world = len(shards)
    bounds = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
    out = shards[0].new_empty((*shards[0].shape[:dim], bounds[-1], *shards[0].shape[dim + 1:]))
    for r, s in enumerate(shards):
        out.index_copy_(dim, _varlen_positions(bounds, layout, r, world).to(s.device), s)
    return out
