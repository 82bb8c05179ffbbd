"""attnforge's parallel work on the host's OpenMP threads (docs/PYTORCH.md, "Threads").

PyTorch's CPU wheels run their operators on the GNU OpenMP runtime they load (torch/lib/libgomp.so.1), whose workers
keep spinning for a while after each operator. attnforge's own pool, woken right after a matmul, would wait for those
cores; so once torch is imported, attnforge's parallel work runs on torch's OpenMP threads, torch.get_num_threads() of
them (attnforge.set_num_threads(n) with n > 0 still chooses n). ATTNFORGE_HOST_THREADS=0, or set_host_threads(False),
keeps attnforge's own pool. Nothing here imports torch: the switch happens when torch is imported, in either order."""
import logging
import os
import sys

from . import _C, _register

ENV_VAR = "ATTNFORGE_HOST_THREADS"
_log = logging.getLogger("attnforge")
_wanted = os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _torch_openmp_library(torch):
    """(path of libtorch_cpu.so, None) when torch runs its parallel work on OpenMP, else (None, why)."""
    if not torch.backends.openmp.is_available():
        return None, "torch was built without OpenMP"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "torch's parallel backend is not OpenMP"
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(library):
        return None, f"{library} does not exist"
    return library, None


def _lend():
    """Lend libattnforge torch's OpenMP runtime when torch is imported and uses GNU OpenMP; else keep the own pool."""
    torch = sys.modules.get("torch")
    if torch is None:   # None: an import of torch that failed or was blocked
        return
    library, why = _torch_openmp_library(torch)
    runtime = None
    if library:
        runtime, why = _C.use_host_threads(library)
    if runtime:
        _log.debug("attnforge: parallel work runs on torch's OpenMP threads (%s)", runtime)
    else:
        _log.debug("attnforge: own thread pool: %s", why)


def _lend_if_wanted():
    if _wanted:
        _lend()


def install():
    """At attnforge's import: lend torch's threads now if torch is imported, else when it is."""
    if _wanted:
        _register.after_torch_import(_lend_if_wanted)


def set_host_threads(enabled):
    global _wanted
    _wanted = bool(enabled)
    if _wanted:
        install()
    else:
        _C.stop_host_threads()


def get_host_threads():
    return _C.host_threads()
