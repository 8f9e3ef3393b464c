# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-unit test-aioquic test-interop bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the range in pyproject admits it and nothing larger is fetched.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[agent,dev]'
	touch $@

interop/.venv-aiomoqt/.installed: interop/aiomoqt-requirements.txt interop/install-peer.sh
	bash interop/install-peer.sh
	touch $@

interop/.venv-moqrs/.installed: interop/moqrs-requirements.txt interop/install-moqrs.sh
	bash interop/install-moqrs.sh
	touch $@

demo: $(BIN)/.installed
	$(BIN)/kvsp demo

test: test-unit test-aioquic test-interop

test-unit: $(BIN)/.installed
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest -q tests

# The MOQT, relay and KV-track suites again on the second QUIC engine (the default run uses
# the default engine, qh3); the interop suite runs on both engines below.
test-aioquic: $(BIN)/.installed
	KVSP_QUIC_ENGINE=aioquic $(BIN)/python -m pytest -q tests/moqt tests/relay tests/moqt_blocks

# The independent peers (aiomoqt, moq-rs) live in venvs of their own. aiomoqt binds wildcard
# addresses, so the interop suite runs in a private network namespace with only loopback up.
test-interop: $(BIN)/.installed interop/.venv-aiomoqt/.installed interop/.venv-moqrs/.installed
	unshare -n sh -c 'ip link set lo up && KVSP_PRIVATE_NETNS=1 KVSP_QUIC_ENGINE=aioquic $(BIN)/python -m pytest -q interop'
	unshare -n sh -c 'ip link set lo up && KVSP_PRIVATE_NETNS=1 $(BIN)/python -m pytest -q interop'

bench: $(BIN)/.installed
	$(BIN)/kvsp bench core

clean:
	rm -rf $(VENV) interop/.venv-aiomoqt interop/.venv-moqrs build *.egg-info
