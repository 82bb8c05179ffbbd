"""Ring attention over torch.distributed: each rank keeps its query shard and passes K/V shards round the ring; every
step computes this rank's rows against the K/V it holds (only the blocks the global mask touches), merges the block
into float32 accumulators by its lse, and has the next K/V in flight meanwhile. The backward passes K/V round again
with float32 dK/dV accumulators that arrive back at their owner after W hops; dQ stays local in float32.

A sequence's shard is described by _layout (ring, zigzag, stripe); a block's rows and keys by a Sel (a slice or an
index along the rows dim), so that batched (B, n, H, D) and packed (T, H, D) shards share one schedule."""
from typing import List, NamedTuple, Optional

import torch

from .._flash import flash_attn_func, flash_attn_varlen_func
from . import _comm, _layout, _local, _merge


# ---------------------------------------------------------------- selections of rows
class Sel(NamedTuple):
    """Rows of a shard along `dim`: start/count (a view), or index (a gathered copy); `doc` makes a packed slice one
    batch row (a 4-D call of its own)."""
    dim: int
    start: int = 0
    count: int = 0
    index: Optional[torch.Tensor] = None
    doc: bool = False

    def take(self, t):
        if self.index is not None:
            return t.index_select(self.dim, self.index)
        return t.narrow(self.dim, self.start, self.count)

    def kernel(self, t):
        """t's rows as the kernel takes them (a packed document becomes a batch of one)."""
        taken = self.take(t)
        return taken.unsqueeze(0) if self.doc else taken

    def merge_(self, out, lse_t, block_out, block_lse_t):
        if self.index is None:
            _merge.merge_(self.take(out), self.take(lse_t), block_out, block_lse_t)
            return
        sub_out, sub_lse = self.take(out), self.take(lse_t)
        _merge.merge_(sub_out, sub_lse, block_out, block_lse_t)
        out.index_copy_(self.dim, self.index, sub_out)
        lse_t.index_copy_(self.dim, self.index, sub_lse)

    def add_(self, acc, value):
        value = value.squeeze(0) if self.doc else value
        if self.index is None:
            self.take(acc).add_(value)
        else:
            acc.index_add_(self.dim, self.index, value.to(acc.dtype))


class Call(NamedTuple):
    """One kernel call of a ring step: q rows × k rows under `window` (FULL or FA4's (left, right))."""
    q: Sel
    k: Sel
    window: object
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    max_q: Optional[int] = None
    max_k: Optional[int] = None


def _lse_rows(lse, sel, packed):
    """A kernel lse ((B, H, L), packed (H, T), a document (1, H, L)) in the accumulators' row layout."""
    if packed and not sel.doc:
        return lse.t()
    return lse[0].t() if sel.doc else lse.transpose(1, 2)


def _lse_kernel(lse_t_rows, sel, packed):
    """Rows of the accumulators' lse_t as the kernel's lse."""
    if packed and not sel.doc:
        return lse_t_rows.t()
    return lse_t_rows.t().unsqueeze(0) if sel.doc else lse_t_rows.transpose(1, 2)


# ---------------------------------------------------------------- the calls of one step
def _batched_calls(qsegs, ksegs, left, right) -> List[Call]:
    """The calls of one step for batched shards (every batch row has the same segments): each (q segment, k segment)
    block the mask touches, joined into one call where a whole column (or row) of blocks is fully visible and its
    segments are adjacent rows."""
    grid = [[_layout.block_window(qs, ks, left, right) for ks in ksegs] for qs in qsegs]
    sel = lambda segs, idx: Sel(1, segs[idx[0]].row, sum(segs[i].count for i in idx))   # noqa: E731
    adjacent = lambda segs, idx: all(segs[a].row + segs[a].count == segs[b].row   # noqa: E731
                                     for a, b in zip(idx, idx[1:]))
    if all(w == _layout.FULL for row in grid for w in row):
        return [Call(sel(qsegs, range(len(qsegs))), sel(ksegs, range(len(ksegs))), _layout.FULL)]

    def grouped(by_column):
        calls = []
        outer = range(len(ksegs)) if by_column else range(len(qsegs))
        for o in outer:
            cells = [(a, grid[a][o]) for a in range(len(qsegs))] if by_column else \
                [(b, grid[o][b]) for b in range(len(ksegs))]
            full = [i for i, w in cells if w == _layout.FULL]
            inner_segs = qsegs if by_column else ksegs
            if len(full) > 1 and adjacent(inner_segs, full):
                joined = sel(inner_segs, full)
                one = Sel(1, (ksegs if by_column else qsegs)[o].row, (ksegs if by_column else qsegs)[o].count)
                calls.append(Call(joined, one, _layout.FULL) if by_column else Call(one, joined, _layout.FULL))
                cells = [(i, w) for i, w in cells if w != _layout.FULL]
            for i, w in cells:
                if w is not _layout.SKIP:
                    a, b = (i, o) if by_column else (o, i)
                    calls.append(Call(sel(qsegs, [a]), sel(ksegs, [b]), w))
        return calls

    by_column, by_row = grouped(True), grouped(False)
    return by_column if len(by_column) <= len(by_row) else by_row


