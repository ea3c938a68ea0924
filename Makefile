# `make demo` and `make test` work on a fresh machine: both run `make setup` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU torch, installed before the project so the project's torch range pulls no CUDA build.
# On GPU machines: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Two workers: most of an end-to-end run's time is one busy process (an engine, one rank) or a wait
# (a deadline, a poll), so two of them share two cores; tests/conftest.py says how tests are grouped.
XDIST := -n 2 --no-loadscope-reorder

.PHONY: setup test test-fast demo step-sequence clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) tests/sglang_files.py  # SGLang's own files for the contract tests: fetched and unpacked, not installed
	touch $@

# Every process of a run imports the project's modules: compiled once here, as pip compiles what it installs
# (a rank saves ~0.2 CPU-s; where PYTHONDONTWRITEBYTECODE is set, no process would write them itself).
COMPILE := $(PY) -m compileall -q -j 0 slime slime_plugins examples tests train.py train_async.py >/dev/null

test: setup
	$(COMPILE)
	$(PY) -m pytest -q $(XDIST) --durations=30 tests $(PYTEST_ARGS)

# The inner loop: unit tests and the forked-rank tests, no train.py run (a few minutes).
test-fast: setup
	$(COMPILE)
	$(PY) -m pytest -q $(XDIST) -m "not e2e" --durations=10 tests $(PYTEST_ARGS)

demo: setup
	$(COMPILE)
	bash examples/run_cpu_demo.sh

# Record upstream #1487's layout with every rank's collective sequence and regenerate docs/step_sequence.md.
step-sequence: setup
	$(PY) -m slime.tools.record_step_sequence --doc docs/step_sequence.md

clean:
	rm -rf $(VENV) outputs
