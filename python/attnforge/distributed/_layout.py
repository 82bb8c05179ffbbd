"""Which global positions a rank's shard holds, and what one block (a run of my query rows against a run of another
rank's keys) sees of the global mask, as the local window FlashAttention-4's kernels take.

A shard of one sequence (one batch row, or one document of a packed batch) of global length N = W·n is a list of
segments: `count` tokens at global positions start, start + stride, ... stored from local row `row`.
- "ring" (contiguous): rank r holds positions [r·n, (r+1)·n).
- "zigzag": the sequence in 2W chunks of n/2; rank r holds chunks r and 2W-1-r (every rank the same causal work).
- "stripe": token t on rank t mod W (Striped Attention: block size 1).

The global mask is FlashAttention-2's: key g_k is visible to query g_q when -left <= g_k - g_q <= right (None:
unbounded; causal is right = 0). Over two segments of one stride σ, with c = k.start - q.start, local key j is
visible to local row i when lo <= j - i <= hi, lo = ceil((-left - c) / σ), hi = floor((right - c) / σ): a band, which
is exactly a local window of FA4's kernels. Blocks outside the band are skipped, not computed and masked."""
from typing import NamedTuple, Optional, Tuple

from .. import _C

LAYOUTS = ("ring", "zigzag", "stripe")


class Segment(NamedTuple):
    start: int    # global position of the first token
    count: int    # tokens
    stride: int   # global distance between consecutive tokens
    row: int      # local row of the first token


def segments(layout: str, rank: int, world: int, n: int):
    """The segments of rank `rank`'s shard of n local tokens of one sequence."""
    if layout == "ring" or (world == 1 and layout in LAYOUTS):   # one rank: the whole sequence in order, any n
        return (Segment(rank * n, n, 1, 0),)
    if layout == "zigzag":
        c = n // 2
        return (Segment(rank * c, c, 1, 0), Segment((2 * world - 1 - rank) * c, c, 1, c))
    if layout == "stripe":
        return (Segment(rank, n, world, 0),)
    raise _C.InvalidArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def length_rule(layout: str, world: int) -> int:
    """Local lengths must be a multiple of this (zigzag: each shard is two equal chunks)."""
    return 2 if layout == "zigzag" and world > 1 else 1


def _floor_div(a: int, b: int) -> int:
    return a // b


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


FULL = "full"
SKIP = None


def block_window(q: Segment, k: Segment, left: Optional[int], right: Optional[int]):
    """What q's rows see of k's keys under the global window (left, right): SKIP (None) when nothing, FULL when
    everything, else FA4's (left, right) local window (bottom-right aligned on the block's own lengths; None sides
    unbounded)."""
    if q.count == 0 or k.count == 0:
        return SKIP
    if q.stride != k.stride:
        raise _C.InternalError("block_window: segments of different strides")
    sigma, c = q.stride, k.start - q.start
    lo = None if left is None else _ceil_div(-left - c, sigma)
    hi = None if right is None else _floor_div(right - c, sigma)
    first, last = -(q.count - 1), k.count - 1      # the j - i a block spans
    if (lo is not None and lo > last) or (hi is not None and hi < first) or \
            (lo is not None and hi is not None and lo > hi):
        return SKIP
    lo_binds = lo is not None and lo > first
    hi_binds = hi is not None and hi < last
    if not lo_binds and not hi_binds:
        return FULL
    shift = k.count - q.count                      # FA4: row i sees i + shift - left <= j <= i + shift + right
    return (shift - lo if lo_binds else None, hi - shift if hi_binds else None)


def global_window(causal: bool, window_size: Tuple[int, int]):
    """FlashAttention-2's (causal, window_size) as (left, right), None = unbounded: -1 (any negative) is unbounded,
    causal sets right = 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise TypeError(f"window_size: expected a (left, right) pair of ints (-1 = unbounded), got {window_size!r}")
    left = None if window_size[0] < 0 else int(window_size[0])
    right = None if window_size[1] < 0 else int(window_size[1])
    if causal:
        right = 0
    return left, right


def fa4_window(causal: bool, window: Tuple[Optional[int], Optional[int]]):
    """FA4's (causal, window_size) for a whole-sequence call of the same meaning (a group of one rank)."""
    left, right = window
    return False, (left, right)
