/* The C library calls the callback on whatever thread logs, with its log lock held. So every call into
 * libattnforge that may log is made with the GIL released (otherwise: C thread holds the log lock and
 * waits for the GIL while the GIL holder waits for the log lock). */
#include "log_bridge.h"

#include "attnforge.h"

static PyObject *logger;   /* logging.getLogger("attnforge"), strong reference */

static int interpreter_gone(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

static void log_to_python(af_log_level level, const char *message, void *user) {
    (void)user;
    if (interpreter_gone()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (logger) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);   /* a log line must not clobber a pending exception */
        /* af_log_level uses the logging module's numbers (10 debug ... 40 error) */
        PyObject *result = PyObject_CallMethod(logger, "log", "is", (int)level, message);
        if (result) Py_DECREF(result);
        else PyErr_Clear();                       /* a failing handler must not break the C call */
        PyErr_Restore(type, value, traceback);
    }
    PyGILState_Release(gil);
}

/* The level the callback is installed at: the logger's effective level when last synced (DEBUG until then). */
static int installed_level = AF_LOG_DEBUG;

static void install_at(int level) {
    Py_BEGIN_ALLOW_THREADS   /* af_set_log_callback takes the C log lock; see the top of this file */
    af_set_log_callback(log_to_python, NULL, (af_log_level)level);
    Py_END_ALLOW_THREADS
    installed_level = level;
}

void afpy_log_sync(void) {
    if (!logger) return;
    PyObject *level = PyObject_CallMethod(logger, "getEffectiveLevel", NULL);
    const long value = level ? PyLong_AsLong(level) : -1;
    Py_XDECREF(level);
    if (value < 0) {   /* a logger that cannot say: everything goes to Python, which filters */
        PyErr_Clear();
        if (installed_level != AF_LOG_DEBUG) install_at(AF_LOG_DEBUG);
        return;
    }
    const int wanted = value > AF_LOG_DEBUG ? (int)(value > AF_LOG_OFF ? AF_LOG_OFF : value) : AF_LOG_DEBUG;
    if (wanted != installed_level) install_at(wanted);
}

int afpy_log_install(void) {
    PyObject *logging = PyImport_ImportModule("logging");
    if (!logging) return -1;
    PyObject *found = PyObject_CallMethod(logging, "getLogger", "s", "attnforge");
    Py_DECREF(logging);
    if (!found) return -1;
    Py_XSETREF(logger, found);
    install_at(AF_LOG_DEBUG);
    return 0;
}

void afpy_log_uninstall(void) {
    Py_BEGIN_ALLOW_THREADS
    af_set_log_callback(NULL, NULL, AF_LOG_OFF);
    Py_END_ALLOW_THREADS
    Py_CLEAR(logger);
}
