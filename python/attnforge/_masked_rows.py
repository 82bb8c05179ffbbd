"""Transformers' softcap/sink attention under a mask, as one varlen call over pages of one token: the kernel of
attnforge::masked_rows (_ops), below the operators so that they never import the Transformers integration."""
import torch

from . import _C, _flash_call


def _visible(mask, batch, L, S):
    """The mask as (B, L, S) bool, the same for every head; UnsupportedError where it is not."""
    if mask.dtype != torch.bool:   # additive: 0 = attend, the dtype's lowest (or -inf) = masked
        lowest = torch.finfo(mask.dtype).min
        attend, masked = mask == 0, mask <= lowest / 2
        if not torch.all(attend | masked):
            raise _C.UnsupportedError("attnforge: softcap or sinks with an additive mask holding a bias (values "
                                      "other than 0 and -inf) are not supported")
        mask = attend
    if mask.ndim != 4:
        raise _C.InvalidArgumentError(f"attention_mask: expected 4 dimensions (B, H, L, S), got {mask.ndim}")
    if mask.shape[1] != 1 and not torch.equal(mask, mask[:, :1].expand_as(mask)):
        raise _C.UnsupportedError("attnforge: softcap or sinks with a mask that differs between heads are not "
                                  "supported")
    return mask[:, 0].expand(batch, L, S)


def masked_rows(query, key, value, mask, scaling, softcap, sink):
    """Softcap or sinks under a mask: query row (b, i) is sequence b * L + i of a varlen call whose keys are pages
    of one token, the row's visible range [lo, lo + count) of batch b's keys. The kernel of attnforge::masked_rows
    (it reads the mask's values); its varlen call runs the C library directly (_flash_call)."""
    B, Hq, L, E = query.shape
    S, Hkv, Ev = key.shape[2], key.shape[1], value.shape[-1]
    visible = _visible(mask, B, L, S)
    count = visible.sum(-1)                                            # (B, L)
    position = torch.arange(S, device=visible.device)
    lo = torch.where(visible, position, S).amin(-1)                    # first visible key (S if none)
    hi = torch.where(visible, position, -1).amax(-1)                   # last visible key (-1 if none)
    if not torch.all((count == 0) | (hi - lo + 1 == count)):
        raise _C.UnsupportedError("attnforge: softcap or sinks with a mask whose rows are not one contiguous range "
                                  "of keys are not supported")
    width = max(int(count.max()), 1) if count.numel() else 1
    first_page = torch.arange(B, device=lo.device)[:, None] * S + torch.where(count > 0, lo, 0)   # (B, L)
    table = first_page[..., None] + torch.arange(width, device=lo.device)
    table = table.clamp_(max=max(B * S - 1, 0)).reshape(B * L, width).to(torch.int32)
    k_pages = key.transpose(1, 2).reshape(B * S, 1, Hkv, E)
    v_pages = value.transpose(1, 2).reshape(B * S, 1, Hkv, Ev)
    q_rows = query.transpose(1, 2).reshape(B * L, Hq, E)
    cu_seqlens_q = torch.arange(B * L + 1, dtype=torch.int32, device=query.device)
    out, _ = _flash_call.run(q_rows, k_pages, v_pages, scaling, False, None, softcap, sink,
                             cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1, max_seqlen_k=width,
                             seqused_k=count.reshape(B * L).to(torch.int32), page_table=table, varlen=True)
    return out.reshape(B, L, Hq, Ev)
