"""Hugging Face Transformers on attnforge: register() adds attn_implementation="attnforge" and, for continuous
batching, "attnforge_flash".

    import attnforge.transformers
    attnforge.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attnforge")
    model.generate_batch(prompts, ...)   # with attn_implementation="attnforge_flash": paged continuous batching

Every attention call of the model then runs on attnforge, forward and backward (a plain model(x) outside
torch.no_grad(), training: attnforge's operators have a backward pass), and a call attnforge cannot run raises (there
is no silent fallback to PyTorch), except that calls needing gradients that attnforge's backward does not cover run on
PyTorch, with one warning per process on the "attnforge" logger: on CUDA (the backward runs on the CPU only), with
attention dropout (training mode), with a mask or position_bias that needs a gradient (T5's learned bias), or with a
sink per query (Inkling 2): Transformers' sdpa computation, or its eager one with a softcap or sinks.
With or without gradients:
- a call with no mask (causal prefill, decode, full attention) runs attnforge.scaled_dot_product_attention, or
  flash_attn_func when the layer has a sliding window, a softcap or learned sinks — the window goes to the kernel
  as window_size, so no (L, S) mask is built for it;
- a call with a mask (padded batches) runs attnforge.scaled_dot_product_attention with that mask; with a softcap or
  sinks too, each query row becomes one sequence of flash_attn_varlen_func over its visible keys, read in place
  through a page table of single-token pages (every row's visible keys must be one contiguous range, as causal,
  sliding-window and padding masks are). Its backward is PyTorch's explicit one (_backward.masked_rows_backward):
  neither C backward reads keys through a page table.
A position_bias (T5 and its family) is folded into the additive mask as Transformers' sdpa path folds it; the sparse
key selections of DeepSeek sparse attention's models (indices, block_indices) raise.
The mask function registered with it is Transformers' sdpa_mask, except that a causal sliding-window layer without
padding gets no mask: its window is the sliding_window the layer passes to the attention call.

"attnforge_flash" is the same attention function under a name Transformers treats as a FlashAttention
implementation: it gets FlashAttention's masks (none, or a (B, S) padding mask, which it expands to the causal,
windowed (B, 1, L, S) mask of the paths above) and, in continuous batching (generate_batch), the packed sequences of
a batch with cu_seq_lens_q / cu_seq_lens_k, which run as one flash_attn_varlen_func call. Transformers accepts only
its own implementations and names containing "flash" for continuous batching, hence the name. Its decode fast path
(a block table into the paged cache) is only taken for FlashAttention 2/3 on CUDA, never for this name.
"""
import logging

import torch
import torch.nn.functional as F

from . import _C
from ._flash import flash_attn_func, flash_attn_varlen_func
from ._sdpa import scaled_dot_product_attention

NAME = "attnforge"
FLASH_NAME = "attnforge_flash"
FLEX_NAME = "attnforge_flex"

logger = logging.getLogger("attnforge")


def register(name: str = NAME, flash_name: str = FLASH_NAME, flex_name: str = FLEX_NAME) -> None:
    """Register attention implementations `name`, `flash_name` and `flex_name` (and their mask functions) with
    Transformers' AttentionInterface and AttentionMaskInterface, for every model loaded or configured afterwards with
    attn_implementation=name (SDPA-style masks), flash_name (FlashAttention-style: continuous batching) or flex_name
    (FlexAttention-style: block masks built by attnforge.create_block_mask, run block-sparse by
    attnforge.flex_attention, forward and backward)."""
    if "flash" not in flash_name:
        raise ValueError(f"flash_name must contain 'flash' (Transformers' test for a FlashAttention-style "
                         f"implementation), got {flash_name!r}")
    from transformers import AttentionInterface
    AttentionInterface.register(name, attention_forward)
    AttentionInterface.register(flash_name, attention_forward)
    AttentionInterface.register(flex_name, flex_attention_forward)
    _teach_flash_imports(flash_name)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:   # before Transformers 4.53 each model built its own mask; no registration needed
        return
    AttentionMaskInterface.register(name, attention_mask)
    AttentionMaskInterface.register(flex_name, flex_attention_mask)
    from transformers.masking_utils import flash_attention_mask
    AttentionMaskInterface.register(flash_name, flash_attention_mask)


