# Two commands do all the set-up on a fresh machine (Linux or macOS, Python 3.10+, no Docker, no root):
#   make demo   - start Redis and two real Celery workers, fire duplicates, print who ran and who was skipped
#   make test   - lint, type-check and run the test suite on throwaway redis-server processes
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench bench-check clean soak-model

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,demo]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python examples/demo.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two test modules at a time (pytest-xdist, a module's tests stay in one process and share its servers and workers):
# the suite mostly waits on leases, sleeps and real servers, so two at once about halve its time on two cores.
# --no-loadscope-reorder: modules are handed out in the order tests/conftest.py sets, the longest first.
test: lint
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# The model-based suite's long budget (docs/testing.md): 20 random deployments x 10 schedules each, the known-open
# option pairs included, failures shrunk and written as JSON under $(CSL_MODEL_OUT) (default /tmp/model-soak).
soak-model: $(BIN)/.installed
	mkdir -p $${CSL_MODEL_OUT:-/tmp/model-soak}
	CSL_MODEL_BUDGET=long CSL_MODEL_OUT=$${CSL_MODEL_OUT:-/tmp/model-soak} $(BIN)/pytest -q -s tests/testing/test_model.py

bench: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench_lock.py

# The key ratios (a lock per use vs the floor, LockedTask executed vs plain, a skip in the tracer vs executed) beside
# the previous release's (benchmarks/release_figures.json): a printout, not a timing assertion (~40 s).
bench-check: $(BIN)/.installed
	$(BIN)/python benchmarks/bench_check.py

clean:
	rm -rf $(VENV) build dist *.egg-info
