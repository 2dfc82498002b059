# spdl_lab — every target creates .venv on first use and installs what it needs.
# torch==2.13.0 goes in first: a bare `torch` requirement with no torch installed
# would pull several GB of CUDA wheels.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test lab demo bench lint soak clean browser-deps notebooks gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import shutil, sysconfig; shutil.copy('spdl_lab_watch.pth', sysconfig.get_path('purelib'))"
	touch $(STAMP)

# Unit tests first, in TEST_WORKERS processes (pytest-xdist, worksteal: an idle worker takes
# tests from a busy one, so one long file does not hold the run). Then, one at a time, what timing or a loaded
# machine could change: the browser tests, the `measurement` set (real timing) and the
# notebooks. Exit 5 (none selected, e.g. under PYTEST_ARGS=-k...) is fine for the middle two.
# The browser tests must run, not skip: Chromium is installed first and
# SPDL_LAB_REQUIRE_BROWSER=1 turns a missing browser into a failure.
# Three workers on two cores: the unit tests wait on child processes a good part of their time
# (2 workers kept the cores 126% busy, 357-362 s; 3 kept them 143% busy, 301-317 s).
TEST_WORKERS ?= 3
BROWSER_TESTS := tests/ui/test_browser.py

test: $(STAMP) browser-deps
	$(PY) -m ruff check spdl_lab tests benchmarks tools notebooks
	$(PY) -m pytest -m "not measurement" -n $(TEST_WORKERS) --dist worksteal --durations=25 --ignore=$(BROWSER_TESTS) $(PYTEST_ARGS) tests
	SPDL_LAB_REQUIRE_BROWSER=1 $(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(BROWSER_TESTS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	$(PY) -m pytest -m measurement -p no:cacheprovider --durations=15 $(PYTEST_ARGS) tests; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
	$(PY) -m pytest --nbval --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider --durations=15 notebooks

# Jupyter refuses to run as root unless told; containers often run as root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks $(ALLOW_ROOT)

demo: $(STAMP)
	$(PY) -m spdl_lab demo
	$(PY) -m spdl_lab demo --workload images

bench: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

# The StepClock's CUDA timing on a real GPU (benchmarks/gpu_check.py): a conv net under the thread
# and process runners, checked against the script's own CUDA events and torch.profiler's kernel
# time. Without CUDA it says so and exits 0. Then every test of the CUDA path, measurement ones
# too (skipped without CUDA): real event pairs, a watched job on the GPU against its own events,
# and a watched job on the CPU of a GPU machine that gets no CUDA context.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py
	$(PY) -m pytest -p no:cacheprovider -m "measurement or not measurement" -k "cuda or gpu" $(PYTEST_ARGS) tests

# The soak tests at full size (tests/reliability/test_soak.py, test_fork_soak.py): 1,000,000 items
# through each thread engine, 100 open/close cycles of every runner, 500 epochs of a watched DataLoader
# forking its workers every epoch while the lab's threads run. `make test` runs them short;
# -s shows the numbers they print (RSS before and after, items/s, cycles, epochs).
soak: $(STAMP)
	SPDL_LAB_SOAK=full $(PY) -m pytest -m slow -s -p no:cacheprovider $(PYTEST_ARGS) tests

# The tutorials' sources are notebooks/*.py (jupytext percent format); this writes the
# .ipynb files from them (tests/test_notebooks_source.py checks that they agree).
notebooks: $(STAMP)
	$(PY) tools/sync_notebooks.py

lint: $(STAMP)
	$(PY) -m ruff check spdl_lab tests benchmarks tools notebooks

# Chromium for tests/ui: Playwright cannot download its own browser offline, so the
# tests drive Debian's /usr/bin/chromium. Installs it only when it is missing.
browser-deps:
	@if [ -x /usr/bin/chromium ]; then \
		echo "browser-deps: /usr/bin/chromium is installed"; \
	else \
		SUDO=; \
		if [ "$$(id -u)" != 0 ]; then \
			command -v sudo >/dev/null || { echo "browser-deps: not root and no sudo; as root run: apt-get install -y chromium" >&2; exit 1; }; \
			SUDO=sudo; \
		fi; \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	fi

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
