"""`python -m attnforge`: what a bug report needs. attnforge's version, the CPU kernels' ISA and why it was chosen,
the CUDA backend (which libattnforge_cuda.so was loaded, or why none could run), the NVIDIA driver and GPUs, the
versions of the packages attnforge works with, Python and the platform.

Nothing here raises on a machine without a GPU, a driver or torch: a missing piece is reported as missing.
"""
import ctypes
import importlib.metadata
import os
import platform
import sys
import warnings

from . import _C

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CUDA_LIBRARY = "libattnforge_cuda.so"
# CPU flags (/proc/cpuinfo) behind each ISA: what the processor offers, before the OS and the build have their say
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16")


def _section(title, rows):
    width = max(len(key) for key, _ in rows)
    return [title] + [f"  {key + ':':<{width + 1}} {value}" for key, value in rows]


def _attnforge():
    return _section(f"attnforge {_C.__version__}", [
        ("package", _PACKAGE_DIR),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()}) {sys.executable}"),
        ("platform", platform.platform()),
    ])


def _cpuinfo():
    """(model name, set of flags) of the first processor in /proc/cpuinfo; ("", None) where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return "", None
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model, flags


def _cpu():
    compiled = _C.isas()
    chosen = _C.get_isa()
    wanted = os.environ.get("ATTNFORGE_ISA", "")
    if wanted and wanted == chosen:
        why = f"ATTNFORGE_ISA={wanted} asked for it"
    elif wanted:
        why = f"ATTNFORGE_ISA={wanted} is not available here, so the best ISA of this build that this CPU and OS run"
    else:
        why = "the best ISA of this build that this CPU and OS run"
    model, flags = _cpuinfo()
    rows = [("CPU", model or platform.processor() or platform.machine())]
    if flags is not None:
        rows.append(("CPU flags", " ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in _CPU_FLAGS)))
    rows += [
        ("ISAs built", ", ".join(f"{name} ({'runs here' if _C.isa_available(name) else 'not on this machine'})"
                                 for name in compiled)),
        ("ISA in use", f"{chosen}: {why}"),
        ("threads", str(_C.get_num_threads())),
    ]
    return _section("CPU kernels", rows)


def _cuda_backend():
    explicit = os.environ.get("ATTNFORGE_CUDA_LIBRARY", "")
    carried = os.path.join(_PACKAGE_DIR, _CUDA_LIBRARY)
    devices, library, error = _C.load_cuda_backend()
    if not library:
        where = "none could be loaded"
    elif explicit:
        where = f"{library} (ATTNFORGE_CUDA_LIBRARY)"
    elif os.path.dirname(os.path.realpath(library)) == os.path.realpath(_PACKAGE_DIR):
        where = f"{library} (inside this package)"
    else:
        where = library
    rows = [
        ("in this package", carried if os.path.exists(carried) else "no (it was built without nvcc, or without CUDA)"),
        ("ATTNFORGE_CUDA_LIBRARY", explicit or "unset"),
        ("loaded", where),
        ("status", f"ready, {devices} GPU(s)" if error is None else f"cannot run: {error}"),
    ]
    return _section("CUDA backend", rows)


def _cuda_error(cuda, code):
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({code})"
    return f"error {code}"


def _driver_release():
    """The driver's release ("570.124.06") from NVML, or None where NVML is missing."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    version = ctypes.create_string_buffer(96)
    ok = nvml.nvmlSystemGetDriverVersion(version, len(version)) == 0
    nvml.nvmlShutdown()
    return version.value.decode() if ok else None


def _gpu(cuda, index):
    """Name, compute capability and memory of CUDA device `index`, or the error that hid them."""
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    name, memory = ctypes.create_string_buffer(256), ctypes.c_size_t()
    code = cuda.cuDeviceGet(ctypes.byref(device), index)
    for query in (lambda: cuda.cuDeviceGetName(name, len(name), device),
                  lambda: cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device),   # ..._COMPUTE_CAPABILITY_MAJOR
                  lambda: cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device),   # ..._COMPUTE_CAPABILITY_MINOR
                  lambda: cuda.cuDeviceTotalMem_v2(ctypes.byref(memory), device)):
        code = code or query()
    if code != 0:
        return f"cannot be queried: {_cuda_error(cuda, code)}"
    return (f"{name.value.decode(errors='replace')}, compute capability {major.value}.{minor.value}, "
            f"{memory.value / 2**30:.1f} GiB")


def _driver():
    rows = [("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))]
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        rows.append(("driver", f"none: libcuda.so.1 could not be loaded ({exc})"))
        return _section("NVIDIA driver and GPUs", rows)
    version = ctypes.c_int()
    code = cuda.cuDriverGetVersion(ctypes.byref(version))
    if code == 0:
        release = _driver_release()
        supports = f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10}"
        rows.append(("driver", f"{release}, {supports}" if release else supports))
    else:
        rows.append(("driver", f"libcuda.so.1 loaded, but cuDriverGetVersion: {_cuda_error(cuda, code)}"))
    count = ctypes.c_int()
    code, call = cuda.cuInit(0), "cuInit"
    if code == 0:
        code, call = cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount"
    if code != 0:
        rows.append(("GPUs", f"none: {call}: {_cuda_error(cuda, code)}"))
        return _section("NVIDIA driver and GPUs", rows)
    rows.append(("GPUs", str(count.value)))
    rows += [(f"GPU {index}", _gpu(cuda, index)) for index in range(count.value)]
    return _section("NVIDIA driver and GPUs", rows)


def _torch():
    try:
        import torch
    except ImportError as exc:
        return "not installed" if getattr(exc, "name", None) == "torch" else f"cannot be imported: {exc}"
    except Exception as exc:   # a broken install must not hide the rest of the report
        return f"cannot be imported: {type(exc).__name__}: {exc}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch warns when it finds a driver but no GPU; the line below says so
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    return f"{torch.__version__} ({built}; torch.cuda.is_available() {available}, {count} GPU(s))"


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _packages():
    return _section("Python packages", [
        ("torch", _torch()),
        ("transformers", _version("transformers")),
        ("aitune", _version("aitune")),
        ("flash-attn-4", _version("flash-attn-4")),
        ("numpy", _version("numpy")),
    ])


def report():
    """The whole report as text: one section per subject, each line "key: value"."""
    sections = (_attnforge(), _cpu(), _cuda_backend(), _driver(), _packages())
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"
