# The two set-up commands are `make demo` and `make test` (see README.md).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
DEMO    ?= demo

.PHONY: install install-test test lint demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: on our machines it is a local CPU wheel; the range in pyproject admits it.
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.11"
	$(BIN)/pip install -q -e .

install-test: install
	$(BIN)/pip install -q -e '.[test]'

test: install-test
	$(BIN)/python -m pytest -q

lint: install-test
	$(BIN)/ruff check runtime kernels tools tests ftkit

demo: install
	$(BIN)/ft-run demo --out $(DEMO)

clean:
	rm -rf $(VENV) $(DEMO) build *.egg-info .pytest_cache
