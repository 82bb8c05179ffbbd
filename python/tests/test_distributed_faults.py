"""attnforge.distributed when the ranks of a group do not make the same call, or one of them dies or raises in the
middle of a ring call: every rank must get an error that says what happened, within the group's timeout, and every
process must exit. Each test runs one small gloo group with a short timeout and a run_group deadline, so a hang
fails the test instead of the CI job."""
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from dist_harness import run_group  # noqa: E402

GROUP_TIMEOUT = 10   # seconds a transfer may wait before gloo gives up


def outcome(call):
    """(exception type name, message, seconds until it was raised) of call(), or ("ok", "", seconds)."""
    start = time.monotonic()
    try:
        call()
    except Exception as error:   # noqa: B902 (the test asserts on the type)
        return type(error).__name__, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def tensors(shape, dtype=torch.float32, seed=0, grad=False):
    """q, k, v of one shape (the same on every rank that passes the same seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def forward_backward(fn, *args, **kwargs):
    """One ring call and its backward."""
    out = fn(*args, **kwargs)
    out.sum().backward()


# ---------------------------------------------------------------- calls that differ between ranks
def mismatched_calls(rank, world):
    """Several calls in which the last rank differs from the others in one respect, then one matching call (the
    group stays usable after a refused call): {label: outcome}."""
    import attnforge.distributed as ad
    odd_one = rank == world - 1
    shape = (1, 6 if odd_one else 4, 2, 16)
    base = (1, 4, 2, 16)
    cu = torch.tensor([0, 2, 8] if odd_one else [0, 4, 8], dtype=torch.int32)
    packed = tensors((8, 2, 16))
    return {
        "q shape": outcome(lambda: ad.zigzag_ring_flash_attn_func(*tensors(shape), causal=True)),
        "dtype": outcome(lambda: ad.ring_flash_attn_func(
            *tensors(base, torch.bfloat16 if odd_one else torch.float32))),
        "causal": outcome(lambda: ad.stripe_flash_attn_func(*tensors(base), causal=odd_one)),
        "window": outcome(lambda: ad.ring_flash_attn_func(*tensors(base), window_size=(3, -1) if odd_one
                                                          else (-1, -1))),
        "cu_seqlens": outcome(lambda: ad.ring_flash_attn_varlen_func(*packed, cu, 6, causal=True)),
        "function": outcome(lambda: (ad.stripe_flash_attn_func if odd_one else ad.ring_flash_attn_func)(
            *tensors(base))),
        "after the refusals": outcome(lambda: forward_backward(ad.zigzag_ring_flash_attn_func,
                                                               *tensors(base, grad=True), causal=True)),
    }


@pytest.mark.parametrize("world", [3])
def test_mismatched_calls_raise_on_every_rank(world):
    """Only the last rank differs; every rank raises InvalidArgumentError naming the field, none hangs."""
    per_rank = run_group(mismatched_calls, world, timeout=60, group_timeout=GROUP_TIMEOUT)
    assert len(per_rank) == world
    for rank, results in enumerate(per_rank):
        for label, (kind, message, _) in results.items():
            if label == "after the refusals":
                assert kind == "ok", f"rank {rank}: a matching call after the refused ones failed: {kind}: {message}"
                continue
            assert kind == "InvalidArgumentError", f"rank {rank}: {label}: {kind}: {message}"
            assert f"{label} differs between the ranks" in message, f"rank {rank}: {label}: {message!r}"
            assert f"rank {world - 1}:" in message, f"rank {rank}: {label}: the ranks' values not listed: {message!r}"


# ---------------------------------------------------------------- a rank that dies or raises mid-call
class Injected(RuntimeError):
    """The failure a test injects into one rank's ring call."""


def exit_now():
    os._exit(3)   # no cleanup, no goodbye to the peers: as a killed process


def raise_injected():
    raise Injected("injected failure")


