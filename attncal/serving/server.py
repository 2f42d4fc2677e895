"""Start, watch and stop a real Triton Inference Server on a model repository.

By default the server is the `tritonserver` inside the serving env's
nvidia-pytriton wheel, launched with what that binary needs (see `env`); a
user's own install can be given instead (`tritonserver=PATH`), which is then
run as is.  The server binds 127.0.0.1 unless told otherwise, runs in its own
session (so a terminal's Ctrl-C reaches only us, and we stop it in order),
and logs to a file whose tail is shown when it fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .env import ServingEnvError, check_env
from .repository import validate_repository


class ServerError(RuntimeError):
    """The server did not start or become ready; the message says why and what to try."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


_HINTS = [
    (re.compile(r"output tensor shape does not match|numpy.*(ABI|version)|_ARRAY_API", re.I),
     "the stub's numpy does not match: the serving env needs numpy < 2 (python -m attncal.serving.env)"),
    (re.compile(r"libpython\S* cannot open|No module named 'encodings'|Fatal Python error: init", re.I),
     "the stub cannot start its Python: LD_LIBRARY_PATH must hold the serving env Python's libpython directory"),
    (re.compile(r"No module named '(onnxruntime|transformers|numpy)'", re.I),
     "the Python models' packages are missing from the Python the stub runs (install requirements-triton.txt)"),
    (re.compile(r"triton_python_backend_stub.*(not found|No such file)", re.I),
     "the Python-backend stub is not in --backend-directory"),
    (re.compile(r"unable to find backend library for backend 'python'", re.I),
     "this server has no Python backend in its backend directory"),
    (re.compile(r"address already in use|bind.*failed", re.I), "a port is taken: pick others"),
]


def diagnose(log: str) -> str:
    """The log's error lines and, where a known cause matches, what to fix."""
    errors = [ln.strip() for ln in log.splitlines() if ln.startswith("E") or "error" in ln.lower()][-6:]
    hints = [h for rx, h in _HINTS if rx.search(log)]
    parts = []
    if hints:
        parts.append("likely cause: " + "; ".join(dict.fromkeys(hints)))
    if errors:
        parts.append("server log: " + " | ".join(errors))
    return "; ".join(parts) or "no error in the server log"


class TritonServer:
    """One tritonserver process.  Use as a context manager, or start()/wait_ready()/stop()."""

    def __init__(
        self,
        repo: str | os.PathLike,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        tritonserver: str | os.PathLike | None = None,
        env_dir: str | os.PathLike | None = None,
        log_file: str | os.PathLike | None = None,
        exit_timeout_s: int = 10,
        extra_args: list[str] | tuple[str, ...] = (),
        keep_log: bool = False,
    ) -> None:
        """``log_file`` None: a temporary file, removed after a clean stop (exit status 0) unless
        ``keep_log``; kept whenever the server failed, so that the errors that name it can be read."""
        self.repo = Path(repo).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.own = tritonserver
        self.env_dir = env_dir
        self.log_file = Path(log_file) if log_file else None
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args)
        self.keep_log = keep_log
        self._temp_log = False
        self._failed = False
        self.proc: subprocess.Popen | None = None
        self._shm_prefix = f"attncal{uuid.uuid4().hex[:10]}_"

    # -- launch ---------------------------------------------------------------------------------
    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        validate_repository(self.repo)  # a damaged repository fails here, naming the file, before any launch
        common = [f"--model-repository={self.repo}",
                  f"--http-address={self.host}", f"--http-port={self.http_port}",
                  f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                  f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                  "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout_s}",
                  "--strict-readiness=true", "--exit-on-error=true"]
        if self.own is not None:
            exe = Path(self.own)
            if not exe.is_file() or not os.access(exe, os.X_OK):
                raise FileNotFoundError(f"--tritonserver {exe} is not an executable file")
            return [str(exe)] + common + self.extra_args, dict(os.environ)
        env = check_env(self.env_dir)
        cmd = [str(env.tritonserver)] + common + [
            f"--backend-directory={env.backend_dir()}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
        ] + self.extra_args
        return cmd, env.environ()

    def start(self) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            raise ServerError("this server is already running")
        cmd, environ = self.command()
        taken = [p for p in (self.http_port, self.grpc_port, self.metrics_port) if _port_in_use(self.host, p)]
        if taken:
            raise ServerError(f"port(s) {taken} on {self.host} are already in use; pick free ones")
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="attncal-triton-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)
            self._temp_log = True
        log = open(self.log_file, "ab")
        try:
            self.proc = subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        return self

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace") if self.log_file else ""
        except OSError:
            return ""

    # -- health ---------------------------------------------------------------------------------
    def _get(self, path: str, timeout: float = 2.0, data: bytes | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def is_ready(self) -> bool:
        try:
            return self._get("/v2/health/ready", timeout=1.0)[0] == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float = 180.0) -> "TritonServer":
        """Block until every model is ready; raise ServerError (and stop the server) on exit or timeout."""
        if self.proc is None:
            raise ServerError("start() first")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self._failed = True
                raise ServerError(f"tritonserver exited with status {rc} before it was ready; "
                                  f"{diagnose(self.log_text())} (full log: {self.log_file})")
            if self.is_ready():
                return self
            time.sleep(0.25)
        self._failed = True
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f} s; {diagnose(self.log_text())}; "
                          f"a silent hang at model load usually means nvidia_pytriton.libs is not on "
                          f"LD_LIBRARY_PATH (full log: {self.log_file})")

    def models(self) -> list[dict]:
        """The repository index: [{name, version, state, reason}]."""
        status, body = self._get("/v2/repository/index", data=b"{}", timeout=5.0)
        if status != 200:
            raise ServerError(f"repository index: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    # -- stop -----------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (Triton finishes in-flight requests), then SIGKILL after the timeout."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s or self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        self._cleanup_shm()
        if self.proc.returncode == 0:
            self._drop_temp_log()
        return self.proc.returncode

    def _drop_temp_log(self) -> None:
        # A temporary log of a server that started and stopped cleanly says nothing anyone will
        # read; hundreds of runs (benchmarks, tests) would otherwise pile them up in /tmp.
        if self._temp_log and not self.keep_log and not self._failed and self.log_file is not None:
            self.log_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the server and its Python stubs."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reap_group()
        self._cleanup_shm()

    def _reap_group(self) -> None:
        # The server leads its own process group (start_new_session); its Python stubs
        # are in it.  When the server was killed they can outlive it, so once the server
        # has exited, whatever is left of *this* group is ended.
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _cleanup_shm(self) -> None:
        # Only this server's regions (unique prefix); a SIGKILLed server leaves them behind.
        for f in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
            try:
                f.unlink()
            except OSError:
                pass

    def __enter__(self) -> "TritonServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["TritonServer", "ServerError", "ServingEnvError", "free_port", "diagnose"]
