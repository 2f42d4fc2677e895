"""Helpers shared by the tests (CPU and GPU) and by the benchmarks, each defined once.

* `support.masks`: attention masks [B,K], hand-made (`token_mask`) and random (`random_mask`, one padding
  side; `mixed_mask`, each item its own side, optionally empty items and holes);
* `support.tensors`: random attention probabilities and scores, Q/K/V of the calibrated attention ops, the
  fused ops' float64 spec, the bound on the float32 rounding of the scores, plain attention in float64;
* `support.cases`: random calibration attributes and which rows the spec calibrates;
* `support.oracle_loop`: the driver of the randomized comparisons against the float64 oracle;
* `support.computed_once`: a reference (the float64 oracle, a function body's run) computed once per process for
  the same inputs and shared read-only, e.g. by a test's runs on each CPU path;
* `support.cuda`: the CUDA launchers through ctypes (compiled with
  `attncal.runtime.oplib.compile_cuda_kernel`), their AttncalParams and dtype codes, and why CUDA is
  not usable here when it is not;
* `support.s3`: a moto S3 server on 127.0.0.1 in its own process, and a directory upload, for the cluster
  tests and the Ray benchmark.

The tests import it as `support`: pytest puts tests/ on sys.path (tests/ is no package, so its test
modules and tests/conftest.py are imported from there).  A benchmark puts tests/ on sys.path itself.
Nothing here touches CUDA at import time.
"""
