"""ring-flash-attn's llama3 context parallelism on attnforge (the all-gather form Llama 3 was trained with): the packed
batch of documents is cut into W equal contiguous pieces, a document may straddle ranks; each rank all-gathers K/V,
heads_k_stride K/V heads at a time (the next group's gather in flight under the current group's attention), and runs
one varlen call of its queries against the keys they need. No merge: each row's softmax is computed whole, so a
learnable sink is passed to the kernel as it is. The backward gathers K/V again, computes dK/dV over the gathered
keys and reduce-scatters them (float32) back to their owners.

    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world)
    out = llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride, k_slice, causal=True)

window_size follows FlashAttention-2's convention (-1 = unbounded); a window needs causal=True (bottom-right
alignment of a query piece that is not the end of its document is only right when the keys end where it ends)."""
import torch
import torch.distributed as dist

from .. import _C, _backward, _flash_call
from . import _comm, _layout


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """This rank's view of the global documents cu_seqlens (B + 1,) over a packed batch cut into world_size equal
    pieces: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice). cu_seqlens_q are the documents'
    pieces on this rank; the keys they need are local_k_slice of the gathered packed K/V (from the start of this
    rank's first document; to this piece's end when causal, else to the end of its last document) and cu_seqlens_k
    their documents within that slice."""
    total = int(cu_seqlens[-1])
    if total % world_size:
        raise _C.InvalidArgumentError(f"cu_seqlens: {total} tokens do not divide into {world_size} equal pieces")
    per_rank = total // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    bounds = [int(c) for c in cu_seqlens.tolist()]
    first = max(i for i in range(len(bounds)) if bounds[i] <= lo)            # the document this piece starts in
    last = min(i for i in range(len(bounds)) if bounds[i] >= hi)             # the boundary at or after its end
    docs = bounds[first:last + 1]
    q_bounds = [min(max(b, lo), hi) - lo for b in docs]
    k_start = docs[0]
    k_end = hi if causal else docs[-1]
    k_bounds = [min(b, k_end) - k_start for b in docs]
    device = cu_seqlens.device
    cu_q = torch.tensor(q_bounds, dtype=torch.int32, device=device)
    cu_k = torch.tensor(k_bounds, dtype=torch.int32, device=device)
    max_q = max((b - a for a, b in zip(q_bounds, q_bounds[1:])), default=0)
    max_k = max((b - a for a, b in zip(k_bounds, k_bounds[1:])), default=0)
    return cu_q, cu_k, max_q, max_k, slice(k_start, k_end)


class _Problem:
    def __init__(self, q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride, k_slice, scale, causal, window_size,
                 softcap, sink, group, dropout_p, alibi_slopes):
        self.group, self.world, self.rank = _comm.group_info(group)
        left, right = _layout.global_window(causal, window_size)
        error = None
        if dropout_p:
            error = f"dropout_p: {dropout_p}; attnforge computes no dropout (pass 0.0)"
        elif alibi_slopes is not None:
            error = "alibi_slopes: ALiBi is not implemented by attnforge"
        elif not causal and (left is not None or right is not None):
            error = ("window_size: a window needs causal=True in the llama3 form (a query piece that does not end its "
                     "document is aligned on the keys' end only then)")
        elif q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            error = "q, k, v: expected packed (T_local, H, D) tensors"
        elif not isinstance(heads_k_stride, int) or heads_k_stride < 1 or k.shape[1] % heads_k_stride:
            error = f"heads_k_stride: must divide the {k.shape[1]} K/V heads, got {heads_k_stride!r}"
        elif q.shape[1] % k.shape[1]:
            error = f"q: {q.shape[1]} heads are not a multiple of k's {k.shape[1]}"
        elif not isinstance(k_slice, slice):
            error = "local_k_slice: expected the slice llama3_flash_attn_prepare_cu_seqlens returned"
        fields = {"function": "llama3_flash_attn_varlen_func", "dtype": str(q.dtype), "q shape": tuple(q.shape),
                  "k shape": tuple(k.shape), "v shape": tuple(v.shape), "causal": bool(causal),
                  "window": (left, right), "softmax_scale": scale, "softcap": float(softcap or 0.0),
                  "heads_k_stride": heads_k_stride, "learnable_sink": sink is not None}
        _comm.check_consistent(self.group, self.world, q.device, "llama3_flash_attn_varlen_func", fields, error)
        # FA4's window for the whole-document call: its bottom-right alignment is the global one here
        self.window = "full" if left is None and right is None else (left, right)
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, int(max_q), int(max_k)
        self.stride, self.k_slice = heads_k_stride, k_slice
        self.scale, self.softcap, self.sink = scale, float(softcap or 0.0), sink
        self.group_size = q.shape[1] // k.shape[1]

    def heads(self, h0):
        """(query heads, K/V heads) of the K/V head group starting at h0."""
        return slice(h0 * self.group_size, (h0 + self.stride) * self.group_size), slice(h0, h0 + self.stride)


