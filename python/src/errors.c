#include "errors.h"

/* Each class also derives from the builtin a Python caller would expect (seed code catches ValueError). */
typedef struct {
    af_status status;
    const char *name;       /* attnforge.<name> */
    PyObject **builtin;     /* second base; NULL for MemoryError itself */
    const char *doc;
    PyObject *type;
} error_class;

static PyObject *error_base;   /* attnforge.Error */

static error_class classes[] = {
    {AF_ERR_INVALID_ARGUMENT, "InvalidArgumentError", &PyExc_ValueError, "An argument breaks a rule of the call.", NULL},
    {AF_ERR_UNSUPPORTED, "UnsupportedError", &PyExc_NotImplementedError,
     "Valid scaled_dot_product_attention that attnforge does not run.", NULL},
    {AF_ERR_RUNTIME_UNAVAILABLE, "RuntimeUnavailableError", &PyExc_RuntimeError, "A backend cannot be loaded.", NULL},
    {AF_ERR_PARSE, "ParseError", &PyExc_ValueError, "Malformed JSON or a document that breaks its format.", NULL},
    {AF_ERR_IO, "FileError", &PyExc_OSError, "A file could not be read or written.", NULL},
    {AF_ERR_PLAN_MISMATCH, "PlanMismatchError", &PyExc_ValueError, "A call does not match the prepared plan.", NULL},
    {AF_ERR_NOT_PREPARED, "NotPreparedError", &PyExc_RuntimeError, "The provider was used before prepare() succeeded.",
     NULL},
    {AF_ERR_INTERNAL, "InternalError", &PyExc_RuntimeError, "A bug in attnforge: please report it.", NULL},
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

int afpy_errors_init(PyObject *module) {
    error_base = PyErr_NewExceptionWithDoc("attnforge.Error", "Base class of attnforge's errors.", NULL, NULL);
    if (!error_base) return -1;
    Py_INCREF(error_base);
    if (PyModule_AddObject(module, "Error", error_base) < 0) return -1;
    for (size_t i = 0; i < N_CLASSES; i++) {
        char qualified[96];
        snprintf(qualified, sizeof qualified, "attnforge.%s", classes[i].name);
        PyObject *bases = PyTuple_Pack(2, error_base, *classes[i].builtin);
        if (!bases) return -1;
        classes[i].type = PyErr_NewExceptionWithDoc(qualified, classes[i].doc, bases, NULL);
        Py_DECREF(bases);
        if (!classes[i].type) return -1;
        Py_INCREF(classes[i].type);   /* one reference for the table, one given to the module */
        if (PyModule_AddObject(module, classes[i].name, classes[i].type) < 0) return -1;
    }
    return 0;
}

PyObject *afpy_raise_message(af_status status, const char *message) {
    if (!message || !message[0]) message = af_status_name(status);
    if (status == AF_ERR_NO_MEMORY) {
        PyErr_SetString(PyExc_MemoryError, message);
        return NULL;
    }
    for (size_t i = 0; i < N_CLASSES; i++)
        if (classes[i].status == status && classes[i].type) {
            PyErr_SetString(classes[i].type, message);
            return NULL;
        }
    PyErr_Format(PyExc_RuntimeError, "%s: %s", af_status_name(status), message);
    return NULL;
}

PyObject *afpy_raise_status(af_status status) { return afpy_raise_message(status, af_last_error()); }
