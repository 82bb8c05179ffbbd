"""The `workspace` argument without a GPU: a CUDA call's scratch comes from the caller's (alloc, free) pair, which the
binding hands the backend as an af_cuda_allocator (python/src/workspace.c). _C._testing_workspace runs what the
backend does with it (alloc with the GIL released, then free of what it gave), so the glue is checked here; the
torch path, where the pair is PyTorch's caching allocator, runs in test_cuda_gpu.py (GPU only)."""
import sys

import numpy as np
import pytest

import attnforge as af
from attnforge import _C
from attnforge._tensors import call_workspace
from fake_dlpack import UNMAPPED, FakeTensor


class Recorder:
    """alloc(nbytes, device, stream) -> pointer and free(ptr), recording their arguments."""

    def __init__(self, pointer=0x7F0000000000, fail=None):
        self.pointer, self.fail = pointer, fail
        self.allocs, self.frees = [], []

    def alloc(self, nbytes, device, stream):
        self.allocs.append((nbytes, device, stream))
        if self.fail is not None:
            raise self.fail
        return self.pointer

    def free(self, ptr):
        self.frees.append(ptr)


def test_alloc_and_free_receive_the_size_device_and_stream():
    r = Recorder()
    assert _C._testing_workspace((r.alloc, r.free), 6144, 1, 0x7F00) == r.pointer
    assert r.allocs == [(6144, 1, 0x7F00)]
    assert r.frees == [r.pointer]


def test_no_workspace_asks_nothing():
    assert _C._testing_workspace(None, 6144, 0, 0) is None


def test_an_allocator_that_raises_fails_the_call_naming_the_workspace():
    r = Recorder(fail=RuntimeError("CUDA out of memory (the caller's allocator)"))
    with pytest.raises(MemoryError, match=r"workspace: the caller's allocator \(af_cuda_allocator.alloc\) returned "
                                          r"NULL for 6144 bytes on cuda:1") as raised:
        _C._testing_workspace((r.alloc, r.free), 6144, 1, 0)
    assert raised.value.__cause__ is r.fail   # the allocator's own exception, chained
    assert r.frees == []                      # nothing was given: nothing to give back


@pytest.mark.parametrize("result", [None, 1.5, "0x1000"], ids=repr)
def test_alloc_must_return_an_int(result):
    with pytest.raises(MemoryError, match="workspace: ") as raised:
        _C._testing_workspace((lambda nbytes, device, stream: result, lambda ptr: None), 256, 0, 0)
    assert isinstance(raised.value.__cause__, TypeError)
    assert "expected the device pointer as an int" in str(raised.value.__cause__)


def test_alloc_returning_0_is_out_of_memory():
    with pytest.raises(MemoryError, match="returned NULL") as raised:
        _C._testing_workspace((lambda nbytes, device, stream: 0, lambda ptr: None), 256, 0, 0)
    assert raised.value.__cause__ is None


