"""FlashAttention-4's own test reference (`flash_attn/cute/testing.py` of the `flash-attn-4` wheel: attention_ref,
generate_qkv, generate_random_padding_mask, ...), loaded for python/tests/test_fa4_peer_suite.py, plus the tolerance
rule FA4's forward tests apply with it.

The wheel's package `__init__` imports FA4's interface, which needs NVIDIA's CUTLASS DSL (a GPU toolchain); testing.py
itself needs only torch and einops. So the module is imported normally where that works, else loaded from its file."""
import ast
import importlib
import importlib.metadata
import importlib.util

import torch

PINNED = "4.0.0b27"   # the version scripts/test-python.sh installs and the suite was ported from


def load_testing():
    """(module, None) with FA4's testing module, or (None, why) when it cannot be had here."""
    try:
        dist = importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None, (f"flash-attn-4 is not installed (scripts/test-python.sh installs flash-attn-4=={PINNED} "
                      "with --no-deps, plus einops)")
    try:
        import einops  # noqa: F401  (testing.py's only dependency beside torch)
    except ImportError:
        return None, "einops is not installed (FA4's testing.py needs it)"
    try:
        return importlib.import_module("flash_attn.cute.testing"), None
    except ImportError:
        pass   # no CUTLASS DSL here: the package __init__ fails; the file alone does not need it
    path = dist.locate_file("flash_attn/cute/testing.py")
    if not path.is_file():
        return None, f"flash-attn-4 {dist.version} has no flash_attn/cute/testing.py at {path}"
    spec = importlib.util.spec_from_file_location("_fa4_cute_testing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, None


def load_window_resolution():
    """FA4's own `_resolve_causal_local_window(causal, left, right, mask_mod=None) -> (causal, local, left, right)`,
    compiled alone from the wheel's flash_attn/cute/interface.py (the module imports the CUTLASS DSL; this function
    uses nothing), or None if the file or the function is not there. attention_ref masks whatever window it is given;
    FA4's interface resolves (causal, window_size) first (a pair of ints summing below zero is no window), so a test
    passing such a pair builds its reference from this resolution."""
    try:
        path = importlib.metadata.distribution("flash-attn-4").locate_file("flash_attn/cute/interface.py")
        source = path.read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_resolve_causal_local_window":
            namespace = {}
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
            return namespace[node.name]
    return None


def fa4_version():
    return importlib.metadata.version("flash-attn-4")


def within_fa4_bound(actual, ref, pt, rtol, atol=None):
    """FA4's forward check: max|actual - ref| <= rtol * max|pt - ref| + atol, where ref is the reference in a higher
    precision (rounded to the output's dtype, as FA4 does) and pt the same reference computed in the inputs' dtype;
    atol defaults to FA4's 2 * the rounding error of an arithmetic round trip on ref. Returns (ok, message)."""
    assert actual.shape == ref.shape == pt.shape, (actual.shape, ref.shape, pt.shape)
    if ref.numel() == 0:
        return True, ""
    if atol is None:
        atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    # the differences themselves in float64 (FA4 subtracts in the output dtype; exact or finer here)
    diff = (actual.double() - ref.double()).abs().max().item()
    diff_pt = (pt.double() - ref.double()).abs().max().item()
    bound = rtol * diff_pt + atol
    return diff <= bound, (f"max|attnforge - ref| = {diff:.3g} > {rtol} * max|pytorch - ref| ({diff_pt:.3g}) "
                           f"+ {atol:.3g}")


def within_fa4_ulp_bound(actual, ref, pt, rtol):
    """FA4's check for a float32 value per head or row (check_dsink_vs_ref, used for dSink): elementwise
    |actual - ref| <= rtol * max|pt - ref| + 2 ulp(ref). The LSE is such a value; FA4's output atol (a round trip
    through + 0.3) can be 0 on it where both references agree exactly. Returns (ok, message)."""
    assert actual.shape == ref.shape == pt.shape, (actual.shape, ref.shape, pt.shape)
    if ref.numel() == 0:
        return True, ""
    ulp = torch.nextafter(ref.abs(), torch.full_like(ref, float("inf"))) - ref.abs()
    diff = (actual.double() - ref.double()).abs()
    diff_pt = (pt.double() - ref.double()).abs().max().item()
    excess = diff - (rtol * diff_pt + 2 * ulp.double())
    worst = int(excess.argmax())
    ok = bool((excess <= 0).all())
    return ok, (f"|attnforge - ref| = {diff.flatten()[worst].item():.3g} at {worst} > {rtol} * max|pytorch - ref| "
                f"({diff_pt:.3g}) + 2 ulp ({2 * ulp.flatten()[worst].item():.3g})")