def _gather(p, t, heads):
    """Post the all-gather of t's K/V heads `heads` over the group: (work, gathered (W·T_local, heads, D))."""
    piece = t[:, heads].contiguous()
    whole = piece.new_empty((p.world * piece.shape[0], *piece.shape[1:]))
    work = _comm.guarded("llama3_flash_attn_varlen_func: the K/V all_gather", dist.all_gather_into_tensor, whole,
                         piece, group=p.group, async_op=True)
    return work, whole


def _gathered_groups(p, k, v):
    """(h0, k group, v group) for each K/V head group, the next group's all-gather posted before this one is used."""
    starts = list(range(0, k.shape[1], p.stride))
    pending = [_gather(p, k, slice(starts[0], starts[0] + p.stride)), _gather(p, v, slice(starts[0],
                                                                                          starts[0] + p.stride))]
    for i, h0 in enumerate(starts):
        current = pending
        if i + 1 < len(starts):
            h1 = starts[i + 1]
            pending = [_gather(p, k, slice(h1, h1 + p.stride)), _gather(p, v, slice(h1, h1 + p.stride))]
        for work, _ in current:
            _comm.guarded("llama3_flash_attn_varlen_func: the K/V all_gather", work.wait)
        yield h0, current[0][1], current[1][1]


def _forward(p, q, k, v):
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    for h0, kg, vg in _gathered_groups(p, k, v):
        qh, _ = p.heads(h0)
        sink = None if p.sink is None else p.sink.detach()[qh]
        o, l = _local_call(p, q[:, qh], kg[p.k_slice], vg[p.k_slice], sink)
        out[:, qh] = o
        lse[qh] = l
    return out, lse


def _local_call(p, q, k, v, sink):
    causal, window = (False, None) if p.window == "full" else _flash_call.resolve_window(False, p.window)
    return _flash_call.run(q, k, v, p.scale, causal, window, p.softcap, sink, cu_seqlens_q=p.cu_q,
                           cu_seqlens_k=p.cu_k, max_seqlen_q=p.max_q, max_seqlen_k=p.max_k, return_lse=True,
                           varlen=True)


def _backward_pass(p, dout, q, k, v, out, lse):
    dq = torch.empty_like(q)
    dk_whole = torch.zeros((p.world * k.shape[0], *k.shape[1:]), dtype=torch.float32, device=k.device)
    dv_whole = torch.zeros((p.world * v.shape[0], *v.shape[1:]), dtype=torch.float32, device=v.device)
    dsink = None if p.sink is None else torch.zeros(p.sink.shape, dtype=torch.float32, device=q.device)
    causal, window = (False, None) if p.window == "full" else (False, p.window)
    for h0, kg, vg in _gathered_groups(p, k, v):
        qh, kh = p.heads(h0)
        sink = None if p.sink is None else p.sink.detach()[qh].contiguous()
        gq, gk, gv, gs = _backward.flash_backward(
            dout[:, qh], q[:, qh], kg[p.k_slice], vg[p.k_slice], out[:, qh], lse[qh], softmax_scale=p.scale,
            causal=causal, window_size=window if window is not None else (None, None), softcap=p.softcap,
            learnable_sink=sink, cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, max_seqlen_q=p.max_q,
            max_seqlen_k=p.max_k, float32_grads=q.device.type == "cpu")   # reduced over ranks: unrounded first
        dq[:, qh] = gq
        dk_whole[p.k_slice, kh] = gk.float()
        dv_whole[p.k_slice, kh] = gv.float()
        if dsink is not None:
            dsink[qh] = gs.float()
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for whole, mine in ((dk_whole, dk), (dv_whole, dv)):   # each owner gets the sum of every rank's part
        _comm.guarded("llama3_flash_attn_varlen_func: the dK/dV reduce_scatter", dist.reduce_scatter_tensor, mine,
                      whole, group=p.group)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dsink


class _Llama3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, problem):
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out, lse = _forward(problem, qd, kd, vd)
        ctx.problem = problem
        ctx.save_for_backward(qd, kd, vd, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _unused):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dsink = _backward_pass(ctx.problem, dout.contiguous(), q, k, v, out, lse)
        sink = ctx.problem.sink
        return dq, dk, dv, (None if dsink is None else dsink.to(sink.dtype)), None


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """ring-flash-attn's llama3_flash_attn_varlen_func on attnforge: q (T_local, Hq, E), k (T_local, Hkv, E), v
    (T_local, Hkv, Ev), this rank's contiguous piece of the packed batch; the cu_seqlens, max_seqlens and
    local_k_slice from llama3_flash_attn_prepare_cu_seqlens. Returns out (T_local, Hq, Ev), or (out, lse float32
    (Hq, T_local), None) with return_attn_probs. learnable_sink's gradient is this rank's rows' part (sum it over
    the group, as for any replicated parameter)."""
    problem = _Problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
                       softmax_scale, causal, window_size, softcap, learnable_sink, group, dropout_p, alibi_slopes)
    out, lse = _Llama3.apply(q, k, v, learnable_sink, problem)
    return (out, lse, None) if return_attn_probs else out


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                           return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """llama3_flash_attn_varlen_func with kv (T_local, 2, Hkv, E)."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap, learnable_sink=learnable_sink)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0,
                                            learnable_sink=None):
    """llama3_flash_attn_varlen_func with qkv (T_local, 3, H, E)."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap, learnable_sink=learnable_sink)

