/* Shared objects that are not usable attnforge CUDA backends, for tests/test_cuda_unavailable.c:
 *   -DFAKE_NO_ENTRY   exports no af_cuda_backend at all (any other library, as far as the loader can tell)
 *   otherwise         exports af_cuda_backend with FAKE_ABI_VERSION (an attnforge from another interface) */
#include <stddef.h>

#ifdef FAKE_NO_ENTRY
__attribute__((visibility("default"))) int fake_cuda_backend_marker(void) { return 1; }
#else
typedef struct {
    int abi_version;   /* the one field every interface version starts with */
    const char *name;
} fake_backend_ops;

static const fake_backend_ops wrong_version = {FAKE_ABI_VERSION, "cuda"};

__attribute__((visibility("default"))) const fake_backend_ops *af_cuda_backend(void) { return &wrong_version; }
#endif
