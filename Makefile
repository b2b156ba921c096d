VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: on these machines 2.13.0 is a local CPU wheel, while a bare
# `torch` or an open range would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: setup test test-fast lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not distributed"

lint: setup
	$(VENV)/bin/ruff check fsdp2 tests scripts
	$(VENV)/bin/ruff format --check fsdp2 tests scripts

format: setup
	$(VENV)/bin/ruff check --fix fsdp2 tests scripts
	$(VENV)/bin/ruff format fsdp2 tests scripts

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