def inject(at_call: int, action):
    """Make attnforge.distributed's per-block forward run action() at its at_call-th call on this rank."""
    from attnforge.distributed import _local
    original, calls = _local.forward, [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            action()
        return original(*args, **kwargs)

    _local.forward = patched


def ring_call_with_fault(rank, world, victim, fault, linger):
    """A non-causal ring call (one block a step) forward and backward on every rank; rank `victim` exits ("exit")
    or raises ("raise") at its second block, i.e. with the ring's transfers in flight. A raising victim stays
    alive `linger` seconds (its peers then wait for data that never comes) before it fails. Survivors return the
    outcome of their call."""
    import attnforge.distributed as ad
    if rank == victim:
        inject(2, exit_now if fault == "exit" else raise_injected)
    q, k, v = tensors((1, 8, 2, 16), grad=True)
    result = outcome(lambda: forward_backward(ad.ring_flash_attn_func, q, k, v))
    if rank == victim:
        time.sleep(linger)
        raise RuntimeError(f"the victim's own call ended with {result[0]}: {result[1]}")
    return result


def assert_survivors_failed_cleanly(outcomes, victim, victim_error, within):
    """Every rank but the victim returned (so it exited through the harness) with CommunicationError in time."""
    for rank, (status, value) in enumerate(outcomes):
        if rank == victim:
            assert status == "error" and victim_error in value, f"victim rank {rank}: {status}: {value}"
            continue
        assert status == "ok", f"rank {rank} did not come back cleanly:\n{value}"
        kind, message, seconds = value
        assert kind == "CommunicationError", f"rank {rank}: {kind}: {message}"
        assert "attnforge.distributed" in message and "ring" in message, f"rank {rank}: {message!r}"
        assert seconds < within, f"rank {rank}: the error took {seconds:.1f} s (limit {within} s)"


def test_rank_that_dies_mid_call():
    """Rank 1 of 3 exits inside its ring call: ranks 0 and 2 raise CommunicationError within the group timeout."""
    outcomes = run_group(ring_call_with_fault, 3, 1, "exit", 0, timeout=60, group_timeout=GROUP_TIMEOUT,
                         expect_errors=True)
    assert_survivors_failed_cleanly(outcomes, 1, "exited with code 3", GROUP_TIMEOUT + 5)


def test_rank_that_raises_mid_call_and_lingers():
    """Rank 1 of 2 raises inside its ring call and stays alive past the group timeout: rank 0 raises
    CommunicationError when its transfer times out, and both processes exit (no hang at teardown)."""
    outcomes = run_group(ring_call_with_fault, 2, 1, "raise", GROUP_TIMEOUT + 3, timeout=60,
                         group_timeout=GROUP_TIMEOUT, expect_errors=True)
    assert_survivors_failed_cleanly(outcomes, 1, "Injected: injected failure", GROUP_TIMEOUT + 5)
    assert outcomes[0][1][2] >= GROUP_TIMEOUT - 1, f"rank 0 failed before the timeout: {outcomes[0][1]}"


def test_rank_that_raises_mid_call_and_leaves():
    """Rank 1 of 2 raises inside its ring call and its process ends: rank 0 raises CommunicationError."""
    outcomes = run_group(ring_call_with_fault, 2, 1, "raise", 0, timeout=60, group_timeout=GROUP_TIMEOUT,
                         expect_errors=True)
    assert_survivors_failed_cleanly(outcomes, 1, "Injected: injected failure", GROUP_TIMEOUT + 5)


def test_the_check_can_be_switched_off_by_the_environment():
    """ATTNFORGE_DISTRIBUTED_CHECK=0 turns the per-call consistency check off at import (docs/DISTRIBUTED.md)."""
    import subprocess
    import sys
    code = "import attnforge.distributed._comm as c; print(c.checks.enabled)"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(__import__("os").environ, ATTNFORGE_DISTRIBUTED_CHECK=value)
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert got.stdout.strip() == want, (value, got.stdout, got.stderr)
