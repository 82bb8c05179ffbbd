"""Ulysses attention (DeepSpeed-Ulysses) over torch.distributed on attnforge's kernels: each rank holds a contiguous
shard of the sequence with every head; one all-to-all per tensor trades that for the whole sequence with 1/P of the
heads, attnforge's own flash_attn_func runs on it (the whole mask, window, softcap and sink as in one process), and
the inverse all-to-all brings the output back to sequence shards. The backward is the same in reverse: each
all-to-all's gradient is the opposite all-to-all, and attnforge's backward runs in between.

    out = ulysses_attention(q, k, v, causal=True)                          # (B, S_local, H, D) shards, ring layout
    out, lse, _ = ulysses_attention(q, k, v, return_attn_probs=True)       # lse float32 (B, H, S_local)

Rank r holds tokens [r·n, (r+1)·n) ("ring" layout: shard(x, "ring", r, P)). window_size follows FlashAttention-2's
convention like the ring functions: (left, right), -1 = unbounded, causal sets right = 0.

Heads: Hq must divide by the degree P. K/V heads that do not divide by P are replicated just enough for each rank to
receive the K/V heads its query heads read (their gradients are summed back by autograd); learnable_sink (Hq,) is
sliced per rank, so each rank's sink gradient is non-zero only on its heads' slice and the sum over ranks is the
single-process gradient (what a data-parallel all-reduce of a replicated parameter computes)."""
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import _C
from .._flash import flash_attn_func
from . import _comm, _layout

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- the all-to-all
def all_to_all(x: torch.Tensor, group, world: int, scatter_dim: int, gather_dim: int, what: str) -> torch.Tensor:
    """One all_to_all_single over `group`: x split into `world` pieces along scatter_dim (piece j goes to rank j),
    the pieces received concatenated along gather_dim in rank order. No autograd (see AllToAll)."""
    if world == 1:
        return x
    piece = x.shape[scatter_dim] // world
    send = x.unflatten(scatter_dim, (world, piece)).movedim(scatter_dim, 0).contiguous()   # piece j = send[j]
    receive = torch.empty_like(send)
    _comm.guarded(f"{what}: the all-to-all", dist.all_to_all_single, receive, send, group=group)
    # receive[j] came from rank j: put rank order outermost along the gather dim
    return receive.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class AllToAll(torch.autograd.Function):
    """all_to_all with autograd: the gradient of an all-to-all (scatter a, gather b) is the all-to-all (scatter b,
    gather a) of the incoming gradient, so gradients reach the rank whose shard produced them."""

    @staticmethod
    def forward(ctx, x, group, world, scatter_dim, gather_dim, what):
        ctx.args = (group, world, gather_dim, scatter_dim, what + " (backward)")
        return all_to_all(x, group, world, scatter_dim, gather_dim, what)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, *ctx.args), None, None, None, None, None


def seq_to_heads(x, group, world, what):
    """(B, n, H, D) sequence shards -> (B, P·n, H/P, D): the whole sequence, this rank's heads."""
    return AllToAll.apply(x, group, world, 2, 1, what)


def heads_to_seq(x, group, world, what):
    """(B, P·n, H/P, D) -> (B, n, H, D): the inverse of seq_to_heads."""
    return AllToAll.apply(x, group, world, 1, 2, what)


def lse_heads_to_seq(lse, group, world, what):
    """lse (B, H/P, P·n) -> (B, H, n); lse carries no gradient, so a plain all-to-all."""
    return all_to_all(lse.detach(), group, world, 2, 1, what + " (lse)")


