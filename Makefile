# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the range in pyproject admits it and nothing larger is fetched.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[agent,dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/kvsp demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

bench: $(BIN)/.installed
	$(BIN)/kvsp bench core

clean:
	rm -rf $(VENV) build *.egg-info
