# tpkit: two commands set up everything on a fresh machine.
#   make demo   creates .venv, installs, runs the main job on this CPU machine
#   make test   creates .venv, installs, runs the test suite
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PYTHONUNBUFFERED := 1
# pip installs without compiling every module to bytecode (torch alone has thousands, most
# never imported: 25 s of 35 here); Python caches the bytecode of what is imported on first
# use, so it must be allowed to write it (an environment may say not to).
unexport PYTHONDONTWRITEBYTECODE
PIP     := $(BIN)/pip install -q --no-compile

.PHONY: demo test test-fast bench lint docs venv browser clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip

# torch first, pinned: the CPU build (a bare `torch` would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,hf,web,track,data,serve,docs]'
	$(BIN)/python -c 'import tpkit.comm.shm_build as s, tpkit.kernels.paged_attention as a, tpkit.kernels.decode_ops as d; s.main(); a.main(); d.main()'   # C++ kernels (g++, a few s)
	touch $(STAMP)

venv: $(STAMP)

# Debian's chromium for the quiz's browser test (Playwright drives it; its own
# browser download does not work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# The main job: prove the sharded models exact against tp=1 (a GPT-style and a
# Llama-style GQA model), then train gpt2-tiny with tp=2 x pp=2 on 4 processes.
demo: $(STAMP)
	$(BIN)/tpkit verify --preset gpt2-tiny --tp 1,2,4
	$(BIN)/tpkit verify --preset llama-tiny --tp 1,2,4 --sp
	$(BIN)/tpkit train --preset gpt2-tiny --tp 2 --pp 2 --steps 400 --micro-batches 4 --global-batch 16 --seq 128 --out runs/demo --overwrite

test: $(STAMP) browser   # two workers (tests/conftest.py says how the files are shared out)
	$(BIN)/python -m pytest -n 2 --dist loadgroup

test-fast: $(STAMP)   # the suite without the tests marked slow (multi-process, subprocess, HF)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not slow"

bench: $(STAMP)
	$(PIP) --no-deps megatron-core   # a peer of the block benchmark; keeps torch
	$(BIN)/python benchmarks/run_all.py

# The documentation site (mkdocs.yml) into site/: a broken link, a stale name or a page left
# out of the navigation stops it (--strict; the suite builds it too).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs bench-results .pytest_cache site
