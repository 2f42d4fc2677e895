"""Serving attncal exports with Triton Inference Server.

- `repository.build_repository`: export directory -> Triton model repository
  (tokenizer + encoder + text-in ensemble; python, onnxruntime or tensorrt encoder);
- `env`: the separate serving virtualenv (numpy < 2, the pytriton-bundled server);
- `server.TritonServer`: start / wait for readiness / stop a real server;
- `bench.bench_triton`: throughput and latency, calibrated vs uncalibrated.

Nothing here imports torch; `repository` needs onnx and transformers (main env).
"""
