# One-command set-up: `make demo` and `make test` create .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU-only machines get the CPU wheel; never pull a multi-GB CUDA build there.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install install-test demo test lint bench clean

$(VENV)/.base:
	python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" numpy
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(PIP) install -q -e '.[plot]'
	$(VENV)/bin/gpufleet demo

test: install-test
	$(VENV)/bin/pytest -q --durations=25 tests

lint: install-test
	$(VENV)/bin/ruff check src tests benchmarks

# All benchmarks at the sizes of record (long); or e.g. `make bench BENCH_ARGS="--quick --only P1,P3"`,
# `make bench BENCH_ARGS=--list`. Results: benchmarks/results/ (--quick: benchmarks/results/quick/).
bench: install-test
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
