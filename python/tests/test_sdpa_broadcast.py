"""PyTorch's broadcasting rule for SDPA (docs/PYTORCH.md, "The broadcasting rule") on every path of attnforge.

Falcon's multi-query attention calls F.scaled_dot_product_attention(q (2,4,8,64), k/v (2,1,8,64), is_causal=True)
without enable_gqa: PyTorch broadcasts size-1 batch and head dims (and takes any rank from 2). The property test
draws random call metadata (ranks 2..5, batch/head sizes with 1s and mismatches, enable_gqa, causal, masks) and holds
every path to PyTorch's math SDPA: where PyTorch runs, attnforge gives its result (or a provider refuses the call at
prepare); where PyTorch raises, attnforge raises (or refuses at prepare); no prepare() is True for a call its infer
cannot run."""
import random

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attnforge as af  # noqa: E402
from attnforge import FlashAttention4KernelProvider  # noqa: E402

TOLERANCE = dict(atol=2e-5, rtol=2e-5)   # float32 against the math path's float32


def math_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def _aitune_provider_class():
    try:
        import attnforge.aitune as aitune
        aitune.load_aitune(kernel_forge_only=True)
        return aitune.AttnforgeKernelProvider
    except ImportError:
        return None


AITUNE_PROVIDER = _aitune_provider_class()


# ---------------------------------------------------------------- the cases the issue measured

ISSUE_CASES = [   # q, k/v shapes, enable_gqa, is_causal
    ((2, 4, 8, 64), (2, 1, 8, 64), False, True),     # Falcon's MQA
    ((2, 4, 8, 64), (1, 4, 8, 64), False, False),
    ((2, 4, 8, 64), (1, 1, 8, 64), False, False),
    ((1, 4, 8, 64), (2, 4, 8, 64), False, False),    # out (2, 4, 8, 64)
    ((8, 64), (8, 64), False, True),                 # 2-D
    ((3, 2, 4, 8, 64), (3, 2, 4, 8, 64), False, False),   # 5-D
    ((3, 2, 4, 8, 64), (1, 2, 1, 8, 64), False, True),
]


@pytest.mark.parametrize("q_shape,kv_shape,enable_gqa,is_causal", ISSUE_CASES)
def test_issue_shapes_run_as_in_pytorch(q_shape, kv_shape, enable_gqa, is_causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=gen) for s in (q_shape, kv_shape, kv_shape))
    want = math_sdpa(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    with torch.no_grad():
        got = af.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
        op = torch.ops.attnforge.sdpa(q, k, v, None, 0.0, is_causal, None, enable_gqa, False, True)
    assert got.shape == want.shape and op[0].shape == want.shape and op[1].shape == want.shape[:-1]
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(op[0], want, **TOLERANCE)


def test_heads_2_of_4_without_enable_gqa_is_refused_as_by_pytorch():
    q, k = torch.randn(2, 4, 8, 64), torch.randn(2, 2, 8, 64)
    with pytest.raises(RuntimeError):
        math_sdpa(q, k, k)
    with pytest.raises(af.InvalidArgumentError, match="enable_gqa is false but query has 4 heads and key has 2"):
        af.scaled_dot_product_attention(q, k, k)


def test_no_copy_for_broadcast_4d_and_views_for_other_ranks():
    """A broadcast 4-D call reads the caller's memory (the C library takes stride 0); 2-D/3-D/5-D calls are views."""
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16)
    from attnforge._sdpa_call import layout
    call = layout(q, k, k)
    assert call.key is k and call.shape4 == (2, 4, 8, 16)
    q5, k5 = torch.randn(3, 2, 4, 8, 16), torch.randn(3, 2, 1, 8, 16)
    call = layout(q5, k5, k5)
    assert call.query.data_ptr() == q5.data_ptr() and call.key.data_ptr() == k5.data_ptr()
    assert call.query.shape == (6, 4, 8, 16) and call.key.shape == (6, 1, 8, 16)
    q2 = torch.randn(8, 16)
    assert layout(q2, q2, q2).query.data_ptr() == q2.data_ptr()


