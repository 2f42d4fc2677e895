"""The CUDA simulator's tests (marker `simt`): the kernel sources of plugins/kernels/cuda compiled with g++
against the SIMT runtime of tests/simt/include and run on the CPU, thread by thread (tests/simt/build.py builds
the library; the design is in tests/simt/include/simt/runtime.h).  A package, so that its modules import as
`simt.*` beside `gpu.*`, whose check functions they run."""
