"""A score_mod / mask_mod written with torch operations, captured into attnforge's program (attnforge.h, af_mod_*):
traced once by make_fx over one-element index tensors into ATen operations, then translated one node at a time into
instructions over typed registers (float32, or int32 for integers and booleans). Captured tensors become the
program's aux tensors, read by reference at each call. What it cannot express raises ModTraceError naming the
operation and where the mod is defined, before any attention work."""
import collections
import inspect

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from . import _C

# attnforge.h's af_mod_op, in order
_OP_NAMES = ("CONST_F32 CONST_I32 ADD SUB MUL DIV FLOORDIV MOD MIN MAX POW NEG ABS SIGN FLOOR CEIL ROUND EXP LOG SQRT "
             "RSQRT TANH SIGMOID ERF SIN COS TAN LT LE GT GE EQ NE AND OR XOR NOT WHERE TO_F32 TO_I32 LOAD").split()
OP = {name: i for i, name in enumerate(_OP_NAMES)}
INPUTS = 5   # registers 0-4: score, b, h, q_idx, kv_idx

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ModTraceError(_C.UnsupportedError):
    """A mod uses something attnforge's programs cannot express."""


class Program:
    """An af_mod_program: code (tuples of op, in0..in3, aux, imm) and its aux tensors."""

    def __init__(self, code, aux, score):
        self.code, self.aux, self.score = code, aux, score

    def as_c(self):
        """(code, aux) as attnforge._C.flex_attn takes a mod: aux in the dtypes the C programs load."""
        return self.code, [_loadable(t) for t in self.aux]


def _loadable(t):
    """A captured tensor as the C LOAD reads it: float32/float16/bfloat16, int32 or bool; 0-d as one element."""
    t = t.detach()   # read, never differentiated here (DLPack takes no tensor that needs a gradient)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype == torch.float64:
        return t.float()
    if t.dtype in (torch.int8, torch.int16, torch.int64, torch.uint8):
        return t.int()
    return t


def _where(fn):
    try:
        return f"{fn.__qualname__} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError):
        return getattr(fn, "__qualname__", repr(fn))


class _Builder:
    def __init__(self, fn, score):
        self.fn, self.score = fn, score
        self.code, self.aux, self.aux_ids = [], [], {}
        self.consts = {}

    def fail(self, what):
        raise ModTraceError(f"{'score_mod' if self.score else 'mask_mod'} {_where(self.fn)}: {what}")

    def emit(self, op, *ins, aux=0, imm=0.0):
        ins = list(ins) + [0] * (4 - len(ins))
        self.code.append((OP[op], ins[0], ins[1], ins[2], ins[3], aux, float(imm)))
        return INPUTS + len(self.code) - 1

    def const(self, value, is_int):
        key = (value, is_int)
        if key not in self.consts:
            if is_int:
                if value != int(value) or not -2**31 <= value < 2**31:
                    self.fail(f"the integer constant {value} does not fit int32")
                self.consts[key] = self.emit("CONST_I32", imm=int(value))
            else:
                self.consts[key] = self.emit("CONST_F32", imm=float(value))
        return self.consts[key]


_CACHE = collections.OrderedDict()   # snapshot ids -> (snapshot, Program), the least recently used first
_CACHE_ENTRIES = 64                  # programs kept at most


