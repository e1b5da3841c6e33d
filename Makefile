# fp8moe: the two commands a new user needs are `make demo` and `make test`.
#   make deps     install missing Debian packages and pinned PyPI packages (scripts/setup.sh)
#   make build    configure and build into build/ (CUDA kernels when nvcc is found)
#   make test     deps + build + every test: unit, CUDA (skipped without a GPU), Python-driven,
#                 the unit tests again under ASan+UBSan, a bounded fuzz run, the format check
#   make demo     the main job on the CPU: plan, run and check the bundled example checkpoint
JOBS  ?= $(shell nproc)
BUILD ?= build
CMAKE_FLAGS ?=

.PHONY: all deps build test test-fast test-asan fuzz-smoke format-check format demo clean

all: build

deps:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test-fast: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-asan: deps
	cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFP8MOE_SANITIZE=ON \
	  -DFP8MOE_WITH_CUDA=OFF -DFP8MOE_BUILD_BENCH=OFF
	cmake --build build-asan -j $(JOBS) --target fp8moe_unit_tests fp8moe_cli
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir build-asan --output-on-failure -j $(JOBS) -E '^py\.'

fuzz-smoke: deps
	@scripts/fuzz_smoke.sh

format-check:
	@scripts/format.sh --check

format:
	@scripts/format.sh

test: test-fast test-asan fuzz-smoke format-check
	@echo "make test: all passed"

# The demo needs only the command-line tool on the CPU: it builds in its own folder without the CUDA
# kernels, tests and benchmarks (the CPU kernels are what it runs), which keeps a fresh `make demo`
# near two minutes on two cores. DEMO_BUILD=build reuses a full build instead.
DEMO_BUILD ?= build-demo
demo: deps
	@test -f $(DEMO_BUILD)/build.ninja || cmake -S . -B $(DEMO_BUILD) -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release -DFP8MOE_WITH_CUDA=OFF -DFP8MOE_BUILD_TESTS=OFF \
	  -DFP8MOE_BUILD_BENCH=OFF >/dev/null
	cmake --build $(DEMO_BUILD) -j $(JOBS) --target fp8moe_cli
	@scripts/demo.sh $(DEMO_BUILD)

clean:
	rm -rf build build-asan build-fuzz build-demo
