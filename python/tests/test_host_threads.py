"""attnforge's parallel work on torch's OpenMP threads (issue 39): lent when torch is imported in either order, the
work runs on the threads torch's own operators use (no thread of attnforge's made), with torch's thread count unless
attnforge's is set; calls from inside torch's OpenMP region, from several Python threads at once and from
torch.utils.data workers neither deadlock nor change a bit; ATTNFORGE_HOST_THREADS=0 / set_host_threads(False) keep
attnforge's own pool. Deadlocks fail the test through join and subprocess timeouts."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import attnforge as af  # noqa: E402
from attnforge import _C  # noqa: E402

if not (torch.backends.openmp.is_available() and "parallel backend: OpenMP" in torch.__config__.parallel_info()):
    pytest.skip("torch runs its parallel work without OpenMP: attnforge keeps its own pool", allow_module_level=True)

TIMEOUT = 300   # seconds: a deadlock, not a slow machine (each case runs well under a second)


def _torch_openmp_runtime():
    """The libgomp mapped from torch's own lib/ (what its CPU wheels ship), or None (a torch built elsewhere)."""
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libgomp") and os.path.dirname(os.path.realpath(path)) == torch_lib:
                return os.path.realpath(path)
    return None


@pytest.fixture
def host_threads():
    """Host threads on, attnforge's count unset, torch at 2 threads; restored afterwards."""
    torch_threads = torch.get_num_threads()
    af.set_host_threads(True)
    af.set_num_threads(0)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(torch_threads)
    af.set_num_threads(0)
    af.set_host_threads(True)
    _C._testing_host_record(False)


@pytest.fixture(autouse=True)
def every_call_threaded(monkeypatch):
    """The test shapes are small: run them on every thread anyway (driver.c's threads_worth_waking)."""
    monkeypatch.setenv("ATTNFORGE_MIN_FLOPS_PER_THREAD", "0")


def test_torch_runtime_is_lent():
    runtime = af.get_host_threads()
    assert runtime is not None, "torch is imported and runs on libgomp, yet attnforge kept its own pool"
    assert os.path.basename(runtime).startswith("libgomp")
    expected = _torch_openmp_runtime()
    if expected:
        assert os.path.realpath(runtime) == expected


def test_switching_off_and_on(host_threads):
    af.set_host_threads(False)
    assert af.get_host_threads() is None
    q = torch.randn(1, 4, 64, 32)
    _C._testing_host_record(True)
    af.scaled_dot_product_attention(q, q, q)
    assert _C._testing_host_counts()["regions"] == 0   # the own pool ran it
    af.set_host_threads(True)
    assert af.get_host_threads() is not None
    af.scaled_dot_product_attention(q, q, q)
    assert _C._testing_host_counts()["regions"] >= 1


def test_thread_count_follows_torch(host_threads):
    q = torch.randn(1, 8, 128, 32)
    for n in (1, 3, 2):
        torch.set_num_threads(n)
        assert af.get_num_threads() == n
        _C._testing_host_record(True)
        af.scaled_dot_product_attention(q, q, q)
        counts = _C._testing_host_counts()
        assert counts["regions"] == (0 if n == 1 else 1)   # one thread: on the caller, no region
        assert counts["members"] == (0 if n == 1 else n)
    af.set_num_threads(3)   # attnforge's own setting wins over torch's
    torch.set_num_threads(1)
    assert af.get_num_threads() == 3
    _C._testing_host_record(True)
    af.scaled_dot_product_attention(q, q, q)
    assert _C._testing_host_counts()["members"] == 3


# A fresh interpreter: which threads exist after torch's first parallel operator, and which ran attnforge's work.
THREAD_PROBE = textwrap.dedent("""
    import json, os, sys, threading
    order = sys.argv[1]
    if order == "attnforge-first":
        import attnforge as af
        import torch
    else:
        import torch
        import attnforge as af
    from attnforge import _C
    def tasks():
        return {int(t) for t in os.listdir("/proc/self/task")}
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    before_torch = tasks()
    (a @ a).sum()                        # torch's OpenMP team is made here
    after_torch = tasks()
    _C._testing_host_record(True)
    q = torch.randn(1, 8, 256, 64)
    out = af.scaled_dot_product_attention(q, q, q)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    print(json.dumps({"runtime": af.get_host_threads(), "main": threading.get_native_id(),
                      "torch_made": sorted(after_torch - before_torch), "after_torch": sorted(after_torch),
                      "after_attnforge": sorted(tasks()), "counts": _C._testing_host_counts(),
                      "error": float((out - ref).abs().max())}))
""")


def _probe(order, host_threads_env=None):
    env = dict(os.environ, ATTNFORGE_MIN_FLOPS_PER_THREAD="0", OMP_NUM_THREADS="2")
    env.pop("ATTNFORGE_HOST_THREADS", None)
    if host_threads_env is not None:
        env["ATTNFORGE_HOST_THREADS"] = host_threads_env
    run = subprocess.run([sys.executable, "-c", THREAD_PROBE, order], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["attnforge-first", "torch-first"])