def _teach_flash_imports(flash_name):
    """Transformers 5 imports the kernels of any implementation whose name contains "flash" when a model is built
    (modeling_flash_attention_utils._lazy_imports: the flash_attn packages, else a hub kernel by that name), and fails
    for a name it cannot find. For flash_name it now gets attnforge's functions; every other name goes through as
    before. Transformers only uses them in its own FlashAttention wrapper, which flash_name does not run."""
    import transformers.modeling_flash_attention_utils as fau
    lazy_imports = getattr(fau, "_lazy_imports", None)
    if lazy_imports is None:   # a Transformers without it imports nothing for a flash-named implementation
        return
    names = getattr(lazy_imports, "attnforge_names", None)
    if names is not None:   # already taught (register called again)
        names.add(flash_name)
        return

    def attnforge_lazy_imports(implementation, *args, **kwargs):
        if implementation in attnforge_lazy_imports.attnforge_names:
            return (flash_attn_func, flash_attn_varlen_func, None, getattr(fau, "_pad_input", None),
                    getattr(fau, "_unpad_input", None))
        return lazy_imports(implementation, *args, **kwargs)

    attnforge_lazy_imports.attnforge_names = {flash_name}
    fau._lazy_imports = attnforge_lazy_imports


def attention_mask(*args, local_size=None, allow_is_causal_skip=True, config=None, **kwargs):
    """Transformers' sdpa_mask, with a causal sliding window left to the kernel: local_size (the window) only stops
    sdpa_mask from returning None, and attention_forward applies the layer's sliding_window itself. A chunked layer
    (local_size = the chunk size) keeps its mask."""
    from transformers.masking_utils import sdpa_mask
    if allow_is_causal_skip and local_size is not None and local_size == getattr(config, "sliding_window", None) \
            and not getattr(config, "attention_chunk_size", None):
        local_size = None
    return sdpa_mask(*args, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, config=config, **kwargs)


def flex_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                        attention_mask=None, device="cpu", **kwargs):
    """Transformers' flex_attention_mask with attnforge.create_block_mask: the layer's mask function (causal, sliding
    or chunked windows, packed documents), the padding and the offsets, as a BlockMask built in C without the dense
    mask and without torch.compile."""
    from transformers.masking_utils import (add_offsets_to_mask_function, and_masks, causal_mask_function,
                                            padding_mask_function, prepare_padding_mask)

    from .flex import create_block_mask
    mask_function = mask_function if mask_function is not None else causal_mask_function
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    mask_function = add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    return create_block_mask(mask_function, batch_size, None, q_length, kv_length)


def flex_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                           s_aux=None, **kwargs):
    """The attention-function contract of Transformers' flex implementation on attnforge.flex_attention:
    attention_mask a BlockMask (flex_attention_mask's) or None; a softcap becomes the built-in softcap score_mod;
    gradients flow through attnforge's flex backward. Dropout and learned sinks raise."""
    from .flex import builtin, flex_attention
    if dropout:
        raise _C.UnsupportedError("attnforge_flex: attention dropout is not supported")
    if s_aux is not None or kwargs.get("sinks") is not None:
        raise _C.UnsupportedError("attnforge_flex: learned sinks are not supported; use attn_implementation="
                                  f"{NAME!r}")
    _refuse_sparse_selection(kwargs)
    if isinstance(attention_mask, torch.Tensor):
        raise _C.UnsupportedError("attnforge_flex: takes a BlockMask (its own mask function's); got a dense mask")
    out = flex_attention(query, key, value, score_mod=builtin.softcap(softcap) if softcap else None,
                         block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, position_bias=None, **kwargs):
    """Transformers' attention-function contract: query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev),
    attention_mask None or (B or 1, 1 or Hq, L, S) (bool: True = attend, or additive), position_bias None or an
    additive bias broadcastable to (B, Hq, L, S); returns (attn_output (B, L, Hq, Ev), None)."""
    _refuse_sparse_selection(kwargs)
    sink = s_aux if s_aux is not None else kwargs.get("sinks")
    softcap = softcap or 0.0
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if kwargs.get("block_table") is not None:
        raise _C.UnsupportedError("attnforge: continuous batching's block-table decode path (flash_attn_with_kvcache) "
                                  "is not supported; it is only enabled for FlashAttention 2/3 on CUDA")
    on_pytorch = _needs_autograd(query, key, value, attention_mask, sink, position_bias) and \
        _backward_not_covered(query, attention_mask, position_bias, dropout, sink)
    if on_pytorch:   # PyTorch's attention keeps training correct where attnforge's backward does not reach
        _warn_autograd_once()
    elif dropout:
        raise _C.UnsupportedError(f"attnforge: dropout={dropout} is not supported (attention dropout only runs in "
                                  "training; call model.eval())")
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        if on_pytorch:
            raise _C.UnsupportedError("attnforge: packed sequences (cu_seq_lens_q/k) that need gradients on CUDA, "
                                      "with dropout or with a mask that needs a gradient are not supported")
        return _packed(query, key, value, kwargs, scaling, is_causal, sliding_window, softcap, sink), None
    if attention_mask is not None and attention_mask.ndim == 2:   # a FlashAttention-style (B, S) padding mask
        attention_mask = _mask_from_padding(attention_mask, query.shape[2], is_causal, sliding_window)
    if position_bias is not None:   # as Transformers' sdpa path: the bias becomes the additive mask
        key, value, attention_mask = _with_position_bias(query, key, value, attention_mask, position_bias,
                                                          is_causal, sliding_window)
        is_causal = False
    if on_pytorch:
        return _pytorch_attention(query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
                                  softcap, sink), None
    if attention_mask is None:
        out = _unmasked(query, key, value, scaling, is_causal, sliding_window, softcap, sink)
    elif not softcap and sink is None:
        out = _masked_sdpa(query, key, value, attention_mask, scaling)
    else:   # reads the mask's values: an operator of its own, so a compiled graph keeps it whole
        from . import _ops
        out = _ops.masked_rows(query, key, value, attention_mask, scaling, softcap, sink)
    return out, None


