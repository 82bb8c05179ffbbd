#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_sdpa_args: a few valid calls in the harness's byte format."""
import os, random, struct

def ext(n):            # a small extent 0..7 as the harness decodes it (top 3 bits >= 2)
    return 0x40 | n

def view(dtype, shape, strides, values):
    b = bytes([dtype]) + bytes(ext(s) for s in shape) + bytes(ext(s) for s in strides)
    reach = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    size = {0: 4, 1: 2, 2: 2, 3: 1}[dtype]
    return b + bytes(values(reach * size))

def contiguous(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.insert(0, acc)
        acc *= max(n, 1)
    return st

def rand_bytes(n):
    out = bytearray()
    while len(out) < n:
        out += struct.pack('<f', random.uniform(-2, 2))
    return bytes(out[:n])

random.seed(1)
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'corpus', 'sdpa_args')
os.makedirs(here, exist_ok=True)
cases = {   # contiguous strides must stay <= 7 to be encodable
    'mha_f32': ([1, 1, 3, 2], [1, 1, 3, 2], [1, 1, 3, 2], 0x00),
    'gqa_causal': ([1, 2, 3, 1], [1, 1, 3, 1], [1, 1, 3, 2], 0x04 | 0x08),
    'bottom_right': ([1, 1, 2, 3], [1, 1, 1, 3], [1, 1, 1, 3], 0x10),
    'with_mask': ([1, 1, 3, 2], [1, 1, 3, 2], [1, 1, 3, 1], 0x01),
}
for name, (qs, ks, vs, flags) in cases.items():
    os_ = [qs[0], qs[1], qs[2], vs[3]]
    data = b''.join(view(0, s, contiguous(s), rand_bytes) for s in (qs, ks, vs, os_))
    data += view(3, [qs[2], ks[2]], contiguous([qs[2], ks[2]]), lambda n: bytes(random.randint(0, 1) for _ in range(n)))
    lse = [qs[0], qs[1], qs[2]]
    data += bytes([0]) + bytes(ext(s) for s in lse) + bytes(ext(s) for s in contiguous(lse)) + rand_bytes(4 * qs[0] * qs[1] * qs[2])
    data += bytes([flags | 0x80, 0x10])
    open(os.path.join(here, name), 'wb').write(data)
