"""Routing decisions from metadata alone (devices, dtypes, shapes, strides, arguments), in plain Python so that
torch.compile and torch.export decide them at trace time on fake tensors exactly as eager mode does:

- refusal(args, kwargs): why attnforge cannot compute an SDPA call at all (None when it can);
- sdpa_shapes(...): PyTorch's broadcasting rule for SDPA's shapes (docs/PYTORCH.md, "The broadcasting rule");
- PlanView.mismatch(args, kwargs): why a plan does not cover a call (None when it does) — the C guard's rules
  (src/provider/infer.c, plan_mismatch) in the same order with the same words; tests/test_torch_ops.py checks both
  agree on random calls.

Nothing here reads tensor data, calls into C or imports torch at module level."""

_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_QKV_NAMES = ("query", "key", "value")
_FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")


class Call:
    """One F.scaled_dot_product_attention call bound to its parameters, as the C binding binds it (call_args.c):
    q/k/v positional when at least three arguments came positionally, else by keyword."""

    def __init__(self, args, kwargs):
        if len(args) > len(_ARG_NAMES):
            raise TypeError(f"scaled_dot_product_attention() takes at most {len(_ARG_NAMES)} positional arguments "
                            f"({len(args)} given)")
        slots = dict(zip(_ARG_NAMES, args))
        for name, value in kwargs.items():
            if name not in _ARG_NAMES:
                raise TypeError(f"scaled_dot_product_attention() got an unexpected keyword argument {name!r}")
            if name in slots:
                raise TypeError(f"scaled_dot_product_attention() got multiple values for argument '{name}'")
            slots[name] = value
        for name in _QKV_NAMES:
            if name not in slots:
                raise TypeError(f"scaled_dot_product_attention() missing required argument '{name}'")
        self.query, self.key, self.value = (slots[n] for n in _QKV_NAMES)
        self.attn_mask = slots.get("attn_mask")
        self.dropout_p = slots.get("dropout_p", 0.0)
        self.is_causal = bool(slots.get("is_causal", False))
        self.scale = slots.get("scale")
        self.enable_gqa = bool(slots.get("enable_gqa", False))
        self.keyword_qkv = len(args) < 3
        self.qkv = (self.query, self.key, self.value)


def _device_name(device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index}"


def _nhd_contiguous(shape, strides) -> bool:
    """An HND view of NHD-contiguous memory (src/provider/layout.c): dims in the order B, L, H, D, each stride the
    product of the sizes after it; size-1 dims do not count, an empty tensor is contiguous."""
    for size in shape:
        if size == 0:
            return True
    expected = 1
    for d in (3, 1, 2, 0):
        if shape[d] == 1:
            continue
        if strides[d] != expected:
            return False
        expected = expected * shape[d]
    return True


_MAX_HEAD_DIM = 1024   # what the kernels run (src/sdpa/check.c)


def broadcast_shapes(a, b):
    """NumPy's (and PyTorch's) broadcasting of two shapes, right-aligned: each pair of sizes equal or one of them 1.
    None when they do not broadcast."""
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _broadcast_size(a, b, c):
    """The size three dims broadcast to (each equal to it or 1), or None."""
    n = max(a, b, c)
    return n if a in (1, n) and b in (1, n) and c in (1, n) else None


def plain_4d_shape(q, k, v, enable_gqa):
    """sdpa_shapes' answer for the common call, 4-D q/k/v whose batch and head dims broadcast directly (one group
    size under enable_gqa), in well under a microsecond: (B, H, L, Ev), or None for anything else (sdpa_shapes then
    applies the whole rule). Shape tuples in."""
    if not (len(q) == len(k) == len(v) == 4 and q[3] == k[3] and k[2] == v[2]):
        return None
    batch = _broadcast_size(q[0], k[0], v[0])
    if enable_gqa:
        heads = q[1] if k[1] == v[1] and k[1] and q[1] % k[1] == 0 else None
    else:
        heads = _broadcast_size(q[1], k[1], v[1])
    return None if batch is None or heads is None else (batch, heads, q[2], v[3])


