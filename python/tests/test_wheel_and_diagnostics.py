"""The wheel carries the CUDA backend: `pip install .` on a machine with nvcc puts libattnforge_cuda.so inside the
package, the package finds it with ATTNFORGE_CUDA_LIBRARY unset, the variable still wins, and `python -m attnforge`
reports it with the rest of what a bug report needs. Each check runs in a fresh interpreter: the C loader reads the
environment when it loads, and keeps a backend that could run for the rest of the process."""
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

import attnforge

PACKAGE = os.path.realpath(os.path.dirname(attnforge.__file__))
CARRIED = os.path.join(PACKAGE, "libattnforge_cuda.so")
# where CMake looks for nvcc: PATH, then the toolkit's default place
NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.access(p, os.X_OK)), None)
# what the loader says once it has loaded the library, on a machine without a driver or a GPU (docs/CUDA.md)
DRIVER_OR_GPU_MISSING = ("found no NVIDIA driver", "needs a newer NVIDIA driver", "found no CUDA GPU")
LOAD = "import json; from attnforge import _C; print(json.dumps(_C.load_cuda_backend()))"


def run_python(args, tmp_path, **env_changes):
    """`python ARGS` in tmp_path with ATTNFORGE_CUDA_LIBRARY and ATTNFORGE_ISA unset unless given; its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNFORGE_CUDA_LIBRARY", "ATTNFORGE_ISA")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def load_backend(tmp_path, **env_changes):
    """(devices, library, error) of _C.load_cuda_backend() in a fresh interpreter."""
    return tuple(json.loads(run_python(["-c", LOAD], tmp_path, **env_changes)))


def assert_loaded_but_no_gpu_or_ready(devices, error):
    if error is None:
        assert devices >= 1
    else:
        assert any(reason in error for reason in DRIVER_OR_GPU_MISSING), error


def report_sections(text):
    """`python -m attnforge`'s output as {section title: {key: value}}."""
    sections = {}
    for block in text.strip().split("\n\n"):
        title, *rows = block.splitlines()
        sections[title] = {}
        for row in rows:
            assert row.startswith("  "), f"{title}: a row that is not '  key: value': {row!r}"
            key, _, value = row.strip().partition(":")
            sections[title][key] = value.strip()
    return sections


def test_the_wheel_carries_the_backend_where_nvcc_was_there():
    if not NVCC:
        pytest.skip("no nvcc on PATH or at /usr/local/cuda/bin: this build is CPU-only, and carries no backend")
    assert os.path.isfile(CARRIED), (f"nvcc is at {NVCC}, but the installed package {PACKAGE} holds no "
                                     "libattnforge_cuda.so (was it built with -C cmake.define.AF_WITH_CUDA=OFF?)")


def test_the_package_finds_its_backend_without_the_variable(tmp_path):
    if not os.path.isfile(CARRIED):
        pytest.skip(f"{PACKAGE} carries no libattnforge_cuda.so (built without nvcc)")
    devices, library, error = load_backend(tmp_path)
    assert os.path.realpath(library) == CARRIED, error
    assert_loaded_but_no_gpu_or_ready(devices, error)


def test_a_cpu_only_package_says_where_it_looked(tmp_path):
    if os.path.isfile(CARRIED):
        pytest.skip(f"{PACKAGE} carries libattnforge_cuda.so (the test above loads it)")
    devices, library, error = load_backend(tmp_path)
    if library:
        pytest.skip(f"a libattnforge_cuda.so on the library search path was loaded instead: {library}")
    assert (devices, library) == (0, "")
    assert f"libattnforge_cuda.so was found neither at {CARRIED}" in error, error


def test_the_variable_wins_over_the_package(tmp_path):
    missing = str(tmp_path / "missing" / "libattnforge_cuda.so")
    devices, library, error = load_backend(tmp_path, ATTNFORGE_CUDA_LIBRARY=missing)
    assert (devices, library) == (0, "")
    assert f"ATTNFORGE_CUDA_LIBRARY={missing} could not be opened" in error, error
    if not os.path.isfile(CARRIED):
        return   # nothing in the package to win over: the message above shows the variable alone was tried
    copy = tmp_path / "elsewhere" / "libattnforge_cuda.so"
    copy.parent.mkdir()
    shutil.copyfile(CARRIED, copy)
    devices, library, error = load_backend(tmp_path, ATTNFORGE_CUDA_LIBRARY=str(copy))
    assert library == str(copy), error
    assert_loaded_but_no_gpu_or_ready(devices, error)
    report = report_sections(run_python(["-m", "attnforge"], tmp_path, ATTNFORGE_CUDA_LIBRARY=str(copy)))
    backend = report["CUDA backend"]
    assert backend["ATTNFORGE_CUDA_LIBRARY"] == str(copy)
    assert backend["loaded"] == f"{copy} (ATTNFORGE_CUDA_LIBRARY)"
    assert backend["in this package"] == CARRIED


