# tpkit: two commands set up everything on a fresh machine.
#   make demo   creates .venv, installs, runs the main job on this CPU machine
#   make test   creates .venv, installs, runs the test suite
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: demo test bench lint venv browser clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU build (a bare `torch` would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf,web]'
	touch $(STAMP)

venv: $(STAMP)

# Debian's chromium for the quiz's browser test (Playwright drives it; its own
# browser download does not work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: $(STAMP)
	$(BIN)/tpkit verify --component mlp --tp 1,2,4

test: $(STAMP) browser
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/mlp_vs_peers.py
	$(BIN)/python benchmarks/block_vs_peers.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs bench-results .pytest_cache
