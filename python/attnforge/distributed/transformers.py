"""Context parallelism inside Hugging Face Transformers models: each attention call of a model whose
attn_implementation is "attnforge_cp" runs attnforge's ring attention over a torch.distributed group (gloo on CPUs),
forward and backward, while a context_parallel() block (or enable()) is active. The role of ring-flash-attn's
substitute_hf_flash_attn / update_ring_flash_attn_params, for attnforge's kernels and zigzag/ring/stripe shards.

    import attnforge.distributed.transformers as cpt
    model = LlamaForCausalLM(config)                          # the same weights on every rank
    with cpt.context_parallel(group, model=model):            # switches it to "attnforge_cp"
        batch = cpt.shard_batch(input_ids, labels, group=group)   # this rank's tokens, global positions, labels
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        loss = cpt.loss_across_ranks(*cpt.loss_sum(logits, batch.labels), group)   # the whole batch's mean
        loss.backward()
    cpt.sum_gradients(model, group)                           # as DDP/FSDP over the CP ranks would
    optimizer.step()

What runs on the ring: self-attention with query and key of the same local length (training, or one prefill without
a cache), causal or not, grouped-query K/V heads as they are (never repeated), a causal sliding window (the layer's
sliding_window), a softcap, and learned sinks (one logit per head: gpt-oss). Each rank's layers see only its shard, so
every token-wise layer (embeddings, MLPs, norms, the LM head) needs nothing; RoPE needs the global positions, which
shard_batch gives as position_ids.

Refused with an error (never computed wrongly): any attention_mask, even an all-ones one (padding, packed documents
and mask-only patterns such as Llama 4's chunked attention are out of scope; under context parallelism the mask
function of "attnforge_cp" builds no mask from the local, non-contiguous positions; the refusal does not look at the
mask's values, so that every rank refuses alike instead of one rank entering the ring alone), a KV cache
longer than the query (decoding), attention dropout, position_bias (T5), a sink per query, sparse key selections,
packed cu_seq_lens, a non-causal sliding window.

Labels: Transformers' causal-LM loss shifts labels inside the model, which on a shard would pair a token with its
local neighbour, not its global successor. shard_batch therefore shifts the whole sequence's labels before sharding;
its labels are not to be passed as labels= (which would shift again). Either compute the loss from the logits with
loss_sum / loss_across_ranks (as examples/train_context_parallel.py does), or let Transformers compute it without
shifting: model(..., labels=batch.labels, shift_labels=batch.labels, num_items_in_batch=batch.num_items) returns this
rank's sum over the whole batch's count, whose sum over the ranks (and its gradients' sum) is the whole batch's mean.

Outside any context_parallel() block "attnforge_cp" is attnforge.transformers' attention ("attnforge"): the same
model then runs on one process, whole sequences, with padding masks."""
import contextlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _C
from .. import transformers as _single
from .ring import ring_flash_attn_func, stripe_flash_attn_func, zigzag_ring_flash_attn_func
from .shard import shard as _shard

NAME = "attnforge_cp"
IGNORE_INDEX = -100

_RING_FUNCS = {"zigzag": zigzag_ring_flash_attn_func, "ring": ring_flash_attn_func,
               "stripe": stripe_flash_attn_func}


class _Setting(NamedTuple):
    group: object
    layout: str


_active: Optional[_Setting] = None   # process-wide, as ring-flash-attn's substituted function is


# ---------------------------------------------------------------- switching it on
def register(name: str = NAME) -> None:
    """Register the attention function `name` and its mask function with Transformers' AttentionInterface and
    AttentionMaskInterface (idempotent). Without a mask function Transformers would drop the caller's padding mask
    silently; this one refuses it under context parallelism and is attnforge's outside."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)


def enable(model=None, group=None, layout: str = "zigzag") -> None:
    """Run every "attnforge_cp" attention call on the ring over `group` (None: the default group) with `layout`'s
    shards, until disable(). A model given is switched to attn_implementation="attnforge_cp" (and checked for what
    the ring cannot run)."""
    global _active
    if layout not in _RING_FUNCS:
        raise _C.InvalidArgumentError(f"layout: expected one of {tuple(_RING_FUNCS)}, got {layout!r}")
    register()
    if model is not None:
        use(model)
    _active = _Setting(group, layout)


def disable() -> None:
    """Back to single-process attention for "attnforge_cp" models (attnforge.transformers' attention)."""
    global _active
    _active = None


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "zigzag", model=None):
    """enable(model, group, layout) for the block; the setting before it comes back afterwards (the model keeps
    "attnforge_cp", which outside the block is single-process attnforge). Run the backward inside the block too, on
    every rank of the group: gradient checkpointing runs the attention forward again during the backward."""
    global _active
    before = _active
    enable(model, group, layout)
    try:
        yield
    finally:
        _active = before


