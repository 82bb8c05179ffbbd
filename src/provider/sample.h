/* The sample model: one recorded SDPA call as the caller made it (Python's (args, kwargs)), no data. */
#ifndef AF_PROVIDER_SAMPLE_H
#define AF_PROVIDER_SAMPLE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attnforge.h"

#define AF_DEVICE_NAME_MAX 32

/* A tensor argument: what a recorder sees of a torch.Tensor without its data. */
typedef struct {
    const char *dtype_name;        /* PyTorch's name ("float16", "float64", ...): a static string */
    bool dtype_known;              /* the name is one of af_dtype's; then view.dtype is it */
    af_tensor view;                /* shape, strides (as given, else contiguous), dtype; data NULL */
    bool strides_given;            /* written back only when they were given */
    char device[AF_DEVICE_NAME_MAX];
    bool device_given;
} af_tensor_desc;

typedef enum {
    AF_VALUE_NONE,     /* Python None (JSON null) */
    AF_VALUE_BOOL,
    AF_VALUE_NUMBER,   /* int or float */
    AF_VALUE_TENSOR,
    AF_VALUE_OTHER     /* a string, list, ...: kept as JSON text so it can be refused and written back */
} af_value_kind;

typedef struct {
    af_value_kind kind;
    bool boolean;
    double number;
    bool number_is_integer;        /* written back as 3, not 3.0 */
    int64_t integer;
    af_tensor_desc tensor;
    char *other_json;              /* AF_VALUE_OTHER: the JSON text as read */
} af_value;

typedef struct {
    char *name;
    af_value value;
} af_kwarg;

typedef struct {
    af_value *args;
    size_t nargs;
    af_kwarg *kwargs;              /* in the order given; names are unique */
    size_t nkwargs;
    long count;                    /* how often the call was seen, >= 1 */
} af_sample;

struct af_samples {
    af_sample *items;
    size_t size, capacity;
};

/* Append `sample`, taking ownership of its memory (also on failure, when it is released). */
af_status af_samples_append(af_samples *samples, af_sample *sample);
void af_sample_clear(af_sample *sample);
void af_value_clear(af_value *value);

/* The keyword argument called `name`, or NULL. */
const af_value *af_sample_kwarg(const af_sample *sample, const char *name);

/* "None", "a bool", "a number", "a tensor", "a string", "a list", "a value": for messages. */
const char *af_value_kind_text(const af_value *value);

/* PyTorch dtype names the samples file accepts; af_dtype's four map to themselves, the rest are
 * read so that prepare can refuse them as unsupported rather than as malformed. NULL when unknown. */
const char *af_torch_dtype_name(const char *name, bool *known, af_dtype *dtype);

/* Row-major strides of `shape`, saturating at INT64_MAX where they would overflow (prepare then refuses
 * the size), so absurd shapes never overflow. */
void af_contiguous_strides(const int64_t *shape, int ndim, int64_t *strides);

/* A tensor descriptor with contiguous strides (or the view's own when strides_given). `device` NULL: the
 * view's own af_device ("cpu", "cuda:N"); else that name, and view.device from it where it is one of ours. */
af_tensor_desc af_tensor_desc_from_view(const af_tensor *view, const char *device);

/* PyTorch device names attnforge runs on: "cpu", "cuda" (read as "cuda:0") and "cuda:N". false for any other
 * name ("mps", "xpu", "cuda:x", ...), leaving *device the CPU. */
bool af_device_from_name(const char *name, af_device *device);
/* "cpu" or "cuda:N", as str(tensor.device) writes them. */
void af_device_name(af_device device, char *name, size_t size);

#endif
