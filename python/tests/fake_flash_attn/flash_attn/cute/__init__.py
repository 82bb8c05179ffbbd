"""Stand-in for FlashAttention-4's flash_attn.cute (see ../../README.md): records each flash_attn_func call and computes
FA4's documented forward semantics with torch on the CPU. Tests only; it is not FlashAttention-4."""
import math

import torch

__version__ = "4.0.0b27"

calls = []   # one dict per flash_attn_func call, oldest first


def _described(t):
    return {"shape": tuple(t.shape), "strides": tuple(t.stride()), "data_ptr": t.data_ptr(), "dtype": t.dtype,
            "device": t.device}


def _resolve_window(causal, left, right):
    """FA4's normalisation: causal is right = 0; a window whose sides sum below 0 is none; (None, 0) is causal."""
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right == 0:
        return True, None, 0
    return False, left, right


def _visible(seq_q, seq_k, left, right):
    """(L, S) bool: query row i sees key j (bottom-right aligned: row i's diagonal is key i + S - L)."""
    i = torch.arange(seq_q).unsqueeze(1)
    j = torch.arange(seq_k).unsqueeze(0)
    diagonal = i + seq_k - seq_q
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if right is not None:
        visible &= j <= diagonal + right
    if left is not None:
        visible &= j >= diagonal - left
    return visible


def flash_attn_func(q, k, v, **kwargs):
    """q (B, L, H, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv) -> (out (B, L, H, Dv), lse (B, H, L) or None)."""
    calls.append({"q": _described(q), "k": _described(k), "v": _described(v), "kwargs": dict(kwargs)})
    known = {"softmax_scale", "causal", "window_size", "pack_gqa", "return_lse", "softcap", "num_splits",
             "deterministic", "learnable_sink"}
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(f"flash_attn_func() got unexpected keyword arguments {sorted(unknown)}")
    if kwargs.get("learnable_sink") is not None or kwargs.get("softcap", 0.0):
        raise NotImplementedError("the stand-in computes no sink and no softcap")
    assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype, "inputs must have the same dtype"
    batch, seq_q, heads, head_dim = q.shape
    _, seq_k, heads_kv, head_dim_v = v.shape
    assert k.shape == (batch, seq_k, heads_kv, head_dim)
    assert heads % heads_kv == 0, "num_head must be divisible by num_head_kv"
    assert head_dim % 8 == 0 and head_dim_v % 8 == 0, "head_dim must be divisible by 8"
    left, right = kwargs.get("window_size", (None, None))
    causal, left, right = _resolve_window(bool(kwargs.get("causal", False)), left, right)
    scale = kwargs.get("softmax_scale")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    group = heads // heads_kv
    qf = q.float().permute(0, 2, 1, 3)                                     # (B, H, L, D)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)     # q head h reads kv head h // group
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    visible = _visible(seq_q, seq_k, left, right)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # -inf for a row that sees no key
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(weights, vf)                                        # (B, H, L, Dv); 0 for such a row
    out = out.permute(0, 2, 1, 3).contiguous().to(q.dtype)
    return out, (lse.contiguous() if kwargs.get("return_lse", False) else None)
