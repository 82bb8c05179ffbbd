"""bench/cuda_compare.py's before/after mode (issue 37) where there is no GPU: the shapes and the time estimate
(--dry-run, which needs no torch), the table and the CSV/JSON/markdown files made from a run's rows (--render), and
the backend processes' failures (one that cannot start, one that hangs on a row)."""
import csv
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "cuda_compare.py"
HEADER = ("| kind | B | H | L | S | E | dtype | causal | baseline | current | torch flash | cuDNN | current/baseline | "
          "current/cuDNN | err baseline | err current |")


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("cuda_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_lists_the_grid_and_fits_gpu_checks_budget():
    got = run("--before-after", "--dry-run", "--budget", "285", "--baseline-missing", "no sources")
    assert got.returncode == 0, got.stderr
    assert "74 rows" in got.stdout and ": fits" in got.stdout
    assert HEADER in got.stdout
    assert "baseline: none (no sources)" in got.stdout


def test_shapes_are_fa3s_grid_with_a_gqa_and_a_paged_row_in_order_of_importance(cc):
    shapes = cc.before_after_shapes()
    prefill = [s for s in shapes if s["kind"] == "prefill"]
    assert len(prefill) == 3 * 2 * 2 * 6 and len(shapes) == len(prefill) + 2
    assert all(s["B"] * s["L"] == 16384 and s["Hq"] * s["E"] == 2048 and s["S"] == s["L"] for s in prefill)
    assert {(s["E"], s["dtype"], s["causal"], s["L"]) for s in prefill} == {
        (E, d, c, L) for E in (64, 128, 256) for d in ("float16", "bfloat16") for c in (False, True)
        for L in (512, 1024, 2048, 4096, 8192, 16384)}
    first = shapes[0]
    assert (first["dtype"], first["E"], first["L"], first["causal"]) == ("bfloat16", 128, 8192, False)
    assert [s["kind"] for s in shapes[12:14]] == ["gqa", "paged decode"]
    assert shapes[13]["page_size"] == 16 and shapes[12]["Hq"] != shapes[12]["Hkv"]
    assert len(cc.before_after_shapes(quick=True)) == 3 * 2 * 2 * 2 + 2
    # the FLOP count is the file's FA4 formula: causal counts the keys seen, (L+1)/2 on average for L = S
    s = shapes[1]
    assert cc.shape_flops(s) == pytest.approx(2 * s["B"] * s["Hq"] * s["L"] * (s["L"] + 1) / 2 * 2 * s["E"])


def rows(cc):
    shapes = cc.before_after_shapes()
    a = dict(shapes[0], key=cc.shape_key(shapes[0]), flops=cc.shape_flops(shapes[0]), kv_bytes=0,
             baseline_tflops=400.0, current_tflops=500.0, flash_tflops=450.0, cudnn_tflops=625.0,
             current_over_baseline=1.25, current_over_cudnn=0.8, baseline_max_abs_err=3.9e-3,
             current_max_abs_err=float("nan"), current_spread=0.02, baseline_spread=0.01)
    b = dict(shapes[13], key=cc.shape_key(shapes[13]), flops=cc.shape_flops(shapes[13]), kv_bytes=1 << 29,
             baseline_tflops=None, current_tflops=0.75, flash_tflops=None, cudnn_tflops=0.5, current_kv_gbps=3000.0,
             current_over_cudnn=1.5, baseline_error="no baseline: the baseline's build failed",
             flash_error="No available kernel")
    return [a, b]


def test_table_and_files_from_a_runs_rows(cc, tmp_path):
    data = {"meta": {"device": "NVIDIA H200", "torch": "2.11.0", "samples": 5,
                     "baseline": {"name": "19c44b2", "missing": "the baseline's build failed"},
                     "current": {"name": "abc1234", "library": "build-gpu/libattnforge_cuda.so", "status": "ready"}},
            "rows": rows(cc), "skipped": ["prefill float16 ..."], "complete": False}
    cc.write_before_after(str(tmp_path), data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before_after.csv", "before_after.json", "before_after.md"]
    with open(tmp_path / "before_after.csv") as f:
        lines = list(csv.DictReader(f))
    assert [line["kind"] for line in lines] == ["prefill", "paged decode"]
    assert lines[0]["current_over_baseline"] == "1.25" and lines[1]["baseline_tflops"] == ""
    md = (tmp_path / "before_after.md").read_text()
    assert HEADER in md
    assert "| prefill | 2 | 16 | 8192 | 8192 | 128 | bfloat16 | no | 400 | 500 | 450 | 625 | 1.25 | 0.80 | 3.9e-03 | NaN |" in md
    assert "| paged decode | 16 | 32/8 | 1 | 8192 | 128 | bfloat16 | no | - | 0.75 | - | 0.50 | - | 1.50 | - | - |" in md
    assert "GB/s of K+V read" in md and "baseline: none (the baseline's build failed)" in md
    assert "flash: No available kernel" in md and "incomplete" in md and "not measured" in md
    assert "timing spread" in md
    rendered = run("--render", str(tmp_path / "before_after.json"))
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.strip() == md.strip()
    loaded = json.loads((tmp_path / "before_after.json").read_text())
    assert math.isnan(loaded["rows"][0]["current_max_abs_err"])


def test_a_backend_process_that_cannot_start_or_hangs_is_reported_not_waited_for(cc):
    gone = cc.BackendProcess("baseline", None, None, cmd=[sys.executable, "-c", "raise SystemExit(3)"])
    gone.start()
    gone.wait_ready(30)
    assert gone.dead and "exit 3" in gone.dead
    assert "no baseline process" in gone.ask({"shape": {}}, 5)["error"]
    hangs = [sys.executable, "-c", "import sys, time; print('{\"ready\": true}', flush=True); time.sleep(60)"]
    slow = cc.BackendProcess("current", None, None, restarts=1, cmd=hangs)
    slow.start()
    slow.wait_ready(30)
    assert slow.info == {"ready": True} and not slow.dead
    reply = slow.ask({"shape": {}}, 1)
    assert "TimeoutError" in reply["error"] and slow.proc is None and not slow.dead   # started again next row
    reply = slow.ask({"shape": {}}, 1)
    assert "TimeoutError" in reply["error"] and slow.dead                             # no restart left
    assert "no current process" in slow.ask({"shape": {}}, 1)["error"]
