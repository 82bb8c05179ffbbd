/* Test-only functions of attnforge._C (see testing.c). */
#ifndef AFPY_TESTING_H
#define AFPY_TESTING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyMethodDef afpy_testing_methods[];

#endif
