# One command each: `make demo` (set-up + the main job), `make test` (set-up + tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
QUICK  ?= 0
THREADS ?=

.PHONY: setup test test-fast demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

demo: setup
	HF_HUB_OFFLINE=1 $(PY) demo.py $(if $(filter 1,$(QUICK)),--quick,) $(if $(THREADS),--threads $(THREADS),)

bench: setup
	$(PY) benchmarks/attention.py --out runs/bench/attention.json
	$(PY) benchmarks/model.py --out runs/bench/model.json

clean:
	rm -rf $(VENV) runs .pytest_cache
