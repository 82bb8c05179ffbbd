"""Inputs cross into C without copies (checked by data pointers), outputs are written in place, repeated calls
do not leak (references or memory), and the GIL is released around the kernel."""
import gc
import logging
import sys
import threading

import numpy as np
import pytest

import attnforge as af


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def grows(fn, warmup=300, calls=6000):
    """RSS growth over `calls` calls after a warm-up (allocator pools and caches settle first)."""
    for _ in range(warmup):
        fn()
    gc.collect()
    before = rss_bytes()
    for _ in range(calls):
        fn()
    gc.collect()
    return rss_bytes() - before


# ---- NumPy (always)

def test_numpy_copy_free_provider_reads_the_callers_memory():
    rng = np.random.default_rng(0)
    base = [rng.standard_normal((1, 8, 2, 16)).astype(np.float32) for _ in range(3)]
    q, k, v = (b.transpose(0, 2, 1, 3) for b in base)
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {})])
    af._C._testing_spy(provider._c)
    provider(q, k, v)
    assert af._C._testing_seen() == tuple(b.ctypes.data for b in base)


def test_numpy_references_and_memory_do_not_grow():
    q = np.ones((1, 2, 8, 16), np.float32)
    out = np.empty_like(q)
    refs = [sys.getrefcount(t) for t in (q, out)]
    assert grows(lambda: af.scaled_dot_product_attention(q, q, q, out=out)) < 2 << 20
    bad = np.ones((1, 2, 8, 15), np.float32)

    def failing():
        with pytest.raises(af.InvalidArgumentError):
            af.scaled_dot_product_attention(q, bad, q, out=out)

    assert grows(failing, calls=3000) < 2 << 20
    assert [sys.getrefcount(t) for t in (q, out)] == refs


def test_prepare_and_plan_json_do_not_leak():
    q = np.ones((1, 8, 2, 16), np.float32).transpose(0, 2, 1, 3)   # copy-free: no warning records piling up in pytest
    provider = af.FlashAttention4KernelProvider()

    def cycle():
        assert provider.prepare([((q, q, q), {"is_causal": True})])
        af.FlashAttention4KernelProvider.from_dict(provider.to_dict())
        assert not provider.prepare([((q, q), {})])

    assert grows(cycle, warmup=100, calls=2000) < 2 << 20


def test_logging_from_other_threads(af_log):
    q = np.ones((1, 2, 8, 16), np.float32)
    results = []

    def prepare_in_thread():
        results.append(af.FlashAttention4KernelProvider().prepare([((q, None, q), {})]))

    threads = [threading.Thread(target=prepare_in_thread, name=f"preparer-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [False] * 4
    names = {r.threadName for r in af_log.records if r.levelno == logging.DEBUG and "tensor query" in r.getMessage()}
    assert names == {f"preparer-{i}" for i in range(4)}


def test_concurrent_calls_and_prepare():
    rng = np.random.default_rng(1)
    inputs = [[rng.standard_normal((1, 4, 64, 32)).astype(np.float32) for _ in range(3)] for _ in range(4)]
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([(tuple(inputs[0]), {"is_causal": True})])
    want = [af.scaled_dot_product_attention(*qkv, is_causal=True) for qkv in inputs]
    errors = []

    def worker(i):
        try:
            for _ in range(30):
                np.testing.assert_array_equal(provider(*inputs[i], is_causal=True), want[i])
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    def preparer():
        for _ in range(30):
            assert provider.prepare([(tuple(inputs[0]), {"is_causal": True})])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=preparer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- torch

def test_torch_pointers_outputs_and_leaks():
    torch = pytest.importorskip("torch")
    q_nhd, k_nhd, v_nhd = (torch.randn(2, 16, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (q_nhd, k_nhd, v_nhd))
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    af._C._testing_spy(provider._c)
    provider(q, k, v, is_causal=True)
    assert af._C._testing_seen() == (q_nhd.data_ptr(), k_nhd.data_ptr(), v_nhd.data_ptr())

    # a call that leaves the plan (a strided slice) runs on the general path, still on the caller's memory
    wide = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
    sliced = wide[..., :32]
    provider(sliced, sliced, sliced, is_causal=True)
    assert af._C._testing_seen() == (wide.data_ptr(),) * 3

    out = torch.empty(2, 4, 16, 32, dtype=torch.bfloat16)
    pointer = out.data_ptr()
    assert af.scaled_dot_product_attention(q, k, v, out=out) is out and out.data_ptr() == pointer
    before = [t.clone() for t in (q, k, v)]
    af.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))

    refs = [sys.getrefcount(t) for t in (q, k, v, out)]
    assert grows(lambda: provider(q, k, v, is_causal=True)) < 4 << 20
    assert grows(lambda: af.scaled_dot_product_attention(q, k, v, out=out)) < 4 << 20
    assert [sys.getrefcount(t) for t in (q, k, v, out)] == refs
    big = torch.randn(1, 1, 256, 256)   # a leaked DLPack export would keep 256 KiB alive per call
    assert grows(lambda: af.scaled_dot_product_attention(big, big, big), warmup=20, calls=300) < 16 << 20
