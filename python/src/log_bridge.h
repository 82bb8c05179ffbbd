/* attnforge's log callback → Python's logging, logger "attnforge". */
#ifndef AFPY_LOG_BRIDGE_H
#define AFPY_LOG_BRIDGE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Install the callback (all levels; Python's logging filters). -1 with an exception set on failure. */
int afpy_log_install(void);
/* Install the callback at the "attnforge" logger's effective level (getEffectiveLevel: about 0.3 us), so messages
 * Python would drop are not formatted and handed over, GIL and all, on every call (the kernel driver logs a DEBUG line
 * a call). Called at each entry that may log, with the GIL held. */
void afpy_log_sync(void);
/* Remove the callback and drop the logger; safe to call twice. */
void afpy_log_uninstall(void);

#endif