def test_fake_implementation_gives_the_real_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    shapes = [((2, 4, 8, 16), (2, 1, 8, 16)), ((1, 4, 8, 16), (2, 4, 8, 16)), ((8, 16), (3, 2, 8, 16)),
              ((3, 2, 4, 8, 16), (1, 2, 1, 8, 16))]
    for q_shape, kv_shape in shapes:
        q, k = torch.randn(q_shape), torch.randn(kv_shape)
        with torch.no_grad():
            real_out, real_lse = torch.ops.attnforge.sdpa(q, k, k, None, 0.0, False, None, False, False, True)
        with FakeTensorMode() as mode:
            fq, fk = mode.from_tensor(q), mode.from_tensor(k)
            fake_out, fake_lse = torch.ops.attnforge.sdpa(fq, fk, fk, None, 0.0, False, None, False, False, True)
        assert (fake_out.shape, fake_out.stride()) == (real_out.shape, real_out.stride())
        assert (fake_lse.shape, fake_lse.stride()) == (real_lse.shape, real_lse.stride())


def test_compiled_and_exported_broadcast_calls():
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16)

    def attend(q, k, v):
        return af.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        compiled = torch.compile(attend, fullgraph=True)
        torch.testing.assert_close(compiled(q, k, k), math_sdpa(q, k, k, is_causal=True), **TOLERANCE)

        class Attend(torch.nn.Module):
            def forward(self, q, k, v):
                return attend(q, k, v)

        program = torch.export.export(Attend(), (q, k, k))
        torch.testing.assert_close(program.module()(q, k, k), math_sdpa(q, k, k, is_causal=True), **TOLERANCE)


# ---------------------------------------------------------------- the property test

def _batch_dims(rng, rank, out_dims):
    """A tensor's leading dims (all but the last two) for the output's `out_dims`: each the output's size or 1,
    sometimes another size (a mismatch PyTorch refuses), right-aligned and maybe fewer of them."""
    dims = []
    for size in out_dims[len(out_dims) - (rank - 2):]:
        roll = rng.random()
        dims.append(1 if roll < 0.3 else rng.choice([2, 3, 4]) if roll < 0.38 else size)
    return tuple(dims)


def random_call(rng):
    """(args, kwargs) of one random F.scaled_dot_product_attention call on small float32 tensors."""
    out_rank = rng.choice([2, 3, 4, 4, 4, 5])
    out_dims = tuple(rng.choice([1, 2, 3, 4]) for _ in range(out_rank - 2))
    ranks = [out_rank if rng.random() < 0.7 else rng.randint(2, out_rank) for _ in range(3)]
    ranks[rng.randrange(3)] = out_rank
    enable_gqa = rng.random() < 0.35
    q_batch, k_batch, v_batch = (_batch_dims(rng, r, out_dims) for r in ranks)
    if enable_gqa and out_rank >= 3 and rng.random() < 0.6:   # grouped heads: divisors of query's
        hq = rng.choice([2, 4, 6, 8])
        q_batch = q_batch[:-1] + (hq,) if q_batch else q_batch
        k_batch = k_batch[:-1] + (rng.choice([h for h in (1, 2, 3, 4) if hq % h == 0 or rng.random() < 0.2]),) \
            if k_batch else k_batch
        v_batch = v_batch[:-1] + ((k_batch[-1] if k_batch and rng.random() < 0.6 else rng.choice([1, 2, 4])),) \
            if v_batch else v_batch
    L, S = rng.randint(1, 6), rng.randint(1, 6)
    E, Ev = rng.choice([4, 8]), rng.choice([4, 8])
    k_len, v_len, k_e = S, S, E
    if rng.random() < 0.05:
        v_len = S + 1
    if rng.random() < 0.05:
        k_e = E + 4
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q = torch.randn(q_batch + (L, E), generator=gen)
    k = torch.randn(k_batch + (k_len, k_e), generator=gen)
    v = torch.randn(v_batch + (v_len, Ev), generator=gen)
    if rng.random() < 0.2:   # a transposed layout: strides as Transformers' (B, L, H, E) views give them
        if q.dim() >= 3:
            q = q.transpose(-2, -3).contiguous().transpose(-2, -3)
    kwargs = {}
    if enable_gqa:
        kwargs["enable_gqa"] = True
    roll = rng.random()
    if roll < 0.3:
        kwargs["is_causal"] = True
    elif roll < 0.6:
        kwargs["attn_mask"] = _random_mask(rng, gen, q, k, out_rank)
        if rng.random() < 0.05:
            kwargs["is_causal"] = True   # PyTorch refuses a mask with is_causal
    return (q, k, v), kwargs


