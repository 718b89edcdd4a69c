# The two set-up commands are `make demo` and `make test` (see README.md).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
DEMO    ?= demo

.PHONY: install install-test test lint fuzz demo clean

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

# The reader fuzz targets at length (CI runs a fixed minute of them): FTKIT_FUZZ_EXAMPLES per
# target, FTKIT_FUZZ_SEED to draw another set.
FUZZ_EXAMPLES ?= 100000
fuzz: install-test
	FTKIT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/test_fuzz_headers.py -k test_fuzz_ \
		-p no:cacheprovider --hypothesis-show-statistics

lint: install-test
	$(BIN)/ruff check runtime kernels tools tests ftkit

demo: install
	$(BIN)/ft-run demo --out $(DEMO)

clean:
	rm -rf $(VENV) $(DEMO) build *.egg-info .pytest_cache