def version_or_missing(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_python_m_attnforge_reports_each_section(tmp_path):
    sections = report_sections(run_python(["-m", "attnforge"], tmp_path))
    assert list(sections) == [f"attnforge {attnforge.__version__}", "CPU kernels", "CUDA backend",
                              "NVIDIA driver and GPUs", "Python packages"]
    about = sections[f"attnforge {attnforge.__version__}"]
    assert os.path.realpath(about["package"]) == PACKAGE
    assert about["Python"].startswith(platform.python_version() + " ")
    assert about["platform"] == platform.platform()

    cpu = sections["CPU kernels"]
    best = [isa for isa in attnforge.isas() if attnforge.isa_available(isa)][-1]
    assert cpu["ISA in use"] == f"{best}: the best ISA of this build that this CPU and OS run"
    for isa in attnforge.isas():
        runs = "runs here" if attnforge.isa_available(isa) else "not on this machine"
        assert f"{isa} ({runs})" in cpu["ISAs built"]

    backend = sections["CUDA backend"]
    assert backend["ATTNFORGE_CUDA_LIBRARY"] == "unset"
    if os.path.isfile(CARRIED):
        assert backend["in this package"] == CARRIED
        assert backend["loaded"] == f"{CARRIED} (inside this package)"
    else:
        assert backend["in this package"].startswith("no ")
    status = backend["status"]
    assert status.startswith("ready, ") or any(reason in status for reason in DRIVER_OR_GPU_MISSING), status

    driver = sections["NVIDIA driver and GPUs"]
    assert "driver" in driver and "CUDA_VISIBLE_DEVICES" in driver
    if driver["driver"].startswith("none: libcuda.so.1 could not be loaded"):
        assert "GPU 0" not in driver

    packages = sections["Python packages"]
    for name in ("transformers", "aitune", "numpy"):
        assert packages[name] == version_or_missing(name)
    try:
        import torch
    except ImportError:
        assert packages["torch"] == "not installed"
    else:
        assert packages["torch"].startswith(torch.__version__ + " (")


@pytest.mark.parametrize("wanted", ["portable", "avx9"])
def test_the_report_says_why_this_isa(tmp_path, wanted):
    cpu = report_sections(run_python(["-m", "attnforge"], tmp_path, ATTNFORGE_ISA=wanted))["CPU kernels"]
    if wanted == "portable":
        assert cpu["ISA in use"] == "portable: ATTNFORGE_ISA=portable asked for it"
    else:
        best = [isa for isa in attnforge.isas() if attnforge.isa_available(isa)][-1]
        assert cpu["ISA in use"] == (f"{best}: ATTNFORGE_ISA=avx9 is not available here, so the best ISA of this "
                                     "build that this CPU and OS run")


def test_the_report_names_the_drivers_error(tmp_path):
    # the toolkit's stub libcuda answers every call with CUDA_ERROR_STUB_LIBRARY (34): the ctypes calls run for real
    stub = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC or "/"))), "lib64", "stubs", "libcuda.so")
    if not os.path.isfile(stub):
        pytest.skip("no CUDA toolkit with a stub libcuda.so here")
    (tmp_path / "libcuda.so.1").symlink_to(stub)
    report = report_sections(run_python(["-m", "attnforge"], tmp_path, LD_LIBRARY_PATH=str(tmp_path)))
    driver = report["NVIDIA driver and GPUs"]
    assert driver["driver"].startswith("libcuda.so.1 loaded, but cuDriverGetVersion: "), driver
    assert driver["GPUs"].startswith("none: cuInit: ") and "34" in driver["GPUs"], driver


def test_python_m_attnforge_runs_without_torch(tmp_path):
    # -S: no site-packages, so the interpreter sees attnforge (through PYTHONPATH) and the standard library only
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "attnforge").symlink_to(PACKAGE)
    sections = report_sections(run_python(["-S", "-m", "attnforge"], tmp_path, PYTHONPATH=str(alone)))
    packages = sections["Python packages"]
    assert [packages[name] for name in ("torch", "transformers", "numpy")] == ["not installed"] * 3
    if os.path.isfile(CARRIED):
        assert sections["CUDA backend"]["loaded"] == f"{CARRIED} (inside this package)"
