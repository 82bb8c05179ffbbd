"""ISA selection from Python: the compiled list, every ISA this machine runs against the double reference, and the
errors for an unknown name and for an ISA the machine lacks. The previous ISA is restored after each test."""
import numpy as np
import pytest

import attnforge as af


@pytest.fixture(autouse=True)
def restore_isa():
    before = af.get_isa()
    yield
    af.set_isa(before)


def test_isas_lists_the_build_from_portable_up():
    names = af.isas()
    assert names[0] == "portable"
    assert len(names) == len(set(names))
    assert set(names) <= {"portable", "avx2", "avx512", "amx"}
    assert af.get_isa() in names and af.isa_available("portable")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_available_isa_matches_the_reference(dtype):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 37, 40)).astype(dtype)
    k = rng.standard_normal((1, 2, 53, 40)).astype(dtype)
    v = rng.standard_normal((1, 2, 53, 24)).astype(dtype)
    want = af.scaled_dot_product_attention_reference(q, k, v, is_causal=True, enable_gqa=True).astype(np.float64)
    ran = []
    for name in af.isas():
        if not af.isa_available(name):
            continue
        af.set_isa(name)
        assert af.get_isa() == name
        out = af.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        tol = 2e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(out.astype(np.float64), want, atol=tol, rtol=tol, err_msg=name)
        ran.append(name)
    assert "portable" in ran


def test_unknown_isa_is_an_invalid_argument():
    with pytest.raises(af.InvalidArgumentError, match="isa"):
        af.set_isa("sse9")


def test_an_isa_this_machine_lacks_is_unsupported():
    missing = [n for n in af.isas() if not af.isa_available(n)]
    if not missing:
        pytest.skip("this machine runs every ISA compiled in")
    before = af.get_isa()
    with pytest.raises(af.UnsupportedError):
        af.set_isa(missing[0])
    assert af.get_isa() == before
