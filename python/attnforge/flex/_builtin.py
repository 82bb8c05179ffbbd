"""Built-in mods: the common score_mods and mask_mods declared from Python with their programs written out, so nothing
is traced (no make_fx, not even on a process's first call). Each is also the plain torch function it stands for, so
torch's own flex_attention and create_block_mask take it too, and each combines with and_masks / or_masks.

    from attnforge.flex import builtin
    mask = builtin.and_masks(builtin.causal(), builtin.document(doc_ids))
    out = attnforge.flex_attention(q, k, v, score_mod=builtin.alibi(slopes),
                                   block_mask=attnforge.create_block_mask(mask, 1, 1, L, L))
"""
import inspect

import torch

from .._mod_trace import INPUTS, OP, Program

SCORE, B, H, Q, KV = range(INPUTS)


class BuiltinMod:
    """A score_mod or mask_mod with its program: called, it is `fn` (torch operations); traced, it is `program`."""

    def __init__(self, name, fn, program):
        self.__name__ = self.__qualname__ = name
        self.fn, self.program = fn, program
        self.__signature__ = inspect.signature(fn)   # what torch's flex inspects to tell a score_mod from a mask_mod

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self):
        return f"attnforge.flex.builtin.{self.__name__}"


class _Asm:
    """A program written by hand: each op appends one instruction and returns its register."""

    def __init__(self, score):
        self.score, self.code, self.aux = score, [], []

    def op(self, name, *ins, aux=0, imm=0.0):
        regs = list(ins) + [0] * (4 - len(ins))
        self.code.append((OP[name], *regs, aux, float(imm)))
        return INPUTS + len(self.code) - 1

    def i32(self, value):
        return self.op("CONST_I32", imm=int(value))

    def f32(self, value):
        return self.op("CONST_F32", imm=float(value))

    def load(self, tensor, *indices):
        self.aux.append(tensor)
        return self.op("LOAD", *indices, aux=len(self.aux) - 1)

    def program(self):
        return Program(self.code, self.aux, self.score)


def _score(name, fn, build):
    asm = _Asm(score=True)
    build(asm)
    return BuiltinMod(name, fn, asm.program())


def _mask(name, fn, build):
    asm = _Asm(score=False)
    build(asm)
    return BuiltinMod(name, fn, asm.program())


def _tensor(t, name, dim):
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        raise TypeError(f"{name}: expected a {dim}-D torch.Tensor")
    return t


# ---------------------------------------------------------------- score_mods

