"""The NumPy tier: runs without PyTorch (buffer protocol in, NumPy out), against a NumPy double reference."""
import json
import subprocess
import sys

import numpy as np
import pytest

import attnforge as af


def numpy_sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """SDPA in float64, PyTorch's meaning (top-left causal, GQA by repeat_interleave)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ np.swapaxes(k, -1, -2)
    L, S = q.shape[2], k.shape[2]
    if is_causal:
        scores = np.where(np.tril(np.ones((L, S), dtype=bool)), scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


TOL = {np.float32: 2e-5, np.float16: 2e-3}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(17, 19), (19, 17), (16, 16), (1, 33)], ids=lambda ls: f"L{ls[0]}S{ls[1]}")
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_numpy_reference(dtype, heads, lengths, is_causal):
    rng = np.random.default_rng(1)
    (hq, hkv), (L, S) = heads, lengths
    q, k, v = rand(rng, (2, hq, L, 8), dtype), rand(rng, (2, hkv, S, 8), dtype), rand(rng, (2, hkv, S, 8), dtype)
    out = af.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hq != hkv)
    assert out.dtype == dtype and out.shape == (2, hq, L, 8)
    want = numpy_sdpa(q, k, v, is_causal=is_causal)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_views_scale_and_value_head_dim():
    rng = np.random.default_rng(2)
    q_nhd, k_nhd = rand(rng, (2, 9, 3, 16), np.float32), rand(rng, (2, 11, 3, 16), np.float32)
    v_big = rand(rng, (2, 3, 22, 6), np.float32)
    q, k, v = q_nhd.transpose(0, 2, 1, 3), k_nhd.transpose(0, 2, 1, 3), v_big[:, :, ::2, :]   # no copies
    out = af.scaled_dot_product_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(out, numpy_sdpa(q, k, v, scale=0.3), atol=2e-5, rtol=2e-5)


def test_bool_and_additive_masks():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (1, 2, 5, 8), np.float32), rand(rng, (1, 2, 7, 8), np.float32), rand(rng, (1, 2, 7, 8), np.float32)
    bool_mask = rng.random((5, 7)) < 0.7
    bool_mask[:, 0] = True   # every row sees a key (PyTorch's math path gives NaN otherwise)
    np.testing.assert_allclose(af.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
                               numpy_sdpa(q, k, v, mask=bool_mask), atol=2e-5)
    additive = rand(rng, (1, 1, 5, 7), np.float32)
    np.testing.assert_allclose(af.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                               numpy_sdpa(q, k, v, mask=additive), atol=2e-5)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (1, 1, 3, 4), np.float32), rand(rng, (1, 1, 5, 4), np.float32), rand(rng, (1, 1, 5, 4), np.float32)
    mask = np.ones((3, 5), dtype=bool)
    mask[1] = False
    out, lse = af.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert lse.dtype == np.float32 and lse.shape == (1, 1, 3)
    assert np.all(out[0, 0, 1] == 0) and lse[0, 0, 1] == -np.inf
    assert np.all(np.isfinite(lse[0, 0, [0, 2]]))


def test_output_given_is_written_in_place():
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, (1, 2, 4, 8), np.float32) for _ in range(3))
    out = np.full((1, 2, 4, 8), np.nan, dtype=np.float32)
    result = af.scaled_dot_product_attention(q, k, v, out=out)
    assert result is out and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, numpy_sdpa(q, k, v), atol=2e-5)


def test_reference_agrees_with_kernel():
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (1, 2, 33, 16), np.float32), rand(rng, (1, 2, 40, 16), np.float32), rand(rng, (1, 2, 40, 16), np.float32)
    fast = af.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = af.scaled_dot_product_attention_reference(q, k, v, is_causal=True)
    np.testing.assert_allclose(fast, ref, atol=2e-6)


def test_bottom_right_causal_is_an_explicit_option():
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (1, 1, 3, 4), np.float32), rand(rng, (1, 1, 6, 4), np.float32), rand(rng, (1, 1, 6, 4), np.float32)
    out = af.scaled_dot_product_attention(q, k, v, causal_bottom_right=True)
    mask = np.tril(np.ones((3, 6), dtype=bool), k=6 - 3)   # row i sees j <= i + S - L
    np.testing.assert_allclose(out, numpy_sdpa(q, k, v, mask=mask), atol=2e-5)
    with pytest.raises(af.InvalidArgumentError, match="pick one alignment"):
        af.scaled_dot_product_attention(q, k, v, is_causal=True, causal_bottom_right=True)


# ---- errors: C statuses become Python exceptions with af_last_error()'s message

def test_errors_name_the_argument_and_the_rule():
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(af.InvalidArgumentError, match="key: head dimension 7 does not match query's 8") as e:
        af.scaled_dot_product_attention(q, np.zeros((1, 2, 4, 7), np.float32), np.zeros((1, 2, 4, 8), np.float32))
    assert isinstance(e.value, ValueError) and isinstance(e.value, af.Error)
    with pytest.raises(af.InvalidArgumentError, match="enable_gqa is false"):   # 1 head would broadcast
        af.scaled_dot_product_attention(q, np.zeros((1, 3, 4, 8), np.float32), np.zeros((1, 3, 4, 8), np.float32))
    with pytest.raises(af.UnsupportedError, match="dropout_p") as e:
        af.scaled_dot_product_attention(q, q.copy(), q.copy(), dropout_p=0.1)
    assert isinstance(e.value, NotImplementedError)
    with pytest.raises(af.InvalidArgumentError, match="query: expected at least 2 dimensions"):
        af.scaled_dot_product_attention(q[0, 0, 0], q[0], q[0])


def test_misaligned_arrays_are_refused_and_nothing_is_written():
    raw = np.zeros(4 * 64 + 1, np.uint8)
    odd = np.frombuffer(raw, np.float32, count=64, offset=1).reshape(1, 2, 4, 8)   # float32 one byte off
    q = np.ones((1, 2, 4, 8), np.float32)
    out = np.full((1, 2, 4, 8), 7.0, np.float32)
    with pytest.raises(af.InvalidArgumentError, match="key: data at 0x[0-9a-f]+ is not aligned to its 4-byte float32"):
        af.scaled_dot_product_attention(q, odd, q, out=out)
    assert (out == 7.0).all()
    out_raw = np.zeros(4 * 64 + 2, np.uint8)
    odd_out = np.frombuffer(out_raw, np.float32, count=64, offset=2).reshape(1, 2, 4, 8)
    with pytest.raises(af.InvalidArgumentError, match="out: data at"):
        af.scaled_dot_product_attention(q, q, q, out=odd_out)
    assert not out_raw.any()


def test_unsupported_buffers_and_non_tensors():
    q = np.zeros((1, 1, 2, 4), np.float64)
    with pytest.raises(af.UnsupportedError, match="query: buffer format 'd' is not supported"):
        af.scaled_dot_product_attention(q, q, q)
    with pytest.raises(TypeError, match="key: expected a tensor"):
        af.scaled_dot_product_attention(q.astype(np.float32), [1, 2], q.astype(np.float32))
    f = np.zeros((1, 1, 2, 4), np.float32)
    read_only = np.zeros((1, 1, 2, 4), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        af.scaled_dot_product_attention(f, f.copy(), f.copy(), out=read_only)
    with pytest.raises(af.InvalidArgumentError, match="out: overlaps query's memory"):
        af.scaled_dot_product_attention(f, f.copy(), f.copy(), out=f)


# ---- the provider on NumPy arrays

def test_provider_on_numpy_arrays():
    rng = np.random.default_rng(8)
    q = rand(rng, (2, 5, 4, 8), np.float32).transpose(0, 2, 1, 3)   # HND views of NHD-contiguous memory
    k = rand(rng, (2, 6, 4, 8), np.float32).transpose(0, 2, 1, 3)
    v = rand(rng, (2, 6, 4, 8), np.float32).transpose(0, 2, 1, 3)
    provider = af.FlashAttention4KernelProvider()
    assert provider.prepare([((q, k, v), {"is_causal": True})])
    assert provider.to_dict()["copy_free_layout"] is True
    np.testing.assert_allclose(provider(q, k, v, is_causal=True), numpy_sdpa(q, k, v, is_causal=True), atol=2e-5)
    restored = af.FlashAttention4KernelProvider.from_dict(json.loads(json.dumps(provider.to_dict())))
    np.testing.assert_allclose(restored(q, k, v, is_causal=True), numpy_sdpa(q, k, v, is_causal=True), atol=2e-5)


def test_samples_file_round_trip(tmp_path):
    q = np.zeros((1, 2, 3, 4), np.float16)
    samples = [((q, q, q), {"is_causal": True, "scale": 0.5}), ((), {"query": q, "key": q, "value": q})]
    af.save_samples(samples, tmp_path / "samples.json", counts=[3, 1])
    data = af.load_samples(tmp_path / "samples.json")
    first = data["samples"][0]
    assert first["count"] == 3 and first["kwargs"] == {"is_causal": True, "scale": 0.5}
    assert first["args"][0]["shape"] == [1, 2, 3, 4] and first["args"][0]["dtype"] == "float16"
    assert set(data["samples"][1]["kwargs"]) == {"query", "key", "value"}


def test_numpy_tier_does_not_import_torch():
    code = ("import sys, numpy, attnforge\n"
            "attnforge.scaled_dot_product_attention(*(numpy.zeros((1, 1, 2, 4), numpy.float32) for _ in range(3)))\n"
            "assert 'torch' not in sys.modules, 'attnforge imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_c_messages_reach_python_only_at_the_loggers_level(monkeypatch):
    """The kernel driver logs a DEBUG line a call: handed to Python (the GIL, a logging call) only when the "attnforge"
    logger would keep it, so a plain call pays nothing for logging it does not show."""
    import logging
    logger = logging.getLogger("attnforge")
    handed = []
    monkeypatch.setattr(logger, "log", lambda level, message, *a, **k: handed.append((level, message)))
    q = np.ones((1, 2, 3, 8), dtype=np.float32)
    old = logger.level
    try:
        logger.setLevel(logging.WARNING)
        af.scaled_dot_product_attention(q, q, q)
        assert handed == []
        logger.setLevel(logging.DEBUG)
        af.scaled_dot_product_attention(q, q, q)
        assert any(level == logging.DEBUG and message.startswith("flash: isa") for level, message in handed)
    finally:
        logger.setLevel(old)
