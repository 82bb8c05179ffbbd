"""CUDA tensors without a GPU: DLPack kDLCUDA tensors cross as af_tensor on their CUDA device with the stream
handshake, calls on them fail with the CUDA backend loader's message (never touching their memory), and cuda
plans are made from recorded descriptions and guard calls by device. Runs without PyTorch (fake_dlpack.py makes
the CUDA producer). What needs a GPU is in test_cuda_gpu.py."""
import numpy as np
import pytest

import attnforge as af
from fake_dlpack import KDL_CPU, KDL_CUDA, KDL_CUDA_MANAGED, KDL_ROCM, UNMAPPED, FakeTensor

CUDA_PLAN = {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
             "flash_kwargs": {"causal": True}, "copy_free_layout": False, "backend": "cuda"}


def loader_message():
    """What the CUDA backend's loader says on this machine (no library, or no driver, or no GPU)."""
    with pytest.raises(af.RuntimeUnavailableError) as raised:
        af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN).load_runtime_dependencies()
    return str(raised.value)


def fake_qkv(device=(KDL_CUDA, 0), dtype="float16"):
    q = FakeTensor((1, 2, 8, 64), dtype, device, data=UNMAPPED)
    k = FakeTensor((1, 2, 8, 64), dtype, device, data=UNMAPPED + 0x4000)
    v = FakeTensor((1, 2, 8, 64), dtype, device, data=UNMAPPED + 0x8000)
    return q, k, v


# ---- DLPack: the device, the handshake, ownership

@pytest.mark.parametrize("device", [(KDL_CUDA, 0), (KDL_CUDA, 3), (KDL_CUDA_MANAGED, 1)], ids=str)
def test_cuda_tensors_cross_without_a_copy_on_their_device(device):
    t = FakeTensor((2, 4, 16, 32), "bfloat16", device, strides=(4096, 32, 128, 1))
    view = af._C._testing_tensor_view(t, stream=0x7F00)
    assert view == {"device": "cuda", "index": device[1], "data": UNMAPPED, "shape": (2, 4, 16, 32),
                    "strides": (4096, 32, 128, 1), "dtype": "bfloat16"}
    assert t.streams == [0x7F00]   # the stream the call runs on, handed to the producer
    assert t.released == 1         # the export is given back


def test_the_legacy_default_stream_is_dlpack_stream_1():
    t = FakeTensor((1, 1, 4, 8))
    af._C._testing_tensor_view(t)             # no stream: the legacy default stream
    af._C._testing_tensor_view(t, stream=0)   # torch's handle of the legacy default stream
    assert t.streams == [1, 1]                # DLPack: 0 is ambiguous for CUDA, 1 is the legacy default stream


def test_cpu_producers_are_asked_without_a_stream():
    t = FakeTensor((1, 1, 4, 8), "float32", (KDL_CPU, 0))
    assert af._C._testing_tensor_view(t, stream=0x7F00)["device"] == "cpu"
    assert t.streams == [None]


def test_other_devices_and_broken_producers_are_refused():
    rocm = FakeTensor((1, 1, 4, 8), device=(KDL_ROCM, 0))
    with pytest.raises(af.UnsupportedError, match="tensor: tensor is on rocm:0; attnforge runs on the CPU and on CUDA"):
        af._C._testing_tensor_view(rocm)
    assert rocm.released == 1
    liar = FakeTensor((1, 1, 4, 8), device=(KDL_CUDA, 0), capsule_device=(KDL_CUDA, 1))
    with pytest.raises(ValueError, match=r"__dlpack_device__\(\) says cuda:0, the capsule cuda:1"):
        af._C._testing_tensor_view(liar)
    assert liar.released == 1
    silent = FakeTensor((1, 1, 4, 8), report_device=False)   # a CUDA capsule, no way to pass our stream
    with pytest.raises(af.UnsupportedError, match=r"without __dlpack_device__\(\)"):
        af._C._testing_tensor_view(silent)
    assert silent.streams == [None] and silent.released == 1
    with pytest.raises(TypeError, match="stream: expected None or a cudaStream_t"):
        af._C._testing_tensor_view(FakeTensor((1,)), stream="default")


# ---- calls on CUDA tensors without a GPU: the loader's message, nothing touched

def test_sdpa_on_cuda_tensors_fails_with_the_loaders_message():
    expected = loader_message()
    q, k, v = fake_qkv()
    out = FakeTensor((1, 2, 8, 64), "float16", data=UNMAPPED + 0xC000)
    with pytest.raises(RuntimeError) as raised:   # RuntimeUnavailableError is a RuntimeError
        af.scaled_dot_product_attention(q, k, v, is_causal=True, out=out)
    assert isinstance(raised.value, af.RuntimeUnavailableError)
    assert str(raised.value) == expected
    for t in (q, k, v, out):
        assert t.streams == [1] and t.released == 1