def _names(code):
    """The global names a code object and the functions defined inside it look up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _snapshot(fn, depth=0):
    """What a trace of fn bakes in besides its code: the objects its closure cells, defaults and the globals it names
    hold now, and (a few levels down) those of the Python functions among them; None when fn is not a plain
    function (a functools.partial, a callable object), which is then traced at every call."""
    code = getattr(fn, "__code__", None)
    if code is None or not hasattr(fn, "__globals__"):
        return None
    try:
        cells = tuple(c.cell_contents for c in (fn.__closure__ or ()))
    except ValueError:   # a cell not yet filled
        return None
    g = fn.__globals__
    held = cells + tuple(g[n] for n in sorted(_names(code)) if n in g)
    nested = []
    if depth < 3:
        for obj in held:
            for f in (obj if isinstance(obj, (tuple, list)) else (obj,)):
                if callable(f) and hasattr(f, "__code__"):
                    nested.append(_snapshot(f, depth + 1))
    return (code, held, fn.__defaults__, fn.__kwdefaults__, tuple(nested))


def _ids(snap):
    """A snapshot as the identities of what it holds: while the cache keeps a snapshot alive, no other object can
    have one of its ids, so equal ids mean the very same objects."""
    if snap is None:
        return None
    code, held, defaults, kwdefaults, nested = snap
    return (id(code), tuple(id(x) for x in held), id(defaults), id(kwdefaults), tuple(_ids(n) for n in nested))


def trace(fn, score):
    """fn's Program, traced once per function and what it refers to: the same function, with the same objects in its
    closure, defaults and the globals it names (a tensor updated in place included: programs read captured tensors
    at each call), gets the Program of its first trace; any of those rebound traces it again. A Python container
    or number changed in place without being rebound is not noticed. score: a score_mod (score, b, h, q_idx,
    kv_idx) rather than a mask_mod (b, h, q_idx, kv_idx)."""
    program = getattr(fn, "program", None)   # a built-in mod (_builtin) carries its program: nothing to trace
    if isinstance(program, Program):
        if program.score != score:
            raise ModTraceError(f"{getattr(fn, '__name__', fn)}: a built-in {'score' if program.score else 'mask'}"
                                f"_mod where a {'score' if score else 'mask'}_mod is expected")
        return program
    snap = _snapshot(fn)
    if snap is None:
        return _trace(fn, score)
    key = (_ids(snap), score)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit[1]
    program = _trace(fn, score)
    _CACHE[key] = (snap, program)
    if len(_CACHE) > _CACHE_ENTRIES:
        _CACHE.popitem(last=False)
    return program


def _trace(fn, score):
    """fn's Program, traced now."""
    ints = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    args = ([torch.zeros(1, dtype=torch.float32)] if score else []) + ints
    builder = _Builder(fn, score)
    try:
        graph = make_fx(fn)(*args)
    except ModTraceError:
        raise
    except Exception as exc:   # data-dependent control flow, .item(), an unsupported Python construct
        builder.fail(f"cannot be traced over tensors ({type(exc).__name__}: {str(exc).splitlines()[0]}); a mod must "
                     "be torch operations on its arguments, without Python branches on their values")
    values = {}   # fx node -> (register, is_int) or ("tensor", aux index) or a Python constant
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    first = 0 if score else 1
    for k, node in enumerate(placeholders):
        values[node] = (first + k, k + first > 0)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            t = getattr(graph, node.target)
            key = id(t)
            if key not in builder.aux_ids:
                builder.aux_ids[key] = len(builder.aux)
                builder.aux.append(t)
            values[node] = ("tensor", builder.aux_ids[key])
            continue
        if node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            reg, is_int = _value(builder, values, out)
            if score and is_int:
                reg = builder.emit("TO_F32", reg)
            if not score and not is_int:
                builder.fail("returns a floating-point value; a mask_mod returns a boolean")
            if reg < INPUTS or builder.code and reg != INPUTS + len(builder.code) - 1:
                reg = _copy(builder, reg, is_int and not score)
            return Program(builder.code, builder.aux, score)
        values[node] = _translate(builder, values, node)
    builder.fail("has no output")


def _copy(builder, reg, is_int):
    """The value of `reg` again as the last instruction (the program's result is its last register)."""
    return builder.emit("MAX", reg, reg) if is_int else builder.emit("ADD", reg, builder.const(0.0, False))


def _value(builder, values, arg, want_int=None):
    """(register, is_int) of an fx argument: a node's value or a Python number (a constant of the wanted type)."""
    if isinstance(arg, torch.fx.Node):
        v = values[arg]
        if v[0] == "tensor":
            t = builder.aux[v[1]]
            if t.numel() != 1:
                builder.fail("uses a captured tensor of several elements as a whole; index it with the mod's "
                             "arguments instead")
            # a one-element tensor (a learnable scalar, a constant made inside the mod): read at each call
            return builder.emit("LOAD", *[builder.const(0, True)] * max(t.dim(), 1), aux=v[1]), \
                t.dtype in _INT_DTYPES
        return v
    if isinstance(arg, bool):
        return builder.const(int(arg), True), True
    if isinstance(arg, int):
        if want_int is False:
            return builder.const(float(arg), False), False
        return builder.const(arg, True), True
    if isinstance(arg, float):
        return builder.const(arg, False), False
    builder.fail(f"uses {arg!r} where attnforge expects a tensor or a number")


def _as(builder, reg, is_int, want_int):
    if is_int == want_int:
        return reg
    return builder.emit("TO_I32" if want_int else "TO_F32", reg)


