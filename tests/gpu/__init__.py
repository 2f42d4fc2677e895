"""GPU correctness tests (marker `gpu`; `make gpu-check` runs them, then the GPU timing).

A package, so that its modules and its conftest.py are imported as `gpu.*` and never shadow the
top-level tests/conftest.py.  Every test skips, saying why, where there is no CUDA device, no CUDA build
of torch, no nvcc, no onnxruntime-gpu or no TensorRT (whichever the test needs); nothing touches CUDA
at import or collection time.
"""
