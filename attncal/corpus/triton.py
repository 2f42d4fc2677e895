"""The `triton` engine: batches of texts sent to a served attncal model (`attncal triton-repo`).

The served ensemble tokenizes, so the client sends UTF-8 text (input `text`,
BYTES [n, 1]) and reads `sentence_embedding`.  A window is sorted by character
length (a cheap proxy for token length; the server pads per request) and cut
into requests of `batch_size` texts, which `concurrency` client threads send
at once, each with its own gRPC client.  Transient failures (server
unavailable, deadline exceeded, overloaded queue, dropped connection) are
retried with exponential backoff; anything else, or a transient failure that
persists through every retry, stops the run with one line naming the model,
the URL and the last error.  Token counts are not known on the client side
(the server tokenizes) and are reported as absent.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np

TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "Socket closed",
             "Connection reset", "failed to connect", "Broken pipe")


class TritonEngineError(RuntimeError):
    """The server failed persistently (or the model is not served); one line says which and why."""


def is_transient(exc: Exception) -> bool:
    status = exc.status() if callable(getattr(exc, "status", None)) else ""
    text = f"{status} {exc}"
    return any(t.lower() in text.lower() for t in TRANSIENT)


class TritonEngine:
    name = "triton"

    def __init__(self, url: str, model: str, *, batch_size: int, concurrency: int = 4, retries: int = 5,
                 backoff_s: float = 0.5, timeout_s: float = 120.0) -> None:
        self.url, self.model, self.batch_size, self.concurrency = url, model, batch_size, concurrency
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._local = threading.local()
        self._clients: list = []

    def describe(self) -> dict:
        return {"name": self.name, "url": self.url, "model": self.model, "concurrency": self.concurrency,
                "retries": self.retries}

    def _client(self):
        import tritonclient.grpc as grpcclient

        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = grpcclient.InferenceServerClient(self.url)
            self._clients.append(c)
        return c

    def check(self, dimension: int) -> None:
        """Fail early, in one line, when the server or the model is not there or has another dimension."""
        try:
            ready = self._client().is_model_ready(self.model)
        except Exception as exc:  # noqa: BLE001 - any client error means "not reachable"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TritonEngineError(f"triton server at {self.url} is not reachable: {first}") from None
        if not ready:
            raise TritonEngineError(f"model {self.model!r} is not ready on the triton server at {self.url}")
        got = self._infer(["dimension probe"]).shape[1]
        if got != dimension:
            raise TritonEngineError(f"served model {self.model!r} returns dimension {got}, the export has {dimension}")

    def _infer(self, texts: list[str]) -> np.ndarray:
        import tritonclient.grpc as grpcclient

        arr = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                inp = grpcclient.InferInput("text", list(arr.shape), "BYTES")
                inp.set_data_from_numpy(arr)
                res = self._client().infer(self.model, [inp], client_timeout=self.timeout_s)
                return np.asarray(res.as_numpy("sentence_embedding"), dtype=np.float32)
            except Exception as exc:  # noqa: BLE001 - classified below
                last = exc
                if not is_transient(exc):
                    break
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
        first = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
        kind = "persistent transient error" if is_transient(last) else "error"
        tries = self.retries + 1 if is_transient(last) else 1
        raise TritonEngineError(f"triton model {self.model!r} at {self.url} failed after {tries} "
                                f"attempt(s) ({kind}): {first[:300]}")

    def encode(self, windows: Iterable[tuple[list[str], list[str]]]) -> Iterator[tuple[list[str], np.ndarray, None]]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            try:
                for ids, texts in windows:
                    order = np.argsort([len(t) for t in texts], kind="stable")[::-1]
                    batches = [order[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
                    results = pool.map(lambda idx: self._infer([texts[j] for j in idx]), batches)
                    out = None
                    for idx, emb in zip(batches, results):
                        if out is None:
                            out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
                        out[idx] = emb
                    yield ids, out, None
            finally:
                for c in self._clients:
                    try:
                        c.close()
                    except Exception:  # noqa: BLE001 - closing is best effort
                        pass
