"""attnforge as PyTorch's attention (attnforge.torch_attention): torch.nn.attention.activate_flash_attention_impl
("attnforge") sends the CPU flash backend's forward and backward to attnforge, in PyTorch's layouts, and
restore_flash_attention_impl() takes them back. Checked against math SDPA in float64 with FlashAttention-4's rule
(error at most twice PyTorch's own flash kernel's, plus the dtype's rounding), with a count of the C calls; PyTorch's
backward on attnforge's forward and the other way round; eager, torch.compile(fullgraph=True) and torch.export; and
a tiny Llama (GQA) and Gemma 2 trained 20 steps against PyTorch's kernels, and their greedy generate() with padding."""
import copy

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
attention = pytest.importorskip("torch.nn.attention")
if not hasattr(attention, "activate_flash_attention_impl"):
    pytest.skip("torch.nn.attention has no flash-attention registry (PyTorch 2.15+)", allow_module_level=True)

import attnforge as af  # noqa: E402
import attnforge.torch_attention as ta  # noqa: E402

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class Calls:
    """Counts the calls that reach attnforge's C forward and backward."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        real_forward, real_backward = af._C.sdpa, af._C.sdpa_backward

        def forward(*args, **kwargs):
            self.forward += 1
            return real_forward(*args, **kwargs)

        def backward(*args, **kwargs):
            self.backward += 1
            return real_backward(*args, **kwargs)

        monkeypatch.setattr(af._C, "sdpa", forward)
        monkeypatch.setattr(af._C, "sdpa_backward", backward)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


@pytest.fixture
def activated():
    attention.activate_flash_attention_impl("attnforge")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def pytorch_kernels():
    """PyTorch's own kernels from here on (the tests that activate restore in a finally)."""
    assert attention.current_flash_attention_impl() is None


# ---------------------------------------------------------------- registration

def test_registered_on_import_and_idempotent(calls):
    assert "attnforge" in attention.list_flash_attention_impls()
    assert ta.register() and ta.register()
    assert attention.list_flash_attention_impls().count("attnforge") == 1
    q = torch.randn(1, 2, 8, 16)
    F.scaled_dot_product_attention(q, q, q)
    assert calls.forward == 0, "registered but not activated: PyTorch's kernel runs"


def test_activate_restore(calls):
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    attention.activate_flash_attention_impl("attnforge")
    try:
        assert attention.current_flash_attention_impl() == "attnforge"
        attention.activate_flash_attention_impl("attnforge")   # activating again: restore, then override anew
        got = F.scaled_dot_product_attention(q, k, v)
        got.sum().backward()
        assert (calls.forward, calls.backward) == (1, 1)
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    again = F.scaled_dot_product_attention(q, k, v)
    again.sum().backward()
    assert (calls.forward, calls.backward) == (1, 1), "restored: PyTorch's kernels, forward and backward"
    assert torch.equal(again, want)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


# ---------------------------------------------------------------- accuracy against math SDPA in float64

CASES = {   # name: (Hq, Hkv, L, S, call's keyword arguments; "mask" is built by make_mask)
    "plain": (4, 4, 33, 47, {}),
    "causal_l_lt_s": (4, 4, 33, 47, {"is_causal": True}),
    "causal_l_gt_s": (4, 4, 47, 33, {"is_causal": True}),
    "scale": (4, 4, 33, 47, {"scale": 0.37}),
    "float_mask": (4, 4, 33, 47, {"mask": "float"}),
    "float_mask_per_batch": (4, 4, 33, 47, {"mask": "float_b11s"}),
    "bool_mask": (4, 4, 33, 47, {"mask": "bool"}),
    "gqa": (8, 2, 33, 47, {"enable_gqa": True}),
    "gqa_mask_scale": (8, 2, 33, 47, {"enable_gqa": True, "mask": "bool", "scale": 0.2}),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_mask(kind, b, l, s, dtype, g):
    if kind == "float":
        return torch.randn(l, s, generator=g).to(dtype)
    if kind == "float_b11s":
        return torch.randn(b, 1, 1, s, generator=g).to(dtype)
    mask = torch.rand(l, s, generator=g) > 0.3
    mask[:, 0] = True   # every row sees a key (math SDPA gives NaN for one that sees none)
    return mask


def make_call(case, dtype, seed=0):
    hq, hkv, l, s, kwargs = CASES[case]
    g = torch.Generator().manual_seed(seed)
    b, e = 2, 32
    # query as models make it: an (B, H, L, E) view of (B, L, H, E) memory
    q = torch.randn(b, l, hq, e, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, hkv, s, e, generator=g).to(dtype) for _ in range(2))
    kwargs = dict(kwargs)
    if "mask" in kwargs:
        kwargs["attn_mask"] = make_mask(kwargs.pop("mask"), b, l, s, dtype, g)
    grad = torch.randn(b, hq, l, e, generator=g).to(dtype)
    return (q, k, v), kwargs, grad