def active():
    """(group, layout) of the ring "attnforge_cp" calls run on now, or None (single-process)."""
    return None if _active is None else tuple(_active)


def use(model) -> None:
    """Switch `model` to attn_implementation="attnforge_cp" after checking its config for attention patterns that
    live only in the mask (which this implementation never builds)."""
    config = getattr(model, "config", None)
    if getattr(config, "attention_chunk_size", None):
        raise _C.UnsupportedError("attnforge_cp: chunked attention (attention_chunk_size, Llama 4) exists only as a "
                                  "mask, which context parallelism does not build")
    register()
    model.set_attn_implementation(NAME)


# ---------------------------------------------------------------- the mask and attention functions
def attention_mask(*args, attention_mask=None, **kwargs):
    """Transformers' mask function for "attnforge_cp": attnforge.transformers' (sdpa_mask) outside
    context_parallel(); inside, None (the ring applies causality and windows from global positions itself; the
    packed-sequence mask Transformers infers from the shards' non-contiguous position_ids is such an artefact), and
    a caller's (B, S) mask raises."""
    if _active is None:
        return _single.attention_mask(*args, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None:
        raise _mask_refusal()
    return None


def _mask_refusal():
    return _C.UnsupportedError("attnforge_cp: attention masks (padding, packed documents, custom patterns) are not "
                               "supported under context parallelism; pass attention_mask=None (causal "
                               "self-attention over whole, unpadded sequences)")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """Transformers' attention-function contract (query (B, Hq, L, E), key/value (B, Hkv, S, E/Ev); returns
    (attn_output (B, L, Hq, Ev), None)). Inside context_parallel(): L is this rank's shard and the call runs on the
    ring; outside: attnforge.transformers.attention_forward."""
    setting = _active
    if setting is None:
        return _single.attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
                                         softcap=softcap, s_aux=s_aux, **kwargs)
    sink = s_aux if s_aux is not None else kwargs.get("sinks")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    _refuse(query, key, attention_mask, dropout, causal, sliding_window, sink, kwargs)
    window = (int(sliding_window) - 1, -1) if sliding_window else (-1, -1)   # Transformers: q - k < sliding_window
    ring = _RING_FUNCS[setting.layout]
    # (B, H, S, D) -> (B, S, H, D) views; the ring copies K/V to contiguous buffers itself (they travel)
    out = ring(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling,
               causal=causal, window_size=window, group=setting.group, softcap=float(softcap or 0.0),
               learnable_sink=sink)
    return out, None


def _refuse(query, key, mask, dropout, causal, sliding_window, sink, kwargs):
    """Raise for what the ring cannot compute exactly (see the module's docstring). Decided by shapes, flags and the
    presence of arguments, never by values, so every rank (whose model makes the same call) raises alike."""
    unsupported = _C.UnsupportedError
    if mask is not None:   # a 4-D mask the caller built: Transformers passes it through
        raise _mask_refusal()
    if key.shape[2] != query.shape[2]:
        raise unsupported(f"attnforge_cp: key length {key.shape[2]} differs from the query's {query.shape[2]} (a KV "
                          "cache or cross-attention); context parallelism runs self-attention over shards only "
                          "(use_cache=False)")
    if dropout:
        raise unsupported(f"attnforge_cp: attention dropout {dropout} is not supported (set attention_dropout=0)")
    if sliding_window and not causal:
        raise unsupported("attnforge_cp: a non-causal sliding window is not supported")
    if sink is not None and sink.ndim != 1:
        raise unsupported("attnforge_cp: sinks must be one logit per head, got shape " + str(tuple(sink.shape)))
    for name in ("position_bias", "indices", "block_indices", "cu_seq_lens_q", "block_table"):
        if kwargs.get(name) is not None:
            raise unsupported(f"attnforge_cp: {name} is not supported under context parallelism")


