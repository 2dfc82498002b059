# spdl_lab — every target creates .venv on first use and installs what it needs.
# torch==2.13.0 goes in first: a bare `torch` requirement with no torch installed
# would pull several GB of CUDA wheels.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test lab demo bench lint soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check spdl_lab tests benchmarks tools
	$(PY) -m pytest $(PYTEST_ARGS) tests
	$(PY) -m pytest --nbval --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider notebooks

# Jupyter refuses to run as root unless told; containers often run as root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks $(ALLOW_ROOT)

demo: $(STAMP)
	$(PY) -m spdl_lab demo

bench: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

lint: $(STAMP)
	$(PY) -m ruff check spdl_lab tests benchmarks tools

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