def _refuse_sparse_selection(kwargs):
    """DeepSeek sparse attention's models fold their top-k key selection into the mask only for "eager" and "sdpa";
    any other implementation gets it as indices for a sparse kernel, which attnforge is not: refuse, never ignore."""
    for name in ("indices", "block_indices"):
        if kwargs.get(name) is not None:
            raise _C.UnsupportedError(f"attnforge: {name} (a sparse selection of keys per query) is not supported")


def _needs_autograd(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _backward_not_covered(query, mask, position_bias, dropout, sink):
    """A call needing gradients that attnforge's backward pass does not take: CUDA (CPU only), dropout (none), a
    mask or position bias that needs its own gradient (the backward gives the mask none), or a sink per query
    (Inkling 2's (B, H, L, 1), which attnforge does not run at all; PyTorch ran it with gradients before)."""
    return query.device.type != "cpu" or bool(dropout) or (sink is not None and sink.ndim == 4) or any(
        t is not None and t.requires_grad for t in (mask, position_bias))


_autograd_warned = False


def _warn_autograd_once():
    """One warning per process (not per layer and step), in the words and on the logger of attnforge.torch.apply."""
    global _autograd_warned
    if _autograd_warned or torch.compiler.is_compiling():   # a logging call would break a compiled graph
        return
    _autograd_warned = True
    logger.warning("attnforge: attention calls that need gradients on CUDA, with dropout or with a mask that needs a "
                   "gradient run on PyTorch (attnforge's backward pass runs on the CPU, without dropout, and gives "
                   "the mask no gradient)")


def _with_position_bias(query, key, value, mask, position_bias, is_causal, sliding_window):
    """Transformers' sdpa path (integrations/sdpa_attention.py): position_bias, and the causality and window no mask
    states, folded into one additive mask; returns (key, value, mask), the keys cropped as _unmasked crops them."""
    key, value, causal = _unused_slots_cropped(query, key, value, mask, is_causal)
    position_bias = position_bias[..., :key.shape[2]]
    if mask is None:
        mask = _implicit_mask(query, key, causal, sliding_window, is_causal)
    if mask is None:
        return key, value, position_bias
    if mask.dtype == torch.bool:
        return key, value, torch.where(mask, position_bias, torch.finfo(key.dtype).min)
    return key, value, position_bias + mask


def _unused_slots_cropped(query, key, value, mask, is_causal):
    """(key, value, causal): a causal prefill without a mask attends top-left; the keys past L are unused slots of a
    static cache, dropped as Transformers' sdpa path drops them."""
    L = query.shape[2]
    causal = is_causal and L > 1 and mask is None
    if causal and key.shape[2] > L:
        key, value = key[:, :, :L], value[:, :, :L]
    return key, value, causal


def _implicit_mask(query, key, causal, sliding_window, is_causal):
    """The (1, 1, L, S) bool mask of a maskless call (causality, the layer's window), or None where every key is
    visible; the keys already cropped, so top-left and bottom-right causality agree."""
    if not causal and _window_left(sliding_window, is_causal) is None:
        return None
    padding = torch.ones(1, key.shape[2], device=key.device)
    return _mask_from_padding(padding, query.shape[2], True, sliding_window)


def _pytorch_attention(query, key, value, mask, dropout, scaling, is_causal, sliding_window, softcap, sink):
    """The call on PyTorch, with gradients: Transformers' sdpa computation (F.scaled_dot_product_attention), or its
    eager one where a softcap or sinks need the scores; (B, L, Hq, Ev)."""
    key, value, causal = _unused_slots_cropped(query, key, value, mask, is_causal)
    if mask is None and (_window_left(sliding_window, is_causal) is not None or softcap or sink is not None):
        mask, causal = _implicit_mask(query, key, causal, sliding_window, is_causal), False
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    if softcap or sink is not None:
        return _eager_attention(query, key, value, mask, dropout, scaling, softcap, sink)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _eager_attention(query, key, value, mask, dropout, scaling, softcap, sink):
    """Gemma 2's and gpt-oss's eager attention: softcapped scores, the mask, a sink logit per head beside the keys."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    if sink is not None:
        sinks = sink if sink.ndim == 4 else sink.reshape(1, -1, 1, 1)   # (B, H, L, 1): a sink per query (Inkling 2)
        sinks = sinks.to(scores.dtype).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores - scores.amax(-1, keepdim=True), dim=-1, dtype=torch.float32).to(query.dtype)
    if sink is not None:
        probs = probs[..., :-1]
    if dropout:   # only passed in training
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2)


def _nhd(x):
    return x.transpose(1, 2)   # (B, H, N, D) -> (B, N, H, D): a view, read in place


def _window_left(sliding_window, is_causal):
    """Transformers' causal sliding window: key kv is visible from query q iff q - kv < sliding_window."""
    return sliding_window - 1 if sliding_window and is_causal else None


def _packed(query, key, value, kwargs, scaling, is_causal, sliding_window, softcap, sink):
    """Continuous batching: the batch's sequences packed along dim 2 of (1, H, total, D) tensors, sequence b's query
    rows [cu_seq_lens_q[b], cu_seq_lens_q[b + 1]) the last ones of its keys [cu_seq_lens_k[b], cu_seq_lens_k[b + 1])
    (FlashAttention's bottom-right causal alignment); returns (1, total_q, Hq, Ev)."""
    if query.shape[0] != 1:
        raise _C.InvalidArgumentError(f"query: packed sequences come as a batch of 1, got {query.shape[0]}")
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")   # None: the kernel bounds them
    max_q = int(max_q) if max_q is not None else None
    max_k = int(max_k) if max_k is not None else None
    out, _ = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                                    max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scaling, causal=is_causal,
                                    window_size=(_window_left(sliding_window, is_causal), None), softcap=softcap,
                                    learnable_sink=sink)
    return out.unsqueeze(0)


def _mask_from_padding(padding, L, is_causal, sliding_window):
    """A FlashAttention-style (B, S) padding mask (nonzero = a real token) as the (B, 1, L, S) bool mask of the SDPA
    paths: the L queries are the last L positions, causal (bottom-right) and windowed as the layer asks."""
    B, S = padding.shape
    visible = (padding != 0)[:, None, None, :].expand(B, 1, L, S)
    if is_causal:
        query_pos = torch.arange(S - L, S, device=padding.device)[:, None]
        key_pos = torch.arange(S, device=padding.device)[None, :]
        allowed = key_pos <= query_pos
        left = _window_left(sliding_window, is_causal)
        if left is not None:
            allowed = allowed & (query_pos - key_pos <= left)
        visible = visible & allowed
    return visible


def _unmasked(query, key, value, scaling, is_causal, sliding_window, softcap, sink):
    """No mask: causal (L > 1) or full attention, as Transformers' sdpa integration decides it."""
    L = query.shape[2]
    causal = is_causal and L > 1
    if causal and key.shape[2] > L:   # prefill into a static cache: the keys past L are unused slots
        key, value = key[:, :, :L], value[:, :, :L]
    left = _window_left(sliding_window, is_causal)
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
