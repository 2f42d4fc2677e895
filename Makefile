# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs (CPU torch first,
# from `pip install torch==2.13.0`, so no dependency can pull a CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attncal-installed
OVERLAY := $(VENV)/loader-overlay
# Triton's Python-backend stub needs numpy < 2, so the server gets its own environment (no torch).
TRITON_VENV  ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.attncal-installed
export ATTNCAL_TRITON_ENV := $(abspath $(TRITON_VENV))
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test bench-core plugins gpu-check serving-env install clean

install: $(STAMP)

$(STAMP): pyproject.toml tests/loaders/requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,demo,serving]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(OVERLAY) -r tests/loaders/requirements.txt
	@touch $(STAMP)

# attncal/serving/env.py needs only the standard library, so the base interpreter runs it and creates the server's
# environment, and `make test` builds it beside .venv (in parallel: the two installs overlap).
$(TRITON_STAMP): attncal/serving/requirements-triton.txt
	$(PYTHON) attncal/serving/env.py --env $(TRITON_VENV)
	@touch $(TRITON_STAMP)

serving-env: $(TRITON_STAMP)

# The demo times the calibrated model with the native kernel when it can be built here (a C++
# compiler, cmake and npm for the ONNX Runtime headers); otherwise, or if the build fails, it says so
# and times the ONNX function body.  `attncal demo` prints which one ran.
demo: $(STAMP)
	@if command -v cmake >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && \
	    { command -v c++ || command -v g++ || command -v clang++; } >/dev/null 2>&1; then \
	  $(PY) -c "from attncal.runtime import oplib; print('native kernel library:', oplib.build_library())" || \
	    echo "attncal: building the native kernel library failed (see build/plugins/build.log); the demo uses the ONNX function body"; \
	else \
	  echo "attncal: no C++ compiler, cmake or npm here: the native kernel library is not built; the demo uses the ONNX function body"; \
	fi
	$(VENV)/bin/attncal demo

# The slowest tests are listed at the end of every run (CI's log shows where its time goes).
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(TRITON_STAMP)
	ATTNCAL_REQUIRE_SERVING=1 $(PY) -m pytest -q --durations=25

# Native kernels: the ORT custom-op library (CPU, + CUDA when nvcc is present), and the TensorRT
# plugin where TensorRT is found. The tests build it on demand too.
plugins: $(STAMP)
	$(PY) -c "from attncal.runtime import oplib; print(oplib.build_library())"

# On a GPU machine with torch and nvcc: kernel correctness, bandwidth and torch timing.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --json results/gpu_check.json

bench-core: $(STAMP)
	$(PY) benchmarks/calibration_overhead.py

clean:
	rm -rf $(VENV) $(TRITON_VENV) build *.egg-info .pytest_cache .hypothesis
