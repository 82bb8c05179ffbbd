/* The `attnforge` subcommands. Each returns the process exit code: 0 ok, 1 a check failed, 2 bad usage or
 * unreadable input, 3 not supported (plan). */
#ifndef AF_TOOLS_COMMANDS_H
#define AF_TOOLS_COMMANDS_H

typedef struct {
    const char *name;
    int (*main)(int argc, char **argv);   /* argv[0] is the subcommand's name */
    const char *summary;
} cli_command;

int cmd_run(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_verify(int argc, char **argv);
int cmd_bench(int argc, char **argv);

/* NULL-terminated table of every subcommand (main.c). */
extern const cli_command cli_commands[];

#endif
