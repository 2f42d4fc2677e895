# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs: `pip install torch==2.13.0` first, so no dependency
# can pull another build.  Which build that is depends on pip's indexes: one that serves torch 2.13.0+cpu (the
# build the committed results record) gives the CPU build; PyPI's Linux wheel is the CUDA build.  On such a
# machine, TORCH_INDEX=https://download.pytorch.org/whl/cpu adds PyTorch's CPU index, which pip then prefers for
# the same version (a local version label sorts after the plain one).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_INDEX ?=
TORCH  := torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# `make test` installs the checkout editable (pure Python; the tests build the native library into
# build/plugins); `make demo` installs the platform wheel, native library inside, as `pip install .` gives users.
# Each stamp says which install .venv holds, so switching between the two reinstalls.
STAMP  := $(VENV)/.attncal-installed
DEMO_STAMP := $(VENV)/.attncal-demo-installed
OVERLAY := $(VENV)/loader-overlay
LOWEST  := $(VENV)/lowest-overlay
# Triton's Python-backend stub needs numpy < 2, so the server gets its own environment (no torch).
TRITON_VENV  ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.attncal-installed
export ATTNCAL_TRITON_ENV := $(abspath $(TRITON_VENV))
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test bench-core plugins gpu-check simt-tsan serving-env cross-tools install wheel clean

install: $(STAMP)

$(STAMP): pyproject.toml tests/loaders/requirements.txt tests/lowest/requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,export,eval,demo,serving,docs,openvino]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(OVERLAY) -r tests/loaders/requirements.txt
	$(PY) -m pip install -q --no-deps --upgrade --target $(LOWEST) -r tests/lowest/requirements.txt
	@rm -f $(DEMO_STAMP)
	@touch $(STAMP)

# attncal/serving/env.py needs only the standard library, so the base interpreter runs it and creates the server's
# environment, and `make test` builds it beside .venv (in parallel: the two installs overlap).
$(TRITON_STAMP): attncal/serving/requirements-triton.txt
	$(PYTHON) attncal/serving/env.py --env $(TRITON_VENV)
	@touch $(TRITON_STAMP)

serving-env: $(TRITON_STAMP)

# The arm64 check of the CPU kernels (tests/test_aarch64.py) needs Debian's cross compiler and QEMU's user-mode
# emulation: installed here where apt-get can (as root); elsewhere those tests skip and say why.
cross-tools:
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user-static; } >/dev/null 2>&1 || \
	  echo "attncal: g++-aarch64-linux-gnu and qemu-user-static not installed: the arm64 kernel tests skip"

# The demo runs what `pip install .` gives a user: the platform wheel, with the native kernel library compiled
# into the package (scikit-build-core: a C++17 compiler and CMake; the ONNX Runtime headers come once from npm).
# Where that build fails, it says so and installs the pure-Python package: the demo then times the ONNX function
# body, and `attncal demo` prints which one ran.
$(DEMO_STAMP): pyproject.toml $(wildcard plugins/*.txt plugins/*/*.h plugins/*/*.cc plugins/*/*.cu plugins/*/*.cmake plugins/*/*/*.h plugins/*/*/*.cuh plugins/*/*/*.cc plugins/*/*/*.cu plugins/*/*/*.def)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q '.[demo]' || { \
	  echo "attncal: building the native kernel library failed (above); installing without it: the demo uses the ONNX function body"; \
	  $(PY) -m pip install -q '.[demo]' -C wheel.cmake=false; }
	@rm -f $(STAMP)
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/attncal demo

# The slowest tests are listed at the end of every run (CI's log shows where its time goes).  pytest-xdist
# runs one worker per core, each test file on one worker (module fixtures are built once), the files in
# collection order, which tests/conftest.py starts with the longest (LONGEST_FILES_FIRST).
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(TRITON_STAMP) cross-tools
	ATTNCAL_REQUIRE_SERVING=1 $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

# Native kernels: the ORT custom-op library (CPU, + CUDA when nvcc is present), and the TensorRT
# plugin where TensorRT is found. The tests build it on demand too.
plugins: $(STAMP)
	$(PY) -c "from attncal.runtime import oplib; print(oplib.build_library())"

# A platform wheel in dist/ (native library inside; CUDA where nvcc is found), repaired to a manylinux tag.
# OpenBLAS stays the scipy-openblas32 dependency's (the library's RUNPATH finds it in site-packages).
wheel: $(STAMP)
	rm -rf dist/raw && $(PY) -m pip wheel . --no-deps -w dist/raw
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair dist/raw/attncal-*.whl --exclude libscipy_openblas.so -w dist
	rm -rf dist/raw

# On a GPU machine with a CUDA build of torch and nvcc: the GPU correctness suite (tests/gpu, marker `gpu`;
# JUnit report in results/gpu_tests.xml), then the timing (results/gpu_check.json).  The timing runs even
# when a test fails; the target fails if either did.
gpu-check: $(STAMP)
	@mkdir -p results
	$(PY) -m pytest -q -m gpu -rs tests/gpu --junitxml=results/gpu_tests.xml; status=$$?; \
	$(PY) benchmarks/gpu_check.py --json results/gpu_check.json || status=1; exit $$status

# The CUDA simulator's kernels (tests/simt) under ThreadSanitizer, at small shapes: opt-in, it takes minutes; the
# test fails on any report.  `make test` runs the simulator without it.
simt-tsan: $(STAMP)
	SIMT_TSAN=1 $(PY) -m pytest -q -p no:cacheprovider -s tests/simt/test_simt_tsan.py

bench-core: $(STAMP)
	$(PY) benchmarks/calibration_overhead.py

clean:
	rm -rf $(VENV) $(TRITON_VENV) build *.egg-info .pytest_cache .hypothesis