def _pair(builder, values, a, b):
    """(ra, ia, rb, ib): a Python number takes the other operand's type."""
    if isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
        ra, ia = _value(builder, values, a)
        rb, ib = _value(builder, values, b, want_int=ia)
    else:
        rb, ib = _value(builder, values, b)
        ra, ia = _value(builder, values, a, want_int=ib)
    return ra, ia, rb, ib


def _binary(builder, values, a, b, op, float_only=False):
    """Both operands in one type (PyTorch's promotion: int with float -> float), then op."""
    ra, ia, rb, ib = _pair(builder, values, a, b)
    is_int = ia and ib and not float_only
    return builder.emit(op, _as(builder, ra, ia, is_int), _as(builder, rb, ib, is_int)), is_int


_UNARY_FLOAT = {"exp": "EXP", "log": "LOG", "sqrt": "SQRT", "rsqrt": "RSQRT", "tanh": "TANH", "sigmoid": "SIGMOID",
                "erf": "ERF", "sin": "SIN", "cos": "COS", "tan": "TAN", "floor": "FLOOR", "ceil": "CEIL",
                "round": "ROUND"}
_UNARY_ANY = {"neg": "NEG", "abs": "ABS", "sign": "SIGN"}
_BINARY = {"add": "ADD", "sub": "SUB", "mul": "MUL", "floor_divide": "FLOORDIV", "remainder": "MOD",
           "minimum": "MIN", "maximum": "MAX"}
_COMPARE = {"lt": "LT", "le": "LE", "gt": "GT", "ge": "GE", "eq": "EQ", "ne": "NE"}
_LOGIC = {"bitwise_and": "AND", "bitwise_or": "OR", "bitwise_xor": "XOR", "logical_and": "AND", "logical_or": "OR",
          "logical_xor": "XOR"}
_IDENTITY = {"lift_fresh_copy", "clone", "alias", "detach", "view", "expand", "unsqueeze", "squeeze", "reshape",
             "_unsafe_view", "contiguous"}


def _bool_of(builder, reg, is_int):
    """A 0 / 1 int32 from any value (nonzero is true)."""
    zero = builder.const(0, True) if is_int else builder.const(0.0, False)
    return builder.emit("NE", reg, zero)


