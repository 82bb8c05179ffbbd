/* Replays libFuzzer inputs without libFuzzer: every file named (or inside a directory named) on the command line
 * goes once through the harness's LLVMFuzzerTestOneInput. ctest runs it over the seed corpus and
 * tests/fuzz/regressions/ in every build (normal, ASan+UBSan, TSan, valgrind), so a crash found once stays fixed. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc(size > 0 ? (size_t)size : 1);   /* exactly the input's bytes: ASan sees over-reads */
    const size_t got = data ? fread(data, 1, (size_t)size, f) : 0;
    fclose(f);
    if (!data || got != (size_t)size) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(data);
        return 1;
    }
    LLVMFuzzerTestOneInput(data, got);
    free(data);
    return 0;
}

static int replay(const char *path, int *count) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s does not exist\n", path);
        return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
        ++*count;
        return replay_file(path);
    }
    DIR *dir = opendir(path);
    if (!dir) return 1;
    int failures = 0;
    for (struct dirent *e; (e = readdir(dir)) != NULL;) {
        if (e->d_name[0] == '.') continue;   /* ., .. and .gitkeep */
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        failures += replay(child, count);
    }
    closedir(dir);
    return failures;
}

int main(int argc, char **argv) {
    int count = 0, failures = 0;
    for (int i = 1; i < argc; i++) failures += replay(argv[i], &count);
    printf("replay: %d inputs, %d unreadable\n", count, failures);
    return failures ? 1 : 0;
}
