# One command each: `make demo` (set-up + the main job), `make test` (set-up + tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
QUICK  ?= 0
THREADS ?=
# make test and test-fast run the suite on this many pytest-xdist workers (a test module at a time each; 0: in one process)
TEST_WORKERS ?= 2

.PHONY: setup test test-fast demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

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
