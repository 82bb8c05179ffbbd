"""Hugging Face Transformers on attnforge: register() adds attn_implementation="attnforge".

    import attnforge.transformers
    attnforge.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attnforge")

Every attention call of the model then runs on attnforge, and a call attnforge cannot run raises (there is no silent
fallback to PyTorch):
- a call with no mask (causal prefill, decode, full attention) runs attnforge.scaled_dot_product_attention, or
  flash_attn_func when the layer has a sliding window, a softcap or learned sinks — the window goes to the kernel
  as window_size, so no (L, S) mask is built for it;
- a call with a mask (padded batches) runs attnforge.scaled_dot_product_attention with that mask; with a softcap or
  sinks too, each query row becomes one sequence of flash_attn_varlen_func over its visible keys, read in place
  through a page table of single-token pages (every row's visible keys must be one contiguous range, as causal,
  sliding-window and padding masks are).
The mask function registered with it is Transformers' sdpa_mask, except that a causal sliding-window layer without
padding gets no mask: its window is the sliding_window the layer passes to the attention call.
"""
import torch

from . import _C
from ._flash import flash_attn_func, flash_attn_varlen_func
from ._sdpa import scaled_dot_product_attention

NAME = "attnforge"


def register(name: str = NAME) -> None:
    """Register attention implementation `name` (and its mask function) with Transformers' AttentionInterface and
    AttentionMaskInterface, for every model loaded or configured afterwards with attn_implementation=name."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:   # before Transformers 4.53 each model built its own mask; no registration needed
        return
    AttentionMaskInterface.register(name, attention_mask)


def attention_mask(*args, local_size=None, allow_is_causal_skip=True, config=None, **kwargs):
    """Transformers' sdpa_mask, with a causal sliding window left to the kernel: local_size (the window) only stops
    sdpa_mask from returning None, and attention_forward applies the layer's sliding_window itself. A chunked layer
    (local_size = the chunk size) keeps its mask."""
    from transformers.masking_utils import sdpa_mask
    if allow_is_causal_skip and local_size is not None and local_size == getattr(config, "sliding_window", None) \
            and not getattr(config, "attention_chunk_size", None):
        local_size = None
    return sdpa_mask(*args, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, config=config, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """Transformers' attention-function contract: query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev),
    attention_mask None or (B or 1, 1 or Hq, L, S) (bool: True = attend, or additive); returns
    (attn_output (B, L, Hq, Ev), None)."""
    if dropout:
        raise _C.UnsupportedError(f"attnforge: dropout={dropout} is not supported (attention dropout only runs in "
                                  "training; call model.eval())")
    if kwargs.get("position_bias") is not None:
        raise _C.UnsupportedError("attnforge: position_bias (an additive bias per layer) is not supported")
    sink = s_aux if s_aux is not None else kwargs.get("sinks")
    softcap = softcap or 0.0
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None:
        out = _unmasked(query, key, value, scaling, bool(is_causal), sliding_window, softcap, sink)
    elif not softcap and sink is None:
        out = _masked_sdpa(query, key, value, attention_mask, scaling)
    else:
        out = _masked_rows(query, key, value, attention_mask, scaling, softcap, sink)
    return out, None


def _nhd(x):
    return x.transpose(1, 2)   # (B, H, N, D) -> (B, N, H, D): a view, read in place


def _unmasked(query, key, value, scaling, is_causal, sliding_window, softcap, sink):
    """No mask: causal (L > 1) or full attention, as Transformers' sdpa integration decides it."""
    L = query.shape[2]
    causal = is_causal and L > 1
    if causal and key.shape[2] > L:   # prefill into a static cache: the keys past L are unused slots
        key, value = key[:, :, :L], value[:, :, :L]
    # Transformers' causal sliding window: key kv is visible from query q iff q - kv < sliding_window
    left = sliding_window - 1 if sliding_window and is_causal else None
    if not softcap and sink is None and left is None:
        out = scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling,
                                           enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)
    out, _ = flash_attn_func(_nhd(query), _nhd(key), _nhd(value), softmax_scale=scaling, causal=causal,
                             window_size=(left, None), softcap=softcap, learnable_sink=sink)
    return out


def _masked_sdpa(query, key, value, mask, scaling):
    if mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


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


def _masked_rows(query, key, value, mask, scaling, softcap, sink):
    """Softcap or sinks under a mask: query row (b, i) is sequence b * L + i of a varlen call whose keys are pages
    of one token, the row's visible range [lo, lo + count) of batch b's keys."""
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
    k_pages = _nhd(key).reshape(B * S, 1, Hkv, E)
    v_pages = _nhd(value).reshape(B * S, 1, Hkv, Ev)
    q_rows = _nhd(query).reshape(B * L, Hq, E)
    cu_seqlens_q = torch.arange(B * L + 1, dtype=torch.int32, device=query.device)
    out, _ = flash_attn_varlen_func(q_rows, k_pages, v_pages, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                                    max_seqlen_k=width, seqused_k=count.reshape(B * L).to(torch.int32),
                                    page_table=table, softmax_scale=scaling, softcap=softcap, learnable_sink=sink)
    return out.reshape(B, L, Hq, Ev)