def forward_backward(qkv, kwargs, grad, dtype=None):
    """out and (dq, dk, dv) of F.scaled_dot_product_attention, in `dtype` (the inputs' when None)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in qkv]
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool and dtype is not None:
        kwargs = dict(kwargs, attn_mask=mask.to(dtype))
    out = F.scaled_dot_product_attention(*leaves, **kwargs)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def rounding(t):
    """FlashAttention-4's eps: the dtype's rounding error at the reference's magnitudes."""
    return ((t + 0.3 - 0.3) - t).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_backward_match_float64_math(case, dtype, calls):
    dtype = DTYPES[dtype]
    qkv, kwargs, grad = make_call(case, dtype)
    with attention.sdpa_kernel(attention.SDPBackend.MATH):
        want = forward_backward(qkv, kwargs, grad, torch.float64)
    pytorch_kernels()
    with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):   # fails rather than run math
        pytorch = forward_backward(qkv, kwargs, grad)
        attention.activate_flash_attention_impl("attnforge")
        try:
            got = forward_backward(qkv, kwargs, grad)
        finally:
            attention.restore_flash_attention_impl()
    assert (calls.forward, calls.backward) == (1, 1), "forward and backward ran on attnforge"
    for name, g, p, w in zip(("out", "dq", "dk", "dv"), got, pytorch, want):
        assert g.dtype == p.dtype and g.shape == p.shape
        eps = 2 * rounding(w.to(dtype).double())
        err, pytorch_err = (g.double() - w).abs().max().item(), (p.double() - w).abs().max().item()
        assert err <= 2 * pytorch_err + eps, f"{name}: attnforge's error {err:.3g}, PyTorch's {pytorch_err:.3g}"


# ---------------------------------------------------------------- layouts and the cross-combination

LAYOUTS = {   # name: (B, H, L, E) query of this memory order ("bhle": contiguous, "blhe": a view of (B, L, H, E))
    "bhle": ((2, 4, 9, 16), "bhle"),
    "blhe": ((2, 4, 9, 16), "blhe"),
    "batch_1_head_1": ((1, 1, 9, 16), "blhe"),
    "head_1": ((2, 1, 9, 16), "bhle"),
}


def layout_tensor(shape, order, g):
    b, h, l, e = shape
    if order == "blhe":
        return torch.randn(b, l, h, e, generator=g).transpose(1, 2)
    return torch.randn(b, h, l, e, generator=g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_have_pytorchs_strides(layout, calls):
    shape, order = LAYOUTS[layout]
    g = torch.Generator().manual_seed(1)
    q, k, v = (layout_tensor(shape, order, g) for _ in range(3))
    grad = layout_tensor(shape, "bhle", g)
    pytorch_kernels()
    out, lse = FORWARD(q, k, v)
    grads = BACKWARD(grad, q, k, v, out, lse, 0.0, False)
    with torch.nn.attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
        attention.activate_flash_attention_impl("attnforge")
        try:
            out2, lse2 = FORWARD(q, k, v)
            grads2 = BACKWARD(grad, q, k, v, out2, lse2, 0.0, False)
        finally:
            attention.restore_flash_attention_impl()
    assert (calls.forward, calls.backward) == (1, 1)
    for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads, (out2, lse2) + grads2):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.stride() == want.stride(), f"{name}: strides {got.stride()}, PyTorch's {want.stride()}"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def cross_inputs():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 17, 4, 32, generator=g).transpose(1, 2)
    k, v = (torch.randn(2, 2, 23, 32, generator=g) for _ in range(2))
    mask = torch.randn(17, 23, generator=g)
    mask[5] = float("-inf")   # a row that sees no key: PyTorch stores logsumexp 0 there, not -inf
    grad = torch.randn(2, 4, 17, 32, generator=g)
    return q, k, v, mask, grad


