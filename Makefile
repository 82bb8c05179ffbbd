# Thin wrapper over CMake: `make run` (the main job) and `make test` install their own dependencies.
BUILD ?= build
BUILD_SAN ?= build-san
JOBS ?= $(shell nproc)

.PHONY: deps build run test test-fast test-sanitize fuzz test-python install clean
BUILD_FUZZ ?= build-fuzz
FUZZ_SECONDS ?= 60

deps:
	bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j $(JOBS)

run: build
	./$(BUILD)/attnforge run

test-fast: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-sanitize: deps
	cmake -S . -B $(BUILD_SAN) -DCMAKE_BUILD_TYPE=Debug -DAF_SANITIZE=ON
	cmake --build $(BUILD_SAN) -j $(JOBS)
	cd $(BUILD_SAN) && ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# Each libFuzzer harness for FUZZ_SECONDS from the seed corpus in tests/fuzz/corpus/<name>; any finding fails.
fuzz: deps
	CC=clang cmake -S . -B $(BUILD_FUZZ) -DAF_FUZZ=ON -DAF_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD_FUZZ) -j $(JOBS)
	bash tests/fuzz/run_fuzzers.sh $(BUILD_FUZZ)/tests/fuzz $(FUZZ_SECONDS)

# pip install ./ (the attnforge Python package) and pytest python/tests; ATTNFORGE_CLI for plan round trips
test-python: build
	bash scripts/test-python.sh $(BUILD)/attnforge

test: test-fast test-sanitize fuzz test-python

install: build
	cmake --install $(BUILD) --prefix $(or $(PREFIX),/usr/local)

clean:
	rm -rf $(BUILD) $(BUILD_SAN)