def _cumulative(counts, device):
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    if counts:
        cu[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)


def _packed_calls(doc_segs_q, doc_segs_k, offsets, left, right, device) -> List[Call]:
    """The calls of one step for packed shards: per (q segment, k segment) pair, one varlen call over the documents
    when they all see the same local window (gathering the rows when a segment is not a whole local document), else
    one call per document."""
    calls = []
    nq, nk = len(doc_segs_q[0]), len(doc_segs_k[0])
    whole = nq == 1 and nk == 1
    for a in range(nq):
        for b in range(nk):
            windows = [_layout.block_window(q[a], k[b], left, right) for q, k in zip(doc_segs_q, doc_segs_k)]
            live = [d for d, w in enumerate(windows) if w is not _layout.SKIP]
            if not live:
                continue
            if all(windows[d] == windows[live[0]] for d in live):
                qcounts = [doc_segs_q[d][a].count for d in live]
                kcounts = [doc_segs_k[d][b].count for d in live]
                if whole and len(live) == len(windows):
                    qsel, ksel = Sel(0, 0, offsets[-1][0]), Sel(0, 0, offsets[-1][1])
                else:
                    qidx = [torch.arange(offsets[d][0] + doc_segs_q[d][a].row,
                                         offsets[d][0] + doc_segs_q[d][a].row + doc_segs_q[d][a].count) for d in live]
                    kidx = [torch.arange(offsets[d][1] + doc_segs_k[d][b].row,
                                         offsets[d][1] + doc_segs_k[d][b].row + doc_segs_k[d][b].count) for d in live]
                    qsel = Sel(0, index=torch.cat(qidx).to(device))
                    ksel = Sel(0, index=torch.cat(kidx).to(device))
                calls.append(Call(qsel, ksel, windows[live[0]], _cumulative(qcounts, device),
                                  _cumulative(kcounts, device), max(qcounts), max(kcounts)))
            else:
                for d in live:
                    qs, ks = doc_segs_q[d][a], doc_segs_k[d][b]
                    calls.append(Call(Sel(0, offsets[d][0] + qs.row, qs.count, doc=True),
                                      Sel(0, offsets[d][1] + ks.row, ks.count, doc=True), windows[d]))
    return calls


