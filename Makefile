# Thin wrapper over CMake: `make run` (the main job) and `make test` install their own dependencies.
BUILD ?= build
BUILD_SAN ?= build-san
JOBS ?= $(shell nproc)

.PHONY: deps build configure cuda run test test-fast test-sanitize test-tsan fuzz fuzz-long valgrind test-python install clean
BUILD_FUZZ ?= build-fuzz
FUZZ_SECONDS ?= 60
BUILD_TSAN ?= build-tsan
# the tests that run threads: the concurrency test, the provider's infer and fault tests, the thread pool (test_core),
# the executor hook (test_executor)
TSAN_TESTS ?= test_concurrency test_provider_infer test_provider_faults test_core test_executor

deps:
	bash scripts/install-deps.sh

# libattnforge_cuda.so is built too when CMake finds nvcc (AF_WITH_CUDA=OFF skips it); the sanitizer, TSan and
# fuzz builds never build it (nvcc's objects are not instrumented)
build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j $(JOBS)

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

# The main job builds what it needs first: the command and the library. The CUDA backend (minutes of nvcc for five
# GPU architectures) only where it can run (an NVIDIA driver is loaded), or with `make cuda` / `make build`.
GPU_PRESENT := $(shell test -e /proc/driver/nvidia/version && echo yes)
run: configure
	cmake --build $(BUILD) -j $(JOBS) --target attnforge_cli
	$(if $(GPU_PRESENT),if grep -q 'AF_CUDA_BACKEND:INTERNAL=ON' $(BUILD)/CMakeCache.txt; then \
	  cmake --build $(BUILD) -j $(JOBS) --target attnforge_cuda; fi)
	./$(BUILD)/attnforge run

# libattnforge_cuda.so alone (CMake must have found nvcc)
cuda: configure
	cmake --build $(BUILD) -j $(JOBS) --target attnforge_cuda

test-fast: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# -O1, as ASan's documentation advises: the suites ran 214 s at -O0 and 108 s at -O1 on CI's 2-core machine
test-sanitize: deps
	cmake -S . -B $(BUILD_SAN) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DAF_SANITIZE=ON -DAF_WITH_CUDA=OFF
	cmake --build $(BUILD_SAN) -j $(JOBS)
	cd $(BUILD_SAN) && ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer over TSAN_TESTS; any data race or lock-order problem fails.
test-tsan: deps
	cmake -S . -B $(BUILD_TSAN) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAF_TSAN=ON -DAF_WITH_CUDA=OFF
	cmake --build $(BUILD_TSAN) -j $(JOBS) --target $(TSAN_TESTS)
	cd $(BUILD_TSAN) && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  ctest --output-on-failure -j $(JOBS) -R '^($(shell echo $(TSAN_TESTS) | tr ' ' '|'))$$'

# Every C test binary of the Release build under valgrind's memcheck (invalid accesses, uninitialised reads, leaks),
# with fewer random cases and calls; about 2 minutes on 2 cores (docs/RELIABILITY.md).
valgrind: build
	bash scripts/valgrind-tests.sh $(BUILD) $(JOBS)

# Each libFuzzer harness for FUZZ_SECONDS from the seed corpus in tests/fuzz/corpus/<name>, one per core at a time;
# any finding fails.
fuzz: deps
	CC=clang cmake -S . -B $(BUILD_FUZZ) -DAF_FUZZ=ON -DAF_WITH_CUDA=OFF -DAF_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD_FUZZ) -j $(JOBS)
	bash tests/fuzz/run_fuzzers.sh $(BUILD_FUZZ)/tests/fuzz $(FUZZ_SECONDS)

# Each harness to FUZZ_LONG_RUNS executions in all, over FUZZ_LONG_WORKERS processes (not in `make test`: 10^7 each
# is tens of minutes on 2 cores; run it before a release and after changing a check; docs/RELIABILITY.md).
FUZZ_LONG_RUNS ?= 10000000
FUZZ_LONG_WORKERS ?= $(JOBS)
fuzz-long: deps
	CC=clang cmake -S . -B $(BUILD_FUZZ) -DAF_FUZZ=ON -DAF_WITH_CUDA=OFF -DAF_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD_FUZZ) -j $(JOBS)
	FUZZ_RUNS=$(FUZZ_LONG_RUNS) FUZZ_WORKERS=$(FUZZ_LONG_WORKERS) bash tests/fuzz/run_fuzzers.sh $(BUILD_FUZZ)/tests/fuzz

# pip install ./ (the attnforge Python package) and pytest python/tests; ATTNFORGE_CLI for plan round trips
test-python: build
	bash scripts/test-python.sh $(BUILD)/attnforge

test: test-fast test-sanitize test-tsan valgrind fuzz test-python

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD) $(BUILD_SAN)
