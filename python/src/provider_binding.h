/* attnforge._C.Provider: one af_provider (the seed's FlashAttention4KernelProvider, all rules in C). */
#ifndef AFPY_PROVIDER_BINDING_H
#define AFPY_PROVIDER_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "attnforge.h"

typedef struct {
    PyObject_HEAD
    af_provider *provider;
    pthread_rwlock_t lock;   /* infer (readers, GIL released) vs prepare (writer): prepare swaps the plan */
    bool lock_ready;
} afpy_provider;

extern PyTypeObject afpy_provider_type;

/* Add the type to the module; -1 with an exception set on failure. */
int afpy_provider_init(PyObject *module);

#endif
