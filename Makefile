# Development entry points. `make run` and `make test` set everything up on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/*/pyproject.toml))
STAMP := $(VENV)/.ds4-installed

.PHONY: setup run test lint gpu-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: pip takes the CPU build from this machine's disk instead of a CUDA download
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]' $(foreach d,$(PLUGIN_DIRS),-e $(d))
	# wheels of the runtime dependencies, for the offline install test (tests/test_packaging.py)
	$(BIN)/python -m pip download -q --only-binary=:all: -d .wheelhouse $$($(BIN)/python scripts/runtime_requirements.py)
	touch $@

run: $(STAMP)
	$(BIN)/ds4 run --raw -p "import os" -n 64 --temp 0.8 --seed 1

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

lint: $(STAMP)
	$(BIN)/ruff check .

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .wheelhouse build dist .pytest_cache
