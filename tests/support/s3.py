"""A moto S3 server on 127.0.0.1 in a process of its own, for the cluster tests and the Ray benchmark.

The server runs as `python -m moto.server` in a child process rather than in the caller (moto's
in-process mocks), so the caller's I/O counters and memory peak do not include the server's, and so
Ray workers and subprocess drivers, which cannot see an in-process mock, reach it over TCP like a
real endpoint.  `moto_server` yields the endpoint (`http://127.0.0.1:PORT`) once the port accepts
connections and stops the server on exit; `upload_tree` copies a local directory (an export, a corpus)
under a key prefix.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class MotoServerError(RuntimeError):
    """The moto server did not start (it exited, or its port never accepted a connection)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise MotoServerError(f"moto server exited with status {proc.returncode} before listening on "
                                      f"port {port}") from None
            if time.monotonic() > deadline:
                raise MotoServerError(f"moto server did not listen on port {port} within {timeout_s:g} s") from None
            time.sleep(0.05)


@contextlib.contextmanager
def moto_server(env_extra: Mapping[str, str] | None = None, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run a moto S3 server with the caller's environment plus `env_extra`; yield its endpoint.

    Raises `MotoServerError` when the server does not accept connections within `timeout_s`; the
    server is terminated on exit (killed if it does not stop within `STOP_TIMEOUT_S`)."""
    port = free_port()
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(proc, port, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def upload_tree(client, bucket: str, local: Path, prefix: str) -> None:
    """Upload every file under `local` to `bucket` as `prefix/<relative path>` (a boto3 S3 client)."""
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local).as_posix()}")