def test_tensors_of_one_call_on_two_devices_are_named():
    q, _, _ = fake_qkv()
    k = v = np.zeros((1, 2, 8, 64), np.float16)
    out = FakeTensor((1, 2, 8, 64), "float16", data=UNMAPPED + 0xC000)
    with pytest.raises(ValueError, match="key: on cpu but query is on cuda:0"):
        af.scaled_dot_product_attention(q, k, v, out=out)
    q2, k2, v2 = fake_qkv()
    k2 = FakeTensor((1, 2, 8, 64), "float16", (KDL_CUDA, 1), data=UNMAPPED)
    with pytest.raises(af.InvalidArgumentError, match="key: on cuda:1 but query is on cuda:0"):
        af.scaled_dot_product_attention(q2, k2, v2, out=out)


# ---- the provider: cuda plans from recorded descriptions, the guard by device

def test_cuda_samples_give_a_cuda_plan_without_loading_anything():
    q, k, v = fake_qkv((KDL_CUDA, 1))
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})]), provider.reason
    assert provider.to_dict() == {**CUDA_PLAN, "flash_kwargs": {"causal": True}}
    assert provider.name == f"attnforge FlashAttention-4 (cuda) {af.__version__}"
    assert af._C._testing_runtime_loaded(provider._c) is False
    assert q.streams == []   # recording describes tensors; nothing was exported
    restored = af.FlashAttention4KernelProvider.from_json(provider.to_json())
    assert restored.to_dict()["backend"] == "cuda"


def test_mixed_and_unknown_devices_are_refused_with_the_seeds_wording(af_log):
    q, k, v = fake_qkv()
    cpu_k = FakeTensor((1, 2, 8, 64), "float16", (KDL_CPU, 0))
    provider = af.FlashAttention4KernelProvider()
    assert not provider.prepare([((q, cpu_k, v), {})])
    assert provider.reason == ("FlashAttention-4 provider requires query, key and value on one device "
                               "(samples[0]: query is on 'cuda:0', key on 'cpu', value on 'cuda:0')")
    assert f"FlashAttention-4 not supported due to: {provider.reason}" in af_log.text
    cpu = tuple(np.zeros((1, 2, 8, 64), np.float16) for _ in range(3))
    assert not provider.prepare([(cpu, {}), ((q, k, v), {})])
    assert "(samples[1] differs from samples[0]: backend cpu vs cuda)" in provider.reason
    rocm = FakeTensor((1, 2, 8, 64), "float16", (KDL_ROCM, 0))
    assert not provider.prepare([((rocm, rocm, rocm), {})])
    assert "supports devices 'cpu' and 'cuda' only (samples[0]: query is on 'rocm:0')" in provider.reason


def test_the_guard_sends_cpu_calls_under_a_cuda_plan_to_the_general_path():
    provider = af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    with pytest.raises(af.PlanMismatchError, match="query, key and value are on cpu, the plan runs on cuda"):
        provider.infer((q, k, v), {"is_causal": True}, strict=True)
    out = provider(q, k, v, is_causal=True)   # the general path: af_sdpa on the CPU
    want = af.scaled_dot_product_attention_reference(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    stats = af._C._testing_stats(provider._c)
    assert stats["general_calls"] == 1 and stats["plan_calls"] == 0
    assert af._C._testing_runtime_loaded(provider._c) is False   # a CPU call never needs the CUDA backend


def test_cuda_calls_under_a_cuda_plan_need_the_backend():
    expected = loader_message()
    provider = af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN)
    q, k, v = fake_qkv((KDL_CUDA, 2))
    out = FakeTensor((1, 2, 8, 64), "float16", (KDL_CUDA, 2), data=UNMAPPED + 0xC000)
    for strict in (False, True):   # the guard accepts it (any CUDA device), then the backend is missing
        with pytest.raises(af.RuntimeUnavailableError) as raised:
            provider._c.infer((q, k, v), {"is_causal": True}, out, None, strict, 0x5000)
        assert str(raised.value) == expected
    assert q.streams == [0x5000, 0x5000] and out.released == 2
    assert af._C._testing_stats(provider._c)["plan_calls"] == 0
    cpu_plan = af.FlashAttention4KernelProvider.from_dict({**CUDA_PLAN, "backend": "cpu"})
    with pytest.raises(af.PlanMismatchError, match="query, key and value are on cuda:2, the plan runs on cpu"):
        cpu_plan._c.infer((q, k, v), {"is_causal": True}, out, None, True)


def test_cuda_check_errors_needs_the_backend_and_a_valid_device():
    expected = loader_message()
    with pytest.raises(af.RuntimeUnavailableError) as raised:
        af.cuda_check_errors(0)
    assert str(raised.value) == expected
    with pytest.raises(ValueError, match="device: a CUDA device index is >= 0, got -1"):
        af.cuda_check_errors(-1)
