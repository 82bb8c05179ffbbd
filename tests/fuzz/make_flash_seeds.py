#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_flash_args: a few valid calls in the harness's byte format."""
import os, random, struct

def ext(n):            # a small extent 0..7 as the harness decodes it (top 3 bits >= 2)
    return 0x40 | n

def contiguous(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.insert(0, acc)
        acc *= max(n, 1)
    return st

def floats(n):
    return b''.join(struct.pack('<f', random.uniform(-2, 2)) for _ in range(n))

F16, F8E4M3, F8E5M2 = 1, 5, 6   # af_dtype codes (0 = f32)

def view(shape, values=None, int32=False, dtype=0):
    """f32 (or int32: one byte per element, value = byte as int8 / 4; or another float dtype code) contiguous view."""
    head = bytes([0x30 if int32 else dtype]) + bytes(ext(s) for s in shape) + bytes(ext(s) for s in contiguous(shape))
    n = 1
    for s in shape:
        n *= s
    if int32:
        return head + bytes((4 * x) & 0xff for x in values) + bytes(max(0, 1 - n))
    if dtype == F16:
        return head + b''.join(struct.pack('<e', random.uniform(-2, 2)) for _ in range(max(n, 2)))
    if dtype in (F8E4M3, F8E5M2):   # any byte: NaN, Inf (e5m2), subnormals included
        return head + bytes(random.randrange(256) for _ in range(max(n, 4)))
    return head + floats(max(n, 1))

def scalars(flags, left=0, right=0, scale=16, softcap=0, max_q=0, max_k=0):
    return bytes([flags, left & 0xff, right & 0xff, scale, softcap, max_q, max_k])

random.seed(2)
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'corpus', 'flash_args')
os.makedirs(here, exist_ok=True)
dummy = view([1], [0], int32=True)
seeds = {
    # fixed NHD: q (1, 2, 1, 2), k/v (1, 3, 1, 2), sink, causal + window, softcap, lse
    'fixed_window_softcap_sink': bytes([0]) + view([1, 2, 1, 2]) + view([1, 3, 1, 2]) + view([1, 3, 1, 2]) +
        view([1]) + dummy + dummy + dummy + view([1, 1], [0], int32=True) + view([1, 2, 1, 2]) + view([1, 1, 2]) +
        scalars(0x01 | 0x02 | 0x08 | 0x10 | 0x80, left=1, right=-1, softcap=20),
    # varlen q (3, 1, 2) with cu_seqlens_q [0, 1, 3]; paged k/v (2 pages of 2) with seqused_k [2, 3]
    'varlen_q_paged': bytes([1 | 4]) + view([3, 1, 2]) + view([2, 2, 1, 2]) + view([2, 2, 1, 2]) + view([1]) +
        view([3], [0, 1, 3], int32=True) + dummy + view([2], [2, 3], int32=True) +
        view([2, 2], [1, 0, 0, 1], int32=True) + view([3, 1, 2]) + view([1, 3]) +
        scalars(0x01 | 0x10 | 0x20 | 0x80, max_q=2),
    # varlen q and k: q (3, 1, 2), k/v (4, 1, 2), cu_seqlens_k [0, 3, 4]
    'varlen_qk': bytes([1 | 2]) + view([3, 1, 2]) + view([4, 1, 2]) + view([4, 1, 2]) + view([1]) +
        view([3], [0, 2, 3], int32=True) + view([3], [0, 3, 4], int32=True) + dummy + view([1, 1], [0], int32=True) +
        view([3, 1, 2]) + view([1, 3]) + scalars(0x02 | 0x80, left=0, right=1, max_q=2, max_k=3),
    # float8 K/V under an f16 q: q (1, 1, 2, 4), k/v e4m3 (1, 5, 1, 4), out f16, all three descales (1, 1)
    'f8_kv_descales': bytes([0]) + view([1, 1, 2, 4], dtype=F16) + view([1, 5, 1, 4], dtype=F8E4M3) +
        view([1, 5, 1, 4], dtype=F8E4M3) + view([1]) + dummy + dummy + dummy + view([1, 1], [0], int32=True) +
        view([1, 1, 2, 4], dtype=F16) + view([1, 2, 1]) + scalars(0x80) + view([1, 1]) + view([1, 1]) +
        view([1, 1]) + bytes([7]),
    # all-float8 e5m2 q/k/v, out f32, k_descale only
    'f8_all_e5m2': bytes([0]) + view([1, 2, 1, 4], dtype=F8E5M2) + view([1, 3, 1, 4], dtype=F8E5M2) +
        view([1, 3, 1, 4], dtype=F8E5M2) + view([1]) + dummy + dummy + dummy + view([1, 1], [0], int32=True) +
        view([1, 2, 1, 4]) + view([1, 1, 2]) + scalars(0x01 | 0x80) + view([1, 1]) + view([1, 1]) + view([1, 1]) +
        bytes([2]),
}
for name, data in seeds.items():
    open(os.path.join(here, name), 'wb').write(data)
