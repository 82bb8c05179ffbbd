"""attnforge.torch: record a module's SDPA calls, prepare, and apply the plan; PyTorch's function comes back."""
import logging

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
import attnforge.torch as aft  # noqa: E402

PYTORCH_SDPA = F.scaled_dot_product_attention


class GPTBlock(nn.Module):
    """A pre-norm GPT block whose attention calls F.scaled_dot_product_attention on HND views of NHD memory."""

    def __init__(self, dim=64, heads=4, kv_heads=2, keyword=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.keyword = heads, kv_heads, dim // heads, keyword
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, L, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(B, L, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.contiguous().transpose(1, 2), v.contiguous().transpose(1, 2)
        if self.keyword:
            y = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=2, **kwargs):
        super().__init__()
        self.blocks = nn.Sequential(*(GPTBlock(**kwargs) for _ in range(layers)))

    def forward(self, x):
        return self.blocks(x)


def gpt(dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    return GPT(**kwargs).to(dtype).eval()


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_record_prepare_apply_gpt(keyword, dtype):
    model = gpt(dtype, keyword=keyword)
    x = torch.randn(2, 24, 64, dtype=dtype)
    with torch.no_grad():
        want = model(x)
    samples = aft.record(model, x)
    assert len(samples) == 1 and samples.counts == [2]   # two blocks, one distinct call
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(samples), provider.reason
    assert provider.to_dict()["copy_free_layout"] is True
    assert provider.to_dict()["qkv_source"] == ("keyword_qkv" if keyword else "positional_qkv")
    with aft.apply(model, provider), torch.no_grad():
        q = torch.randn(1, 2, 5, 16, dtype=dtype)
        outside = F.scaled_dot_product_attention(q, q, q)   # inside the block, outside the module: PyTorch's
        assert af._C._testing_stats(provider._c)["plan_calls"] == 0
        torch.testing.assert_close(outside, PYTORCH_SDPA(q, q, q))
        got = model(x)
    assert F.scaled_dot_product_attention is PYTORCH_SDPA
    assert af._C._testing_stats(provider._c)["plan_calls"] == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_other_lengths_run_the_same_plan():
    model = gpt()
    samples = aft.record(model, torch.randn(1, 16, 64))
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(samples)
    x = torch.randn(3, 40, 64)
    with torch.no_grad():
        want = model(x)
        with aft.apply(model, provider.to_dict()):   # a plan dict works as well as a provider
            got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pytorch_function_is_restored_after_an_exception():
    class Failing(nn.Module):
        def forward(self, q):
            F.scaled_dot_product_attention(q, q, q)
            raise KeyError("boom")

    q = torch.randn(1, 2, 4, 8)
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, q, q), {})])
    module = Failing()
    with pytest.raises(KeyError):
        with aft.apply(module, provider):
            module(q)
    assert F.scaled_dot_product_attention is PYTORCH_SDPA
    with pytest.raises(KeyError):
        aft.record(module, q)
    assert F.scaled_dot_product_attention is PYTORCH_SDPA


def test_transformer_encoder_layer(af_log):
    """nn.MultiheadAttention calls SDPA with six positionals, which the seed's subset refuses; apply() with
    another plan still gives PyTorch's output (the C guard sends those calls to PyTorch, or to attnforge's
    general path)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0).eval()
    x = torch.randn(10, 2, 64)   # (L, B, E): batch_first=False keeps PyTorch's fused fast path out of the way
    samples = aft.record(layer, x)
    assert len(samples) == 1 and len(samples[0][0]) == 6
    provider = af.FlashAttention4KernelProvider()
    assert not provider.prepare(samples)
    assert "only supports positional or query/key/value qkv arguments" in provider.reason

    other = af.FlashAttention4KernelProvider()
    q = torch.randn(2, 4, 10, 16)
    assert other.prepare([((q, q, q), {"is_causal": True})])
    with torch.no_grad():
        want = layer(x)
        with aft.apply(layer, other):   # not covered by the plan: PyTorch's own SDPA
            got = layer(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        stats = af._C._testing_stats(other._c)
        assert stats["plan_calls"] == 0 and stats["general_calls"] == 0
        af_log.clear()
        with aft.apply(layer, other, uncovered="attnforge"):   # attnforge's general path, the call's own arguments
            got = layer(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        general = [r for r in af_log.records if "running it on attnforge's general path" in r.getMessage()]
        assert len(general) == 1 and "is_causal is false" in general[0].getMessage()


def test_calls_that_need_gradients_run_on_attnforge(af_log, monkeypatch):
    """Grad enabled, parameters require grad: the calls run on attnforge, forward and backward (they went to
    PyTorch with a warning while attnforge had no backward), with PyTorch's gradients and no warning."""
    model, reference = gpt(), gpt()
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.record(model, torch.randn(1, 8, 64)))
    x = torch.randn(1, 8, 64)
    reference(x).sum().backward()
    backward_calls = []
    real_backward = af._C.sdpa_backward
    monkeypatch.setattr(af._C, "sdpa_backward", lambda *a, **k: backward_calls.append(1) or real_backward(*a, **k))
    with aft.apply(model, provider):
        y = model(x)
        y.sum().backward()
    assert len(backward_calls) == 2, "both blocks' backward on attnforge"
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert not [r for r in af_log.records if r.levelno >= logging.WARNING]


def test_calls_attnforge_cannot_run_go_to_pytorch():
    model = gpt()
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.record(model, torch.randn(1, 8, 64)))
    model64 = gpt(torch.float64)
    x64 = torch.randn(1, 8, 64, dtype=torch.float64)
    with torch.no_grad():
        want = model64(x64)
        with aft.apply(model64, provider):   # float64: not attnforge's
            got = model64(x64)
    torch.testing.assert_close(got, want)


def test_nested_apply_restores_in_order():
    outer, inner = gpt(), gpt()
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare(aft.record(outer, torch.randn(1, 8, 64)))

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer, self.inner = outer, inner

        def forward(self, x):
            return self.inner(self.outer(x))

    both = Both()
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        want = both(x)
        with aft.apply(both, provider), aft.apply(inner, provider):
            got = both(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert F.scaled_dot_product_attention is PYTORCH_SDPA


def test_record_keeps_layouts_apart_and_writes_the_samples_file(tmp_path):
    class TwoLayouts(nn.Module):
        def forward(self, q):
            F.scaled_dot_product_attention(q, q, q)
            F.scaled_dot_product_attention(q, q, q)
            qc = q.contiguous()
            return F.scaled_dot_product_attention(qc, qc, qc)

    q = torch.randn(1, 6, 2, 8).transpose(1, 2)
    samples = aft.record(TwoLayouts(), q)
    assert len(samples) == 2 and samples.counts == [2, 1]
    samples.save(tmp_path / "samples.json")
    data = af.load_samples(tmp_path / "samples.json")
    assert [s["count"] for s in data["samples"]] == [2, 1]
    assert data["samples"][0]["args"][0]["strides"] == list(q.stride())
    provider = af.FlashAttention4KernelProvider()
    assert not provider.prepare(samples) and "consistent" in provider.reason


def test_apply_checks_its_argument():
    with pytest.raises(TypeError, match="expected a FlashAttention4KernelProvider"):
        with aft.apply(gpt(), 42):
            pass
    with pytest.raises(af.NotPreparedError):
        with aft.apply(gpt(), af.FlashAttention4KernelProvider()):
            pass
