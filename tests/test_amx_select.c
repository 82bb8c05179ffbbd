/* Choosing "amx": only where CPUID, XCR0 and the kernel's ARCH_REQ_XCOMP_PERM all allow tiles. Where they do not
 * (this project's machines), af_isa_available("amx") is false, af_set_isa("amx") fails with AF_ERR_UNSUPPORTED and
 * changes nothing, ATTNFORGE_ISA=amx falls back to the best ISA there is, and every other ISA behaves as before.
 * Where they do, "amx" is the first choice and af_set_isa("amx") works. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attnforge.h"
#include "core/cpu.h"
#include "kernel/dispatch_testing.h"
#include "ukernel_amx_emulated.h"

static const char *const all_isas[] = {"amx", "avx512", "avx2", "portable"};   /* best first */
static char initial_isa[32];   /* what this process started with (ATTNFORGE_ISA may be set) */
static char self_path[4096];   /* this binary (readlink of /proc/self/exe, which valgrind also answers rightly) */

static bool amx_usable(void) { return af_cpu()->amx_bf16 && af_cpu_amx_permitted(); }

static const char *best_available(void) {
    for (int i = 0; i < 4; i++)
        if (af_isa_available(all_isas[i])) return all_isas[i];
    return NULL;
}

static void availability_follows_cpu_and_os(void **state) {
    (void)state;
    print_message("cpu: amx_bf16 %d, tile data permitted %d, avx512 %d; best ISA %s\n", af_cpu()->amx_bf16,
                  af_cpu_amx_permitted(), af_cpu()->avx512, best_available());
    /* "amx" is available exactly where the CPU has it, the OS enables it and the kernel grants tile data (in builds
     * with the AMX file; none has AMX without it) */
    if (!amx_usable()) assert_false(af_isa_available("amx"));
    if (af_isa_available("amx")) assert_true(af_isa_available("avx512"));   /* its softmax and f16/f32 path */
    assert_true(af_isa_available("portable"));
}

static void set_isa_amx(void **state) {
    (void)state;
    assert_int_equal(af_set_isa("portable"), AF_OK);
    const af_status st = af_set_isa("amx");
    if (af_isa_available("amx")) {
        assert_int_equal(st, AF_OK);
        assert_string_equal(af_get_isa(), "amx");
    } else {
        assert_int_equal(st, AF_ERR_UNSUPPORTED);
        assert_non_null(strstr(af_last_error(), "'amx'"));
        assert_string_equal(af_get_isa(), "portable");   /* unchanged */
    }
    for (int i = 1; i < 4; i++)   /* the others as before */
        assert_int_equal(af_set_isa(all_isas[i]), af_isa_available(all_isas[i]) ? AF_OK : AF_ERR_UNSUPPORTED);
    assert_int_equal(af_set_isa("AMX"), AF_ERR_INVALID_ARGUMENT);   /* names are exact */
}

/* A fresh process (this binary, re-run) reports the ISA it starts with. */
static char *isa_of_fresh_process(const char *env_isa) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        if (env_isa) setenv("ATTNFORGE_ISA", env_isa, 1);
        else unsetenv("ATTNFORGE_ISA");
        execl(self_path, "test_amx_select", "--print-isa", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    static char buf[64];
    const ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    buf[n > 0 ? n : 0] = 0;
    return buf;
}

/* The child reports "CHOSEN BEST AMX": the ISA it started with, the best its own CPUID offers and whether amx is
 * available to it. The expectation comes from the child, not from this process: under valgrind this process sees
 * no AVX-512 (valgrind masks it in CPUID) while the child, run natively, does. */
static void expect_fresh_choice(const char *env_isa, const char *want_if_portable) {
    char chosen[32], best[32];
    int amx;
    const char *line = isa_of_fresh_process(env_isa);
    if (sscanf(line, "%31s %31s %d", chosen, best, &amx) != 3) fail_msg("child printed '%s'", line);
    if (want_if_portable) assert_string_equal(chosen, want_if_portable);
    else if (env_isa && strcmp(env_isa, "amx") == 0) assert_string_equal(chosen, amx ? "amx" : best);
    else assert_string_equal(chosen, best);   /* amx first where it is usable */
}

static void initial_choice(void **state) {
    (void)state;
    expect_fresh_choice(NULL, NULL);
    expect_fresh_choice("amx", NULL);
    expect_fresh_choice("portable", "portable");
}

/* The test hook: a table outside the registry, then back to the initial choice. */
static void force_for_tests_and_back(void **state) {
    (void)state;
    af_ukernel_force_for_tests(af_ukernel_amx_emulated());
    assert_string_equal(af_get_isa(), "amx-emulated");
    af_ukernel_force_for_tests(NULL);
    assert_string_equal(af_get_isa(), initial_isa);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--print-isa") == 0) {
        printf("%s %s %d", af_get_isa(), best_available(), af_isa_available("amx") ? 1 : 0);
        return 0;
    }
    snprintf(initial_isa, sizeof initial_isa, "%s", af_get_isa());
    const ssize_t len = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (len <= 0) return 1;
    self_path[len] = 0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(availability_follows_cpu_and_os),
        cmocka_unit_test(set_isa_amx),
        cmocka_unit_test(initial_choice),
        cmocka_unit_test(force_for_tests_and_back),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