# ---------------------------------------------------------------- batches and the loss
class Batch(NamedTuple):
    """This rank's part of a batch. labels are already shifted (labels[:, i] is the token that input position i
    predicts, IGNORE_INDEX after each sequence's last token); num_items counts the whole batch's labels that are not
    IGNORE_INDEX (every rank gets the same number)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    num_items: int


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels (B, S) of a causal LM shifted by one along the whole sequence, as Transformers' loss shifts them."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def rank_and_world(group=None):
    """(this rank in `group`, its size); (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, layout: str = "zigzag", group=None,
                ignore_index: int = IGNORE_INDEX) -> Batch:
    """This rank's Batch of whole sequences input_ids (B, S) (identical on every rank of `group`): its input_ids,
    global position_ids (for RoPE) and labels shifted globally before sharding. labels None: input_ids (language
    modelling). position_ids None: 0 .. S-1; given ((B or 1, S)), they must rise by one along each row (packed
    documents are out of scope)."""
    if input_ids.dim() != 2:
        raise _C.InvalidArgumentError(f"input_ids: expected (B, S), got {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise _C.InvalidArgumentError(f"labels: expected {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    position_ids = _whole_positions(position_ids, batch, length, input_ids.device)
    shifted = shift_labels(labels, ignore_index)
    rank, world = rank_and_world(group)
    return Batch(_shard(input_ids, layout, rank, world, dim=1),
                 _shard(position_ids, layout, rank, world, dim=1),
                 _shard(shifted, layout, rank, world, dim=1),
                 int((shifted != ignore_index).sum()))


def _whole_positions(position_ids, batch, length, device):
    """(B, S) int64 positions of the whole sequences; refuses resets (packed documents) and gaps."""
    if position_ids is None:
        return torch.arange(length, device=device).expand(batch, length)
    if position_ids.dim() != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        raise _C.InvalidArgumentError(f"position_ids: expected (B or 1, {length}), got {tuple(position_ids.shape)}")
    if length > 1 and not bool((position_ids[:, 1:] - position_ids[:, :-1] == 1).all()):
        raise _C.UnsupportedError("position_ids: must rise by one along each row; packed documents (positions that "
                                  "restart) are not supported under context parallelism")
    return position_ids.to(torch.int64).expand(batch, length)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """(sum of the cross-entropy over this rank's labels that are not ignore_index, their count) from logits
    (B, S_local, V) and shard_batch's (already shifted) labels; the sum in float32, differentiable."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    total = F.cross_entropy(flat, labels.reshape(-1).to(logits.device), ignore_index=ignore_index, reduction="sum")
    return total, int((labels != ignore_index).sum())


def loss_across_ranks(local_sum: torch.Tensor, local_count, group=None) -> torch.Tensor:
    """The mean over the whole batch on every rank of `group` (one all_reduce of [sum, count]). Its value is the
    global mean; its gradient is this rank's share (d local_sum / global count), so that backward() on every rank
    followed by sum_gradients gives exactly the gradient of the global mean."""
    stats = torch.stack([local_sum.detach().to(torch.float64),
                         torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device)])
    if rank_and_world(group)[1] > 1:
        dist.all_reduce(stats, group=group)
    total_sum, total_count = stats[0].to(local_sum.dtype), stats[1].clamp(min=1).to(local_sum.dtype)
    # local_sum - local_sum.detach() is exactly 0 in value but carries this rank's gradient
    return (local_sum - local_sum.detach() + total_sum) / total_count


def sum_gradients(model_or_parameters, group=None) -> None:
    """Sum the parameters' gradients over `group` in place: each rank's backward gave the gradient of its tokens
    only, and data parallelism over the CP ranks (DDP, FSDP) would combine them so. A parameter with a gradient on
    some ranks only (an expert no local token was routed to) counts as zeros where it has none; one without a
    gradient on every rank keeps None (so the optimizer still skips it)."""
    if rank_and_world(group)[1] == 1:
        return
    parameters = model_or_parameters.parameters() if hasattr(model_or_parameters, "parameters") \
        else model_or_parameters
    parameters = [p for p in parameters if p.requires_grad]
    has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32)
    dist.all_reduce(has_grad, group=group)   # every rank then reduces the same list of buffers
    by_dtype = {}
    for p, ranks_with_grad in zip(parameters, has_grad.tolist()):
        if ranks_with_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():   # one flat buffer per dtype: one transfer instead of one per parameter
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
