# One command each: `make demo` (set-up + the main job), `make test` (set-up + tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
QUICK  ?= 0
THREADS ?=
# make test and test-fast run the suite on this many pytest-xdist workers (a test module at a time each; 0: in one process)
TEST_WORKERS ?= 2

.PHONY: setup test test-fast demo bench clean

# --no-compile: pip byte-compiles every installed file (torch's thousands) one at a time, most of
# a fresh set-up here (102 s -> 59 s without it, 2 cores); Python then writes the bytecode of
# what is imported the first time it is imported (+6 s for the training path, once).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	touch $@

# Python's default (bytecode cached on first import) also where the shell turned it off: with
# --no-compile above, every process would otherwise compile torch from source again.
unexport PYTHONDONTWRITEBYTECODE

setup: $(VENV)/.installed

# the browser tests run alone after the rest: beside the other worker, a download in Chromium
# timed out in two clean-clone runs (it passes alone and beside one other test file)
test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not browser"
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m browser

test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope

demo: setup
	HF_HUB_OFFLINE=1 $(PY) demo.py $(if $(filter 1,$(QUICK)),--quick,) $(if $(THREADS),--threads $(THREADS),)

bench: setup
	$(PY) benchmarks/attention.py --out runs/bench/attention.json
	$(PY) benchmarks/model.py --out runs/bench/model.json

clean:
	rm -rf $(VENV) runs .pytest_cache
