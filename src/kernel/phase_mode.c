/* Whether few-row sequences (decode steps) run on the prefill's tile products (af_set_phase_invariant), so that a
 * decoded token's output and lse are the bits of the same row inside a prefill. ATTNFORGE_PHASE_INVARIANT=1 sets it
 * at the first call that asks. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "kernel/flash.h"

static atomic_int phase_invariant = -1;   /* -1: the environment not read yet */

AF_API void af_set_phase_invariant(bool on) { atomic_store(&phase_invariant, on ? 1 : 0); }

AF_API bool af_get_phase_invariant(void) {
    int mode = atomic_load(&phase_invariant);
    if (mode < 0) {
        const char *env = getenv("ATTNFORGE_PHASE_INVARIANT");
        int expected = -1;
        atomic_compare_exchange_strong(&phase_invariant, &expected, env && strcmp(env, "1") == 0 ? 1 : 0);
        mode = atomic_load(&phase_invariant);
    }
    return mode == 1;
}
