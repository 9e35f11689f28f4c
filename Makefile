# Two commands matter on a fresh machine: `make demo` (the main job) and
# `make test` (the suite).  Both create or refresh the virtualenvs themselves.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# vLLM 0.33.0's CUDA wheel runs the connector classes on this CPU-only machine
# only when this is set before vllm is imported.
export VLLM_TARGET_DEVICE := cpu
PIP_QUIET := -q --disable-pip-version-check

BUILD_DEPS := "setuptools>=68" wheel "Cython>=3.0" "preshed>=3.0.9,<4" "cymem>=2.0.8,<3" "murmurhash>=1.0.10,<2"
TEST_DEPS := "pytest>=8" "pytest-xdist>=3" "hypothesis>=6" ruff
CORE_SOURCES := setup.py pyproject.toml $(wildcard csrc/*.pyx)

.PHONY: all venv build test test-core test-twin lint bench demo clean

all: build

# Main virtualenv: vLLM 0.33.0 (CUDA wheel, connector classes only) + NIXL.
$(VENV)/.deps: Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_QUIET) --upgrade pip
	$(VPY) -m pip install $(PIP_QUIET) "vllm==0.33.0" "nixl==1.5.1" $(BUILD_DEPS) $(TEST_DEPS)
	touch $@

venv: $(VENV)/.deps

# Editable install: compiles csrc/*.pyx next to the Python twins and
# registers the vLLM plugin entry point.
$(VENV)/.built: $(VENV)/.deps $(CORE_SOURCES)
	$(VPY) -m pip install $(PIP_QUIET) --no-build-isolation --no-deps -e .
	$(VPY) -c "import vllm_nixl_lease as m; assert m.IMPLEMENTATION == 'cython', m.IMPLEMENTATION"
	touch $@

build: $(VENV)/.built

lint: build
	$(VENV)/bin/ruff check .

# The parallel suite with the Cython core active (its absence is an error).
test-core: build
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(VPY) -m pytest -n auto -m "not e2e" -p no:cacheprovider -q

# The same suite on the pure-Python twin, through the environment switch.
test-twin: build
	VLLM_NIXL_LEASE_NO_EXTENSIONS=1 $(VPY) -m pytest -n auto -m "not e2e" -p no:cacheprovider -q

test: lint test-core test-twin

bench: build
	$(VPY) tools/bench_core.py --json .build/bench.json

demo: build
	@mkdir -p .build
	$(VPY) tools/bench_core.py --quick --json .build/bench-quick.json

clean:
	rm -rf build .build *.egg-info vllm_nixl_lease/*.so
