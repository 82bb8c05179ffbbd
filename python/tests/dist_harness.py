"""Multi-process tests on one machine: W processes (spawned, not forked: torch and attnforge's thread pools do not
survive a fork), a gloo group over loopback initialised from a fresh file, one thread each (CI has 2 cores and W
reaches 4), and a hard deadline: a rank that hangs fails the test instead of the CI job.

    results = run_group(module_function, world, *args, timeout=120)

module_function(rank, world, *args) runs on every rank inside the group (a module-level function of an importable
test module, so that spawn can find it); its return values come back in rank order. An exception on a rank comes back
as RankFailure with that rank's traceback."""
import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

TESTS = os.path.dirname(os.path.abspath(__file__))


class RankFailure(AssertionError):
    pass


def _entry(function, rank, world, init_file, group_timeout, args, result_path):
    sys.path.insert(0, TESTS)
    outcome = None
    try:
        import torch
        import torch.distributed as dist
        import attnforge
        torch.set_num_threads(1)
        attnforge.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout))
        try:
            outcome = ("ok", function(rank, world, *args))
        finally:
            if outcome is not None:   # a rank that failed leaves without the barrier (its peers see it go)
                dist.destroy_process_group()
    except BaseException:   # noqa: B902 (everything is reported, the process then exits)
        outcome = ("error", traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)
    sys.stdout.flush()
    os._exit(0)


def run_group(function, world, *args, timeout=120, group_timeout=60, expect_errors=False):
    """function(rank, world, *args) on `world` spawned ranks; the list of their results. Raises RankFailure naming
    each rank that raised (unless expect_errors: then a list of ("ok", value) / ("error", traceback) comes back), and
    when any rank is still running after `timeout` seconds (all are killed)."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [context.Process(target=_entry, args=(function, r, world, init_file, group_timeout, args, paths[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise RankFailure(f"ranks {hung} of {world} were still running after {timeout} s (a hang)")
        outcomes = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                outcomes.append(("error", f"rank {r} exited with code {procs[r].exitcode} and no result"))
                continue
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
    if expect_errors:
        return outcomes
    failures = [f"--- rank {r}:\n{value}" for r, (kind, value) in enumerate(outcomes) if kind != "ok"]
    if failures:
        raise RankFailure("\n".join(failures))
    return [value for _, value in outcomes]