def test_a_free_that_raises_is_unraisable_not_the_calls(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    def bad_free(ptr):
        raise ValueError("free failed")

    assert _C._testing_workspace((lambda nbytes, device, stream: 0x1000, bad_free), 256, 0, 0) == 0x1000
    assert len(seen) == 1 and isinstance(seen[0].exc_value, ValueError)


@pytest.mark.parametrize("bad", [(print,), (print, 3), [print, print], print], ids=repr)
def test_workspace_must_be_a_pair_of_callables(bad):
    with pytest.raises(TypeError, match=r"workspace: expected None or a pair \(alloc, free\) of callables"):
        _C._testing_workspace(bad, 256, 0, 0)
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(TypeError, match="workspace: expected None or a pair"):
        _C.sdpa((q, q, q), {}, np.empty_like(q), workspace=bad)
    with pytest.raises(TypeError, match="workspace: expected None or a pair"):
        _C.flash_attn(q, q, q, np.empty_like(q), workspace=bad)


def test_cpu_calls_never_ask_the_allocator():
    r = Recorder()
    q = np.random.default_rng(0).standard_normal((1, 2, 8, 16)).astype(np.float32)
    out = np.empty_like(q)
    _C.sdpa((q, q, q), {}, out, workspace=(r.alloc, r.free))
    np.testing.assert_allclose(out, af.scaled_dot_product_attention(q, q, q), rtol=1e-6, atol=1e-6)
    nhd = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    _C.flash_attn(nhd, nhd, nhd, np.empty_like(nhd), workspace=(r.alloc, r.free))
    assert r.allocs == [] and r.frees == []


def test_a_cuda_call_without_the_backend_fails_before_asking_the_allocator():
    r = Recorder()
    q, k, v = (FakeTensor((1, 2, 8, 64), "float16", data=UNMAPPED + i * 0x4000) for i in range(3))
    out = FakeTensor((1, 2, 8, 64), "float16", data=UNMAPPED + 0xC000)
    with pytest.raises(af.RuntimeUnavailableError):   # no backend, driver or GPU here
        _C.sdpa((q, k, v), {}, out, stream=0, workspace=(r.alloc, r.free))
    assert r.allocs == [] and r.frees == []


def test_only_torch_cuda_tensors_get_pytorchs_allocator():
    assert call_workspace(np.zeros(4, np.float32)) is None
    assert call_workspace(FakeTensor((1, 1, 4, 8))) is None   # a non-torch CUDA producer: attnforge's own pool
    torch = pytest.importorskip("torch")
    assert call_workspace(torch.zeros(4)) is None


# ---- end to end through the emulated backend (tests/cuda_emu): the binding hands the pair on to a real CUDA call

_EMULATED_CALL = r'''
import ctypes, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import attnforge as af
from attnforge import _C
from fake_dlpack import FakeTensor

emulation = ctypes.CDLL(sys.argv[1])   # the backend libattnforge loads (ATTNFORGE_CUDA_LIBRARY), its runtime inside


def device_copy(nbytes, host=None):   # emulated device memory is host memory in the emulation's registry
    ptr = ctypes.c_void_p()
    assert emulation.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0
    if host is not None:
        ctypes.memmove(ptr.value, host.ctypes.data, nbytes)
    return ptr.value


rng = np.random.default_rng(0)
base = rng.standard_normal((1, 2, 8, 128)).astype(np.float16)
q = base[..., ::2]   # stride[3] = 2: the tensor-core path copies it into scratch
k, v = (rng.standard_normal((1, 2, 8, 64)).astype(np.float16) for _ in range(2))
want = np.ascontiguousarray(af.scaled_dot_product_attention(q, k, v))   # out below is contiguous
out_ptr = device_copy(want.nbytes)
calls = []


def alloc(nbytes, device, stream):
    ptr = device_copy(nbytes)
    calls.append(("alloc", nbytes, device, stream, ptr))
    return ptr


def free(ptr):
    calls.append(("free", ptr))
    emulation.cudaFree(ctypes.c_void_p(ptr))


tensors = (FakeTensor(q.shape, "float16", data=device_copy(base.nbytes, base), strides=(2048, 1024, 128, 2)),
           FakeTensor(k.shape, "float16", data=device_copy(k.nbytes, k)),
           FakeTensor(v.shape, "float16", data=device_copy(v.nbytes, v)))
_C.sdpa(tensors, {}, FakeTensor(want.shape, "float16", data=out_ptr), stream=0, workspace=(alloc, free))
got = np.empty(want.shape, want.dtype)
ctypes.memmove(got.ctypes.data, out_ptr, got.nbytes)
assert [c[0] for c in calls] == ["alloc", "free"], calls
assert calls[0][1:4] == (1 * 2 * 8 * 64 * 2, 0, 0) and calls[1][1] == calls[0][4], calls
np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-3, rtol=3e-3)
print("workspace ok")
'''


def _emulated_backend():
    import os
    import pathlib
    cli = os.environ.get("ATTNFORGE_CLI")
    builds = [pathlib.Path(cli).parent] if cli else []
    builds.append(pathlib.Path(__file__).resolve().parents[2] / "build")
    for build in builds:
        candidate = build / "tests" / "cuda_emu" / "libattnforge_cuda_emulated.so"
        if candidate.is_file():
            return candidate
    return None


def test_a_call_through_the_emulated_backend_takes_its_scratch_from_the_pair():
    """In a process of its own (the backend, once loaded, stays for the process): ATTNFORGE_CUDA_LIBRARY names the
    emulated backend of a C build of these sources, CUDA tensors are fake DLPack ones over its memory."""
    import os
    import pathlib
    import subprocess
    backend = _emulated_backend()
    if backend is None:
        pytest.skip("no C build with tests/cuda_emu/libattnforge_cuda_emulated.so (make build)")
    env = dict(os.environ, ATTNFORGE_CUDA_LIBRARY=str(backend))
    run = subprocess.run([sys.executable, "-c", _EMULATED_CALL, str(backend), str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "workspace ok" in run.stdout, run.stdout + run.stderr
