"""One SDPA call as the C library takes it (af_sdpa): the layout of a call of any rank (PyTorch's broadcasting
rule), its outputs allocated and the C call made. The kernel of attnforge::sdpa (_ops) and the NumPy path of
attnforge.scaled_dot_product_attention (_sdpa), below both: it imports neither."""
import math

from . import _C
from ._guard import plain_4d_shape, sdpa_shapes
from ._tensors import call_stream, call_workspace, exportable, is_torch_tensor, new_lse, new_output


def _shape(x):
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else None


def _reshape(t, shape):
    return t.reshape(shape)   # torch and NumPy alike: a view where the strides allow, else a copy


def _expand(t, shape):
    if is_torch_tensor(t):
        return t.expand(shape)
    import numpy
    return numpy.broadcast_to(t, shape)


def _repeat_heads(t, repeats):
    if is_torch_tensor(t):
        return t.repeat_interleave(repeats, dim=-3)
    import numpy
    return numpy.repeat(t, repeats, axis=-3)


def _merge_batch(t, rank, lead):
    """t as 4-D for an output with batch dims `lead` (all but the head dim): t is padded to `rank` dims (a view), then
    its leading dims become one: 1 when they are all 1 (the C library broadcasts it), else lead's product. Merging is
    a view when the strides allow; where only some of t's leading dims are 1, they are expanded first and the merge
    copies (a zero stride beside a non-zero one is no single stride)."""
    shape = _shape(t)
    padded = ((1,) * rank + shape)[-rank:]   # a mask's extra leading dims are 1 (sdpa_shapes checked): dropped
    t = _reshape(t, padded)
    own, tail = padded[:rank - 3], padded[rank - 3:]
    if all(size == 1 for size in own):
        return _reshape(t, (1,) + tail)
    if own != lead:
        t = _expand(t, lead + tail)
    return _reshape(t, (math.prod(lead),) + tail)


class Layout:
    """A call as the C library takes it: q/k/v (and the mask) 4-D (B, H, rows, cols), and the output's shape.

    PyTorch's rule (_guard.sdpa_shapes) allows any rank from 2 and broadcasting of every leading dim. Calls of rank up
    to 4 are padded with leading size-1 dims (views; the C library broadcasts size-1 batch and head dims); higher
    ranks have their batch dims (all but the head dim) merged into one (_merge_batch). Under enable_gqa, key and value
    with different group sizes (neither of them one head) get their heads repeated up to the least common multiple
    (a copy; the kernels read key and value with one group size)."""

    def __init__(self, query, key, value, attn_mask, enable_gqa):
        self.query, self.key, self.value, self.attn_mask = query, key, value, attn_mask
        shapes = [_shape(t) for t in (query, key, value)]
        mask = _shape(attn_mask) if attn_mask is not None else None
        self.out_shape = self.shape4 = None
        if any(s is None for s in shapes) or (attn_mask is not None and mask is None):
            self.shape4 = (0, 0, 0, 0)   # not arrays: the C binding names the argument
            return
        if mask is None or 1 <= len(mask) <= 4:   # the common call: no rule to apply in Python (the C checks the mask)
            self.shape4 = plain_4d_shape(*shapes, enable_gqa)
            if self.shape4 is not None:
                return
        out, why = sdpa_shapes(*shapes, mask, enable_gqa)
        four_d = all(len(s) == 4 for s in shapes) and (mask is None or len(mask) <= 4)
        if why is not None:
            if not four_d:
                raise _C.InvalidArgumentError(why)
            # 4-D: the C checks name the broken rule; out as broadcast without the mask, or query's shape
            out = sdpa_shapes(*shapes, None, enable_gqa)[0] or shapes[0][:2] + (shapes[0][2], shapes[2][3])
            self.shape4 = out
            return
        self.out_shape = out
        if enable_gqa:
            self._same_group_size()
        if four_d:
            self.shape4 = out
            return
        rank = max(len(out), 4)
        padded_out = (1,) * (rank - len(out)) + out
        lead = padded_out[:rank - 3]
        self.query, self.key, self.value = (_merge_batch(t, rank, lead) for t in (self.query, self.key, self.value))
        if attn_mask is not None and (len(mask) > 4 or rank > 4):
            self.attn_mask = _merge_batch(attn_mask, rank, lead)
        self.shape4 = (math.prod(lead),) + padded_out[rank - 3:]

    def _same_group_size(self):
        hk, hv = self.key.shape[-3], self.value.shape[-3]
        if hk == hv or hk == 1 or hv == 1:
            return
        heads = math.lcm(hk, hv)   # divides query's heads: both do
        if hk != heads:
            self.key = _repeat_heads(self.key, heads // hk)
        if hv != heads:
            self.value = _repeat_heads(self.value, heads // hv)

    def out_4d(self, out):
        """The caller's out (the output's shape) as the 4-D view the C library writes; it must be one (no copy)."""
        if self.out_shape is None or len(self.out_shape) == 4:
            return out
        if is_torch_tensor(out):
            try:
                return out.view(self.shape4)
            except RuntimeError as e:
                raise _C.InvalidArgumentError(f"out: cannot be viewed as the 4-D {self.shape4} attnforge writes ({e})") \
                    from None
        view = out.view()
        try:
            view.shape = self.shape4   # NumPy raises rather than copy
        except AttributeError as e:
            raise _C.InvalidArgumentError(f"out: cannot be viewed as the 4-D {self.shape4} attnforge writes ({e})") \
                from None
        return view

    def from_4d(self, out4):
        """The 4-D output as the call's own shape (a view: only size-1 dims go, or the batch dim splits)."""
        if self.out_shape is None or len(self.out_shape) == 4:
            return out4
        return out4.view(self.out_shape) if is_torch_tensor(out4) else out4.reshape(self.out_shape)

    def lse_from_4d(self, lse4):
        if self.out_shape is None or len(self.out_shape) == 4:
            return lse4
        shape = self.out_shape[:-1]
        return lse4.view(shape) if is_torch_tensor(lse4) else lse4.reshape(shape)


def layout(query, key, value, attn_mask=None, enable_gqa=False):
    return Layout(query, key, value, attn_mask, enable_gqa)


def run(reference, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right,
        out, return_lse):
    query, key, value, attn_mask = exportable(query), exportable(key), exportable(value), exportable(attn_mask)
    call = Layout(query, key, value, attn_mask, enable_gqa)
    out4 = new_output(query, call.shape4) if out is None else call.out_4d(out)
    lse4 = new_lse(query, call.shape4[:3]) if return_lse else None
    kwargs = {"attn_mask": call.attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
              "enable_gqa": enable_gqa}
    _C.sdpa((call.query, call.key, call.value), kwargs, out4, lse4, causal_bottom_right, reference,
            call_stream(query), call_workspace(query))
    result = out if out is not None else call.from_4d(out4)
    return (result, call.lse_from_4d(lse4)) if return_lse else result
