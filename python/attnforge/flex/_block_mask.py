"""Block masks: PyTorch's BlockMask objects read for attnforge's kernels, and create_block_mask built in C.

create_block_mask traces the mask_mod once (attnforge._mod_trace) and hands the program to af_create_block_mask,
which classifies each block by an interval analysis of the program, evaluating it only on the blocks that analysis
cannot settle: no dense (B, H, L, S) mask, no compile, nothing to redo when the lengths change. The result is PyTorch's own
BlockMask (BlockMask.from_kv_blocks), so it works with torch's flex_attention as well as attnforge's."""
import torch

from .. import _C
from .._mod_trace import trace

_DEFAULT_BLOCK = 128   # torch.nn.attention.flex_attention's _DEFAULT_SPARSE_BLOCK_SIZE


def _int32_cpu(t, name):
    if not isinstance(t, torch.Tensor):
        raise _C.InvalidArgumentError(f"block_mask.{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise _C.UnsupportedError(f"block_mask.{name}: on {t.device}; attnforge.flex runs on the CPU")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def block_mask_args(block_mask):
    """A BlockMask's kv half as _C.flex_attn's block_mask tuple: (q_block, kv_block, kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices); the tensors keep PyTorch's leading (B, H) dims (1 broadcasts)."""
    size = block_mask.BLOCK_SIZE
    q_block, kv_block = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    tensors = []
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        t = getattr(block_mask, name, None)
        if t is not None:
            t = _int32_cpu(t, name)
            if t.dim() < (3 if "num" in name else 4):   # BlockMask allows fewer leading dims: (H, ...) or (...)
                t = t.reshape((1,) * ((3 if "num" in name else 4) - t.dim()) + tuple(t.shape))
        tensors.append(t)
    return (q_block, kv_block, *tensors)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=_DEFAULT_BLOCK, _compile=False,
                      separate_full_blocks=True):
    """torch.nn.attention.flex_attention.create_block_mask's call and result (a torch BlockMask with the same
    kv_num_blocks / kv_indices / full_kv_* as PyTorch's), built in C in O(blocks) memory without evaluating the
    mask on the blocks its structure settles. B or H None: 1 (broadcast). _compile is accepted and ignored: there
    is nothing to compile."""
    from torch.nn.attention.flex_attention import BlockMask

    if torch.device(device).type != "cpu":
        raise _C.UnsupportedError(f"device: {device}; attnforge.create_block_mask builds block masks on the CPU")
    B = 1 if B is None else int(B)
    H = 1 if H is None else int(H)
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    q_block, kv_block = int(q_block), int(kv_block)
    if q_block < 1 or kv_block < 1:
        raise _C.InvalidArgumentError(f"BLOCK_SIZE: {BLOCK_SIZE}; block sizes must be at least 1")
    nq, nk = -(-int(Q_LEN) // q_block), -(-int(KV_LEN) // kv_block)
    num = torch.empty(B, H, nq, dtype=torch.int32)
    ind = torch.empty(B, H, nq, nk, dtype=torch.int32)
    full_num = torch.empty(B, H, nq, dtype=torch.int32) if separate_full_blocks else None
    full_ind = torch.empty(B, H, nq, nk, dtype=torch.int32) if separate_full_blocks else None
    program = trace(mask_mod, score=False).as_c()
    _C.create_block_mask(program, B, H, int(Q_LEN), int(KV_LEN), q_block, kv_block, num, ind, full_num, full_ind)
    return BlockMask.from_kv_blocks(num, ind, full_num, full_ind, BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod,
                                    seq_lengths=(int(Q_LEN), int(KV_LEN)))