def sdpa_shapes(q, k, v, mask, enable_gqa):
    """PyTorch's broadcasting rule for F.scaled_dot_product_attention (its math path, measured with torch 2.15):
    q (..., L, E), k (..., S, E), v (..., S, Ev), each at least 2-D; every leading dim is a batch dim, and they
    broadcast (right-aligned, equal or 1) as in q @ k.transpose(-2, -1) and then @ v. enable_gqa needs a head dim
    (dim -3) in each; unless the three head counts are equal, key's and value's must divide query's, and count as
    query's. The mask broadcasts to the scores' shape (q·kᵀ: the batch dims of q and k, then L, S) without growing
    it. Returns (the output's shape, None), or (None, why) naming the argument and the rule."""
    q, k, v = tuple(q), tuple(k), tuple(v)
    if mask is None:
        plain = plain_4d_shape(q, k, v, enable_gqa)
        if plain is not None:
            return plain, None
    for name, shape in (("query", q), ("key", k), ("value", v)):
        if len(shape) < 2:
            return None, f"{name}: expected at least 2 dimensions (..., L, E), got {len(shape)}"
    if k[-1] != q[-1]:
        return None, f"key: head dimension {k[-1]} does not match query's {q[-1]}"
    if v[-2] != k[-2]:
        return None, f"value: sequence length {v[-2]} does not match key's {k[-2]}"
    q_batch, k_batch, v_batch = q[:-2], k[:-2], v[:-2]
    if enable_gqa:
        if min(len(q), len(k), len(v)) < 3:
            return None, (f"enable_gqa: query, key and value need a head dimension (at least 3 dimensions), got "
                          f"{len(q)}, {len(k)} and {len(v)}")
        hq, hk, hv = q[-3], k[-3], v[-3]
        if not hq == hk == hv:
            for name, h in (("key", hk), ("value", hv)):
                if h == 0 or hq % h:
                    return None, (f"query: {hq} heads is not a multiple of {name}'s {h} heads (grouped-query "
                                  f"attention: enable_gqa)")
            k_batch, v_batch = k_batch[:-1] + (hq,), v_batch[:-1] + (hq,)
    scores = broadcast_shapes(q_batch, k_batch)
    if scores is None:
        return None, (f"key: batch dimensions {k[:-2]} do not broadcast against query's {q[:-2]}: each size must be "
                      f"equal or 1{'' if enable_gqa else ' (head counts too, without enable_gqa)'}")
    out = broadcast_shapes(scores, v_batch)
    if out is None:
        return None, (f"value: batch dimensions {v[:-2]} do not broadcast against {scores}, query's and key's: each "
                      f"size must be equal or 1{'' if enable_gqa else ' (head counts too, without enable_gqa)'}")
    if mask is not None:
        mask, target = tuple(mask), scores + (q[-2], k[-2])
        if broadcast_shapes(mask, target) != target:
            return None, (f"attn_mask: shape {mask} cannot broadcast to the scores' shape {target} (query's and "
                          f"key's batch dimensions, L, S)")
    return out + (q[-2], v[-1]), None


def _pytorch_skips_shapes(q, v) -> bool:
    """PyTorch returns zeros of q.shape[:-1] + (Ev,) without checking any shape when L == 0 or value has no elements
    (attnforge checks and broadcasts as always: docs/PYTORCH.md)."""
    numel = 1
    for size in v:
        numel *= size
    return len(q) >= 2 and len(v) >= 1 and (q[-2] == 0 or numel == 0)


def shape_refusal(call):
    """Why attnforge would not give PyTorch's result for this call's shapes (None when it would): the broadcasting
    rule, the kernels' head dims, and PyTorch's unchecked empty calls."""
    q, k, v = (tuple(t.shape) for t in call.qkv)
    mask = tuple(call.attn_mask.shape) if call.attn_mask is not None else None
    out, why = sdpa_shapes(q, k, v, mask, call.enable_gqa)
    if _pytorch_skips_shapes(q, v) and out != q[:-1] + v[-1:]:
        return (f"PyTorch returns zeros of shape {q[:-1] + v[-1:]} for a call with no query rows or an empty value, "
                f"without checking shapes; attnforge's {'output is ' + str(out) if out else why}")
    if why is not None:
        return why
    if not 1 <= q[-1] <= _MAX_HEAD_DIM or v[-1] > _MAX_HEAD_DIM:
        return f"head dimensions {q[-1]} (query/key) and {v[-1]} (value): attnforge runs 1..{_MAX_HEAD_DIM}"
    return None


def bind(args, kwargs):
    """(Call, None), or (None, why) when the arguments do not bind as SDPA's (the reason for the DEBUG log)."""
    try:
        return Call(args, kwargs), None
    except TypeError as e:
        return None, str(e)


