"""attnforge.torch with cuda plans on a machine without a GPU: the recorder writes each tensor's device, apply()
loads the plan's backend on entry, and its guard sends calls on the other backend's device to PyTorch (or, with
uncovered="attnforge", to attnforge's general path where the tensors live)."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402
from attnforge._samples import describe  # noqa: E402
from fake_dlpack import FakeTensor  # noqa: E402

PYTORCH_SDPA = F.scaled_dot_product_attention
CUDA_PLAN = {"type": "FlashAttention4KernelProvider", "version": 1, "qkv_source": "positional_qkv",
             "flash_kwargs": {"causal": True}, "copy_free_layout": False, "backend": "cuda"}


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def backend_unavailable():
    try:
        af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN).load_runtime_dependencies()
    except af.RuntimeUnavailableError as e:
        return str(e)
    return None


def test_recorded_samples_carry_the_device():
    q = torch.randn(1, 2, 8, 16)
    samples = aft.record(Attention(), q, q, q)
    assert [describe(t)["device"] for t in samples[0][0]] == ["cpu"] * 3
    # a CUDA call as the recorder describes it (torch.Tensor's fields): shape, dtype, strides, str(device)
    cuda_q = FakeTensor((1, 2, 8, 16), "bfloat16")
    assert describe(cuda_q) == {"shape": [1, 2, 8, 16], "dtype": "bfloat16", "strides": [256, 128, 16, 1],
                                "device": "cuda:0"}
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.Samples([((cuda_q, cuda_q, cuda_q), {"is_causal": True})]))
    assert provider.to_dict()["backend"] == "cuda"


def test_a_device_attnforge_lacks_is_refused_by_name():
    meta = torch.empty(1, 2, 8, 16, device="meta")
    samples = aft.record(Attention(), meta, meta, meta)   # PyTorch runs SDPA on meta tensors (shapes only)
    assert describe(samples[0][0][0])["device"] == "meta"
    provider = af.FlashAttention4KernelProvider()
    assert not provider.prepare(samples)
    assert "supports devices 'cpu' and 'cuda' only (samples[0]: query is on 'meta')" in provider.reason


def test_apply_loads_the_cuda_backend_on_entry():
    message = backend_unavailable()
    if message is None:
        pytest.skip("attnforge's CUDA backend loads here: test_cuda_gpu.py covers this machine")
    module = Attention()
    with pytest.raises(af.RuntimeUnavailableError) as raised:
        with aft.apply(module, CUDA_PLAN):
            pass
    assert str(raised.value) == message
    assert F.scaled_dot_product_attention is PYTORCH_SDPA


def test_cpu_calls_under_a_cuda_plan_go_to_pytorch(monkeypatch, af_log):
    provider = af.FlashAttention4KernelProvider.from_dict(CUDA_PLAN)
    # what apply() does after a successful load; here no backend exists, so the load is skipped for this test
    monkeypatch.setattr(provider, "load_runtime_dependencies", lambda: None)
    pytorch_calls = []

    def counting_sdpa(*args, **kwargs):
        pytorch_calls.append(args[0].device)
        return PYTORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    module = Attention()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with torch.no_grad():
        want = PYTORCH_SDPA(q, k, v, is_causal=True)
        with aft.apply(module, provider):
            got = module(q, k, v)
    assert torch.equal(got, want)                # PyTorch's own result
    assert pytorch_calls == [torch.device("cpu")]
    stats = af._C._testing_stats(provider._c)
    assert stats["plan_calls"] == 0 and stats["general_calls"] == 0
    af_log.clear()
    with torch.no_grad(), aft.apply(module, provider, uncovered="attnforge"):
        got = module(q, k, v)                    # attnforge's general path, on the CPU where the tensors are
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    general = [r for r in af_log.records if "running it on attnforge's general path" in r.getMessage()]
    assert len(general) == 1 and "the plan runs on cuda" in general[0].getMessage()
    assert pytorch_calls == [torch.device("cpu")]
