#!/usr/bin/env bash
# Runs every C test binary of a build (tests/test_*, and the fuzz replays tests/replay_*) under valgrind's memcheck:
# an invalid read or write, a use of uninitialised memory or a leak fails the run. Usage: valgrind-tests.sh BUILD [JOBS]
# The slow suites run fewer cases under valgrind (ATTNFORGE_TEST_CASES random cases, ATTNFORGE_TEST_CALLS calls
# per thread, ATTNFORGE_TEST_LIGHT: 2 threads only; tests/support/case_gen.h); set them to run more.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:?usage: valgrind-tests.sh BUILD_DIR [JOBS]}" && pwd)
jobs=${2:-2}
export ATTNFORGE_TEST_CASES=${ATTNFORGE_TEST_CASES:-20} ATTNFORGE_TEST_CALLS=${ATTNFORGE_TEST_CALLS:-1}
export ATTNFORGE_TEST_LIGHT=1   # each case on 2 threads only: the 1-vs-2-thread bit checks are the other runs' job
export ATTNFORGE_MIN_FLOPS_PER_THREAD=0   # the small shapes still take the threaded paths
export ATTNFORGE_CLI=$build/attnforge ROOT=$root LOGS=$(mktemp -d)

run_one() {   # one binary, run where ctest runs it (tests/), its log kept for the report
  local binary=$1 name args=()
  name=$(basename "$binary")
  if [[ $name == replay_* ]]; then   # a harness's seed corpus and its regressions, as ctest replays them
    for dir in "$ROOT/tests/fuzz/corpus/${name#replay_}" "$ROOT/tests/fuzz/regressions/${name#replay_}"; do
      [ -d "$dir" ] && args+=("$dir")
    done
  fi
  local start=$SECONDS
  if (cd "$ROOT/tests" && valgrind --tool=memcheck --error-exitcode=1 --leak-check=full \
        --suppressions="$ROOT/tests/valgrind.supp" -q "$binary" "${args[@]}") > "$LOGS/$name.log" 2>&1; then
    echo "valgrind: $name clean ($((SECONDS - start)) s)"
  else
    echo "valgrind: $name FAILED ($((SECONDS - start)) s); its log:"
    grep -E "==[0-9]+==|FAILED|ERROR" "$LOGS/$name.log" | head -60
    return 1
  fi
}
export -f run_one

# The emulated CUDA tests (build/tests/cuda_emu/test_*) are not run here: they switch between one fiber stack per
# emulated CUDA thread, which memcheck follows only with stack registration and then runs about 100x slower; they run
# under ASan/UBSan in `make test-sanitize`. test_cuda_unavailable (no fibers) is run here like every test.
# test_memory measures peak RSS, which under valgrind is valgrind's (and its one large call takes 6 minutes there)
skip=${VALGRIND_SKIP:-test_memory}
started=$SECONDS
status=0
ls "$build"/tests/test_* "$build"/tests/replay_* | grep -v '\.' | grep -vE "/($skip)\$" |
  xargs -P "$jobs" -I{} bash -c 'run_one {}' || status=1
count=$(ls "$LOGS" | wc -l)
elapsed=$((SECONDS - started))
echo "valgrind: $count binaries in $elapsed s (skipped: $skip); logs in $LOGS"
exit $status