# ---------------------------------------------------------------- one ring call
class Problem:
    """What every step of one ring call needs: the shards' geometry and the call's flags (checked)."""

    def __init__(self, what, q, k, v, group, layout, causal, window_size, softmax_scale, softcap, sink,
                 cu_seqlens=None, dropout_p=0.0, alibi_slopes=None):
        self.what, self.layout = what, layout
        self.group, self.world, self.rank = _comm.group_info(group)
        self.packed = cu_seqlens is not None
        self.left, self.right = _layout.global_window(causal, window_size)
        self.scale, self.softcap, self.sink = softmax_scale, float(softcap or 0.0), sink
        error = self._refusal(q, k, v, cu_seqlens, dropout_p, alibi_slopes)
        fields = {"function": what, "layout": layout, "causal": bool(causal), "window": (self.left, self.right),
                  "softmax_scale": softmax_scale, "softcap": self.softcap, "dtype": str(q.dtype),
                  "q shape": tuple(q.shape), "k shape": tuple(k.shape), "v shape": tuple(v.shape),
                  "learnable_sink": sink is not None,
                  "requires grad": torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                                   for t in (q, k, v, sink))}
        if self.packed and error is None:
            fields["cu_seqlens"] = tuple(int(x) for x in cu_seqlens.tolist())
        _comm.check_consistent(self.group, self.world, q.device, what, fields, error)
        self.device = q.device
        if self.packed:
            lengths = [int(x) for x in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()]
            starts = [int(x) for x in cu_seqlens[:-1].tolist()]
            self.offsets = [(s, s) for s in starts] + [(int(cu_seqlens[-1]), int(cu_seqlens[-1]))]
            self.lengths = lengths
            self.cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
            self.max_seqlen = max(lengths) if lengths else 0
        else:
            self.n = q.shape[1]
        self._calls = {}

    def _refusal(self, q, k, v, cu_seqlens, dropout_p, alibi_slopes):
        """This rank's own reason to refuse the call (before any transfer), or None."""
        if dropout_p:
            return f"dropout_p: {dropout_p}; attnforge computes no dropout (pass 0.0)"
        if alibi_slopes is not None:
            return "alibi_slopes: ALiBi is not implemented by attnforge"
        if self.layout not in _layout.LAYOUTS:
            return f"layout: expected one of {_layout.LAYOUTS}, got {self.layout!r}"
        rank = 3 if self.packed else 4
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
            if t.dim() != rank:
                shape = "(T_local, H, D) with cu_seqlens" if self.packed else "(B, S_local, H, D)"
                return f"{name}: expected {rank} dimensions {shape}, got {tuple(t.shape)}"
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return (f"q, k, v: one dtype of float32, float16, bfloat16 expected, got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}")
        if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
            return (f"q, k, v: shards of one sequence must have the same leading dims, got q {tuple(q.shape)}, k "
                    f"{tuple(k.shape)}, v {tuple(v.shape)}")
        if q.shape[-1] != k.shape[-1]:
            return f"k: head dim {k.shape[-1]} differs from q's {q.shape[-1]}"
        if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
            return f"q: {q.shape[-2]} heads are not a multiple of k's {k.shape[-2]} (grouped-query attention)"
        rule = _layout.length_rule(self.layout, self.world)
        if self.packed:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
                    cu_seqlens.dtype not in (torch.int32, torch.int64):
                return "cu_seqlens: expected a 1-D int32 tensor of B + 1 prefix sums (this rank's shard)"
            cu = cu_seqlens.cpu()
            if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((cu[1:] < cu[:-1]).any()):
                return (f"cu_seqlens: must rise from 0 to the shard's {q.shape[0]} tokens, got "
                        f"{cu.tolist()}")
            lengths = (cu[1:] - cu[:-1])
            if bool((lengths % rule != 0).any()):
                return (f"cu_seqlens: with layout {self.layout!r} each local sequence length must be even (each "
                        f"document is 2W chunks: rank r holds chunks r and 2W-1-r), got {lengths.tolist()}")
        elif q.shape[1] % rule:
            return (f"q: local length {q.shape[1]} is odd; layout {self.layout!r} needs the global length to divide "
                    f"into 2W = {2 * self.world} equal chunks (rank r holds chunks r and 2W-1-r)")
        if self.sink is not None and (not isinstance(self.sink, torch.Tensor) or tuple(self.sink.shape) !=
                                      (q.shape[-2],)):
            return f"learnable_sink: expected a ({q.shape[-2]},) tensor, one logit per query head"
        if self.softcap < 0:
            return f"softcap: must be >= 0, got {self.softcap}"
        return None

    def calls(self, source: int) -> List[Call]:
        """This rank's calls against the K/V shard of rank `source` (cached: the backward replays them)."""
        if source not in self._calls:
            if source == self.rank and self.left is None and self.right in (None, 0):
                self._calls[source] = [self._own_block_call()]
            elif self.packed:
                segs = lambda r: [_layout.segments(self.layout, r, self.world, n) for n in self.lengths]  # noqa
                self._calls[source] = _packed_calls(segs(self.rank), segs(source), self.offsets, self.left,
                                                    self.right, self.device)
            else:
                qsegs = _layout.segments(self.layout, self.rank, self.world, self.n)
                ksegs = _layout.segments(self.layout, source, self.world, self.n)
                self._calls[source] = _batched_calls(qsegs, ksegs, self.left, self.right)
        return self._calls[source]

    def _own_block_call(self) -> Call:
        """A rank's own K/V without a window: its local order is the global order (every layout keeps each shard's
        tokens increasing), so the global causal (or no) mask is the local one, and the step is one call."""
        window = _layout.FULL if self.right is None else (None, 0)
        if not self.packed:
            return Call(Sel(1, 0, self.n), Sel(1, 0, self.n), window)
        total = self.offsets[-1][0]
        return Call(Sel(0, 0, total), Sel(0, 0, total), window, self.cu_seqlens, self.cu_seqlens, self.max_seqlen,
                    self.max_seqlen)

    def rows_shape(self, q):
        return tuple(q.shape[:-2])


def _kernel_args(call: Call):
    return dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)


def ring_forward(p: Problem, q, k, v):
    """(out float32 rows layout, lse_t float32) of this rank's rows over the whole ring."""
    out, lse_t = _merge.new_accumulators(p.rows_shape(q), q.shape[-2], v.shape[-1], q.device)
    ring = _comm.Ring(p.group, p.world, p.rank, p.what) if p.world > 1 else None
    k, v = k.contiguous(), v.contiguous()
    for step in range(p.world):
        if step + 1 < p.world:   # the next K/V in flight under this step's compute
            next_k, next_v = torch.empty_like(k), torch.empty_like(v)
            ring.post((k, v), (next_k, next_v))
        for call in p.calls((p.rank - step) % p.world):
            block_out, block_lse = _local.forward(call.q.kernel(q), call.k.kernel(k), call.k.kernel(v), p.scale,
                                                  call.window, p.softcap, **_kernel_args(call))
            if call.q.doc:
                block_out = block_out[0]
            call.q.merge_(out, lse_t, block_out, _lse_rows(block_lse, call.q, p.packed))
        if step + 1 < p.world:
            ring.wait()
            k, v = next_k, next_v
    if p.sink is not None:
        _merge.add_sink_(out, lse_t, p.sink)
    return out, lse_t