def alibi(slopes):
    """ALiBi: score + slopes[h] · (kv_idx - q_idx); slopes (H,), learnable (its gradient is computed)."""
    _tensor(slopes, "slopes", 1)

    def fn(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def build(a):
        a.op("ADD", SCORE, a.op("MUL", a.load(slopes, H), a.op("TO_F32", a.op("SUB", KV, Q))))

    return _score("alibi", fn, build)


_INDEX = {"b": B, "h": H, "q": Q, "kv": KV}


def bias(table, *dims, rel_offset=0):
    """score + table[dims...], each dim one of "b", "h", "q", "kv" or "rel" (kv_idx - q_idx + rel_offset: a
    relative-position table); the table is learnable."""
    _tensor(table, "table", len(dims))
    if not dims or any(d not in (*_INDEX, "rel") for d in dims):
        raise ValueError(f"dims: {dims}; each must be one of 'b', 'h', 'q', 'kv', 'rel'")

    def index(d, b, h, q_idx, kv_idx):
        return {"b": b, "h": h, "q": q_idx, "kv": kv_idx}[d] if d != "rel" else kv_idx - q_idx + rel_offset

    def fn(score, b, h, q_idx, kv_idx):
        return score + table[tuple(index(d, b, h, q_idx, kv_idx) for d in dims)]

    def build(a):
        regs = []
        for d in dims:
            regs.append(_INDEX[d] if d != "rel" else a.op("ADD", a.op("SUB", KV, Q), a.i32(rel_offset)))
        a.op("ADD", SCORE, a.load(table, *regs))

    return _score("bias", fn, build)


def softcap(cap):
    """cap · tanh(score / cap) (Gemma 2's logit softcapping)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"cap: {cap}; must be > 0")

    cap_t = torch.tensor(cap)   # a tensor, not a Python float: torch's eager flex compiles the mod (no SymFloat)

    def fn(score, b, h, q_idx, kv_idx):
        return cap_t * torch.tanh(score / cap_t)

    def build(a):
        c = a.f32(cap)
        a.op("MUL", a.op("TANH", a.op("DIV", SCORE, c)), c)

    return _score("softcap", fn, build)


# ---------------------------------------------------------------- mask_mods

def causal():
    """q_idx >= kv_idx (top-left aligned, as PyTorch's flex examples)."""
    return _mask("causal", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, lambda a: a.op("GE", Q, KV))


def sliding_window(left, right=0):
    """q_idx - left <= kv_idx <= q_idx + right."""
    left, right = int(left), int(right)

    def fn(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)

    def build(a):   # differences of the indices, which never wrap: the form the kernels' fused band takes
        a.op("AND", a.op("LE", a.op("SUB", Q, KV), a.i32(left)), a.op("LE", a.op("SUB", KV, Q), a.i32(right)))

    return _mask("sliding_window", fn, build)


def chunked(size):
    """q_idx // size == kv_idx // size (Llama 4's chunked attention)."""
    size = int(size)
    if size < 1:
        raise ValueError(f"size: {size}; must be >= 1")

    def build(a):
        c = a.i32(size)
        a.op("EQ", a.op("FLOORDIV", Q, c), a.op("FLOORDIV", KV, c))

    return _mask("chunked", lambda b, h, q_idx, kv_idx: q_idx // size == kv_idx // size, build)


def document(doc_ids):
    """doc_ids[q_idx] == doc_ids[kv_idx]: packed documents, doc_ids (L,) integers."""
    _tensor(doc_ids, "doc_ids", 1)
    ids = doc_ids.to(torch.int32)

    def build(a):
        a.op("EQ", a.load(ids, Q), a.load(ids, KV))

    return _mask("document", lambda b, h, q_idx, kv_idx: doc_ids[q_idx] == doc_ids[kv_idx], build)


def prefix_lm(prefix):
    """kv_idx < prefix or q_idx >= kv_idx: a bidirectional prefix, then causal; prefix an int or a (B,) tensor."""
    if isinstance(prefix, torch.Tensor):
        lengths = _tensor(prefix, "prefix", 1).to(torch.int32)

        def fn(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

        def build(a):
            a.op("OR", a.op("LT", KV, a.load(lengths, B)), a.op("GE", Q, KV))
    else:
        n = int(prefix)

        def fn(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (q_idx >= kv_idx)

        def build(a):
            a.op("OR", a.op("LT", KV, a.i32(n)), a.op("GE", Q, KV))
    return _mask("prefix_lm", fn, build)


def _combine(name, op, mods):
    if not mods or not all(isinstance(m, BuiltinMod) and not m.program.score for m in mods):
        raise TypeError(f"{name}: takes built-in mask_mods (attnforge.flex.builtin); combine other mask_mods "
                        "with torch's and_masks / or_masks, which are traced")
    code, aux, last = [], [], None
    for m in mods:   # each program's registers past the inputs and its aux indices moved past the ones before
        shift, aux_shift = len(code), len(aux)
        for (o, i0, i1, i2, i3, a, imm) in m.program.code:
            regs = [r + shift if r >= INPUTS else r for r in (i0, i1, i2, i3)]
            code.append((o, *regs, a + aux_shift if o == OP["LOAD"] else a, imm))
        aux += list(m.program.aux)
        reg = INPUTS + len(code) - 1
        if last is not None:
            code.append((OP[op], last, reg, 0, 0, 0, 0.0))
            reg = INPUTS + len(code) - 1
        last = reg
    fns = [m.fn for m in mods]

    def fn(b, h, q_idx, kv_idx):
        result = fns[0](b, h, q_idx, kv_idx)
        for f in fns[1:]:
            result = (result & f(b, h, q_idx, kv_idx)) if op == "AND" else (result | f(b, h, q_idx, kv_idx))
        return result

    return BuiltinMod(name, fn, Program(code, aux, False))


def and_masks(*mods):
    """Every mask keeps the key."""
    return _combine("and_masks", "AND", mods)


def or_masks(*mods):
    """Some mask keeps the key."""
    return _combine("or_masks", "OR", mods)