def test_pytorch_backward_of_attnforge_forward_and_back(calls):
    q, k, v, mask, grad = cross_inputs()
    pytorch_kernels()
    out, lse = FORWARD(q, k, v, attn_mask=mask)
    want = BACKWARD(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    attention.activate_flash_attention_impl("attnforge")
    try:
        af_out, af_lse = FORWARD(q, k, v, attn_mask=mask)
        af_grads_of_pytorch_forward = BACKWARD(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    finally:
        attention.restore_flash_attention_impl()
    pytorch_grads_of_af_forward = BACKWARD(grad, q, k, v, af_out, af_lse, 0.0, False, attn_mask=mask)
    assert (calls.forward, calls.backward) == (1, 1)
    assert torch.equal(af_lse[:, :, 5], torch.zeros(2, 4)), "PyTorch's logsumexp of a row that sees no key"
    torch.testing.assert_close(af_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(af_lse, lse, atol=1e-5, rtol=1e-5)
    for got in (af_grads_of_pytorch_forward, pytorch_grads_of_af_forward):
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- calls attnforge does not run

def test_calls_attnforge_cannot_run_get_pytorchs_kernel(calls, activated):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    grad = torch.randn(1, 2, 8, 16, generator=g)
    float32_mask = torch.randn(8, 8, generator=g)
    cases = [
        ((q.double(), k.double(), v.double()), {}),                                     # float64
        ((q.bfloat16(), k.bfloat16(), v.bfloat16()), {"attn_mask": float32_mask}),      # mask of another dtype
        ((q, k, v), {"attn_mask": float32_mask, "is_causal": True}),                    # mask and causal
    ]
    with pytest.raises(RuntimeError, match="mask"):   # PyTorch's own error: F.sdpa turns a bool mask into float first
        FORWARD(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    for qkv, kwargs in cases:
        is_causal = kwargs.pop("is_causal", False)
        out, lse = FORWARD(*qkv, 0.0, is_causal, **kwargs)
        grads = BACKWARD(grad.to(qkv[0].dtype), *qkv, out, lse, 0.0, is_causal, **kwargs)
        attention.restore_flash_attention_impl()
        try:
            want_out, want_lse = FORWARD(*qkv, 0.0, is_causal, **kwargs)
            want_grads = BACKWARD(grad.to(qkv[0].dtype), *qkv, want_out, want_lse, 0.0, is_causal, **kwargs)
        finally:
            attention.activate_flash_attention_impl("attnforge")
        for got, want in zip((out, lse) + grads, (want_out, want_lse) + want_grads):
            assert torch.equal(got, want) and got.stride() == want.stride()
    assert (calls.forward, calls.backward) == (0, 0)
    # and F.scaled_dot_product_attention's dropout never reaches the flash operators on the CPU
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert calls.forward == 0


# ---------------------------------------------------------------- torch.compile and torch.export

def loss_of_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()


def test_torch_compile_fullgraph(calls, activated):
    g = torch.Generator().manual_seed(4)
    qkv = [torch.randn(2, 4, 16, 32, generator=g).requires_grad_() for _ in range(3)]
    mask = torch.randn(16, 16, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(loss_of_attention, fullgraph=True)
    loss = compiled(*qkv, mask)
    loss.backward()
    assert (calls.forward, calls.backward) == (1, 1), "the compiled forward and backward run attnforge's kernels"
    got = [loss.detach()] + [t.grad for t in qkv]
    leaves = [t.detach().requires_grad_() for t in qkv]
    attention.restore_flash_attention_impl()
    try:
        want_loss = loss_of_attention(*leaves, mask)
        want_loss.backward()
    finally:
        attention.activate_flash_attention_impl("attnforge")
    for a, b in zip(got, [want_loss.detach()] + [t.grad for t in leaves]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_torch_export(calls, activated):
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 12, 16, generator=g), *(torch.randn(1, 2, 12, 16, generator=g) for _ in range(2))
    program = torch.export.export(Attention(), (q, k, v))
    got = program.module()(q, k, v)
    assert calls.forward == 1, "the exported program's SDPA runs on attnforge"
    attention.restore_flash_attention_impl()
    try:
        want = Attention()(q, k, v)
    finally:
        attention.activate_flash_attention_impl("attnforge")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- training a tiny Llama (GQA) and Gemma 2

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=97, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, use_cache=False)
MODELS = {
    "llama_gqa": ("LlamaConfig", {}),
    # SDPA has no softcap: Gemma 2 without it (sliding window, its norms, GeGLU and final logit softcap stay)
    "gemma2": ("Gemma2Config", dict(sliding_window=6, attn_logit_softcapping=None, final_logit_softcapping=30.0,
                                    query_pre_attn_scalar=16)),
}
STEPS = 20


def build_model(name, monkeypatch):
    transformers = pytest.importorskip("transformers")
    class_name, extra = MODELS[name]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    if name == "gemma2":   # Transformers keeps Gemma 2 off "sdpa" for its softcap, which this config does not use
        from transformers.models.gemma2 import modeling_gemma2
        monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)
    torch.manual_seed(0)
    config = config_class(**{**SMALL, **extra})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def train(model, step_model, initial):
    """Losses of STEPS steps of SGD from the weights `initial` on one fixed random batch (2 x 24 tokens: the model
    learns it quickly); step_model is model or its compiled form (compiled once: the kernels are chosen when the
    aten operators run, so both runs share one graph)."""
    model.load_state_dict(initial)   # in place: the compiled graph's guards still hold
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(STEPS):
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("name", MODELS)
def test_training_matches_pytorchs_kernels(name, compile_model, calls, monkeypatch):
    model = build_model(name, monkeypatch)
    initial = copy.deepcopy(model.state_dict())
    torch._dynamo.reset()
    step_model = torch.compile(model, fullgraph=True) if compile_model else model
    pytorch_kernels()
    want = train(model, step_model, initial)
    assert calls.forward == 0
    attention.activate_flash_attention_impl("attnforge")
    try:
        got = train(model, step_model, initial)
    finally:
        attention.restore_flash_attention_impl()
    layers = SMALL["num_hidden_layers"]
    assert calls.forward == calls.backward == STEPS * layers, "every layer's forward and backward on attnforge"
    assert want[-1] < 0.5 * want[0], "the model learns: the comparison means something"
    # the first loss differs by the forward's rounding only; after 20 steps of SGD the rounding of the gradients has
    # grown: PyTorch's own math and flash kernels end up to 1.3e-4 apart on these runs (attnforge and flash: 9e-5)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-6)
    torch.testing.assert_close(got, want, atol=0, rtol=3e-4)


@pytest.mark.parametrize("name", MODELS)
def test_generate_left_padded_matches_pytorchs_kernels(name, calls, monkeypatch):
    """Inference too: greedy generate() with a KV cache and a left-padded batch (prefill under a mask, then one-row
    decode steps) gives PyTorch's kernels' tokens, every layer's call on attnforge."""
    model = build_model(name, monkeypatch).eval()
    model.config.use_cache = True
    ids = torch.randint(3, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    pytorch_kernels()
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        attention.activate_flash_attention_impl("attnforge")
        try:
            got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        finally:
            attention.restore_flash_attention_impl()
    assert calls.forward == 10 * SMALL["num_hidden_layers"] and calls.backward == 0
    assert torch.equal(got, want)