def ring_backward(p: Problem, dout, q, k, v, out, lse_t):
    """(dq, dk, dv) of this rank's shards: K/V and float32 dK/dV accumulators travel the ring together; each step's
    block gradients are computed before the incoming accumulator is waited for."""
    wide = _local.out_dtype(q)
    dout_w, out_w = dout.to(wide), out.to(wide)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    ring = _comm.Ring(p.group, p.world, p.rank, p.what + " (backward)") if p.world > 1 else None
    grad_ring = _comm.Ring(p.group, p.world, p.rank, p.what + " (backward dK/dV)") if p.world > 1 else None
    k, v = k.contiguous(), v.contiguous()
    dk_acc = dv_acc = None
    for step in range(p.world):
        if step + 1 < p.world:
            next_k, next_v = torch.empty_like(k), torch.empty_like(v)
            ring.post((k, v), (next_k, next_v))
        dk_step = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_step = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for call in p.calls((p.rank - step) % p.world):
            lse = _lse_kernel(call.q.take(lse_t), call.q, p.packed)
            bq, bk, bv = _local.backward(call.q.kernel(dout_w), call.q.kernel(q), call.k.kernel(k),
                                         call.k.kernel(v), call.q.kernel(out_w), lse, p.scale, call.window,
                                         p.softcap, **_kernel_args(call))
            call.q.add_(dq, bq)
            call.k.add_(dk_step, bk)
            call.k.add_(dv_step, bv)
        if step > 0:   # the accumulator of the K/V held now arrives from the previous rank
            grad_ring.wait()
            dk_step += dk_acc
            dv_step += dv_acc
        if p.world > 1:   # on to the next rank; after the last step it reaches the K/V's owner
            dk_acc, dv_acc = torch.empty_like(dk_step), torch.empty_like(dv_step)
            grad_ring.post((dk_step, dv_step), (dk_acc, dv_acc))
        else:
            dk_acc, dv_acc = dk_step, dv_step
        if step + 1 < p.world:
            ring.wait()
            k, v = next_k, next_v
    if p.world > 1:
        grad_ring.wait()
    return dq, dk_acc, dv_acc


# ---------------------------------------------------------------- autograd
def _api_lse(lse_t, packed):
    """The accumulators' lse_t as the API returns it: (B, H, S_local), packed (H, T_local)."""
    return (lse_t.t() if packed else lse_t.transpose(1, 2)).contiguous()


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, problem):
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out, lse_t = ring_forward(problem, qd, kd, vd)
        ctx.problem = problem
        ctx.save_for_backward(qd, kd, vd, out, lse_t)
        lse = _api_lse(lse_t, problem.packed)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _unused_dlse):
        q, k, v, out, lse_t = ctx.saved_tensors
        p = ctx.problem
        dq, dk, dv = ring_backward(p, dout, q, k, v, out, lse_t)
        dsink = None
        if p.sink is not None and ctx.needs_input_grad[3]:
            dsink = _merge.sink_gradient(out, dout, lse_t, p.sink).to(p.sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None


def ring_attention(what, q, k, v, *, group, layout, causal, window_size, softmax_scale, softcap, learnable_sink,
                   cu_seqlens=None, dropout_p=0.0, alibi_slopes=None, deterministic=False,
                   return_attn_probs=False):
    """The ring call behind every public ring function: (out, lse, None) with return_attn_probs, else out."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    problem = Problem(what, q, k, v, group, layout, causal, window_size, softmax_scale, softcap, learnable_sink,
                      cu_seqlens, dropout_p, alibi_slopes)
    if problem.world == 1:   # a group of one rank is plain attnforge: the same call, the same bits
        out, lse = _whole_sequence(problem, q, k, v, cu_seqlens)
    else:
        out, lse = RingAttention.apply(q, k, v, learnable_sink, problem)
    return (out, lse, None) if return_attn_probs else out


def _whole_sequence(p: Problem, q, k, v, cu_seqlens):
    """attnforge's public flash_attn_func / flash_attn_varlen_func with the ring's meaning (the global window is FA4's
    literal one when queries and keys are the same sequence)."""
    kwargs = dict(softmax_scale=p.scale, causal=False, window_size=(p.left, p.right), softcap=p.softcap,
                  learnable_sink=p.sink, return_lse=True)
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, **kwargs)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=p.cu_seqlens, cu_seqlens_k=p.cu_seqlens,
                                  max_seqlen_q=p.max_seqlen, max_seqlen_k=p.max_seqlen, **kwargs)

