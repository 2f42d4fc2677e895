"""Serve a model repository with Triton Inference Server until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading

from ..serving.env import ServingEnvError
from ..serving.server import ServerError, TritonServer
from .common import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", help="model repository (from `attncal triton-repo`)")
    p.add_argument("--http-port", type=int, default=8000, help="default %(default)s")
    p.add_argument("--grpc-port", type=int, default=8001, help="default %(default)s")
    p.add_argument("--metrics-port", type=int, default=8002, help="default %(default)s")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for all)")
    p.add_argument("--tritonserver", default=None,
                   help="your own tritonserver binary, run as is (default: the one in the serving env)")
    p.add_argument("--env", default=None, help="serving env (default $ATTNCAL_TRITON_ENV or .venv-triton)")
    p.add_argument("--log-file", default=None, help="server log (default: a temporary file, kept)")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    for port in (args.http_port, args.grpc_port, args.metrics_port):
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is not in 1..65535")
    server = TritonServer(args.repo, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, host=args.host, tritonserver=args.tritonserver,
                          env_dir=args.env, log_file=args.log_file, keep_log=True)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        try:
            server.start()
            print(f"attncal serve: starting tritonserver (pid {server.pid}, log {server.log_file})", flush=True)
            server.wait_ready(args.ready_timeout)
        except (ServingEnvError, ServerError) as exc:
            raise CLIError(str(exc), code=1) from None
        models = server.models()
        print(f"attncal serve: ready: HTTP {server.http_url}, gRPC {server.grpc_url}, "
              f"metrics {server.client_host}:{args.metrics_port}", flush=True)
        for m in sorted(models, key=lambda m: m["name"]):
            print(f"  {m['name']} v{m.get('version', '?')} {m.get('state', '?')}", flush=True)
        while not stop.is_set():
            if not server.running():
                raise CLIError(f"tritonserver exited unexpectedly (status {server.proc.returncode}); "
                               f"log {server.log_file}", code=1)
            stop.wait(0.5)
        print("attncal serve: SIGTERM received, stopping", flush=True)
    except KeyboardInterrupt:
        print("attncal serve: interrupted, stopping", flush=True)
    finally:
        rc = server.stop()
        signal.signal(signal.SIGTERM, previous)
    print(f"attncal serve: stopped (tritonserver status {rc})", flush=True)
    return 0
