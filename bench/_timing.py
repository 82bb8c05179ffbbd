"""Timing shared by the side-by-side benchmarks (vllm_compare.py, flex_compare.py)."""
import statistics
import time


def timed_loops(fns, target_s=0.3, repeats=7):
    """Median seconds per call of each fn: loops of n calls, n sized so that one loop of fns[0] takes ~target_s,
    the order alternating between repeats so that drift hits every fn alike."""
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    fns[0]()
    n = max(1, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    samples = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            for _ in range(n):
                fns[i]()
            samples[i].append((time.perf_counter() - t0) / n)
    return [statistics.median(s) for s in samples]