def _translate(builder, values, node):
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        builder.fail(f"uses {node.target}, which attnforge's programs cannot express")
    name = node.target.overloadpacket.__name__.rstrip("_")
    args, kwargs = node.args, node.kwargs
    val = node.meta.get("val")
    if name in _IDENTITY:
        if val is not None and val.numel() != 1:
            builder.fail(f"uses {name} to make a value of {val.numel()} elements; a mod computes one value")
        return values[args[0]] if isinstance(args[0], torch.fx.Node) else _value(builder, values, args[0])
    if name in _UNARY_FLOAT:
        r, i = _value(builder, values, args[0])
        return builder.emit(_UNARY_FLOAT[name], _as(builder, r, i, False)), False
    if name in _UNARY_ANY:
        r, i = _value(builder, values, args[0])
        return builder.emit(_UNARY_ANY[name], r), i
    if name in ("add", "sub") and kwargs.get("alpha", 1) != 1:
        builder.fail(f"uses {name} with alpha={kwargs['alpha']}; multiply explicitly")
    if name in _BINARY:
        return _binary(builder, values, args[0], args[1], _BINARY[name])
    if name == "rsub":
        return _binary(builder, values, args[1], args[0], "SUB")
    if name == "div":
        mode = kwargs.get("rounding_mode")
        if mode == "floor":
            return _binary(builder, values, args[0], args[1], "FLOORDIV")
        if mode is not None:
            builder.fail(f"uses div with rounding_mode={mode!r}; only true and floor division are expressed")
        return _binary(builder, values, args[0], args[1], "DIV", float_only=True)
    if name == "pow":
        return _binary(builder, values, args[0], args[1], "POW", float_only=True)
    if name in _COMPARE:
        reg, _ = _binary(builder, values, args[0], args[1], _COMPARE[name])
        return reg, True
    if name in _LOGIC:
        ra, ia, rb, ib = _pair(builder, values, args[0], args[1])
        if name.startswith("logical"):   # nonzero is true, whatever the type
            ra, rb = _bool_of(builder, ra, ia), _bool_of(builder, rb, ib)
        elif not (ia and ib):
            builder.fail(f"uses {name} on floating-point values")
        return builder.emit(_LOGIC[name], ra, rb), True
    if name in ("logical_not", "bitwise_not"):
        r, i = _value(builder, values, args[0])
        if name == "bitwise_not" and (val is None or val.dtype != torch.bool):
            builder.fail("uses bitwise_not on integers; only booleans are negated")
        return builder.emit("NOT", r if i else _bool_of(builder, r, i)), True
    if name == "where":
        rc, ic = _value(builder, values, args[0])
        cond = rc if ic else _bool_of(builder, rc, ic)
        ra, rb_is = _value(builder, values, args[1], want_int=None)
        rb, ib = _value(builder, values, args[2], want_int=rb_is)
        if not isinstance(args[1], torch.fx.Node) and isinstance(args[2], torch.fx.Node):   # where(c, 0.0, x)
            ra, rb_is = _value(builder, values, args[1], want_int=ib)
        is_int = rb_is and ib
        return builder.emit("WHERE", cond, _as(builder, ra, rb_is, is_int), _as(builder, rb, ib, is_int)), is_int
    if name in ("clamp", "clamp_min", "clamp_max"):
        r, i = _value(builder, values, args[0])
        lo = args[1] if name != "clamp_max" else None
        hi = args[2] if name == "clamp" and len(args) > 2 else (args[1] if name == "clamp_max" else None)
        lo, hi = kwargs.get("min", lo), kwargs.get("max", hi)
        if lo is not None:
            r, i = _binary_reg(builder, values, r, i, lo, "MAX")
        if hi is not None:
            r, i = _binary_reg(builder, values, r, i, hi, "MIN")
        return r, i
    if name in ("_to_copy", "to", "type_as"):
        dtype = kwargs.get("dtype", val.dtype if val is not None else None)
        r, i = _value(builder, values, args[0])
        if dtype == torch.bool:
            return _bool_of(builder, r, i), True
        if dtype in _INT_DTYPES:
            return _as(builder, r, i, True), True
        if dtype in _FLOAT_DTYPES:
            return _as(builder, r, i, False), False
        builder.fail(f"converts to {dtype}")
    if name in ("zeros_like", "ones_like", "full_like", "scalar_tensor", "full", "new_ones", "new_zeros", "new_full",
                "ones", "zeros"):
        if val is not None and val.numel() != 1:
            builder.fail(f"uses {name} to make a value of {val.numel()} elements; a mod computes one value")
        value = {"zeros_like": 0, "ones_like": 1, "new_ones": 1, "new_zeros": 0, "ones": 1, "zeros": 0}.get(
            name, args[-1] if name in ("full_like", "full", "new_full") else args[0])
        is_int = val is not None and val.dtype in _INT_DTYPES
        return builder.const(int(value) if is_int else float(value), is_int), is_int
    if name == "index":
        return _load(builder, values, args[0], args[1], val)
    if name == "select" and isinstance(args[0], torch.fx.Node) and values[args[0]][0] == "tensor":
        builder.fail("indexes a captured tensor with a Python number; index it with the mod's arguments")
    builder.fail(f"uses {node.target}, which attnforge's programs cannot express")


def _binary_reg(builder, values, reg, is_int, other, op):
    ro, io = _value(builder, values, other, want_int=is_int)
    both = is_int and io
    return builder.emit(op, _as(builder, reg, is_int, both), _as(builder, ro, io, both)), both


def _load(builder, values, tensor_arg, indices, val):
    if not isinstance(tensor_arg, torch.fx.Node) or values[tensor_arg][0] != "tensor":
        builder.fail("indexes a computed value; only captured tensors can be indexed")
    aux = values[tensor_arg][1]
    t = builder.aux[aux]
    if any(i is None for i in indices) or len(indices) != t.dim():
        builder.fail(f"indexes a captured tensor of {t.dim()} dimensions with {len(indices)} indices; give one "
                     "index per dimension")
    if t.dim() > 4:
        builder.fail("indexes a captured tensor of more than 4 dimensions")
    regs = []
    for d, idx in enumerate(indices):
        r, i = _value(builder, values, idx, want_int=True)
        if not i:
            builder.fail("indexes a captured tensor with a floating-point value")
        # PyTorch's negative indices count from the end
        neg = builder.emit("LT", r, builder.const(0, True))
        wrapped = builder.emit("ADD", r, builder.const(t.shape[d], True))
        regs.append(builder.emit("WHERE", neg, wrapped, r))
    if t.dtype not in _INT_DTYPES + _FLOAT_DTYPES:
        builder.fail(f"reads a captured tensor of {t.dtype}")
    reg = builder.emit("LOAD", *regs, aux=aux)
    return reg, t.dtype in _INT_DTYPES
