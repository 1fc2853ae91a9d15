# One-command set-up: `make demo` and `make test` create .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# uv resolves and downloads the extras in about a minute where pip takes 7+ CPU-minutes; pip keeps torch
# (the CPU wheel lies on local disk, which only pip's configuration knows) and is the fallback.
UV := $(VENV)/bin/uv
INSTALL = $(if $(wildcard $(UV)),$(UV) pip install --python $(PY) -q,$(PIP) install -q)
# CPU-only machines get the CPU wheel; never pull a multi-GB CUDA build there.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install install-test demo test test-fast test-slow test-durations lint bench clean

$(VENV)/.base:
	python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" numpy
	-$(PIP) install -q uv
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(INSTALL) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(INSTALL) -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(INSTALL) -e '.[plot]'
	$(VENV)/bin/gpufleet demo

# Two tiers. test-fast: unit and in-process CLI tests, no services, no multi-process runs (minutes).
# test-slow: the real-process contract tests (gloo ranks, kill -9, Slurm, Ray, S3, Prometheus, llama.cpp),
# with the services `.ci/run` starts. `make test` runs both, as CI does, in two phases: TEST_WORKERS
# pytest-xdist workers share out all but the `solo` tests by group, longest first (tests/conftest.py: a
# shared cluster's tests run one at a time; many real-process tests wait on heartbeats and schedulers,
# so two workers fit two cores), then the `solo` tests (latency measurements) run one at a time.
# `make test-durations` runs `make test` and records each test's seconds in tests/durations.json, which
# orders the groups (tests/support/durations.py): run it when a slow test is added or made faster.
TEST_WORKERS ?= 2
PYTEST = $(VENV)/bin/pytest -q
define two_phases
	$(PYTEST) -n $(TEST_WORKERS) -m "not solo" --durations=30 $(1); parallel=$$?; \
	$(PYTEST) -m solo --durations=10 $(1); solo=$$?; \
	echo "parallel phase: exit $$parallel; solo phase: exit $$solo"; [ $$parallel = 0 ] && [ $$solo = 0 ]
endef

test: install-test
	$(call two_phases,tests)

test-fast: install-test
	$(PYTEST) -n $(TEST_WORKERS) --durations=10 tests/unit

test-slow: install-test
	$(call two_phases,tests/integration tests/e2e)

test-durations: export GPUFLEET_TEST_DURATIONS_OUT = $(CURDIR)/tests/durations.json
test-durations: test

lint: install-test
	$(VENV)/bin/ruff check src tests benchmarks

# All benchmarks at the sizes of record (long); or e.g. `make bench BENCH_ARGS="--quick --only P1,P3"`,
# `make bench BENCH_ARGS=--list`. Results: benchmarks/results/ (--quick: benchmarks/results/quick/).
bench: install-test
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
