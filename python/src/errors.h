/* attnforge's status codes as Python exceptions, carrying af_last_error()'s message. */
#ifndef AFPY_ERRORS_H
#define AFPY_ERRORS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attnforge.h"

/* Create the exception classes and add them to the module; -1 with an exception set on failure. */
int afpy_errors_init(PyObject *module);
/* Raise the exception for `status` with af_last_error() (read on the calling thread); returns NULL. */
PyObject *afpy_raise_status(af_status status);
/* Raise the exception for `status` with `message`; returns NULL. */
PyObject *afpy_raise_message(af_status status, const char *message);

#endif
