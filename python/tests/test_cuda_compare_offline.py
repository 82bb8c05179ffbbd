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
    got = run("--before-after", "--dry-run", "--budget", "205", "--baseline-missing", "no sources")   # 220 - 15
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
    assert ("| prefill | 2 | 16 | 8192 | 8192 | 128 | bfloat16 | no | 400 | 500 | 450 | 625 | 1.25 | 0.80 | 3.9e-03 | "
            "NaN |") in md
    assert ("| paged decode | 16 | 32/8 | 1 | 8192 | 128 | bfloat16 | no | - | 0.75 | - | 0.50 | - | 1.50 | - | "
            "- |") in md
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


def test_the_rows_inputs_and_the_float64_reference_on_the_cpu(cc, monkeypatch):
    """What the GPU run relies on, checked with CPU tensors: every process draws the same inputs for a row, the paged
    row's dense K/V are its pages in the table's order, and reference_errors measures against softmax(q·kᵀ)·v in
    float64 with GQA and top-left causal masking, across chunks of rows, NaN included."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(cc, "DEVICE", "cpu")
    paged = dict(kind="paged decode", dtype="bfloat16", B=3, Hq=4, Hkv=2, L=1, S=40, E=16, causal=False,
                 page_size=16)
    t, again = cc.ba_inputs(paged), cc.ba_inputs(paged)
    assert all(torch.equal(t[n], again[n]) for n in t)
    assert t["table"].dtype == torch.int32 and t["table"].shape == (3, 3)
    assert sorted(t["table"].flatten().tolist()) == list(range(9)) and t["used"].tolist() == [40] * 3
    for b in range(3):
        for j in (0, 15, 16, 39):
            page, row = t["table"][b, j // 16].item(), j % 16
            assert torch.equal(t["k"][b, :, j], t["kp"][page, row]) and torch.equal(t["v"][b, :, j], t["vp"][page, row])
    assert t["q_nhd"].shape == (3, 1, 4, 16) and torch.equal(t["q_nhd"][:, 0], t["q"][:, :, 0])

    gqa = dict(kind="gqa", dtype="float16", B=2, Hq=4, Hkv=2, L=33, S=33, E=16, causal=True, page_size=0)
    t = cc.ba_inputs(gqa)
    assert t["k"].shape == (2, 2, 33, 16) and not torch.equal(cc.ba_inputs(dict(gqa, causal=False))["q"], t["q"])
    q, k, v = t["q"], t["k"], t["v"]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           enable_gqa=True)
    for chunk in (1 << 27, 4 * 33 * 5):   # one chunk a batch; chunks of 5 rows
        worst, rel = cc.reference_errors(q, k, v, ref, True, chunk_scores=chunk)
        assert worst < 1e-12 and rel < 1e-12
        off = ref.clone()
        off[1, 3, 32, 5] += 0.5
        assert cc.reference_errors(q, k, v, off, True, chunk_scores=chunk)[0] == pytest.approx(0.5)
    full = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert cc.reference_errors(q, k, v, full, True)[0] > 1e-3      # the causal mask matters
    assert cc.reference_errors(q, k, v, full, False)[0] < 1e-12
    wrong_heads = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat(1, 2, 1, 1), v.double().repeat(1, 2, 1, 1), is_causal=True)
    assert cc.reference_errors(q, k, v, wrong_heads, True)[0] > 1e-3   # query head h reads kv head h // 2
    nan = ref.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert math.isnan(cc.reference_errors(q, k, v, nan, True)[0])
    # the float16 output of a correct kernel sits at float16's rounding from the reference
    assert cc.reference_errors(q, k, v, ref.half(), True)[0] < 2e-3
