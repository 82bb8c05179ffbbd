#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_backward_args: a few valid backward calls (and one paged, refused) in the harness's
byte format. Shapes are kept so that contiguous strides stay below 8 (the harness's small extents are 0..7)."""
import os, random, struct

def ext(n):            # a small extent 0..7 as the harness decodes it (top 3 bits >= 2)
    assert 0 <= n <= 7
    return 0x40 | n

def contiguous(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.insert(0, acc)
        acc *= max(n, 1)
    return st

def view(shape, values=None, int32=False):
    """f32 (or int32: one byte per element, value = byte as int8 / 4) contiguous view with its data. Kind 0x10 is
    int32 and aligned (0x30 would start the data one byte off the allocation: refused)."""
    head = bytes([0x10 if int32 else 0]) + bytes(ext(s) for s in shape) + bytes(ext(s) for s in contiguous(shape))
    n = 1
    for s in shape:
        n *= s
    if int32:
        return head + bytes((4 * x) & 0xff for x in values) + bytes(max(0, 1 - n))
    return head + b''.join(struct.pack('<f', random.uniform(-2, 2)) for _ in range(max(n, 1)))

DUMMY = bytes([0x80, 1, ext(1), ext(1)]) + struct.pack('<f', 0.0)   # an unused 1-element view

def scalars(flags, left=0, right=0, scale=16, softcap=0, max_q=0, max_k=0, passed=0x0f):
    return bytes([flags, left & 0xff, right & 0xff, scale, softcap, max_q, max_k, passed])

random.seed(36)
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'corpus', 'backward_args')
os.makedirs(here, exist_ok=True)
q, kv, lse = [1, 1, 2, 2], [1, 1, 3, 2], [1, 1, 2]
sdpa = lambda mask, flags, passed: (bytes([0]) + view(q) + view(kv) + view(kv) + view(q) + view(q) + view(lse) +
                                    mask + DUMMY * 5 + view(q) + view(kv) + view(kv) + DUMMY +
                                    scalars(flags, passed=passed))
fq, fkv, flse = [1, 2, 1, 2], [1, 3, 1, 2], [1, 1, 2]          # NHD (B, L, H, D)
pq, pkv, plse = [3, 1, 2], [3, 1, 2], [1, 3]                    # packed varlen (rows, H, D)
seeds = {
    # sdpa (1, 1, 2, 2) over 3 keys, causal, dq/dk/dv
    'sdpa_causal': sdpa(DUMMY, 0x04, 0x07),
    # sdpa with an f32 additive mask (L, S) = (2, 3), dk only
    'sdpa_additive_mask_dk_only': sdpa(bytes([0x80, 2]) + bytes([ext(2), ext(3), ext(3), ext(1)]) +
                                       b''.join(struct.pack('<f', random.uniform(-1, 1)) for _ in range(6)), 0x01, 0x02),
    # flash fixed NHD: window (1, 0), softcap, sink with dsink
    'flash_window_softcap_sink': bytes([1]) + view(fq) + view(fkv) + view(fkv) + view(fq) + view(fq) + view(flse) +
        DUMMY + view([1]) + DUMMY * 4 + view(fq) + view(fkv) + view(fkv) + view([1]) +
        scalars(0x02 | 0x08 | 0x10, left=1, right=0, softcap=20, passed=0x0f),
    # flash varlen q and k: cu_seqlens_q [0, 1, 3], cu_seqlens_k [0, 2, 3], causal, seqused_k [2, 1]
    'flash_varlen_seqused': bytes([1 | 2 | 4]) + view(pq) + view(pkv) + view(pkv) + view(pq) + view(pq) +
        view(plse) + DUMMY + DUMMY + view([3], [0, 1, 3], int32=True) + view([3], [0, 2, 3], int32=True) +
        view([2], [2, 1], int32=True) + DUMMY + view(pq) + view(pkv) + view(pkv) + DUMMY +
        scalars(0x01 | 0x20, max_q=2, max_k=2, passed=0x07),
    # paged K/V (2 pages of 2) with seqused_k: refused by the backward
    'flash_paged_refused': bytes([1 | 8]) + view(fq) + view([2, 2, 1, 2]) + view([2, 2, 1, 2]) + view(fq) +
        view(fq) + view(flse) + DUMMY + DUMMY + DUMMY + DUMMY + view([1], [3], int32=True) +
        view([1, 2], [1, 0], int32=True) + view(fq) + view([2, 2, 1, 2]) + view([2, 2, 1, 2]) + DUMMY +
        scalars(0x20, passed=0x07),
}
for name, data in seeds.items():
    open(os.path.join(here, name), 'wb').write(data)