# ---------------------------------------------------------------- heads
def _kv_heads_with(m: int, hq: int, hkv: int, world: int) -> Optional[List[int]]:
    """The K/V heads to send when each rank receives m of them (local query head i reading local K/V head
    i // (hq/P/m)), or None when some run of hq/P/m query heads reads more than one K/V head."""
    local, group = hq // world, hq // hkv
    per = local // m   # query heads per local K/V head
    index = []
    for first in range(0, hq, per):
        heads = {h // group for h in range(first, first + per)}
        if len(heads) != 1:
            return None
        index.append(heads.pop())
    return index


def kv_head_index(hq: int, hkv: int, world: int) -> Optional[List[int]]:
    """Which K/V heads to send, in order, so that rank r receives (after scattering P equal pieces) the K/V heads
    its query heads [r·hq/P, (r+1)·hq/P) read, as a grouped-query layout of its own, with the fewest heads per rank
    (a divisor of hq/P; hq/P always works: one K/V head per query head). None when the K/V heads divide by P as
    they are (no replication)."""
    if hkv % world == 0:
        return None
    local = hq // world
    for m in range(1, local + 1):
        index = _kv_heads_with(m, hq, hkv, world) if local % m == 0 else None
        if index is not None:
            return index
    raise _C.InternalError("kv_head_index: no layout found")


def replicate_kv(k, v, hq: int, world: int):
    """k, v with their heads replicated (index_select: autograd sums the replicas' gradients) as kv_head_index says."""
    index = kv_head_index(hq, k.shape[2], world)
    if index is None:
        return k, v
    index = torch.tensor(index, dtype=torch.int64, device=k.device)
    return k.index_select(2, index), v.index_select(2, index)


def local_sink(sink, rank: int, world: int):
    """This rank's heads' slice of learnable_sink (a view: its gradient lands in the full (H,) shape, zeros
    elsewhere)."""
    if sink is None:
        return None
    local = sink.shape[0] // world
    return sink[rank * local:(rank + 1) * local]


# ---------------------------------------------------------------- checks
class Call(NamedTuple):
    """One call's checked flags: the window as (left, right) with None = unbounded (FlashAttention-2's meaning)."""
    left: Optional[int]
    right: Optional[int]
    softmax_scale: Optional[float]
    softcap: float


def refusal(q, k, v, sink, softcap, world: int, degree_name: str = "the group's size") -> Optional[str]:
    """This rank's own reason to refuse the call (before any transfer), or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name}: expected 4 dimensions (B, S_local, H, D), got {tuple(t.shape)}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return f"q, k, v: one dtype of float32, float16, bfloat16 expected, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return (f"q, k, v: shards of one sequence must have the same (B, S_local) and k, v the same heads, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[3] != k.shape[3]:
        return f"k: head dim {k.shape[3]} differs from q's {q.shape[3]}"
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        return f"q: {hq} heads are not a multiple of k's {hkv} (grouped-query attention)"
    if hq % world:
        return (f"q: {hq} query heads do not divide by the Ulysses degree {world} ({degree_name}); Ulysses "
                "scatters the heads, so Hq % degree == 0 is required")
    if sink is not None and (not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (hq,)):
        return f"learnable_sink: expected a ({hq},) tensor, one logit per query head"
    if softcap < 0:
        return f"softcap: must be >= 0, got {softcap}"
    return None


def call_fields(what, q, k, v, sink, call: Call, return_attn_probs, extra=None) -> dict:
    """What every rank of the group must agree on (shapes, dtypes, flags)."""
    shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else repr(type(t))   # noqa: E731
    fields = {"function": what, "window": (call.left, call.right), "softmax_scale": call.softmax_scale,
              "softcap": call.softcap, "dtype": str(getattr(q, "dtype", None)), "q shape": shape(q),
              "k shape": shape(k), "v shape": shape(v), "learnable_sink": sink is not None,
              "return_attn_probs": bool(return_attn_probs),
              "requires grad": torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                               for t in (q, k, v, sink))}
    fields.update(extra or {})
    return fields


def make_call(causal, window_size, softmax_scale, softcap) -> Call:
    """The flags as checked values (TypeError for a malformed window, as the ring functions)."""
    left, right = _layout.global_window(causal, window_size)
    return Call(left, right, softmax_scale, float(softcap or 0.0))


# ---------------------------------------------------------------- the call
def local_attention(q, k, v, sink, call: Call):
    """attnforge's flash_attn_func on the whole sequence (FA4's window convention: None = unbounded; with L = S its
    bottom-right alignment is the top-left one of FlashAttention-2). (out, lse float32 (B, H, S))."""
    return flash_attn_func(q, k, v, softmax_scale=call.softmax_scale, causal=False,
                           window_size=(call.left, call.right), softcap=call.softcap, learnable_sink=sink,
                           return_lse=True)


def ulysses_attention(q, k, v, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      learnable_sink=None, return_attn_probs=False):
    """Ulysses attention on every rank of `group` (default: the world): q (B, S_local, Hq, E), k (B, S_local, Hkv,
    E), v (B, S_local, Hkv, Ev), rank r holding tokens [r·S_local, (r+1)·S_local). Hq must divide by the group's
    size P; Hkv need not (K/V heads are then replicated as needed). Returns out (B, S_local, Hq, Ev) in q's dtype,
    or (out, lse float32 (B, Hq, S_local), None) with return_attn_probs. Gradients flow to q, k, v and
    learnable_sink (this rank's heads' slice; sum it over the ranks). Every rank raises InvalidArgumentError when
    any rank's call is malformed or differs from the others'; CommunicationError when a transfer fails."""
    what = "ulysses_attention"
    call = make_call(causal, window_size, softmax_scale, softcap)
    group, world, rank = _comm.group_info(group)
    error = refusal(q, k, v, learnable_sink, call.softcap, world)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    _comm.check_consistent(group, world, device, what, call_fields(what, q, k, v, learnable_sink, call,
                                                                    return_attn_probs), error)
    out, lse = ulysses_core(q, k, v, learnable_sink, call, group, world, rank, what, local_attention,
                            return_attn_probs)
    return (out, lse, None) if return_attn_probs else out


def ulysses_core(q, k, v, sink, call, group, world, rank, what, attend, want_lse):
    """The all-to-alls around `attend(q, k, v, sink, call) -> (out, lse)` on (B, P·n, H/P, D); (out, lse or None)
    back in sequence shards. A group of one rank is attend itself."""
    if world == 1:
        out, lse = attend(q, k, v, sink, call)
        return out, lse if want_lse else None
    k, v = replicate_kv(k, v, q.shape[2], world)
    qh, kh, vh = (seq_to_heads(t, group, world, what) for t in (q, k, v))
    out, lse = attend(qh, kh, vh, local_sink(sink, rank, world), call)
    out = heads_to_seq(out, group, world, what)
    return out, lse_heads_to_seq(lse, group, world, what) if want_lse else None