def refusal(call, torch):
    """Why attnforge cannot compute this bound SDPA call (a string for the DEBUG log), or None when it can: q/k/v
    float32/float16/bfloat16 torch tensors of one dtype on one CPU or CUDA device whose shapes follow PyTorch's
    broadcasting rule (sdpa_shapes; any rank from 2), a bool mask or one of query's dtype not set with is_causal,
    a finite scale, no dropout; a call that needs a gradient on the CPU, with none for the mask (the backward pass
    runs on the CPU only and gives the mask no gradient). Whatever passes here attnforge computes as PyTorch does, so a
    provider that prepares on it never fails at run time."""
    for name, t in zip(_QKV_NAMES, call.qkv):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor"
    q = call.query
    if str(q.dtype) not in _FLOAT_DTYPES:
        return f"query dtype {q.dtype} is not float32, float16 or bfloat16"
    for name, t in zip(_QKV_NAMES[1:], call.qkv[1:]):
        if t.dtype != q.dtype:
            return f"{name} dtype {t.dtype} does not match query's {q.dtype}"
    if q.device.type not in ("cpu", "cuda"):
        return f"query is on {q.device.type}, attnforge runs on cpu and cuda"
    tensors = list(call.qkv)
    if call.attn_mask is not None:
        if not isinstance(call.attn_mask, torch.Tensor):
            return "attn_mask is not a torch.Tensor"
        if call.attn_mask.dtype != torch.bool and call.attn_mask.dtype != q.dtype:
            return f"attn_mask dtype {call.attn_mask.dtype} is neither bool nor query's {q.dtype}"
        tensors.append(call.attn_mask)
    for t in tensors[1:]:
        if t.device != q.device:
            return f"tensors on different devices: query {_device_name(q.device)}, another {_device_name(t.device)}"
    if call.dropout_p != 0.0:
        return f"dropout_p = {call.dropout_p} (attnforge runs no dropout)"
    if call.attn_mask is not None and call.is_causal:
        return "attn_mask is set together with is_causal (PyTorch refuses it too)"
    if call.scale is not None and not _finite(call.scale):
        return f"scale = {call.scale} is not finite"
    why = shape_refusal(call)
    if why is not None:
        return why
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if q.device.type != "cpu":
            return (f"the call needs autograd on {_device_name(q.device)} (attnforge's backward pass runs on the "
                    "CPU only)")
        if call.attn_mask is not None and call.attn_mask.requires_grad:
            return "attn_mask requires grad (attnforge's backward pass computes no gradient for the mask)"
    return None


def _finite(x) -> bool:
    try:
        return abs(float(x)) != float("inf") and float(x) == float(x)
    except (TypeError, ValueError):
        return False


class PlanView:
    """The fields of a plan the per-call guard reads, and the plan's JSON (what the provider operator carries)."""

    def __init__(self, plan: dict, plan_json: str, cpu_stands_for_cuda: bool = False):
        self.json = plan_json
        self.cpu_stands_for_cuda = cpu_stands_for_cuda   # the fa4 tests' hook (_fa4.testing.cpu_as_cuda)
        self.backend = plan["backend"]
        self.keyword_qkv = plan["qkv_source"] == "keyword_qkv"
        kwargs = plan["flash_kwargs"]
        self.causal = bool(kwargs.get("causal", False))
        self.scale = kwargs.get("softmax_scale")
        self.gqa = "pack_gqa" in kwargs
        self.copy_free = bool(plan["copy_free_layout"])

    def mismatch(self, call: Call):
        """Why the plan does not cover the call, in the C guard's words, or None."""
        if any(t.dim() != 4 for t in call.qkv):
            return "q/k/v are not three 4-D tensors"
        names = [_device_name(t.device) for t in call.qkv]
        if len(set(names)) != 1:
            return f"q/k/v are on different devices: query {names[0]}, key {names[1]}, value {names[2]}"
        on_cuda = call.query.device.type == "cuda" or (self.cpu_stands_for_cuda and call.query.device.type == "cpu")
        if on_cuda != (self.backend != "cpu"):
            return f"query, key and value are on {names[0]}, the plan runs on {self.backend}"
        if call.keyword_qkv != self.keyword_qkv:
            return (f"q/k/v passed as {_source_name(call.keyword_qkv)}, the plan has "
                    f"{_source_name(self.keyword_qkv)}")
        if call.attn_mask is not None:
            return "the call has an attn_mask"
        if call.dropout_p != 0.0:
            return "the call has dropout_p != 0"
        if call.is_causal != self.causal:
            return f"is_causal is {str(call.is_causal).lower()}, the plan's is {str(self.causal).lower()}"
        if (call.scale is None) != (self.scale is None) or (call.scale is not None and
                                                            float(call.scale) != float(self.scale)):
            return f"scale is {_scale_text(call.scale)}, the plan's is {_scale_text(self.scale)}"
        gqa = call.query.shape[1] != call.key.shape[1]
        if gqa != self.gqa:
            return (f"query has {call.query.shape[1]} heads and key {call.key.shape[1]}: "
                    f"{'grouped-query' if gqa else 'not grouped-query'}, the plan is "
                    f"{'grouped-query' if self.gqa else 'not'}")
        if gqa and not call.enable_gqa:
            return "grouped-query heads without enable_gqa"
        if self.copy_free:
            for name, t in zip(_QKV_NAMES, call.qkv):
                if not _nhd_contiguous(t.shape, t.stride()):
                    return f"{name} is no longer an HND view of NHD-contiguous memory (the plan is copy-free)"
        return None


def _source_name(keyword: bool) -> str:
    return "keyword_qkv" if keyword else "positional_qkv"


def _scale_text(scale) -> str:
    return "None" if scale is None else "%.17g" % float(scale)   # as the C guard prints it