def test_work_runs_on_torchs_openmp_threads(order):
    seen = _probe(order)
    assert seen["runtime"] is not None
    assert seen["error"] < 1e-4
    counts = seen["counts"]
    assert counts["regions"] == 1 and counts["members"] == 2
    ran_on = set(counts["thread_ids"])
    assert seen["main"] in ran_on   # the caller is one of the threads (thread 0 of the team)
    workers = ran_on - {seen["main"]}
    assert workers and workers <= set(seen["torch_made"]), "attnforge's work ran off torch's OpenMP threads"
    assert seen["after_attnforge"] == seen["after_torch"], "attnforge made threads of its own"


def test_own_pool_when_switched_off_by_the_environment():
    seen = _probe("torch-first", host_threads_env="0")
    assert seen["runtime"] is None
    assert seen["counts"]["regions"] == 0
    assert len(seen["after_attnforge"]) > len(seen["after_torch"]), "attnforge's own pool made no worker"


# ---- bits: whatever runs the work, the same bytes as one thread of attnforge's own pool

def _cases():
    g = torch.Generator().manual_seed(39)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        # prefill: (1,16,L,64) HND views of NHD memory, as a transformer hands them
        q, k, v = (torch.randn(1, 160, 16, 64, generator=g).to(dtype).transpose(1, 2) for _ in range(3))
        cases.append(((q, k, v), {"is_causal": True}))
        # decode: one query row over a long cache (split-KV: two parallel-fors a call)
        q = torch.randn(1, 16, 1, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 4, 2100, 64, generator=g).to(dtype) for _ in range(2))
        cases.append(((q, k, v), {"enable_gqa": True}))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def expected():
    """Each case on one thread of attnforge's own pool."""
    af.set_host_threads(False)
    af.set_num_threads(1)
    try:
        return [af.scaled_dot_product_attention(*args, **kw) for args, kw in CASES]
    finally:
        af.set_num_threads(0)
        af.set_host_threads(True)


def _bits_equal(a, b):
    """Same shape, dtype and bytes (NaN == NaN, -0 != +0)."""
    as_int = {2: torch.int16, 4: torch.int32}
    return (a.shape == b.shape and a.dtype == b.dtype and
            torch.equal(a.contiguous().view(as_int[a.element_size()]), b.contiguous().view(as_int[b.element_size()])))


def test_bits_equal_across_torch_thread_counts(host_threads, expected):
    assert af.get_host_threads() is not None
    for n in (1, 2, 3, 4):
        torch.set_num_threads(n)
        _C._testing_host_record(True)
        for i, (args, kw) in enumerate(CASES):
            assert _bits_equal(af.scaled_dot_product_attention(*args, **kw), expected[i]), (n, i)
        if n > 1:
            assert _C._testing_host_counts()["regions"] >= len(CASES)   # they did run on torch's team


def test_calls_from_inside_torchs_parallel_region(host_threads, expected):
    """Each thread of one of torch's OpenMP regions calls attnforge (a nested region: a team of one, or the caller
    alone when another call's work is in flight)."""
    results = {}

    def member(index):
        outs = []
        for r in range(3):
            i = (index + r) % len(CASES)
            args, kw = CASES[i]
            outs.append((i, af.scaled_dot_product_attention(*args, **kw)))
        return outs

    def region():
        results["value"] = _C._testing_host_region(4, member)

    t = threading.Thread(target=region, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "attnforge called from inside torch's OpenMP region deadlocked"
    members = results["value"]
    ran = [m for m in members if m is not None]
    assert ran, "the region ran no member"
    for m in ran:
        assert not isinstance(m, BaseException), repr(m)
        for i, out in m:
            assert _bits_equal(out, expected[i]), i


def test_several_python_threads_at_once(host_threads, expected):
    wrong, errors = [], []

    def caller(first):
        try:
            for r in range(8):
                i = (first + r) % len(CASES)
                args, kw = CASES[i]
                a = torch.randn(64, 64)
                (a @ a).sum()   # torch's own parallel work on this thread too, between the calls
                if not _bits_equal(af.scaled_dot_product_attention(*args, **kw), expected[i]):
                    wrong.append((first, r))
        except BaseException as e:   # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "concurrent calls deadlocked"
    assert not errors, errors
    assert not wrong


class _AttentionDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        args, kw = CASES[i % len(CASES)]
        return i % len(CASES), af.scaled_dot_product_attention(*args, **kw)


@pytest.mark.parametrize("on_torch_threads", [True, False])
def test_calls_from_data_loader_workers(host_threads, expected, on_torch_threads):
    """torch.utils.data's worker processes (forked after torch's and attnforge's threads ran here) call attnforge, on
    torch's threads or on attnforge's own pool (whose workers the child does not have)."""
    af.set_host_threads(on_torch_threads)
    a = torch.randn(128, 128)
    (a @ a).sum()
    af.scaled_dot_product_attention(*CASES[0][0], **CASES[0][1])   # both teams exist before the fork
    loader = torch.utils.data.DataLoader(_AttentionDataset(), batch_size=None, num_workers=2, timeout=TIMEOUT)
    for i, out in loader:
        assert _bits_equal(out, expected[int(i)]), int(i)