def _random_mask(rng, gen, q, k, out_rank):
    rank = rng.randint(2, out_rank + (1 if rng.random() < 0.1 else 0))
    try:
        scores = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]) if rng.random() < 0.9 else q.shape[:-2]
    except RuntimeError:   # q and k do not broadcast: PyTorch refuses the call anyway
        scores = q.shape[:-2]
    target = (1,) * out_rank + tuple(scores) + (q.shape[-2], k.shape[-2])
    shape = tuple(1 if rng.random() < 0.4 else size for size in target[len(target) - rank:])
    if rng.random() < 0.05:
        shape = shape[:-1] + (shape[-1] + 1,)
    if rng.random() < 0.5:
        mask = torch.rand(shape, generator=gen) < 0.7
        mask[..., 0] = True   # no row without a key: PyTorch gives NaN there, attnforge 0 (docs/PYTORCH.md)
        return mask
    return torch.randn(shape, generator=gen)


def pytorch_result(args, kwargs):
    try:
        return math_sdpa(*args, **kwargs), None
    except (RuntimeError, IndexError, ValueError) as e:
        return None, e


def describe(args, kwargs):
    shapes = ", ".join(str(tuple(t.shape)) for t in args)
    extra = {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return f"q/k/v {shapes} {extra}"


def check_path(name, run, want, pytorch_error, what):
    """A path that runs a call directly: PyTorch's result where PyTorch runs, an error where it raises."""
    if pytorch_error is not None:
        with pytest.raises(af.Error):
            run()
        return
    try:
        got = run()
    except af.Error as e:
        pytest.fail(f"{name}: PyTorch runs {what} but attnforge raises {type(e).__name__}: {e}")
    assert got.shape == want.shape, f"{name}: {what}: shape {tuple(got.shape)}, PyTorch's {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"{name}: {what}: {m}")


def check_provider(name, provider, args, kwargs, want, pytorch_error, what, must_accept):
    """prepare() → infer on the same call: True only for a call infer runs with PyTorch's result."""
    prepared = provider.prepare([(args, kwargs)])
    if not prepared:
        assert not must_accept or pytorch_error is not None, f"{name}: refuses {what}, which PyTorch runs"
        return False
    assert pytorch_error is None, f"{name}: prepare() accepted {what}, which PyTorch refuses ({pytorch_error})"
    try:
        got = provider(*args, **kwargs)
    except Exception as e:   # noqa: BLE001 - any failure after a True prepare() breaks the invariant
        pytest.fail(f"{name}: prepare() was True for {what} but infer raised {type(e).__name__}: {e}")
    assert got.shape == want.shape, f"{name}: {what}: shape {tuple(got.shape)}, PyTorch's {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"{name}: {what}: {m}")
    return True


CASES = 250


@pytest.mark.parametrize("seed", range(4))
def test_every_path_follows_pytorch_on_random_metadata(seed):
    rng = random.Random(seed)
    counts = {"pytorch_runs": 0, "pytorch_raises": 0, "fa4_provider_plans": 0, "aitune_prepares": 0}
    for _ in range(CASES // 4):
        args, kwargs = random_call(rng)
        what = describe(args, kwargs)
        want, error = pytorch_result(args, kwargs)
        counts["pytorch_runs" if error is None else "pytorch_raises"] += 1
        with torch.no_grad():
            check_path("attnforge.scaled_dot_product_attention",
                       lambda: af.scaled_dot_product_attention(*args, **kwargs), want, error, what)
            op_args = (kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False), None,
                       kwargs.get("enable_gqa", False), False, False)
            check_path("torch.ops.attnforge.sdpa", lambda: torch.ops.attnforge.sdpa(*args, *op_args)[0], want,
                       error, what)
            if check_provider("FlashAttention4KernelProvider", FlashAttention4KernelProvider(backend="attnforge"),
                              args, kwargs, want, error, what, must_accept=False):
                counts["fa4_provider_plans"] += 1
            if AITUNE_PROVIDER is not None and check_provider("AttnforgeKernelProvider", AITUNE_PROVIDER(), args,
                                                              kwargs, want, error, what, must_accept=True):
                counts["aitune_prepares"] += 1
    # the draw covers both sides of the rule
    assert counts["pytorch_runs"] > 10 and counts["pytorch_raises"] > 3, counts
    assert counts["fa4_provider_plans"] > 0, counts
